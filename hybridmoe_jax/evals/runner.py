"""Run evaluation tasks on a model, write `<output_dir>/<task>.json`, print short tables.

Tasks: ppl (perplexity / bits per byte by context bucket), niah (passkey grid + PNG
heatmap), mqar (associative recall grid), generate (prompt [+ --image] -> text), vqa
(vision models: question answering on held-out generated images), ruler (the RULER-style
long-context suite, task x length + PNG heatmap; not part of "all": long prompts), all (the
text tasks, and vqa for a vision model). Every task uses the run's tokenizer
(`tokenizer_from_dir` of <workdir>/tokenizer; the byte tokenizer when there is none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any, Sequence

import jax
import numpy as np

from hybridmoe_jax.data.tokenizers.base import Tokenizer
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.data import images as images_lib
from hybridmoe_jax.data import multimodal
from hybridmoe_jax.evals import mqar, niah, ppl, ruler, vqa
from hybridmoe_jax.infer import Engine, SamplingConfig
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.cli import io_noise
from hybridmoe_jax.config import ConfigError

TEXT_TASKS = ("ppl", "niah", "mqar", "generate")
TASKS = TEXT_TASKS + ("vqa", "ruler")
RESULTS_FILE = "results.json"   # every task's latest result, merged across runs


@dataclasses.dataclass(frozen=True)
class EvalOptions:
  """Sizes of every task (defaults: minutes on a CPU for the tiny model)."""

  prefill_chunk: int = 256
  kv_block: int = 512
  seed: int = 0
  ppl_max_len: int = 2048
  ppl_max_docs: int = 8
  text_files: tuple[str, ...] = ()
  niah_lengths: tuple[int, ...] = (256, 512, 1024)
  niah_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
  niah_samples: int = 4
  niah_digits: int = 5
  mqar_lengths: tuple[int, ...] = (64, 128, 256)
  mqar_pairs: tuple[int, ...] = (4, 8, 16)
  mqar_samples: int = 16
  prompt: str = "The sky is"
  max_new_tokens: int = 64
  max_len: int = 4096
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  image: str = ""               # generate: image file (.npy/.ppm/.pgm) placed before the prompt
  pad_image: bool = False       # pad an image whose sides are not multiples of 2p
  vqa_images: int = 48          # vqa: held-out generated scenes
  vqa_seed: int = -1            # vqa: scene seed; -1: the run's data.vision.heldout_seed
  ruler_tasks: tuple[str, ...] = ruler.TASKS
  ruler_lengths: tuple[int, ...] = (1024, 4096)
  ruler_samples: int = 8        # ruler: prompts per (task, length) cell
  ruler_batch: int = 8          # ruler: prompts decoded together
  ruler_seed: int = -1          # ruler: -1: a fresh seed per call (recorded in the result)
  ruler_split: str = "test"     # ruler: "validation" to choose recipes, "test" to report


def check_niah_lengths(opts: EvalOptions, tok: Tokenizer | None = None) -> None:
  """--niah_lengths against the needle and question in `tok` (None: bytes, before a model's
  tokenizer is known). Raises ValueError naming the flag."""
  shortest = niah.min_length(opts.niah_digits, tok)
  where = " in the run's tokenizer" if tok is not None else ""
  if min(opts.niah_lengths) < shortest:
    raise ValueError(f"--niah_lengths: {min(opts.niah_lengths)} is too short for the needle "
                     f"and question{where} (needs >= {shortest})")


def options_from_flags(values: dict[str, Any]) -> EvalOptions:
  """Build EvalOptions from flag values (lists -> tuples of the right type); check ranges."""
  kw = {}
  for f in dataclasses.fields(EvalOptions):
    if f.name not in values or values[f.name] is None:
      continue
    v = values[f.name]
    if isinstance(f.default, tuple):
      cast = (float if f.name == "niah_depths" else
              str if f.name in ("text_files", "ruler_tasks") else int)
      try:
        v = tuple(cast(x) for x in v)
      except ValueError as e:
        raise ValueError(f"--{f.name}: {e}") from None
      if not v and f.name != "text_files":
        raise ValueError(f"--{f.name} is empty")
    kw[f.name] = v
  opts = EvalOptions(**kw)
  positive = ("prefill_chunk", "kv_block", "ppl_max_len", "ppl_max_docs", "niah_samples",
              "niah_digits", "mqar_samples", "max_new_tokens", "max_len", "vqa_images")
  for name in positive:
    if getattr(opts, name) < 1:
      raise ValueError(f"--{name} must be >= 1, got {getattr(opts, name)}")
  for name in ("niah_lengths", "mqar_lengths", "mqar_pairs"):
    if min(getattr(opts, name)) < 1:
      raise ValueError(f"--{name} must hold positive integers, got {getattr(opts, name)}")
  if opts.ppl_max_len < 2:   # one token is BOS alone: nothing to score
    raise ValueError(f"--ppl_max_len must be >= 2, got {opts.ppl_max_len}")
  if opts.seed < 0:          # numpy seeds are non-negative
    raise ValueError(f"--seed must be >= 0, got {opts.seed}")
  for name in ("vqa_seed", "ruler_seed"):
    if getattr(opts, name) < -1:
      raise ValueError(f"--{name} must be >= 0 or -1, got {getattr(opts, name)}")
  try:   # the sampler's own ranges, declared once (infer.sampling.SamplingConfig)
    SamplingConfig(opts.temperature, opts.top_k, opts.top_p)
  except ConfigError as e:
    raise ValueError(f"--{e.field.rsplit('.', 1)[-1]}: {e}") from None
  num_keys = len(mqar.token_ranges(256)[0])
  if max(opts.mqar_pairs) > num_keys:
    raise ValueError(f"--mqar_pairs must hold at most {num_keys} pairs (the key tokens), got "
                     f"{opts.mqar_pairs}")
  if 4 * min(opts.mqar_pairs) > max(opts.mqar_lengths):
    raise ValueError(f"--mqar_lengths: no length fits --mqar_pairs={opts.mqar_pairs} (need a "
                     f"length >= {4 * min(opts.mqar_pairs)}), got {opts.mqar_lengths}")
  check_niah_lengths(opts)
  if not all(0.0 <= d <= 1.0 for d in opts.niah_depths):
    raise ValueError(f"--niah_depths must lie in [0, 1], got {opts.niah_depths}")
  ruler.check_options(opts.ruler_tasks, opts.ruler_lengths, opts.ruler_samples,
                      opts.ruler_batch, opts.ruler_split)
  return opts


def default_output_dir(workdir: str | None, params: str | None) -> str:
  """Where results go without --output_dir: <workdir>/eval for a run; beside a params
  export, <params>_eval (an export stays what the exporter wrote: weights, config,
  tokenizer)."""
  if workdir:
    return os.path.join(workdir, "eval")
  return os.path.normpath(params) + "_eval"


def resolve_tasks(task: str) -> list[str]:
  if task == "all":
    return list(TEXT_TASKS)
  if task not in TASKS:
    raise ValueError(f"unknown task {task!r}: allowed one of {TASKS + ('all',)}")
  return [task]


def default_tokenizer(model: HybridLM) -> Tokenizer:
  """The byte tokenizer (with image ids for a vision model): runs without a saved one."""
  return ByteTokenizer(vision=model.cfg.vision.enabled)


def check_model_tokenizer(model: HybridLM, tok: Tokenizer) -> None:
  """ValueError (one line, both sizes) when the model cannot embed every tokenizer id."""
  if model.cfg.vocab_size < tok.vocab_size:
    raise ValueError(f"the evals' tokenizer ({getattr(tok, 'name', 'byte')}) has "
                     f"{tok.vocab_size} ids; this model's vocab_size is "
                     f"{model.cfg.vocab_size}: evaluate with the tokenizer it was trained with")


def _engine(model, opts: EvalOptions, max_len: int) -> Engine:
  # Capacities rounded up to a power of two let tasks share compilations; the attention
  # reads only filled blocks, so the extra room costs memory, not time.
  cap = 1 << max(int(max_len) - 1, 1).bit_length()
  return Engine(model, max_len=cap, prefill_chunk=opts.prefill_chunk, kv_block=opts.kv_block)


def run_generate(model: HybridLM, opts: EvalOptions,
                 tok: Tokenizer | None = None) -> dict[str, Any]:
  if not opts.prompt:
    raise ValueError("--prompt is empty: give some text to continue")
  tok = tok or default_tokenizer(model)
  images = None
  if opts.image:
    if not model.cfg.vision.enabled:
      raise ValueError("--image needs a vision model (model.vision.enabled = True)")
    if not os.path.isfile(opts.image):
      raise ValueError(f"--image file {opts.image} does not exist")
    proc = multimodal.Processor(model.cfg.vision, pad_images=opts.pad_image, tokenizer=tok)
    # The image goes where the prompt has "<image>", else before the prompt.
    text = (opts.prompt if multimodal.IMAGE_MARKER in opts.prompt
            else multimodal.IMAGE_MARKER + "\n" + opts.prompt)
    doc = proc(text, [images_lib.read_image(opts.image)], eos=False)
    ids, images = doc.tokens, multimodal.inference_batch(doc, model.cfg.vision)
  else:
    ids = tok.encode(opts.prompt, bos=True)
  # The exact --max_len (not rounded): a too-long prompt is reported against what was asked.
  engine = Engine(model, max_len=opts.max_len, prefill_chunk=opts.prefill_chunk,
                  kv_block=opts.kv_block)
  t0 = time.perf_counter()
  with compile_timer() as compiling:
    out = engine.generate(ids, max_new_tokens=opts.max_new_tokens, seed=opts.seed,
                          sampling=SamplingConfig(opts.temperature, opts.top_k, opts.top_p,
                                                  vocab_limit=tok.vocab_size),
                          stop_tokens=[tok.eos_id], pad_id=tok.pad_id, images=images)
  seconds = time.perf_counter() - t0
  n = int(out.lengths[0])
  run_s = max(seconds - compiling[0], 0.0)
  return {"prompt": opts.prompt, "image": opts.image or None,
          "text": tok.decode(out.tokens[0, :n]), "new_tokens": n,
          "seconds": seconds, "compile_s": compiling[0], "run_s": run_s,
          "tokens_per_s": n / run_s if run_s > 0 else None,
          "temperature": opts.temperature, "top_k": opts.top_k, "top_p": opts.top_p}


# jax's duration events for tracing, lowering and XLA compilation (jax._src.dispatch).
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


@contextlib.contextmanager
def compile_timer():
  """Seconds jax spends tracing, lowering and compiling inside the block: yields a
  one-element list, summed as jax reports each event (the rest of the block's wall time
  is the run: prefill and decode)."""
  total = [0.0]

  def listen(event: str, duration: float, **_):
    if event in _COMPILE_EVENTS:
      total[0] += duration

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield total
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def run_vqa(model: HybridLM, opts: EvalOptions, data_cfg=None,
            tok: Tokenizer | None = None) -> dict[str, Any]:
  """VQA on held-out generated scenes; sides and seed from the run's data.vision section."""
  vis = data_cfg.vision if data_cfg is not None else None
  sides = tuple(vis.sides) if vis is not None else tuple(model.cfg.vision.image_buckets)
  seed = opts.vqa_seed if opts.vqa_seed >= 0 else (int(vis.heldout_seed) if vis is not None
                                                   else 2)
  if vis is not None and seed == int(vis.train_seed):
    raise ValueError(f"--vqa_seed={seed} is the training seed of the run's scenes: choose "
                     "another so the images are held out")
  engine = _engine(model, opts, 512)
  return vqa.evaluate_vqa(engine, num_images=opts.vqa_images, seed=seed, sides=sides,
                          channels=model.cfg.vision.num_channels,
                          tokenizer=tok or default_tokenizer(model))


