"""The run plan, its bad-input errors, the one LR schedule, and staged training + resume.

Loop tests use the tiny real model of train_fakes.py on real curriculum data (bundled pydoc
texts, byte tokens); the slow test runs configs/curriculum_cpu.py end to end.
"""

import json
import math
import os

import numpy as np
import optax
import pytest

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.train import dry_run, optim
from hybridmoe_jax.train import stage_plan as plan_lib
from hybridmoe_jax.config.run import default_config
from hybridmoe_jax.train.loop import InputError, train_and_evaluate
from tests.conftest import load_config
from tests._support import set_tiny_model


def _config(steps=(3, 2, 2), lens=(16, 32, 64), tps=512, train_steps=None, **train):
  """Tiny-model config with a 3-stage curriculum (batches divide over 8 test devices)."""
  config = default_config()
  set_tiny_model(config)          # byte vocabulary (259) of the default config; chunk 16
  config.model.layer_kinds = ("kda", "mla")   # a KDA layer: its chunk rules the stage lengths
  c = config.curriculum
  c.tokens_per_step = tps
  c.sources = {"pydoc": {"kind": "bundled"}}
  c.stages = tuple(
      dict(seq_len=T, steps=n, weights={"pydoc": 1.0}, lr=1e-2 / (k + 1), warmup=1,
           schedule="cosine", min_lr_ratio=0.5)
      for k, (T, n) in enumerate(zip(lens, steps)))
  train = {"steps": train_steps or sum(steps), **train}
  config.train.update(dict(log_every=1, eval_every=0, eval_batches=1,
                           checkpoint_every=0, heatmap_every=0, async_checkpoints=False,
                           **train))
  return config


def _records(workdir, split):
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if r.get("split") == split:
        out[r["step"]] = r
  return out


def build_plan(config):
  return plan_lib.build_plan(run_config_from_dict(config))


def test_plan_batches_tokens_and_lengths():
  plan = build_plan(_config(steps=(3, 2, 2)))
  assert [s.batch_size for s in plan.stages] == [32, 16, 8]
  assert {s.batch_size * s.seq_len for s in plan.stages} == {512}
  assert [(s.start_step, s.end_step) for s in plan.stages] == [(0, 3), (3, 5), (5, 7)]
  assert plan.stage_at(2).index == 0 and plan.stage_at(3).index == 1
  config = _config()
  config.curriculum.stages = tuple(dict(s, steps=0, tokens=1024) for s in config.curriculum.stages)
  config.train.steps = 6
  assert [s.steps for s in build_plan(config).stages] == [2, 2, 2]
  # Without stages: one stage of train.batch_size x train.seq_len for train.steps.
  # A stage may raise its own tokens per step (one row longer than the curriculum's step).
  config = _config(steps=(3, 2, 2))
  config.curriculum.stages = config.curriculum.stages[:2] + (
      dict(config.curriculum.stages[2], seq_len=1024, tokens_per_step=2048),)
  plan = build_plan(config)
  assert [(s.batch_size, s.tokens_per_step) for s in plan.stages] == [(32, 512), (16, 512),
                                                                      (2, 2048)]
  assert [plan.tokens_seen(k) for k in (0, 3, 5, 6, 7, 9)] == [
      0, 1536, 2560, 4608, 6656, 6656]
  plain = build_plan(default_config())
  t = run_config_from_dict(default_config()).train
  assert not plain.curriculum and len(plain.stages) == 1
  (s,) = plain.stages
  assert (s.batch_size, s.seq_len, s.steps, s.start_step) == (t.batch_size, t.seq_len,
                                                                t.steps, 0)
  assert plain.tokens_per_step == t.batch_size * t.seq_len and plain.total_steps == t.steps


def _with_curriculum(**fields):
  config = _config()
  for k, v in fields.items():
    config.curriculum[k] = v
  return config


