"""Monitor alerts / outputs and the PNG writer."""

import json
import zlib

import numpy as np
import pytest

from hybridmoe_jax.train import heatmap
from hybridmoe_jax.train.config import default_config
from hybridmoe_jax.train.monitor import Monitor


def _metrics(loss, vio, finite=True):
  # metrics["moe"] as the train step names it: by the MoE module's path.
  moe = {"layers/1/ffn": {"max_vio": vio, "bias_min": -0.1, "bias_max": 0.1, "drop_frac": 0.0,
                          "load": np.array([3, 1, 2, 2])},
         "layers/2/ffn": {"max_vio": 0.0, "bias_min": 0.0, "bias_max": 0.0, "drop_frac": 0.0,
                          "load": np.array([2, 2, 2, 2])}}
  return {"loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens": 100.0, "finite": finite,
          "skipped": 0, "moe": moe}


def test_alerts_and_outputs(tmp_path, caplog):
  t = default_config().train
  t.update(dict(log_every=5, maxvio_alert_threshold=0.4, maxvio_alert_steps=4,
                loss_spike_factor=1.5, heatmap_every=10))
  mon = Monitor(str(tmp_path), t, start_step=0, total_steps=30, tokens_per_step=64)
  for step in range(1, 31):
    loss = 10.0 if step == 20 else 2.0
    vio = 0.5 if step <= 9 else 0.1           # above threshold for 9 steps -> 2 alerts
    mon.step(step, _metrics(loss, vio, finite=step != 25))
  mon.close()
  assert mon.alerts["maxvio"] == 2 and mon.alerts["maxvio/layers/1/ffn"] == 2
  assert mon.alerts["loss_spike"] == 1 and mon.alerts["nonfinite"] == 1
  assert "ALERT" in caplog.text and "MaxVio" in caplog.text
  recs = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in recs] == [5, 10, 15, 20, 25, 30]
  assert recs[-1]["moe"]["layers/1/ffn"]["load"] == [3, 1, 2, 2]
  img = heatmap.decode_png(open(tmp_path / "expert_load.png", "rb").read())
  assert img.shape == (2 * 16, 4 * 16, 3)
  assert len(list((tmp_path / "heatmaps").iterdir())) == 3


def test_png_roundtrip_and_crc():
  values = np.arange(12, dtype=np.float32).reshape(3, 4)
  rgb = heatmap.colorize(values)
  assert rgb.dtype == np.uint8 and rgb.shape == (3, 4, 3)
  assert tuple(rgb[0, 0]) == (68, 1, 84) and tuple(rgb[-1, -1]) == (253, 231, 37)
  data = heatmap.encode_png(rgb)
  np.testing.assert_array_equal(heatmap.decode_png(data), rgb)
  assert data[12:16] == b"IHDR"
  # Flip one compressed byte: the CRC check catches it.
  bad = bytearray(data)
  bad[45] ^= 1
  with pytest.raises((AssertionError, zlib.error)):
    heatmap.decode_png(bytes(bad))


def test_constant_heatmap_does_not_divide_by_zero(tmp_path):
  heatmap.write_heatmap(str(tmp_path / "x.png"), np.ones((2, 3)))
  assert heatmap.decode_png((tmp_path / "x.png").read_bytes()).shape == (32, 48, 3)