def run_task(task: str, model: HybridLM, opts: EvalOptions, output_dir: str,
             data_cfg=None, tokenizer: Tokenizer | None = None
             ) -> dict[str, Any]:
  """One task; tokenizer: the run's (default: bytes)."""
  tok = tokenizer or default_tokenizer(model)
  if task == "ppl":
    docs = ppl.heldout_documents(data_cfg, opts.text_files)
    return ppl.evaluate_ppl(_engine(model, opts, opts.ppl_max_len), docs,
                            max_docs=opts.ppl_max_docs, max_tokens=opts.ppl_max_len,
                            tokenizer=tok)
  if task == "niah":
    engine = _engine(model, opts, max(opts.niah_lengths) + opts.niah_digits)
    return niah.evaluate_niah(engine, opts.niah_lengths, opts.niah_depths,
                              samples=opts.niah_samples, num_digits=opts.niah_digits,
                              seed=opts.seed, output_dir=output_dir, tokenizer=tok)
  if task == "mqar":
    return mqar.evaluate_mqar(_engine(model, opts, max(opts.mqar_lengths)), opts.mqar_lengths,
                              opts.mqar_pairs, samples=opts.mqar_samples, seed=opts.seed)
  if task == "vqa":
    return run_vqa(model, opts, data_cfg, tok)
  if task == "ruler":
    # Room for the longest answer (a few UUIDs) after the longest prompt.
    engine = _engine(model, opts, max(opts.ruler_lengths) + 256)
    return ruler.evaluate_ruler(engine, opts.ruler_tasks, opts.ruler_lengths,
                                samples=opts.ruler_samples, batch=opts.ruler_batch,
                                seed=None if opts.ruler_seed < 0 else opts.ruler_seed,
                                split=opts.ruler_split, tokenizer=tok, output_dir=output_dir)
  return run_generate(model, opts, tok)