def _with_stage(k, **fields):
  config = _config()
  stages = list(config.curriculum.stages)
  stages[k] = dict(stages[k], **fields)
  config.curriculum.stages = tuple(stages)
  return config


@pytest.mark.parametrize("config, match", [
    (lambda: _with_stage(1, seq_len=16), r"stages\[1\].seq_len.*must increase"),
    (lambda: _with_stage(2, seq_len=72), r"stages\[2\].seq_len.*(chunk|divisor)"),
    (lambda: _with_stage(0, weights={"pydoc": -1.0}), r"stages\[0\].weights.pydoc"),
    (lambda: _with_stage(0, weights={"pydoc": 0.0}), r"stages\[0\].weights.*at least one"),
    (lambda: _with_stage(0, weights={"web": 1.0}), r"stages\[0\].weights.*source names"),
    (lambda: _with_stage(0, steps=2, tokens=1024), r"stages\[0\].steps/tokens"),
    (lambda: _with_stage(0, tokens=100, steps=0), r"stages\[0\].tokens"),
    (lambda: _with_stage(0, retrieval_fraction=0.7), r"retrieval_fraction"),
    (lambda: _with_stage(0, schedule="step"), r"stages\[0\].schedule"),
    (lambda: _with_stage(0, colour="red"), r"stages\[0\].colour"),
    (lambda: _with_stage(0, seq_len="long"), r"stages\[0\].seq_len.*an integer"),
    (lambda: _with_stage(0, seq_len=None), r"stages\[0\].seq_len.*>= 2"),
    (lambda: _with_stage(0, lr=20.0), r"stages\[0\].lr"),
    (lambda: _with_stage(0, warmup=9), r"stages\[0\].warmup"),
    (lambda: _with_stage(0, min_lr_ratio=2.0), r"stages\[0\].min_lr_ratio"),
    (lambda: _with_stage(0, warmup_from=-1.0), r"stages\[0\].warmup_from"),
    (lambda: _with_stage(0, long_upsample=0), r"stages\[0\].long_upsample"),
    (lambda: _with_stage(0, long_min_tokens=-1), r"stages\[0\].long_min_tokens"),
    (lambda: _with_stage(0, weights={}), r"stages\[0\].weights"),
    (lambda: _with_stage(1, seq_len=48, retrieval_fraction=0.1), r"seq_len|retrieval_fraction"),
    (lambda: _with_curriculum(tokens_per_step=1), r"curriculum.tokens_per_step"),
    (lambda: _with_curriculum(sources={}), r"curriculum.sources"),
    (lambda: _with_curriculum(sources={"pydoc": {"kind": "web"}}),
     r"curriculum.sources.pydoc.kind"),
    (lambda: _with_curriculum(sources={"pydoc": {"kind": "text"}}),
     r"curriculum.sources.pydoc.paths"),
    (lambda: _with_curriculum(sources={"pydoc": {"kind": "bundled", "url": "x"}}),
     r"curriculum.sources.pydoc.url"),
    (lambda: _with_curriculum(num_packing_bins=0), r"curriculum.num_packing_bins"),
    (lambda: _config(grad_accum=3, tps=768, lens=(16, 32, 64)), r"train.grad_accum"),
    (lambda: _config(tps=500), r"seq_len.*divisor of curriculum.tokens_per_step=500"),
    (lambda: _with_stage(2, tokens_per_step=100), r"stages\[2\].seq_len.*divisor of "
                                                  r"curriculum.stages\[2\].tokens_per_step=100"),
    (lambda: _with_stage(2, tokens_per_step=-1), r"stages\[2\].tokens_per_step"),
    (lambda: _with_curriculum(niah_lengths=(1024, 8)), r"curriculum.niah_lengths"),
    (lambda: _with_curriculum(niah_depths=(0.5, 1.5)), r"curriculum.niah_depths"),
    (lambda: _with_curriculum(niah_samples=0), r"curriculum.niah_samples"),
    (lambda: _config(train_steps=99), r"train.steps.*at most"),
])
def test_bad_curriculum_config_is_refused_before_training(config, match, tmp_path):
  cfg = config()
  with pytest.raises(ConfigError, match=match):
    train_and_evaluate(run_config_from_dict(cfg), str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints")


def test_chunk_size_rule_names_the_kda_chunk():
  config = _config(lens=(16, 32, 40), tps=1280)
  with pytest.raises(ConfigError, match=r"stages\[2\].seq_len.*compute.kda_chunk_size=16"):
    build_plan(config)


def test_source_without_documents_fails_before_training(tmp_path):
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "a.txt").write_text("only one document")
  config = _config()
  config.curriculum.sources = {"pydoc": {"kind": "text", "paths": (str(tmp_path / "data"),)}}
  with pytest.raises(InputError, match="pydoc.*1 documents"):
    train_and_evaluate(run_config_from_dict(config), str(tmp_path / "run"))
  (tmp_path / "data" / "a.txt").write_bytes(b"\xff\xfe")
  with pytest.raises(InputError, match="no usable text"):
    train_and_evaluate(run_config_from_dict(config), str(tmp_path / "run"))


