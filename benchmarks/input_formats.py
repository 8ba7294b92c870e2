"""Input throughput per host by data format: JSONL vs Parquet vs prepared ArrayRecord shards
(local, and in a bucket of the GCS emulator).

  python benchmarks/input_formats.py                       # byte and the 1024-id BPE
  python benchmarks/input_formats.py --docs=1000 --batches=50 --tokenizers=byte

One corpus (--docs documents of 1-16 KB cut from the bundled help texts) is written as JSONL,
as Parquet (row groups of 256) and, per tokenizer, as shards by `hybridmoe_jax.data.prepare`
(`prepare_s`). Per (format, tokenizer), one process (this host):
  index_s                the source indexed and split (train / held out)
  read_tokens_per_s      documents of the train split read in shuffled order and tokenized
                         (prepared records pass through): the stage the format changes;
                         the formats interleaved (benchmarks/_timing), median of 5 calls of
                         --docs_per_call documents; read_ratio_vs_jsonl against JSONL's
  pipeline_tokens_per_s  the whole train iterator (grain's reader threads, packing,
                         batching), cold: from building it to --batches [batch, seq_len]
                         batches; pipeline_ratio_vs_jsonl likewise
gcs rows read from gcp-storage-emulator on 127.0.0.1 (skipped without the cloud-test extra):
Parquet row groups over HTTP each time one is needed; shards copied once to the local cache
(`copy_s`), then read locally.
"""

import importlib.util
import json
import os
import sys
import tempfile

from absl import app
from absl import flags
import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
from benchmarks._timing import stopwatch, time_fns  # pylint: disable=g-import-not-at-top

_DOCS = flags.DEFINE_integer("docs", 3000, "Documents in the corpus.")
_BATCHES = flags.DEFINE_integer("batches", 200, "Batches of the cold pipeline timing.")
_DOCS_PER_CALL = flags.DEFINE_integer("docs_per_call", 100, "Documents per timed read.")
_SEQ = flags.DEFINE_integer("seq_len", 1024, "Tokens per row.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Rows per batch.")
_TOKENIZERS = flags.DEFINE_list("tokenizers", ["byte", "configs/tokenizers/bundled_bpe1024"],
                                "data.tokenizer values to compare.")
_JSON = flags.DEFINE_string("json_out", None, "Also write the rows as JSON here.")


def corpus(n: int) -> list[str]:
  """n documents of 1-16 KB cut from the bundled help texts (deterministic)."""
  from hybridmoe_jax.data.sources import BundledTextSource  # pylint: disable=g-import-not-at-top
  text = "\n\n".join(BundledTextSource()[i] for i in range(len(BundledTextSource())))
  rng = np.random.default_rng(0)
  out = []
  for _ in range(n):
    size = int(rng.integers(1024, 16384))
    start = int(rng.integers(0, len(text) - size))
    out.append(text[start:start + size].strip() or "x")
  return out


def build(source: str, paths, tokenizer: str, docs_per_call: int):
  """-> (seconds to index the source and split it, a function reading documents).

  The function reads the next --docs_per_call documents of the train split in shuffled
  order and tokenizes them as the pipeline does (BOS + ids + EOS; prepared records pass
  through) -> tokens. This is the stage the format changes; grain's reader threads are
  left out so that the interleaved timing compares the formats fairly."""
  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.data import record_sources, sources
  from hybridmoe_jax.data.tokenizers.load import fingerprint, make_tokenizer
  tok = make_tokenizer(tokenizer)
  with stopwatch() as sw:
    src = sources.make_source(source, list(paths))
    record_sources.check_tokenizer(src, tok, fingerprint)
    train, _ = sources.split_source(src, 0.05, 0)
  order = np.random.default_rng(0).permutation(len(train))
  pos = [0]

  def read() -> int:
    n = 0
    for _ in range(docs_per_call):
      doc = train[int(order[pos[0] % len(order)])]
      pos[0] += 1
      ids = doc if isinstance(doc, np.ndarray) else tok.encode(doc, bos=True, eos=True)
      n += len(ids)
    return n
  return sw.seconds, read


def rates(cases: dict) -> dict:
  """{name: tokens/s}: the cases' reads interleaved (benchmarks/_timing), median of 5 after one."""
  counts = {name: fn() for name, fn in cases.items()}   # tokens per call (first call)
  times = time_fns(cases, repeats=5, warmup=1)
  return {name: counts[name] / med for name, (_, med) in times.items()}


def pipeline_rate(source: str, paths, tokenizer: str) -> float:
  """Tokens/s of the whole train iterator (grain's reader threads, packing, batching),
  cold: from building it to --batches batches (so grain's read-ahead is paid for)."""
  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.data.pipeline import build_train_and_eval
  from hybridmoe_jax.data.tokenizers.load import make_tokenizer
  from hybridmoe_jax.config.run import DataConfig
  tok = make_tokenizer(tokenizer)
  cfg = DataConfig(source=source, paths=tuple(paths), tokenizer=tokenizer)
  with stopwatch() as sw:
    it = build_train_and_eval(cfg, vocab_size=tok.vocab_size, seq_len=_SEQ.value,
                              batch_size=_BATCH.value, seed=0, max_eval_batches=1,
                              tokenizer=tok).train
    for _ in range(_BATCHES.value):
      next(it)
  return _BATCHES.value * _BATCH.value * _SEQ.value / sw.seconds


