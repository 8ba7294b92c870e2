"""run_eval.py's program after its flags: a run's HTML report, the agent evaluation, or load
a model and run the evaluation tasks on it (`evals.runner`). Bad input -> ValueError."""

from __future__ import annotations

import os
from typing import Any

from hybridmoe_jax.config.flags import load_model_config
from hybridmoe_jax.data import storage
from hybridmoe_jax.data.tokenizers.load import TOKENIZER_DIR, tokenizer_from_dir
from hybridmoe_jax.evals import niah, report, ruler
from hybridmoe_jax.loading import load_model, local_dir
from hybridmoe_jax.evals.runner import (check_niah_lengths, default_output_dir,
                                        options_from_flags, resolve_tasks, run_evals)
from hybridmoe_jax.model.impls import describe_impls
from hybridmoe_jax.tools import agent_eval


def main(*, task: str, workdir: str | None, params: str | None, output_dir: str | None,
         config: str | None, option_values: dict[str, Any], echo=print) -> dict[str, Any]:
  """Load the model, run `task` ("all" for every task), write results under output_dir.

  task "report" loads no model: it writes <output_dir or workdir>/report.html for a run;
  task "agent" rolls out tool-use episodes (`tools.agent_eval`, its options from the
  agent_* values of `option_values`).
  """
  # A gs:// run or export is read from its local mirror; a run's results (written under its
  # mirror without --output_dir) are uploaded to it too.
  named = workdir or params
  bucket = workdir if workdir and storage.is_remote(workdir) and not output_dir else None
  workdir, params = (workdir and local_dir(workdir)), (params and local_dir(params))
  if task == "agent":
    return agent_eval.run_agent_eval(workdir=workdir, params=params, output_dir=output_dir,
                                     config=config,
                                     options=agent_eval.options_from_flags(option_values))
  if task == "report":
    if not workdir:
      raise ValueError("--task=report needs --workdir (a training run), not --params")
    path = report.write_report(workdir, output_dir)
    if bucket:
      storage.upload(workdir, bucket, [os.path.relpath(path, workdir)])
      path = f"{bucket}/{os.path.relpath(path, workdir)}"
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
  info.pop("run_config", None)
  # The run's own tokenizer (copied there by the train loop); bytes when there is none.
  tok = tokenizer_from_dir(
      os.path.join(workdir or params, TOKENIZER_DIR),
      vision=model.cfg.vision.enabled)
  if "niah" in tasks:   # the flags were checked in bytes; this tokenizer may need more
    check_niah_lengths(opts, tok)
  output_dir = output_dir or default_output_dir(workdir, params)
  where = f"step {info['step']} of {named}" if "step" in info else named
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
  if bucket:
    storage.upload(output_dir, f"{bucket}/eval")
    output_dir = f"{bucket}/eval"
  echo(f"results in {output_dir}")
  return results