def _reference_lr(pieces, step):
  """Independent float reference of the stage schedules (written out per case)."""
  p = [q for q in pieces if q.start <= step][-1]
  n = step - p.start
  if n < p.warmup:
    return p.lr_from + (p.lr - p.lr_from) * n / p.warmup
  end = p.lr * p.min_lr_ratio
  if p.schedule == "constant":
    return p.lr
  if p.schedule == "wsd":
    d = round(p.steps * p.decay_fraction)
    return p.lr if n < p.steps - d else p.lr + (end - p.lr) * min((n - (p.steps - d)) / d, 1.0)
  s = min((n - p.warmup) / (p.steps - p.warmup), 1.0)
  if p.schedule == "linear":
    return p.lr + (end - p.lr) * s
  return end + (p.lr - end) * 0.5 * (1 + math.cos(math.pi * s))


def test_piecewise_learning_rate_matches_reference():
  config = _config(steps=(10, 8, 6))
  schedules = ("cosine", "wsd", "linear")
  config.curriculum.stages = tuple(
      dict(s, schedule=sch, warmup=w, decay_fraction=0.5)
      for s, sch, w in zip(config.curriculum.stages, schedules, (3, 2, 0)))
  plan = build_plan(config)
  pieces = plan.lr_pieces()
  # Re-warm starts where the previous stage ended.
  assert pieces[1].lr_from == pytest.approx(_reference_lr(pieces, 10 - 1e-9), rel=1e-6)
  schedule = plan.schedule()
  got = [float(optim.learning_rate(schedule, np.int32(i))) for i in range(26)]
  want = [_reference_lr(pieces, i) for i in range(26)]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def _optax_schedule(t):
  """The optax schedule a plain run had before the one-scheduler plan (commit 928f724)."""
  peak, end = t.lr, t.lr * t.min_lr_ratio
  warmup_steps = min(t.warmup, t.steps)
  rest = t.steps - warmup_steps
  if t.schedule == "cosine":
    main = optax.cosine_decay_schedule(peak, max(rest, 1), alpha=t.min_lr_ratio)
  elif t.schedule == "wsd":
    decay = min(int(round(t.steps * t.decay_fraction)), rest)
    main = optax.join_schedules(
        [optax.constant_schedule(peak), optax.linear_schedule(peak, end, max(decay, 1))],
        [rest - decay])
  else:
    main = optax.constant_schedule(peak)
  if not warmup_steps:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup_steps), main],
                              [warmup_steps])


