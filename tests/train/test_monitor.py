"""Monitor alerts / outputs, its heatmap figures and the tokens/s of the first log."""

import glob
import json

from matplotlib import image as mpimg
import numpy as np

from hybridmoe_jax.config.run import default_config
from hybridmoe_jax.train import monitor as monitor_lib
from hybridmoe_jax.train.monitor import Monitor


def monitor_metrics(loss, vio, finite=True):
  # metrics["moe"] as the train step names it: by the MoE module's path.
  moe = {"layers/1/ffn": {"max_vio": vio, "bias_min": -0.1, "bias_max": 0.1, "drop_frac": 0.0,
                          "load": np.array([3, 1, 2, 2])},
         "layers/2/ffn": {"max_vio": 0.0, "bias_min": 0.0, "bias_max": 0.0, "drop_frac": 0.0,
                          "load": np.array([2, 2, 2, 2])}}
  return {"loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens": 100.0, "finite": finite,
          "skipped": 0, "moe": moe}


def test_loss_spike_alert_adapts_to_a_noisy_loss_and_is_rate_limited(tmp_path, caplog):
  """704 steps of a loss falling 6 -> 2 with lognormal noise (sigma 0.35: a mix of easy and
  hard batches, like the retrieval recipe whose 1.5 x mean rule fired 129 times in 704
  steps): the old rule would fire on ~1 step in 10; the running-spread bar and the cooldown
  keep alerts rare, and a real spike (20 x the loss) still alerts at its step."""
  t = default_config().train
  t.update(dict(log_every=1000, heatmap_every=0, loss_spike_factor=1.5))
  mon = Monitor(str(tmp_path), t, start_step=0, total_steps=704, tokens_seen=lambda s: s)
  rng = np.random.default_rng(0)
  base = 2.0 + 4.0 * np.exp(-np.arange(1, 705) / 150.0)
  losses = base * np.exp(0.35 * rng.standard_normal(704))
  losses[599] = 20.0 * base[599]                        # step 600: a real spike
  old_mean, old_fires = None, 0
  for step, loss in enumerate(losses, 1):
    if step > 10 and loss > 1.5 * old_mean:             # the previous rule, for scale
      old_fires += 1
    old_mean = loss if old_mean is None else 0.9 * old_mean + 0.1 * loss
    mon.step(step, monitor_metrics(float(loss), 0.0))
  mon.close()
  assert old_fires > 50
  assert 1 <= mon.alerts["loss_spike"] <= 704 // monitor_lib.SPIKE_COOLDOWN + 1
  assert mon.alerts["loss_spike"] <= 5, mon.alerts
  assert "ALERT step 600: loss spike" in caplog.text
  # A 10 x spike every 25 steps on a flat loss (the spread decays between them, so each is
  # a spike): one alert per cooldown, the one in between counted in the next alert.
  caplog.clear()
  mon = Monitor(str(tmp_path / "b"), t, start_step=0, total_steps=300, tokens_seen=lambda s: s)
  for step in range(1, 301):
    mon.step(step, monitor_metrics(20.0 if step % 25 == 0 else 2.0, 0.0))
  mon.close()
  assert mon.alerts["loss_spike"] == 6              # steps 25, 75, ..., 275 of 12 spikes
  assert "ALERT step 75: loss spike" in caplog.text and "ALERT step 50" not in caplog.text
  assert "1 more spike(s) since the last alert" in caplog.text


