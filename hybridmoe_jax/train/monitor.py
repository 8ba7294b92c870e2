"""Run monitoring: progress line, TensorBoard, JSONL, alerts and the expert-load heatmap.

Every step's (host) metrics go through `Monitor.step`, which keeps the alert state (MaxVio
streaks per MoE layer, loss spikes against a running mean and spread: SPIKE_* below); every
`log_every` steps it prints one progress line and writes TensorBoard scalars / histograms
(`train/`, `moe/<layer>/`, the layer named by its MoE module path, e.g. "layers/1/ffn") and
one JSON line to `workdir/metrics.jsonl`. Every `heatmap_every` steps the expert load
summed since the last heatmap goes to `expert_load.png`, `heatmaps/expert_load_<step>.png`
and TensorBoard (`moe/expert_load`, an image next to the scalars), drawn by
`hybridmoe_jax.plots`.

tokens/s is measured between log steps (wall time once each step's metrics reached the host),
from the end of the run's first step, so compilation is not counted; the log right after that
first step (step 1 is always logged, so curves start at the run's start) times it from the
Monitor's creation instead, compilation included, and says so ("incl. compile" in the line,
`tokens_per_sec_incl_compile` in JSONL). On a terminal (`terminal.install`, run by the CLI)
a progress bar is redrawn every step below the log lines.
"""

from __future__ import annotations

import collections
import enum
import json
import math
import os
import time
from typing import Any, Callable

from absl import logging
import jax
import numpy as np
import tensorboardX

from hybridmoe_jax import plots
from hybridmoe_jax.cli import terminal
from hybridmoe_jax.cli.terminal import fmt_duration


class Event(enum.StrEnum):
  """The kinds of metrics.jsonl records that carry an "event" field: a run's start or resume
  (with `hardware()`), and the RL run's SFT steps, iterations and held-out evaluations
  (`Monitor.record`). Pre-training's per-step records carry "split" instead."""
  START = "start"
  RESUME = "resume"
  SFT = "sft"
  RL = "rl"
  EVAL = "eval"


def fmt_rate(x: float) -> str:
  """'3.5k', '1.20M', '950'; '?' when unknown (NaN)."""
  if not math.isfinite(x):
    return "?"
  return f"{x / 1e6:.2f}M" if x >= 1e6 else (f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}")


def _jsonable(x):
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  a = np.asarray(x)
  if a.ndim:
    return a.tolist()
  v = a.item()
  return v if not isinstance(v, float) or math.isfinite(v) else str(v)


def _float_or_str(x) -> float | str:
  v = float(np.asarray(x))
  return v if math.isfinite(v) else str(v)


def hardware() -> dict[str, Any]:
  """Where the run executes: jax backend, device kind and counts (for the run report)."""
  devices = jax.devices()
  return {"backend": jax.default_backend(), "device_kind": devices[0].device_kind,
          "devices": len(devices), "local_devices": jax.local_device_count(),
          "processes": jax.process_count(), "jax_version": jax.__version__}


# The loss-spike rule. A step's loss is a spike when it exceeds both loss_spike_factor x the
# running mean and the running mean + SPIKE_SIGMAS running standard deviations (exponential
# averages, weight SPIKE_EMA per step, from the 10th finite step on): a loss that is noisy by
# nature (a mix of easy and hard batches, e.g. the retrieval recipe's) raises its own bar.
# After an alert, further spikes for SPIKE_COOLDOWN steps are counted into the next alert's
# line, not alerted one by one: an alert on most steps is noise.
SPIKE_SIGMAS = 4.0
SPIKE_EMA = 0.1
SPIKE_WARMUP = 10
SPIKE_COOLDOWN = 50


def spike_rule(factor: float) -> str:
  """The loss-spike rule in words (the run report explains its alerts with it)."""
  return (f"loss above both {factor:g} x its running mean and the running mean + "
          f"{SPIKE_SIGMAS:g} running standard deviations (exponential averages, weight "
          f"{SPIKE_EMA:g}, from step {SPIKE_WARMUP}); at most one alert per "
          f"{SPIKE_COOLDOWN} steps, the spikes in between counted in the next one")


