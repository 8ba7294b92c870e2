"""A staged curriculum with images: every stage mixes image-text documents in at the
configured token share, resumes exactly, and the train loop runs it end to end."""

import json

import numpy as np
import pytest

from hybridmoe_jax.data import curriculum as data_curriculum
from hybridmoe_jax.data.tokenizers.byte import IMAGE_PAD_ID
from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.train import stage_plan as plan_lib
from tests.conftest import load_config


def _config(tmp_path, share=0.5):
  # Short text documents (40-160 bytes), so a few batches already show the token share.
  rng = np.random.default_rng(0)
  lines = [json.dumps({"text": "text " * int(rng.integers(8, 32))}) for _ in range(300)]
  (tmp_path / "text.jsonl").write_text("\n".join(lines))
  config = load_config("tiny_vlm")
  m = config.model
  m.num_layers, m.layer_kinds, m.moe.first_dense_layers = 1, ("mla",), 1  # compiles fast
  c = config.curriculum
  c.tokens_per_step = 1024
  c.sources = {"pydoc": {"kind": "jsonl", "paths": (str(tmp_path / "text.jsonl"),),
                         "field": "text"}}
  c.stages = (dict(name="a", seq_len=128, steps=3, weights={"pydoc": 1.0}),
              dict(name="b", seq_len=256, steps=3, weights={"pydoc": 1.0},
                   retrieval_fraction=0.2))
  config.data.vision.share = share
  t = config.train
  t.steps, t.eval_every, t.eval_batches, t.checkpoint_every = 6, 0, 1, 3
  return config


def _build(config, **shard):
  run = run_config_from_dict(config)
  return data_curriculum.build_curriculum_data(
      plan_lib.build_plan(run).stages, run.curriculum, run.data,
      vocab_size=run.model.vocab_size, seed=run.train.seed,
      eval_batches=run.train.eval_batches, vision=run.model.vision, **shard)


def test_every_stage_mixes_images_at_its_length_and_resumes_exactly(tmp_path):
  config = _config(tmp_path)
  data = _build(config)
  batches = [next(data.train) for _ in range(6)]
  for k, b in enumerate(batches):
    rows, seq = (8, 128) if k < 3 else (4, 256)
    assert b["tokens"].shape == (rows, seq) and b["loss_weights"].shape == (rows, seq)
    assert (b["tokens"] == IMAGE_PAD_ID).any() and (b["image_index"] >= 0).any()
  # Token share of image-text documents (segments holding an image) near data.vision.share.
  img_tok = txt_tok = 0
  for b in batches:
    for r in range(len(b["tokens"])):
      seg = b["segment_ids"][r]
      for s in range(1, seg.max() + 1):
        n = int((seg == s).sum())
        if (b["tokens"][r][seg == s] == IMAGE_PAD_ID).any():
          img_tok += n
        else:
          txt_tok += n
  assert 0.3 < img_tok / (img_tok + txt_tok) < 0.7
  # Held-out batches: text rows and image-text rows at the evaluation length.
  assert any("images" in b for b in data.eval_batches)
  assert any("images" not in b for b in data.eval_batches)
  # Resume inside stage 0 and exactly at the boundary: the next batches, token for token.
  for cut in (1, 3):
    a = _build(config)
    for _ in range(cut):
      next(a.train)
    state = json.loads(json.dumps(a.train.get_state()))
    want = [next(a.train) for _ in range(2)]
    b = _build(config)
    b.train.set_state(state)
    got = [next(b.train) for _ in range(2)]
    for x, y in zip(want, got):
      for key in ("tokens", "segment_ids", "loss_weights", "images", "image_index"):
        np.testing.assert_array_equal(x[key], y[key])


def test_curriculum_with_images_refuses_several_hosts(tmp_path):
  config = _config(tmp_path)
  with pytest.raises(NotImplementedError, match="image-text pipeline has no host shard"):
    _build(config, shard_index=0, shard_count=2)


@pytest.mark.slow  # ~40 s on 2 cores; the staged VLM iterator itself is fast-tested above
def test_train_loop_runs_a_curriculum_with_images(tmp_path):
  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.train.loop import train_and_evaluate
  config = _config(tmp_path)
  config.train.async_checkpoints = False
  out = train_and_evaluate(run_config_from_dict(config), str(tmp_path / "run"))
  assert out["end_step"] == 6 and np.isfinite(out["eval"]["loss"])