def test_alerts_and_outputs(tmp_path, caplog):
  t = default_config().train
  t.update(dict(log_every=5, maxvio_alert_threshold=0.4, maxvio_alert_steps=4,
                loss_spike_factor=1.5, heatmap_every=10))
  mon = Monitor(str(tmp_path), t, start_step=0, total_steps=30, tokens_seen=lambda s: 64 * s)
  for step in range(1, 31):
    loss = 10.0 if step == 20 else 2.0
    vio = 0.5 if step <= 9 else 0.1           # above threshold for 9 steps -> 2 alerts
    mon.step(step, monitor_metrics(loss, vio, finite=step != 25))
  mon.close()
  assert mon.alerts["maxvio"] == 2 and mon.alerts["maxvio/layers/1/ffn"] == 2
  assert mon.alerts["loss_spike"] == 1 and mon.alerts["nonfinite"] == 1
  assert "ALERT" in caplog.text and "MaxVio" in caplog.text
  recs = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  # Step 1 is logged too (the loss curve starts where the run starts), then every log_every.
  assert [r["step"] for r in recs] == [1, 5, 10, 15, 20, 25, 30]
  assert recs[0]["tokens_per_sec_incl_compile"] is True
  assert recs[-1]["moe"]["layers/1/ffn"]["load"] == [3, 1, 2, 2]
  img = mpimg.imread(tmp_path / "expert_load.png")
  assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400   # a real figure
  assert sorted(p.name for p in (tmp_path / "heatmaps").iterdir()) == [
      "expert_load_0000010.png", "expert_load_0000020.png", "expert_load_0000030.png"]
  # The same figure went to TensorBoard as an image summary (a PNG inside the event file).
  events = open(glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))[0],
                "rb").read()
  assert events.count(b"moe/expert_load") == 3 and b"\x89PNG" in events


def test_heatmap_title_and_window(tmp_path, monkeypatch):
  """The Monitor's heatmap: load summed since the last one, MaxVio of the step in the title,
  overload marks at 1 + the alert threshold."""
  t = default_config().train
  t.update(dict(log_every=100, heatmap_every=2, maxvio_alert_threshold=0.4))
  mon = Monitor(str(tmp_path), t, start_step=0, total_steps=4, tokens_seen=lambda s: 64 * s)
  figs = []
  monkeypatch.setattr("hybridmoe_jax.plots.save", lambda fig, path: figs.append(fig) or path)
  for step in range(1, 5):
    mon.step(step, monitor_metrics(2.0, 0.25 * step))
  mon.close()
  assert len(figs) == 4                            # expert_load.png + heatmaps/, twice
  title = figs[-1].axes[0].get_title()
  assert title.startswith("Expert load, steps 3-4 (summed)\nMaxVio at step 4: ")
  assert "layer 1 1.000" in title and "layer 2 0.000" in title
  # Summed load of layer 1 over 2 steps: [6, 2, 4, 4] / 4 -> expert 0 at 1.5 > 1.4.
  marks = figs[-1].axes[0].collections[0].get_offsets()
  assert np.asarray(marks).tolist() == [[0.0, 0.0]]


def run_monitor(workdir, total_steps: int, loss=lambda step: 2.0, **train) -> Monitor:
  """A Monitor over steps 1..total_steps of constant-ish metrics (train: fields to set)."""
  t = default_config().train
  t.update(dict(heatmap_every=0, **train))
  mon = Monitor(str(workdir), t, start_step=0, total_steps=total_steps,
                tokens_seen=lambda s: 64 * s)
  for step in range(1, total_steps + 1):
    mon.step(step, monitor_metrics(loss(step), 0.1))
  mon.close()
  return mon


def test_first_log_tokens_per_sec_is_a_number(tmp_path):
  """log_every = 1: the first log times step 1 from the Monitor's creation (compile
  included, flagged); later logs time the interval between logs."""
  run_monitor(tmp_path, 3, log_every=1)
  recs = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  rates = [r["tokens_per_sec"] for r in recs]
  assert all(isinstance(x, float) and x > 0 for x in rates), rates
  assert recs[0]["tokens_per_sec_incl_compile"] is True
  assert "tokens_per_sec_incl_compile" not in recs[1]


def test_loss_curve_starts_at_the_first_step(tmp_path):
  """metrics.jsonl holds step 1 (log_every = 10), so the plotted curve starts at step 1."""
  from hybridmoe_jax import plots  # pylint: disable=import-outside-toplevel
  from hybridmoe_jax.plots import history  # pylint: disable=import-outside-toplevel
  run_monitor(tmp_path, 30, loss=lambda step: 5.0 - step / 10, log_every=10)
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  top = plots.loss_figure(records).axes[0]
  train = next(line for line in top.get_lines() if line.get_label() == "train loss")
  assert list(train.get_xdata()) == [1, 10, 20, 30]
  assert train.get_ydata()[0] == 4.9
  assert history.series(history.split_records(records, "train"), "loss")[0][0] == 1