class Monitor:
  """Progress line, TensorBoard events, JSONL metrics, alerts and expert-load heatmaps of
  pre-training (`step`, `log_eval`) and the RL run's typed event records (`record`)."""

  def __init__(self, workdir: str, t, *, start_step: int = 0, total_steps: int = 0,
               tokens_seen: Callable[[int], int] = lambda step: 0):
    """tokens_seen(step): training tokens in the first `step` steps (`Plan.tokens_seen`;
    a curriculum stage may change the tokens per step)."""
    self.workdir, self.t = workdir, t
    self.start_step, self.total_steps = start_step, total_steps
    self.tokens_seen = tokens_seen
    self.writer = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"))
    self.jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
    self.alerts: collections.Counter[str] = collections.Counter()
    self._streak: dict[str, int] = collections.defaultdict(int)
    self._loss_mean: float | None = None
    self._loss_var = 0.0
    self._loss_seen = 0
    self._spike_alerted: int | None = None   # step of the last loss-spike alert
    self._spikes_held = 0                     # spikes since then, not alerted
    self._heat_load: dict[str, np.ndarray] = {}
    self._heat_from = start_step + 1     # first step summed into the next heatmap
    self._last_vio: dict[str, float] = {}
    self._built = time.perf_counter()    # ~the first step's start (for log_every = 1)
    self._t0: float | None = None        # timer start: after the first (compiling) step
    self._t0_step = start_step
    self._last_log_time: float | None = None
    self._last_log_step = start_step
    self.first_loss: float | None = None
    self.last_loss: float | None = None
    self.tokens_per_sec = float("nan")

  # ----------------------------------------------------------------------------- per step
  def step(self, step: int, m: dict[str, Any]) -> None:
    """Record the host metrics of the step that brought the state to `step`."""
    now = time.perf_counter()
    if self._t0 is None:
      self._t0, self._t0_step = now, step
      self._last_log_time, self._last_log_step = now, step
    loss = float(m["loss"])
    if self.first_loss is None:
      self.first_loss = loss
    self.last_loss = loss
    if not bool(m["finite"]):
      self.alerts["nonfinite"] += 1
      logging.warning("step %d: non-finite loss (%s) or grad norm (%s): update skipped "
                      "(%d skipped so far)", step, loss, float(m["grad_norm"]),
                      int(m["skipped"]))
    else:
      self._check_loss_spike(step, loss)
    self._check_maxvio(step, m["moe"])
    for name, layer in m["moe"].items():
      load = np.asarray(layer["load"], np.float64)
      self._heat_load[name] = self._heat_load.get(name, 0.0) + load
      self._last_vio[name] = float(layer["max_vio"])
    # Step 1 too, so the curves start where the run does (its tok/s includes compilation).
    if step % self.t.log_every == 0 or step == self.total_steps or step == 1:
      self._log(step, m, now)
    self._draw_bar(step, loss, now)
    if self.t.heatmap_every and (step % self.t.heatmap_every == 0 or step == self.total_steps):
      self.write_heatmap(step)

  def _draw_bar(self, step: int, loss: float, now: float) -> None:
    """The terminal's progress bar (`terminal.install`; a no-op elsewhere): loss, tokens/s
    and ETA since the first step's end (compilation excluded)."""
    bar = terminal.active_bar()
    if bar is None or not bar.enabled:
      return
    done, elapsed = step - self._t0_step, now - self._t0
    rate = ((self.tokens_seen(step) - self.tokens_seen(self._t0_step)) / elapsed
            if done > 0 and elapsed > 0 else float("nan"))
    eta = (self.total_steps - step) * elapsed / done if done > 0 else float("nan")
    bar.update(step, self.total_steps,
               f"loss {loss:.4f} | {fmt_rate(rate)} tok/s | ETA {fmt_duration(eta)}")

  def _check_loss_spike(self, step: int, loss: float) -> None:
    """The rule of SPIKE_* above (spike_rule)."""
    if self._loss_seen >= SPIKE_WARMUP:
      mean, std = self._loss_mean, math.sqrt(self._loss_var)
      bar = max(self.t.loss_spike_factor * mean, mean + SPIKE_SIGMAS * std)
      if loss > bar:
        if self._spike_alerted is not None and step - self._spike_alerted < SPIKE_COOLDOWN:
          self._spikes_held += 1
        else:
          self.alerts["loss_spike"] += 1
          held = (f"; {self._spikes_held} more spike(s) since the last alert"
                  if self._spikes_held else "")
          logging.warning("ALERT step %d: loss spike %.4f > %.4f (%.2f x running mean %.4f, "
                          "mean + %g std %.4f)%s (%d alerts)", step, loss, bar,
                          self.t.loss_spike_factor, mean, SPIKE_SIGMAS, std, held,
                          self.alerts["loss_spike"])
          self._spike_alerted, self._spikes_held = step, 0
    if self._loss_mean is None:
      self._loss_mean = loss
    else:   # exponential mean and variance (West's incremental form)
      delta = loss - self._loss_mean
      self._loss_mean += SPIKE_EMA * delta
      self._loss_var = (1 - SPIKE_EMA) * (self._loss_var + SPIKE_EMA * delta * delta)
    self._loss_seen += 1

  def _check_maxvio(self, step: int, moe: dict[str, Any]) -> None:
    for name, layer in moe.items():
      vio = float(layer["max_vio"])
      self._streak[name] = self._streak[name] + 1 if vio > self.t.maxvio_alert_threshold else 0
      if self._streak[name] >= self.t.maxvio_alert_steps:
        self._streak[name] = 0
        self.alerts["maxvio"] += 1
        self.alerts[f"maxvio/{name}"] += 1
        logging.warning("ALERT step %d: %s MaxVio %.3f above %.3f for %d steps (%d alerts)",
                        step, name, vio, self.t.maxvio_alert_threshold,
                        self.t.maxvio_alert_steps, self.alerts["maxvio"])

  # ----------------------------------------------------------------------------- logging
  def _log(self, step: int, m: dict[str, Any], now: float) -> None:
    dt = now - self._last_log_time
    steps = step - self._last_log_step
    # A log right after the run's first step has no compile-free interval yet: that one step,
    # timed from the Monitor's creation, compilation included, and said so.
    with_compile = steps == 0 and step == self._t0_step
    first = step - steps
    if with_compile:
      dt, first = now - self._built, step - 1
    if step > first and dt > 0:
      self.tokens_per_sec = (self.tokens_seen(step) - self.tokens_seen(first)) / dt
    self._last_log_time, self._last_log_step = now, step
    elapsed, done = now - self._t0, step - self._t0_step
    eta = (self.total_steps - step) * elapsed / done if done > 0 else float("nan")
    moe = m["moe"]
    worst = max(moe, key=lambda k: float(moe[k]["max_vio"])) if moe else None
    vio = f" | maxvio {float(moe[worst]['max_vio']):.3f} ({worst})" if worst else ""
    # Curriculum runs add the stage, its sequence length and the tokens seen so far.
    stage = (f" | stage {int(m['stage'])} T={int(m['seq_len'])} | "
             f"{fmt_rate(float(m['tokens_seen']))} tok seen") if "stage" in m else ""
    logging.info("step %*d/%d | loss %.4f | %s tok/s%s | ETA %s | gnorm %.3f%s | lr %.2e%s",
                 len(str(self.total_steps)), step, self.total_steps, float(m["loss"]),
                 fmt_rate(self.tokens_per_sec), " (incl. compile)" if with_compile else "",
                 fmt_duration(eta), float(m["grad_norm"]), vio, float(m["lr"]), stage)
    w = self.writer
    scalars = {"train/loss": m["loss"], "train/learning_rate": m["lr"],
               "train/grad_norm": m["grad_norm"], "train/tokens_per_sec": self.tokens_per_sec,
               "train/skipped_steps": m["skipped"], "alerts/maxvio": self.alerts["maxvio"],
               "alerts/loss_spike": self.alerts["loss_spike"]}
    for key in ("stage", "seq_len", "tokens_seen"):
      if key in m:
        scalars[f"train/{key}"] = m[key]
    for tag, v in scalars.items():
      w.add_scalar(tag, float(v), step)
    for name, layer in moe.items():
      for key in ("max_vio", "bias_min", "bias_max", "drop_frac"):
        if key in layer:
          w.add_scalar(f"moe/{name}/{key}", float(layer[key]), step)
      self._load_histogram(f"moe/{name}/load", np.asarray(layer["load"], np.float64), step)
    record = {"step": step, "split": "train", "tokens_per_sec": self.tokens_per_sec,
              **({"tokens_per_sec_incl_compile": True} if with_compile else {}),
              "alerts": dict(self.alerts), **{k: v for k, v in m.items() if k != "moe"},
              "moe": {n: {k: v for k, v in layer.items()} for n, layer in moe.items()}}
    self.write_jsonl(record)

  def _load_histogram(self, tag: str, load: np.ndarray, step: int) -> None:
    """Assignments per expert as a histogram over the expert index."""
    idx = np.arange(len(load), dtype=np.float64)
    self.writer.add_histogram_raw(
        tag, min=0.0, max=float(len(load) - 1), num=float(load.sum()),
        sum=float((idx * load).sum()), sum_squares=float((idx * idx * load).sum()),
        bucket_limits=(idx + 0.5).tolist(), bucket_counts=load.tolist(), global_step=step)

  def log_eval(self, step: int, metrics: dict[str, float],
               info: dict[str, int] | None = None) -> None:
    """Held-out metrics; `info` (curriculum stage, seq_len, tokens_seen) goes to the JSONL."""
    where = "".join(f" {k} {v}" for k, v in (info or {}).items())
    logging.info("eval step %d%s | %s", step, where,
                 " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    for k, v in metrics.items():
      self.writer.add_scalar(f"eval/{k}", float(v), step)
    self.write_jsonl({"step": step, "split": "eval", **metrics, **(info or {})})

  def record(self, event: Event, step: int, metrics: dict[str, Any], *,
             line: str | None = None) -> None:
    """One flat {"event", "step", name: number or string} JSON line (numbers as floats, a
    non-finite one as its string) and TensorBoard scalars `<event>/<name>`; `line` goes to
    the log."""
    flat = {k: v if isinstance(v, str) else _float_or_str(v) for k, v in metrics.items()}
    self.jsonl.write(json.dumps({"event": str(event), "step": int(step), **flat}) + "\n")
    self.jsonl.flush()
    for k, v in flat.items():
      if isinstance(v, float):
        self.writer.add_scalar(f"{event}/{k}", v, int(step))
    if line:
      logging.info("%s", line)

  def write_jsonl(self, record: dict[str, Any]) -> None:
    self.jsonl.write(json.dumps(_jsonable(record)) + "\n")
    self.jsonl.flush()

  def write_heatmap(self, step: int) -> str | None:
    """Expert load (layers x experts, summed since the last heatmap, / the layer mean) as
    expert_load.png, heatmaps/expert_load_<step>.png and a TensorBoard image."""
    if not self._heat_load:
      return None
    names = sorted(self._heat_load, key=lambda s: (len(s), s))
    fig = plots.expert_load_figure(
        np.stack([self._heat_load[n] for n in names]), names, step=step,
        first_step=self._heat_from, max_vio=[self._last_vio[n] for n in names],
        overload=1.0 + self.t.maxvio_alert_threshold)
    self._heat_load, self._heat_from = {}, step + 1
    path = plots.save(fig, os.path.join(self.workdir, "expert_load.png"))
    hist_dir = os.path.join(self.workdir, "heatmaps")
    os.makedirs(hist_dir, exist_ok=True)
    plots.save(fig, os.path.join(hist_dir, f"expert_load_{step:07d}.png"))
    self.writer.add_image("moe/expert_load", plots.rgb_array(fig), step, dataformats="HWC")
    return path

  def flush(self) -> None:
    """Everything logged so far into its files (a gs:// workdir pushes them then)."""
    self.jsonl.flush()
    self.writer.flush()

  def close(self) -> None:
    bar = terminal.active_bar()
    if bar is not None:  # the finished bar stays on its own line
      bar.close()
    self.writer.close()
    self.jsonl.close()
