"""`run_eval.py --workdir=W --task=report`: one self-contained HTML page about a run.

W/report.html holds the config and parameter counts, hardware and throughput, loss curves,
held-out and eval-task results, expert load (latest heatmap, MaxVio over steps), checkpoints,
resumes and alerts. For an RL run (rl/trainer.py) the summary counts SFT steps and RL
iterations, the curves are the SFT loss and the per-iteration reward / success / loss /
entropy, and the evaluations include the in-run held-out success by level (over iterations)
and eval/agent.json. Figures are base64 PNG data URIs and the CSS is inline: no script, no
external URL, so the file opens anywhere, offline. Reading W is read-only (a run may still
be training); nothing but report.html is written.
"""

from __future__ import annotations

import base64
import html
import json
import os
import statistics
import time
from typing import Any, Iterable, Sequence

import numpy as np

from hybridmoe_jax import plots
from hybridmoe_jax.evals import report_data
from hybridmoe_jax.evals.report_data import RunData
from hybridmoe_jax.plots import history
from hybridmoe_jax.train import monitor

REPORT_FILE = "report.html"

_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 2px solid #ccd; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
td, th { border: 1px solid #ccd; padding: 3px 8px; text-align: right; }
th { background: #eef; } td.k, th.k { text-align: left; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
.note { background: #fff6d6; border-left: 4px solid #e0b000; padding: 4px 10px; }
.alert { background: #fde2e2; border-left: 4px solid #d33; padding: 4px 10px; }
.muted { color: #777; } pre { background: #f6f6f8; padding: 8px; white-space: pre-wrap; }
"""


def _e(x: Any) -> str:
  return html.escape(str(x))


def _num(x: Any) -> str:
  if isinstance(x, bool) or not isinstance(x, (int, float)):
    return _e(x)
  if isinstance(x, int):
    return f"{x:,}"
  return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _table(header: Sequence[str] | None, rows: Iterable[Sequence[Any]]) -> str:
  """A table; no header row when `header` is None (key-value tables)."""
  head = "".join(f'<th class="{"k" if i == 0 else ""}">{_e(h)}</th>'
                 for i, h in enumerate(header or ()))
  head = f"<tr>{head}</tr>" if head else ""
  body = "".join("<tr>" + "".join(f'<td class="{"k" if i == 0 else ""}">{_num(c)}</td>'
                                  for i, c in enumerate(r)) + "</tr>" for r in rows)
  return f"<table>{head}{body}</table>"


def _img(fig, alt: str) -> str:
  data = base64.b64encode(plots.png_bytes(fig)).decode("ascii")
  return f'<img alt="{_e(alt)}" src="data:image/png;base64,{data}">'


def _flat(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
  out = []
  for k, v in d.items():
    if isinstance(v, dict) and v:
      out += _flat(v, f"{prefix}{k}.")
    else:
      out.append((f"{prefix}{k}", json.dumps(v) if isinstance(v, (list, dict)) else v))
  return out


# ------------------------------------------------------------------------------- sections
def _rl_summary(run: RunData) -> str:
  cfg = (run.run_config or {}).get("rl") or {}
  sft = history.split_records(run.records, "sft", field="event")
  it = history.split_records(run.records, "rl", field="event")
  logged = [r["step"] for r in run.records
            if r.get("event") in ("sft", "rl", "eval") and isinstance(r.get("step"), int)]
  rows = [("workdir", run.workdir),
          ("last logged step", f"{max(logged) if logged else None} (SFT steps, then SFT "
                               "steps + RL iteration)"),
          ("SFT warm start", f"step {sft[-1]['step'] if sft else 0} of "
                             f"{cfg.get('sft_steps', '?')}"),
          ("RL iteration", f"{it[-1].get('iteration') if it else 0} of "
                           f"{cfg.get('iterations', '?')}"),
          ("metrics.jsonl last written", report_data.age(run.metrics_mtime)),
          ("report written", time.strftime("%Y-%m-%d %H:%M:%S"))]
  if sft:
    rows.append(("last SFT loss", sft[-1].get("loss")))
  if it:
    last = it[-1]
    rows += [(f"last iteration: {k}", last[k]) for k in
             ("reward", "success", "loss", "entropy", "clip_fraction", "kl_ref") if k in last]
    zero = sum(1 for r in it if r.get("episodes") and r.get("success", 0.0) == 0.0)
    if zero:
      rows.append(("iterations where no episode succeeded", f"{zero} of {len(it)}"))
  return _table(None, rows)


def _summary(run: RunData, train: list[dict]) -> str:
  if run.is_rl:
    return _rl_summary(run)
  steps = (run.run_config or {}).get("train", {}).get("steps")
  last = train[-1]["step"] if train else None
  rows = [("workdir", run.workdir), ("last logged step", f"{last} of {steps or '?'}"),
          ("metrics.jsonl last written", report_data.age(run.metrics_mtime)),
          ("report written", time.strftime("%Y-%m-%d %H:%M:%S"))]
  if train:
    rows.append(("last train loss", train[-1].get("loss")))
  return _table(None, rows)


def _model(run: RunData) -> str:
  out = []
  if run.params:
    p = run.params
    out.append(_table(("parameters", "count"), [("total", p["total"]),
                                               ("active per token", p["active"])]
                      + [(f"  {k}", v) for k, v in p["components"].items()]))
    if "vision" in p:
      out.append(_table(("vision tower", "count"), list(p["vision"].items())))
  if run.model_config:
    out.append("<details><summary>model config (model_config.json)</summary>"
               + _table(("field", "value"), _flat(run.model_config)) + "</details>")
  if run.run_config:
    rc = {k: v for k, v in run.run_config.items() if k not in ("model",)}
    out.append("<details><summary>run config (newest checkpoint: train, data, compute, "
               "mesh, curriculum)</summary>" + _table(("field", "value"), _flat(rc))
               + "</details>")
  return "".join(out) or '<p class="muted">no config found</p>'


def _hardware(run: RunData, train: list[dict]) -> str:
  events = [r for r in run.records if r.get("event") in ("start", "resume") and "backend" in r]
  hw = events[-1] if events else {}
  keys = ("backend", "device_kind", "devices", "local_devices", "processes", "jax_version")
  rows = [(k, hw[k]) for k in keys if k in hw]
  out = [_table(("hardware (latest start / resume)", ""), rows) if rows else
         '<p class="muted">hardware not recorded (a run from before it was logged)</p>']
  rates = [float(r["tokens_per_sec"]) for r in train
           if isinstance(r.get("tokens_per_sec"), (int, float))
           and np.isfinite(r["tokens_per_sec"]) and not r.get("tokens_per_sec_incl_compile")]
  if rates:
    out.append(_table(("throughput (tokens/s, compile excluded)", ""),
                      [("median over logs", statistics.median(rates)),
                       ("latest", rates[-1]), ("max", max(rates)), ("logs", len(rates))]))
  return "".join(out)


def _rl_evals(run: RunData) -> str:
  """The RL run's own held-out evaluations (greedy success per env / level) by iteration."""
  evals = history.split_records(run.records, "eval", field="event")
  if not evals:
    return ""
  cells = sorted({k.split("/", 1)[1] for r in evals for k in r if k.startswith("success/")})
  iters = [r.get("iteration") for r in evals]
  series = {c: [r.get(f"success/{c}") for r in evals] for c in cells}
  return ("<h3>Held-out success during RL (greedy)</h3>"
          + _img(plots.success_by_level(iters, series, title="held-out success by level "
                                        "(greedy)", xlabel="RL iteration"),
                 "held-out success by level over RL iterations")
          + _table(["RL iteration"] + cells,
                   [[i] + [series[c][n] for c in cells] for n, i in enumerate(iters)]))


def _evals(run: RunData) -> str:
  out = [_rl_evals(run)] if run.is_rl else []
  held = history.split_records(run.records, "eval")
  if held:
    out.append("<h3>Held-out loss during training</h3>" + _table(
        ("step", "loss", "bits/byte", "tokens"),
        [(r["step"], r.get("loss"), r.get("bits_per_byte"), r.get("tokens"))
         for r in held[-12:]]))
  for task, saved in run.evals.items():
    r, model = saved["result"], saved["model"]
    where = f"step {model['step']}" if "step" in model else model.get("path", "")
    out.append(f"<h3>{_e(task)} <span class='muted'>({_e(where)}, written "
               f"{report_data.age(saved['mtime'])})</span></h3>")
    try:
      out.append(_eval_task(task, r))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      out.append(f'<p class="note">eval/{_e(task)}.json has an unexpected layout '
                 f"({_e(type(e).__name__)}: {_e(e)})</p>")
  return "".join(out) or '<p class="muted">no evaluation yet (run_eval.py --task=all)</p>'


def _agent_table(results: dict[str, Any]) -> str:
  rows = [(policy, c["env"], c["level"], c["episodes"], c["success_rate"])
          for policy, r in results.items() for c in r["cells"]]
  return _table(("policy", "env", "level", "episodes", "success"), rows)


def _eval_task(task: str, r: dict[str, Any]) -> str:
  if task == "ppl":
    rows = [(f"{b['context_from']}-{b['context_to'] or ''}", b["tokens"], b["ppl"],
             b["bits_per_byte"]) for b in r["buckets"]]
    o = r["overall"]
    return _table(("context", "tokens", "ppl", "bits/byte"),
                  rows + [("all", o["tokens"], o["ppl"], o["bits_per_byte"])])
  if task == "niah":
    return _img(plots.niah_figure(r), "NIAH accuracy by length and depth")
  if task == "mqar":
    return _table(("length", "pairs", "accuracy"),
                  [(c["length"], c["pairs"], c["accuracy"]) for c in r["cells"]])
  if task == "vqa":
    return _img(plots.vqa_figure(r), "VQA accuracy per question type")
  if task == "ruler":
    corpus = r.get("corpus", {})
    note = (f'<p class="muted">{r["samples"]} prompts per cell, {_e(r["split"])} split '
            f'({_e(", ".join(corpus.get("files", [])))}; sha256 '
            f'{_e(str(corpus.get("sha256", ""))[:12])}), seed {r["seed"]}'
            f'{" (fixed)" if r.get("seed_fixed") else " (fresh)"}; score: RULER recall; '
            "interval: 95% Wilson of the all-correct rate</p>")
    rows = [(c["task"], c["length"], c["score"], c["all_correct"],
             f'{c["wilson_low"]:.2f}-{c["wilson_high"]:.2f}') for c in r["cells"]]
    return (_img(plots.ruler_figure(r), "RULER-style recall by task and length") + note +
            _table(("task", "length", "score", "all correct", "95% interval"), rows))
  if task == "agent":
    return _img(plots.agent_eval_bars(r), "agent success per level") + _agent_table(r)
  return _table(("prompt", "continuation"), [(repr(r["prompt"]), repr(r["text"]))])


def _expert_load(run: RunData, train: list[dict]) -> str:
  latest = next((r for r in reversed(train) if r.get("moe")), None)
  if latest is None:
    return '<p class="muted">no MoE statistics logged yet</p>'
  names = history.layer_names([latest])
  try:
    load = np.array([latest["moe"][n]["load"] for n in names], np.float64)
    vio = [float(latest["moe"][n]["max_vio"]) for n in names]
  except (KeyError, TypeError, ValueError) as e:
    return f'<p class="note">expert load of step {latest["step"]} unreadable ({_e(e)})</p>'
  t = (run.run_config or {}).get("train", {})
  threshold = t.get("maxvio_alert_threshold")
  overload = 1.0 + threshold if threshold is not None else 1.5
  return (_img(plots.expert_load_figure(load, names, step=latest["step"], max_vio=vio,
                                        overload=overload),   # one step: "step N only"
               "expert load heatmap")
          + _img(plots.maxvio_figure(run.records, threshold=threshold,
                                     alert_steps=t.get("maxvio_alert_steps")),
                 "MaxVio over steps"))


def _checkpoints(run: RunData) -> str:
  out = [_table(("checkpoint step", "written"),
                [(s, report_data.age(t)) for s, t in run.checkpoints])
         if run.checkpoints else '<p class="muted">no checkpoint yet</p>']
  if run.partial_checkpoints:
    out.append(f'<p class="note">unfinished (a save in flight, or killed): '
               f'{_e(", ".join(run.partial_checkpoints))}</p>')
  if run.corrupt:
    out.append('<p class="alert">quarantined in checkpoints_corrupt/: '
               f'{_e(", ".join(run.corrupt))}</p>')
  events = [(r["event"], r.get("step")) for r in run.records if r.get("event")]
  if events:
    out.append(_table(("event", "at step"), events))
  return "".join(out)


def _alert_rules(t: dict) -> str:
  """How each alert fires, from the run's train config (train/monitor.py's rules)."""
  thr, steps = t.get("maxvio_alert_threshold"), t.get("maxvio_alert_steps")
  factor = t.get("loss_spike_factor")
  maxvio = (f"a layer's MaxVio (max expert load / mean - 1) above {thr:g} (the dashed line "
            f"of the MaxVio figure) for {steps} steps in a row, every step counted, not only "
            "the logged ones; a shorter excursion above the line raises none"
            if thr is not None and steps is not None else "see train.maxvio_alert_*")
  spike = monitor.spike_rule(factor) if factor is not None else "see train.loss_spike_factor"
  return ('<p class="muted">How alerts fire: <b>maxvio</b>: ' + _e(maxvio) +
          '. <b>loss_spike</b>: ' + _e(spike) + '. <b>nonfinite</b>: a step whose loss or '
          'gradient norm is not finite (its update is skipped).</p>')


def _maxvio_crossings(train: list[dict], thr: float | None) -> str:
  """Without a MaxVio alert: how often the logged MaxVio was above the line anyway."""
  if thr is None:
    return ""
  above, logged, layers = 0, 0, set()
  for r in train:
    moe = r.get("moe") or {}
    vios = {n: l.get("max_vio") for n, l in moe.items() if isinstance(l, dict)}
    vios = {n: v for n, v in vios.items() if isinstance(v, (int, float))}
    if vios:
      logged += 1
      hot = [n for n, v in vios.items() if v > thr]
      above += bool(hot)
      layers.update(hot)
  if not above:
    return ""
  names = ", ".join(history.layer_label(n) for n in sorted(layers))
  return (f'<p class="note">MaxVio was above the line ({thr:g}) at {above} of {logged} '
          f'logged steps ({_e(names)}), but no layer stayed above it long enough for an '
          'alert (the rule above).</p>')


def _alerts(run: RunData, train: list[dict]) -> str:
  """Final alert counters and the first logged step at which each one grew, the rules they
  follow, and MaxVio above the drawn line without an alert (explained, not hidden)."""
  t = (run.run_config or {}).get("train", {})
  first, last = {}, {}
  for r in train:
    for k, v in (r.get("alerts") or {}).items():
      if isinstance(v, (int, float)) and v > last.get(k, 0):
        first.setdefault(k, r["step"])
        last[k] = v
  crossings = "" if "maxvio" in last else _maxvio_crossings(
      train, t.get("maxvio_alert_threshold"))
  if not last:
    return '<p class="muted">no alerts raised</p>' + crossings + _alert_rules(t)
  return ('<p class="alert">alerts were raised (MaxVio streaks, loss spikes, non-finite '
          'steps):</p>' + _table(("alert", "count", "first logged at step"),
                                 [(k, last[k], first[k]) for k in sorted(last)])
          + crossings + _alert_rules(t))


def render(run: RunData) -> str:
  """The whole page as one HTML string (figures inline)."""
  train = history.split_records(run.records, "train")
  name = os.path.basename(run.workdir.rstrip("/")) or run.workdir
  notes = "".join(f'<p class="note">{_e(n)}</p>' for n in run.notes)
  # Pictures first: what a reader looks for is how the run is going.
  sft, rl = (history.split_records(run.records, e, field="event") for e in ("sft", "rl"))
  curves = (_img(plots.rl_training_figure(sft, rl), "SFT loss and RL curves over iterations")
            if run.is_rl else _img(plots.loss_figure(run.records), "loss curves"))
  sections = [("Run", _summary(run, train)),
              ("Curves", curves),
              ("Expert load", _expert_load(run, train)), ("Alerts", _alerts(run, train)),
              ("Evaluations", _evals(run)),
              ("Hardware and throughput", _hardware(run, train)),
              ("Checkpoints and resumes", _checkpoints(run)),
              ("Model and config", _model(run))]
  body = "".join(f"<h2>{_e(title)}</h2>{content}" for title, content in sections)
  return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
          f"<title>run report: {_e(name)}</title><style>{_CSS}</style></head><body>"
          f"<h1>Run report: {_e(name)}</h1>{notes}{body}</body></html>")


def write_report(workdir: str, output_dir: str | None = None) -> str:
  """Write <output_dir or workdir>/report.html for the run in `workdir`; returns its path.

  Raises:
    ValueError: `workdir` is missing or holds no run (see `report_data.read_run`).
  """
  run = report_data.read_run(workdir)
  page = render(run)
  out_dir = output_dir or workdir
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, REPORT_FILE)
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(page)
  os.replace(tmp, path)
  return path