def main(_):
  # pylint: disable=g-import-not-at-top
  import pyarrow as pa
  import pyarrow.parquet as pq
  from hybridmoe_jax.data import prepare
  from hybridmoe_jax.data import storage
  docs = corpus(_DOCS.value)
  rows = []
  with tempfile.TemporaryDirectory() as d:
    os.environ.setdefault(storage.CACHE_ENV, os.path.join(d, "cache"))
    jsonl = os.path.join(d, "c.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
      f.writelines(json.dumps({"text": t}) + "\n" for t in docs)
    pq.write_table(pa.table({"text": docs}), os.path.join(d, "c.parquet"), row_group_size=256)
    mb = os.path.getsize(jsonl) / 2**20
    print(f"corpus: {len(docs)} documents, {mb:.1f} MiB of JSONL; machine: {os.cpu_count()}"
          f"-core CPU box; [{_BATCH.value}, {_SEQ.value}] batches", flush=True)
    emulator = _emulator()
    for tok in _TOKENIZERS.value:
      tok_path = tok if tok in ("byte", "byte_chat") else os.path.join(_ROOT, tok)
      shards = os.path.join(d, f"shards-{len(rows)}")
      with stopwatch() as sw:
        prepare.prepare([jsonl], shards, tok_path, docs_per_shard=500, progress=None)
      prep_s = sw.seconds
      cases = [("jsonl", "local", [jsonl], {}),
               ("parquet", "local", [os.path.join(d, "c.parquet")], {}),
               ("arrayrecord", "local", [shards], {"prepare_s": round(prep_s, 2)})]
      if emulator is not None:
        bucket = f"gs://{emulator[1].BUCKET}"
        remote = f"{bucket}/shards-{len(rows)}"
        prepare.prepare([jsonl], remote, tok_path, docs_per_shard=500, progress=None)
        storage.as_path(f"{bucket}/c.parquet").write_bytes(
            open(os.path.join(d, "c.parquet"), "rb").read())
        with stopwatch() as sw:
          for f in storage.list_files([remote], (".array_record",)):
            storage.local_copy(f)
        cases += [("parquet", "gcs-emulator", [f"{bucket}/c.parquet"], {}),
                  ("arrayrecord", "gcs-emulator", [remote], {"copy_s": round(sw.seconds, 2)})]
      built = {}
      for fmt, where, paths, extra in cases:
        # Parquet in a bucket fetches a whole row group (~2 MiB here) per shuffled document:
        # fewer documents per call keep the run short (the rate is per token either way).
        per_call = _DOCS_PER_CALL.value // (20 if (fmt, where) == ("parquet", "gcs-emulator")
                                            else 1)
        index_s, fn = build(fmt, paths, tok_path, max(1, per_call))
        built[(fmt, where)] = fn
        extra["index_s"] = round(index_s, 3)
      got = rates(built)
      ref = got[("jsonl", "local")]
      cold_ref = None
      for fmt, where, paths, extra in cases:
        r = got[(fmt, where)]
        # The cold pipeline over a bucket's Parquet would fetch a row group per document for
        # every read-ahead thread: left out (minutes), its read rate above says why.
        cold = (float("nan") if (fmt, where) == ("parquet", "gcs-emulator")
                else pipeline_rate(fmt, paths, tok_path))
        cold_ref = cold_ref or cold
        row = {"format": fmt, "storage": where, "tokenizer": tok,
               "read_tokens_per_s": round(r), "read_ratio_vs_jsonl": round(r / ref, 2),
               "pipeline_tokens_per_s": None if cold != cold else round(cold),
               "pipeline_ratio_vs_jsonl": None if cold != cold else round(cold / cold_ref, 2),
               **extra,
               "measurement": "2-core CPU box" if os.cpu_count() == 2 else
                              f"{os.cpu_count()}-core CPU"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if emulator is not None:
      emulator[0].__exit__(None, None, None)
  if _JSON.value:
    with open(_JSON.value, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1)


def _emulator():
  """(running context, tests/_support_gcs.py) or None without the cloud-test extra. The
  module is loaded by path: a benchmark never imports the tests package (its conftest)."""
  try:
    import gcp_storage_emulator  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
    spec = importlib.util.spec_from_file_location(
        "_support_gcs", os.path.join(_ROOT, "tests", "_support_gcs.py"))
    emulator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulator)
    ctx = emulator.running()
    ctx.__enter__()
    return ctx, emulator
  except (ImportError, RuntimeError) as e:
    print(f"gcs-emulator rows skipped: {e}", flush=True)
    return None


if __name__ == "__main__":
  app.run(main)