def format_table(task: str, r: dict[str, Any]) -> str:
  """A few human-readable lines per task."""
  if task == "ppl":
    lines = [f"{'context':>15} {'tokens':>8} {'ppl':>9} {'bits/byte':>9}"]
    for b in r["buckets"] + [dict(r["overall"], context_from="all")]:
      span = b["context_from"] if b["context_from"] == "all" else (
          f"{b['context_from']}-{b['context_to'] or ''}")
      lines.append(f"{span:>15} {b['tokens']:>8} {b['ppl']:>9.3f} {b['bits_per_byte']:>9.3f}")
    return "\n".join(lines)
  if task == "niah":
    lines = [f"{'depth':>7} " + " ".join(f"{n:>7}" for n in r["lengths"])]
    for d, row in zip(r["depths"], r["accuracy"]):
      lines.append(f"{d:>7.2f} " + " ".join(f"{a:>7.2f}" for a in row))
    lines.append(f"mean accuracy {r['mean_accuracy']:.3f} (chance {r['chance']:.0e}), digit "
                 f"accuracy {r['mean_digit_accuracy']:.3f} (chance 0.1)")
    lines.append(f"{'gain':>7} " + " ".join(
        f"{np.mean(col):>7.3f}" for col in zip(*r["key_nll_gain"])) +
                 "  key NLL gain, nats/digit (other key - true key; 0: needle unused)")
    return "\n".join(lines)
  if task == "mqar":
    lines = [f"{'length':>7} {'pairs':>6} {'accuracy':>9}"]
    lines += [f"{c['length']:>7} {c['pairs']:>6} {c['accuracy']:>9.3f}" for c in r["cells"]]
    return "\n".join(lines + [f"chance {r['chance']:.3f}"])
  if task == "vqa":
    return vqa.format_vqa(r)
  if task == "ruler":
    return ruler.format_table(r)
  rate = f", {r['tokens_per_s']:.1f} tok/s" if r.get("tokens_per_s") else ""
  timing = (f"compile {r['compile_s']:.2f}s + run {r['run_s']:.2f}s{rate}"
            if "compile_s" in r else f"{r['seconds']:.2f}s")
  return f"{r['prompt']!r} -> {r['text']!r} ({r['new_tokens']} tokens, {timing})"