@pytest.mark.parametrize("preset, train", [
    ("tiny", {}),
    ("tiny", {"schedule": "wsd", "decay_fraction": 0.3}),
    ("tiny", {"schedule": "wsd", "warmup": 0, "steps": 40, "decay_fraction": 1.0}),
    ("tiny", {"schedule": "constant"}),
    ("tiny", {"warmup": 0, "min_lr_ratio": 0.0}),
    ("tiny", {"warmup": 50, "steps": 20}),   # warmup capped at the run length
    ("tiny_vlm", {}),
])
def test_plain_run_schedule_equals_the_optax_schedule(preset, train):
  config = load_config(preset)
  config.train.update(train)
  t = run_config_from_dict(config).train
  schedule = build_plan(config).schedule()
  steps = np.arange(t.steps + 5)
  got = np.array([float(optim.learning_rate(schedule, np.int32(i))) for i in steps])
  want = np.array([float(_optax_schedule(t)(i)) for i in steps])
  np.testing.assert_array_equal(got, want)  # the same float32 values


def test_stage_end_evaluates_at_the_stage_length_and_runs_the_niah_grid(tmp_path):
  """Two stages, the second with a raised tokens_per_step: at each stage end the held-out
  loss at that stage's length and at the longest, then the hook (here the NIAH grid of
  run_train.py) on the model; its summary joins metrics.jsonl, its grid eval/."""
  from hybridmoe_jax.evals.stage_niah import StageNiah  # pylint: disable=g-import-not-at-top
  config = _config(steps=(2, 1), lens=(16, 64))
  config.curriculum.stages = (config.curriculum.stages[0],
                              dict(config.curriculum.stages[1], tokens_per_step=1024))
  config.curriculum.update(niah_lengths=(64, 96), niah_depths=(0.5,), niah_samples=1)
  with pytest.raises(ConfigError, match=r"curriculum.niah_lengths.*>= 75"):  # 5-digit key
    StageNiah.from_run(run_config_from_dict(config), str(tmp_path))
  config.curriculum.niah_lengths = (96, 128)
  run = run_config_from_dict(config)
  calls = []
  niah = StageNiah.from_run(run, str(tmp_path))
  out = train_and_evaluate(run, str(tmp_path), on_stage_end=lambda step, stage, model: (
      calls.append((step, stage.index, type(model).__name__)) or niah(step, stage, model)))
  assert out["end_step"] == 3 and calls == [(2, 0, "HybridLM"), (3, 1, "HybridLM")]
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  evals = [(r["step"], r["eval_seq_len"]) for r in records if r.get("split") == "eval"]
  assert evals == [(2, 16), (2, 64), (3, 64)]
  train = {r["step"]: r for r in records if r.get("split") == "train"}
  assert [train[s]["tokens_seen"] for s in (1, 2, 3)] == [512, 1024, 2048]
  grids = [r for r in records if r.get("split") == "niah"]
  assert [(r["step"], r["stage"], r["stage_seq_len"]) for r in grids] == [(2, 0, 16), (3, 1, 64)]
  for k, r in enumerate(grids):
    saved = json.load(open(tmp_path / "eval" / f"niah_stage{k}.json"))
    assert saved["lengths"] == [96, 128] and saved["accuracy"] == r["niah_accuracy"]
    assert np.shape(saved["digit_accuracy"]) == (1, 2)
    assert os.path.exists(tmp_path / "eval" / f"niah_stage{k}.png")


