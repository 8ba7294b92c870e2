"""Data: tokenizers (byte, tokenizer.json, tiktoken), document sources, first-fit packing
and grain pipelines.

Nothing is imported eagerly: import the submodule you need (`from hybridmoe_jax.data import
pipeline`); the names below also resolve lazily from the package. Tokenizers are imported
from their modules (`data.tokenizers.load` builds and reads them back).
"""

import importlib

_PUBLIC = {
    "pack_documents": "packing", "unpack_row": "packing",
    "build_train_and_eval": "pipeline", "eval_batches": "pipeline", "make_pipeline": "pipeline",
    "BundledTextSource": "sources", "JsonlSource": "sources", "TextFileSource": "sources",
    "split_source": "sources", "make_source": "sources", "source_from_config": "sources",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
  if name in _PUBLIC:
    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