def write_result(path: str, obj: dict[str, Any]) -> None:
  """JSON into `path` through a temp file and a rename: a full disk leaves the previous
  result (or none), never a truncated or 0-byte file.

  Raises:
    OSError: one line naming `path`, what happened and what to do.
  """
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(obj, f, indent=1)
    os.replace(tmp, path)
  except OSError as e:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    what, fix = io_noise.describe_write_error(e)
    raise OSError(f"cannot write the eval result {path}: {what}; "
                  f"{fix}, then rerun the eval") from None


def run_evals(model: HybridLM, tasks: Sequence[str], opts: EvalOptions, output_dir: str, *,
              info: dict[str, Any] | None = None, data_cfg=None, echo=print,
              tokenizer: Tokenizer | None = None) -> dict[str, Any]:
  """Run `tasks`, write <output_dir>/<task>.json (and results.json), echo a table each.

  tokenizer: the run's (`tokenizer_from_dir`); default the byte tokenizer.
  """
  tokenizer = tokenizer or default_tokenizer(model)
  check_model_tokenizer(model, tokenizer)
  os.makedirs(output_dir, exist_ok=True)
  results = {}
  for task in tasks:
    t0 = time.perf_counter()
    r = run_task(task, model, opts, output_dir, data_cfg, tokenizer)
    r["wall_s"] = time.perf_counter() - t0
    results[task] = r
    write_result(os.path.join(output_dir, f"{task}.json"),
                 {"task": task, "model": info or {}, "result": r})
    echo(f"== {task} ({r['wall_s']:.1f}s)\n{format_table(task, r)}")
  path = os.path.join(output_dir, RESULTS_FILE)
  write_result(path, merge_results(path, info or {}, dataclasses.asdict(opts), results,
                                   echo=echo))
  return results



