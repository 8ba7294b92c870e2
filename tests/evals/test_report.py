"""run_eval --task=report on a hand-made workdir: content, self-contained, read-only, errors;
and the page opened in a real headless browser (Chromium; skipped when absent)."""

import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

from matplotlib import image as mpimg
import numpy as np
import pytest

from hybridmoe_jax.config import model_config_from_dict
from hybridmoe_jax.evals import report, report_data
from hybridmoe_jax.tools import evaluate
from tests.conftest import ROOT, load_config

CHROMIUM = "/usr/bin/chromium"


def _load(step):
  return {"max_vio": 0.1 * step / 10, "bias_min": -0.05, "bias_max": 0.07, "drop_frac": 0.0,
          "load": [10 + step, 10, 10, 10 - step // 10]}


def _make_run(w: pathlib.Path) -> None:
  """A run as train_and_evaluate leaves it (no weights), with a half-written last line."""
  model = dataclasses.asdict(model_config_from_dict(load_config("tiny").model))
  (w / "model_config.json").write_text(json.dumps(model))
  lines = [{"event": "start", "step": 0, "backend": "cpu", "device_kind": "cpu",
            "devices": 1, "local_devices": 1, "processes": 1, "jax_version": "0.x"}]
  for step in (10, 20, 30, 40):
    lines.append({"step": step, "split": "train", "loss": 6.0 - step / 10,
                  "tokens_per_sec": 1000.0 + step, "alerts": {"maxvio": int(step >= 30)},
                  "moe": {"layers/1/ffn": _load(step), "layers/2/ffn": _load(step // 2)}})
  lines += [{"step": 20, "split": "eval", "loss": 4.1, "bits_per_byte": 5.5, "tokens": 99.0},
            {"event": "resume", "step": 20}]
  text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 50, "split": "tr'
  (w / "metrics.jsonl").write_text(text)
  for d in ("checkpoints/20", "checkpoints/40", "checkpoints/50.orbax-checkpoint-tmp-1",
            "checkpoints_corrupt/10-1700000000000", "eval"):
    (w / d).mkdir(parents=True)
  niah = {"lengths": [256, 512], "depths": [0.0, 1.0], "accuracy": [[1.0, 0.5], [0.0, 0.25]],
          "samples": 4, "chance": 1e-5, "mean_accuracy": 0.4375}
  vqa = {"per_type": {"count": {"questions": 8, "accuracy": 0.5, "blank_image_accuracy": 0.25,
                                "chance": 0.25, "majority": 0.375}},
         "images": 8, "questions": 8}
  ppl = {"buckets": [{"context_from": 0, "context_to": None, "tokens": 90, "ppl": 7.5,
                      "bits_per_byte": 2.9}], "overall": {"tokens": 90, "ppl": 7.5,
                                                          "bits_per_byte": 2.9}}
  mqar = {"cells": [{"length": 64, "pairs": 4, "accuracy": 0.125}]}
  gen = {"prompt": "The sky is", "text": " blue <&>"}
  for task, result in [("niah", niah), ("vqa", vqa), ("ppl", ppl), ("mqar", mqar),
                       ("generate", gen)]:
    (w / "eval" / f"{task}.json").write_text(json.dumps({"task": task, "model": {"step": 40},
                                                         "result": result}))


def _snapshot(w: pathlib.Path) -> dict[str, tuple[float, int]]:
  return {str(p.relative_to(w)): (p.stat().st_mtime, p.stat().st_size)
          for p in sorted(w.rglob("*")) if p.name != report.REPORT_FILE}


@pytest.fixture(scope="module")
def run_report(tmp_path_factory):
  w = tmp_path_factory.mktemp("run")
  _make_run(w)
  before = _snapshot(w)
  lines = []
  out = evaluate.main(task="report", workdir=str(w), params=None, output_dir=None, config=None,
                      option_values={}, echo=lines.append)
  assert _snapshot(w) == before                       # read-only: nothing moved or touched
  assert lines == [f"report: {w / 'report.html'}"]
  return w, pathlib.Path(out["report"]).read_text()


def test_report_content(run_report):
  _, page = run_report
  text = re.sub(r"<[^>]+>", " ", page)
  assert "metrics.jsonl line 8 is not valid JSON" in text      # the truncated line: a note
  for section in ("Curves", "Expert load", "Alerts", "Evaluations", "Hardware and throughput",
                  "Checkpoints and resumes", "Model and config"):
    assert f"<h2>{section}</h2>" in page
  # Loss curves, expert-load heatmap, MaxVio over steps, NIAH grid, VQA bars.
  assert page.count("<img ") == 5
  assert re.search(r"all\s*</td><td[^>]*>90</td><td[^>]*>7.5<", page)        # ppl
  assert re.search(r"64\s*</td><td[^>]*>4</td><td[^>]*>0.125<", page)        # mqar
  assert "&#x27; blue &lt;&amp;&gt;&#x27;" in page                           # escaped
  assert re.search(r"checkpoint step\s*</th>.*?>20<.*?>40<", page)
  assert "10-1700000000000" in text and "50.orbax-checkpoint-tmp-1" in text
  assert re.search(r"resume\s*</td><td[^>]*>20<", page)
  assert re.search(r"maxvio\s*</td><td[^>]*>1</td><td[^>]*>30<", page)  # count, first step
  assert re.search(r"median over logs\s*</td><td[^>]*>1,025<", page)
  assert "device_kind" in text and "jax_version" in text
  assert re.search(r"total\s*</td><td[^>]*>346,534<", page)     # configs/tiny.py's count


def test_alerts_explain_the_rules_and_maxvio_above_the_line_without_an_alert():
  """MaxVio above the drawn threshold at logged steps but no alert (the rule wants a streak
  of maxvio_alert_steps): the section says so and states every rule, never a bare "no alerts
  raised" beside a figure whose curves cross the line."""
  train_cfg = {"maxvio_alert_threshold": 0.5, "maxvio_alert_steps": 50,
               "loss_spike_factor": 1.5}
  records = [{"step": s, "split": "train", "loss": 2.0, "alerts": {},
              "moe": {"layers/3/ffn": {"max_vio": 0.6 if s in (20, 40) else 0.2}}}
             for s in (10, 20, 30, 40)]
  run = report_data.RunData("w", records=records, run_config={"train": train_cfg})
  text = re.sub(r"<[^>]+>", " ", report._alerts(run, records))
  assert "no alerts raised" in text
  assert "MaxVio was above the line (0.5) at 2 of 4 logged steps (layer 3)" in text
  assert "above 0.5 (the dashed line of the MaxVio figure) for 50 steps in a row" in text
  assert "1.5 x its running mean" in text and "at most one alert per 50 steps" in text
  # With a MaxVio alert the crossings need no excuse; the rules are still stated.
  records[-1]["alerts"] = {"maxvio": 1}
  text = re.sub(r"<[^>]+>", " ", report._alerts(run, records))
  assert "alerts were raised" in text and "MaxVio was above" not in text
  assert "How alerts fire" in text


def test_report_is_self_contained(run_report):
  _, page = run_report
  assert "http://" not in page and "https://" not in page and "<script" not in page.lower()
  assert "url(" not in page and "@import" not in page and "<link" not in page
  srcs = re.findall(r'src="([^"]*)"', page)
  assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)


def test_report_errors_are_one_line(tmp_path):
  for workdir, why in [(tmp_path / "missing", "does not exist"),
                       (tmp_path, "holds no training run")]:
    with pytest.raises(ValueError, match=why):
      report.write_report(str(workdir))
  with pytest.raises(ValueError, match="needs --workdir"):
    evaluate.main(task="report", workdir=None, params=str(tmp_path), output_dir=None, config=None,
                  option_values={})
  r = subprocess.run([sys.executable, str(ROOT / "run_eval.py"), f"--workdir={tmp_path}",
                      "--task=report"], capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert r.returncode != 0
  assert r.stderr.strip().splitlines()[-1] == (
      f"error: --workdir {tmp_path} holds no training run (no metrics.jsonl and no "
      "model_config.json)")


@pytest.mark.skipif(not os.path.exists(CHROMIUM),
                    reason=f"{CHROMIUM} not installed (apt-get install -y chromium)")
def test_report_renders_in_a_headless_browser(run_report, tmp_path):
  w, _ = run_report
  shot = tmp_path / "shot.png"
  cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
         "--window-size=1200,2400", f"file://{w / report.REPORT_FILE}"]
  subprocess.run(cmd, capture_output=True, timeout=120, check=False)
  assert shot.exists(), "chromium wrote no screenshot"
  img = (mpimg.imread(shot)[..., :3] * 255).astype(np.uint8)
  assert img.shape[:2] == (2400, 1200)
  colours = np.unique(img.reshape(-1, 3), axis=0)
  ink = np.mean(img.min(axis=-1) < 200)
  # Text alone gives a few grey levels; the figures bring hundreds of colours and lots of ink.
  assert len(colours) > 500 and ink > 0.05, (len(colours), ink)
  shutil.rmtree(tmp_path / "profile", ignore_errors=True)


def _make_rl_run(w: pathlib.Path) -> None:
  """An RL workdir as rl/trainer.py leaves it (no weights): SFT records, iterations (the
  first with no successful episode and no update), in-run evaluations, eval/agent.json."""
  model = dataclasses.asdict(model_config_from_dict(load_config("rl_tiny").model))
  (w / "model_config.json").write_text(json.dumps(model))
  lines = [{"event": "sft", "step": s, "loss": 2.0 / s, "grad_norm": 1.0, "lr": 1e-3}
           for s in (50, 100)]
  for i in (1, 2, 3):
    rec = {"event": "rl", "step": 100 + i, "iteration": i, "episodes": 64,
           "reward": 0.1 * (i - 1), "success": 0.1 * (i - 1), "frontier/arithmetic": 0,
           "groups_trained": 0 if i == 1 else 5, "groups_dropped": 8 if i == 1 else 3}
    if i > 1:
      rec.update(loss=-0.01 * i, entropy=0.3 - 0.05 * i, clip_fraction=0.01, updates=2)
    lines.append(rec)
  lines += [{"event": "eval", "step": 100, "iteration": 0, "success/arithmetic/L3": 0.05},
            {"event": "eval", "step": 103, "iteration": 3, "success/arithmetic/L3": 0.25}]
  (w / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
  (w / "eval").mkdir()
  cells = [{"env": "arithmetic", "level": lv, "success_rate": r, "episodes": 8}
           for lv, r in ((2, 0.5), (3, 0.25))]
  (w / "eval" / "agent.json").write_text(json.dumps({
      "task": "agent", "model": {"step": 103}, "envs": ["arithmetic"],
      "results": {"model": {"episodes": 8, "cells": cells}}}))


def test_report_reads_an_rl_workdir(tmp_path):
  """The last logged step and iteration, the SFT and RL curves (iterations on the x axis),
  the in-run held-out success by iteration and eval/agent.json; zero-success iterations."""
  _make_rl_run(tmp_path)
  page = pathlib.Path(report.write_report(str(tmp_path))).read_text()
  text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))
  assert "last logged step 103 " in text and "last logged step None" not in text
  assert "RL iteration 3 of ?" in text and "SFT warm start step 100 of ?" in text
  assert "iterations where no episode succeeded 1 of 3" in text
  assert "last iteration: entropy 0.15" in text and "no evaluation yet" not in text
  assert 'alt="SFT loss and RL curves over iterations"' in page
  assert 'alt="held-out success by level over RL iterations"' in page
  assert 'alt="agent success per level"' in page
  assert re.search(r"RL iteration\s*</th><th[^>]*>arithmetic/L3</th>", page)
  assert re.search(r"model\s*</td><td[^>]*>arithmetic</td><td[^>]*>3</td><td[^>]*>8</td>"
                   r"<td[^>]*>0.25<", page)
  assert "agent (step 103" in text


def test_hostile_metrics_lines_and_eval_files_become_notes(tmp_path):
  """Lines json cannot take (an integer of 5000 digits, nesting 100000 deep) and eval files
  of the wrong shape are notes, never a crashed report."""
  good = json.dumps({"step": 10, "split": "train", "loss": 2.0})
  (tmp_path / "metrics.jsonl").write_text("\n".join(
      [good, '{"step": ' + "1" * 5000 + "}", "[" * 100_000, good]) + "\n")
  (tmp_path / "eval").mkdir()
  for task, saved in [("ppl", {"model": "step 3", "result": {}}),
                      ("mqar", {"model": {}, "result": [1]}),
                      ("ruler", {"model": {}, "result": {"corpus": 1, "samples": 1, "split": "test",
                                                   "seed": 0}})]:
    (tmp_path / "eval" / f"{task}.json").write_text(json.dumps(saved))
  run = report_data.read_run(str(tmp_path))
  assert len(run.records) == 2 and sum("is not valid JSON" in n for n in run.notes) == 2
  assert [n for n in run.notes if n.startswith("eval/")] == [
      "eval/ppl.json unreadable (TypeError): skipped",
      "eval/mqar.json unreadable (TypeError): skipped"]
  page = report.render(run)
  assert "eval/ruler.json has an unexpected layout (AttributeError" in page
