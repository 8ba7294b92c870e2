"""What `run_eval.py` does after parsing flags: load, run, report. Bad input -> ValueError."""

from __future__ import annotations

import dataclasses
import os
from typing import Any


from hybridmoe_jax.config import ModelConfig, model_config_from_dict
from hybridmoe_jax.data.tokenizers.load import TOKENIZER_DIR, tokenizer_from_dir
from hybridmoe_jax.evals import niah, report, ruler
from hybridmoe_jax.loading import load_model
from hybridmoe_jax.evals.runner import (EvalOptions, default_output_dir, resolve_tasks,
                                        run_evals)
from hybridmoe_jax.model.impls import describe_impls
from hybridmoe_jax.config.flags import load_config_file


def load_model_config(path: str) -> ModelConfig:
  """The `model` section of a configs/*.py file (its get_config())."""
  if not os.path.isfile(path):
    raise ValueError(f"--config file {path} does not exist")
  return model_config_from_dict(load_config_file(path).model)


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
  if min(opts.niah_lengths) < niah.min_length(opts.niah_digits):
    raise ValueError(f"--niah_lengths: {min(opts.niah_lengths)} is too short for the needle "
                     f"and question (needs >= {niah.min_length(opts.niah_digits)})")
  if not all(0.0 <= d <= 1.0 for d in opts.niah_depths):
    raise ValueError(f"--niah_depths must lie in [0, 1], got {opts.niah_depths}")
  ruler.check_options(opts.ruler_tasks, opts.ruler_lengths, opts.ruler_samples,
                      opts.ruler_batch, opts.ruler_split)
  return opts


def main(*, task: str, workdir: str | None, params: str | None, output_dir: str | None,
         config: str | None, option_values: dict[str, Any], echo=print) -> dict[str, Any]:
  """Load the model, run `task` ("all" for every task), write results under output_dir.

  task "report" loads no model: it writes <output_dir or workdir>/report.html for a run.
  """
  if task == "report":
    if not workdir:
      raise ValueError("--task=report needs --workdir (a training run), not --params")
    path = report.write_report(workdir, output_dir)
    echo(f"report: {path}")
    return {"report": path}
  tasks = resolve_tasks(task)
  opts = options_from_flags(option_values)
  if "generate" in tasks and not opts.prompt:
    raise ValueError("--prompt is empty: give some text to continue")
  try:  # a command line with bytes that are not UTF-8 arrives as lone surrogates
    opts.prompt.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(f"--prompt holds bytes that are not UTF-8 (at character {e.start}: "
                     f"{opts.prompt[e.start:e.end]!r}); pass UTF-8 text") from None
  expected = load_model_config(config) if config else None
  model, info = load_model(workdir=workdir, params=params, expected=expected)
  if task == "all" and model.cfg.vision.enabled:
    tasks.append("vqa")
  data = info.pop("data_config", None)
  # The run's own tokenizer (copied there by the train loop); bytes when there is none.
  tok = tokenizer_from_dir(
      os.path.join(workdir or params, TOKENIZER_DIR),
      vision=model.cfg.vision.enabled)
  output_dir = output_dir or default_output_dir(workdir, params)
  where = f"step {info['step']} of {workdir}" if "step" in info else params
  kinds = "".join(k[0] for k in model.cfg.layer_kinds)
  echo(f"model: {where} ({model.cfg.num_layers} layers, kinds {kinds}); tokenizer "
       f"{getattr(tok, 'name', 'byte')} ({tok.vocab_size} ids)")
  for line in describe_impls(model.cfg, model.compute):
    echo(f"implementation: {line}")
  results = run_evals(model, tasks, opts, output_dir, info=info,
                      data_cfg=data, echo=echo, tokenizer=tok)
  if "niah" in results:  # a grid of zeros is expected from a small run: say so, and what is not
    echo(f"niah: what to expect: {niah.EXPECTATION}")
  if "ruler" in results:
    echo(f"ruler: what to expect: {ruler.EXPECTATION}")
  echo(f"results in {output_dir}")
  return results