def merge_results(path: str, info: dict[str, Any], options: dict[str, Any],
                  results: dict[str, Any], echo=print) -> dict[str, Any]:
  """results.json after a run of some tasks: the file's other tasks kept, these replaced.

  {"model", "options": this run's; "results": {task: result}; "tasks": {task: {"model",
  "options"}}: what each result ran with} (a later `--task=niah` no longer drops the ppl of
  an earlier `--task=all`). A file that cannot be read is set aside as <path>.unreadable,
  not overwritten.
  """
  old: dict[str, Any] = {}
  if os.path.exists(path):
    try:
      with open(path, encoding="utf-8") as f:
        old = json.load(f)
      if (not isinstance(old, dict) or not isinstance(old.get("results", {}), dict)
          or not isinstance(old.get("tasks") or {}, dict)):
        raise ValueError("not a results file")
    except (OSError, ValueError) as e:
      os.replace(path, path + ".unreadable")
      echo(f"warning: {path} was unreadable ({e}); kept as {path}.unreadable")
      old = {}
  runs = dict(old.get("tasks") or {})
  for task in old.get("results", {}):   # files written before "tasks": the top-level run's
    runs.setdefault(task, {"model": old.get("model", {}), "options": old.get("options", {})})
  runs.update({task: {"model": info, "options": options} for task in results})
  return {"model": info, "options": options,
          "results": {**old.get("results", {}), **results}, "tasks": runs}