@pytest.mark.slow  # ~150 s on 2 cores: four training runs (the data-level resume is fast-tested)
def test_staged_training_resume_at_boundary_and_inside_a_stage(tmp_path, monkeypatch):
  config = _config(steps=(2, 2), lens=(16, 32))
  calls = []
  monkeypatch.setattr(plan_lib, "build_plan",
                      lambda run, _build=plan_lib.build_plan: calls.append(1) or _build(run))
  ref = train_and_evaluate(run_config_from_dict(config), str(tmp_path / "ref"))
  assert len(calls) == 1  # the plan is built once per run
  monkeypatch.undo()
  assert ref["end_step"] == 4
  train = _records(tmp_path / "ref", "train")
  losses = {s: r["loss"] for s, r in train.items()}
  assert [train[s]["stage"] for s in range(1, 5)] == [0, 0, 1, 1]
  assert [train[s]["seq_len"] for s in range(1, 5)] == [16, 16, 32, 32]
  assert train[4]["tokens_seen"] == 4 * 512
  evals = _records(tmp_path / "ref", "eval")          # at the stage end and at the end
  assert sorted(evals) == [2, 4] and [evals[s]["stage"] for s in (2, 4)] == [0, 1]
  # Stop exactly at the stage boundary (step 2), then inside stage 1 (step 3), then finish:
  # every resumed step must see the same batch, hence give the same loss.
  for stop in (2, 3, 4):
    config.train.steps = stop
    out = train_and_evaluate(run_config_from_dict(config), str(tmp_path / "run"))
    assert out["end_step"] == stop
  resumed = {s: r["loss"] for s, r in _records(tmp_path / "run", "train").items()}
  assert resumed == losses


def test_dry_run_prints_plan_and_memory(capsys):
  """The flagship plan names its hardware and fits every stage; without context
  parallelism the 1M stage does not, and the report says what is missing."""
  e = dry_run.dry_run(run_config_from_dict(load_config("curriculum_1m")))
  out = capsys.readouterr().out
  assert e["total"] > 50e6 and e["fits"] == [True] * 4
  for want in ("seq_len 8,192 x batch 512", "seq_len 1,048,576 x batch 4", "target: h200",
               "T=262,144", "MLA attention (blockwise)", "KDA states", "logits", "to spare"):
    assert want in out
  assert out.count("rows/batch shard") == 4 and out.count("fits with compute.remat=") == 4
  config = load_config("curriculum_1m")
  config.mesh.update(data=1, fsdp=16, context=1)
  e = dry_run.dry_run(run_config_from_dict(config))
  last = [line for line in capsys.readouterr().out.splitlines() if "T=1,048,576" in line][0]
  assert e["fits"][3] is False
  assert "context 1" in last and "does not fit" in last and "needs mesh.context >= 4" in last


def test_stage_memory_components_scale():
  """Activations, KDA states and logits grow linearly with the tokens on a device; remat
  keeps less and pays one layer's recompute; the context axis divides the activations and
  adds the gathered MLA latents; remat='full' keeps one layer's KDA states. On the tiny
  preset (3 KDA + 1 MLA layers: every component present, half small's trace time)."""
  config = load_config("tiny")
  config.mesh.update(data=1, fsdp=8, context=1)
  run = run_config_from_dict(config)
  e = dry_run.estimate(run, build_plan(run))
  one = dry_run.stage_memory(run, e, 8192, 8)
  two = dry_run.stage_memory(run, e, 16384, 8)
  for part in ("kda_states", "logits"):
    assert two["none"][part] == pytest.approx(2 * one["none"][part], rel=1e-6)
  # Traced residuals: linear in T up to a small fixed part.
  assert two["none"]["activations"] == pytest.approx(2 * one["none"]["activations"], rel=0.02)
  assert one["full"]["activations"] < one["dots"]["activations"] < one["none"]["activations"]
  assert one["none"]["recompute"] == 0 < one["full"]["recompute"]
  assert one["none"]["params"] == two["none"]["params"] > 0
  assert one["none"]["mla_latents"] == 0
  n_kda = sum(k == "kda" for k in run.model.layer_kinds)
  assert one["none"]["kda_states"] == pytest.approx(n_kda * one["full"]["kda_states"])
  config.mesh.update(data=1, fsdp=8, context=4)
  run4 = run_config_from_dict(config)
  e4 = dry_run.estimate(run4, build_plan(run4))
  cp = dry_run.stage_memory(run4, e4, 16384, 8)
  assert cp["none"]["activations"] == pytest.approx(two["none"]["activations"] / 4)
  assert cp["none"]["mla_latents"] > 0
  # Parameters, gradients and optimizer state are split over context too (ZeRO over it),
  # leaf by leaf as the rules lay them out (a dim 32 ways does not divide stays whole:
  # less than 4x smaller on the tiny preset; exact against jax's placement below).
  for part in ("params", "gradients", "optimizer"):
    assert two["none"][part] / 4 <= cp["none"][part] < two["none"][part]



