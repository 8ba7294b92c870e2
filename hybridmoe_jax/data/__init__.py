"""Data: byte tokenizer, document sources, first-fit packing and grain pipelines."""

from hybridmoe_jax.data.config import SOURCES
from hybridmoe_jax.data.config import default_data_config
from hybridmoe_jax.data.config import source_from_config
from hybridmoe_jax.data.config import validate_data_config
from hybridmoe_jax.data.vlm_pipeline import build_vlm_train_and_eval
from hybridmoe_jax.data.long_docs import StdlibLongDocSource
from hybridmoe_jax.data.packing import pack_documents
from hybridmoe_jax.data.packing import unpack_row
from hybridmoe_jax.data.pipeline import TrainEvalData
from hybridmoe_jax.data.pipeline import build_train_and_eval
from hybridmoe_jax.data.pipeline import eval_batches
from hybridmoe_jax.data.pipeline import make_pipeline
from hybridmoe_jax.data.retrieval import RetrievalSource
from hybridmoe_jax.data.sources import BundledTextSource
from hybridmoe_jax.data.sources import JsonlSource
from hybridmoe_jax.data.sources import SubsetSource
from hybridmoe_jax.data.sources import TextFileSource
from hybridmoe_jax.data.sources import split_source
from hybridmoe_jax.data.stages import StageData
from hybridmoe_jax.data.stages import StagedIterator
from hybridmoe_jax.data.stages import make_stage_dataset
from hybridmoe_jax.data.tokenizer import BOS_ID
from hybridmoe_jax.data.tokenizer import EOS_ID
from hybridmoe_jax.data.tokenizer import PAD_ID
from hybridmoe_jax.data.tokenizer import ByteTokenizer
from hybridmoe_jax.data.tokenizer import check_vocab