def test_stage_memory_counts_the_gradient_sum_and_the_gathered_weights():
  """grad_accum > 1 adds one fp32 gradient set (the loop's running sum); sharding over fsdp
  adds ZeRO-3's working set: the larger of the LM head and one MoE layer's local experts,
  gathered in the compute dtype with one fp32 gradient (libtpu's peak for Kimi K3)."""
  config = load_config("tiny")
  config.mesh.update(data=1, fsdp=1, context=1, expert=1)
  config.train.update(grad_accum=1, batch_size=8)
  run = run_config_from_dict(config)
  e = dry_run.estimate(run, build_plan(run))
  alone = dry_run.stage_memory(run, e, 256, 8)["full"]
  assert alone["gradient_sum"] == 0 and alone["gathered"] == 0
  config.mesh.update(fsdp=2, expert=2)
  config.train.grad_accum = 4
  run = run_config_from_dict(config)
  e = dry_run.estimate(run, build_plan(run))
  split = dry_run.stage_memory(run, e, 256, 8)["full"]
  assert split["gradient_sum"] == split["gradients"] == e["per_device_param_bytes"]
  m, act = run.model, 2 if run.compute.dtype == "bfloat16" else 4
  head = m.vocab_size * m.d_model * (act + 4)
  experts = (m.moe.num_experts // 2) * (m.moe.latent_dim or m.d_model) \
      * m.moe.expert_intermediate * (3 * act + 4)
  assert split["gathered"] == pytest.approx(max(head, experts))
  assert dry_run.step_bytes(split) == pytest.approx(
      sum(v for k, v in split.items() if k != "kda_states"))


def test_hardware_section_checks_its_fields():
  config = load_config("tiny")
  config.hardware.device = "h900"
  with pytest.raises(ConfigError, match=r"hardware\.device.*h200"):
    run_config_from_dict(config)
  config.hardware.device = "tpu_v5p"
  assert run_config_from_dict(config).hardware.usable_bytes == pytest.approx(0.9 * 95 * 2**30)


@pytest.mark.slow  # ~45-60 min on 2 idle cores (the 32K / 64K stages and six NIAH grids)
def test_cpu_curriculum_preset_end_to_end(tmp_path):
  """configs/curriculum_cpu.py (256 -> 64K) as run_train.py runs it: the held-out loss at 64K
  improves at every stage end, every stage is also evaluated at its own length, and a NIAH
  grid follows every stage."""
  from hybridmoe_jax.evals.stage_niah import StageNiah  # pylint: disable=g-import-not-at-top
  run = run_config_from_dict(load_config("curriculum_cpu"))
  out = train_and_evaluate(run, str(tmp_path),
                           on_stage_end=StageNiah.from_run(run, str(tmp_path)))
  assert out["end_step"] == run.train.steps and out["stopped_by"] is None
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  at = {(r["step"], r["eval_seq_len"]): r["loss"] for r in records if r.get("split") == "eval"}
  stages = plan_lib.build_plan(run).stages
  losses = [at[(s.end_step, stages[-1].seq_len)] for s in stages]
  print("held-out loss at 64K per stage:", losses)
  assert all(b < a for a, b in zip(losses, losses[1:]))
  assert all((s.end_step, s.seq_len) in at for s in stages)
  assert [r["stage"] for r in records if r.get("split") == "niah"] == list(range(len(stages)))
