"""Slow: train configs/tiny_vlm.py on CPU, then check that it reads 2-D position from pixels.

Swapping the top-left and bottom-right quadrants of held-out scenes (different digits,
resp. colours, there) must change the answer to "digit at top left?" and "colour at top
left?" for most scenes, and the answer after the swap must usually be the one that moved
there. A model that ignored the image or
the position table (a flat raster gives NoPE MLA / causal KDA no 2-D layout) could not do it.

Set HYBRIDMOE_VLM_WORKDIR to a finished tiny_vlm run to skip the training (minutes).
"""

import os

import pytest

from hybridmoe_jax.evals import vqa
from hybridmoe_jax.loading import load_from_workdir
from hybridmoe_jax.infer import Engine
from hybridmoe_jax.config.run import run_config_from_dict
from tests.conftest import load_config, one_device


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = os.environ.get("HYBRIDMOE_VLM_WORKDIR")
  config = load_config("tiny_vlm")
  if not workdir:
    # pylint: disable=g-import-not-at-top
    from hybridmoe_jax.train.loop import train_and_evaluate
    workdir = str(tmp_path_factory.mktemp("tiny_vlm"))
    config.train.async_checkpoints = False
    with one_device():
      train_and_evaluate(run_config_from_dict(config), workdir)
  model, _ = load_from_workdir(workdir)
  return model, config


@pytest.mark.slow
def test_swapping_quadrants_changes_position_answers(trained):
  model, config = trained
  engine = Engine(model, max_len=512, prefill_chunk=256)
  d = config.data.vision
  r = vqa.quadrant_swap(engine, num_images=24, seed=d.heldout_seed, sides=tuple(d.sides),
                        channels=model.cfg.vision.num_channels)
  for kind, chance in (("colour", 1 / 4), ("where", 1 / 10)):
    assert r[kind]["answer_changed"] >= 0.5, r
    assert r[kind]["correct_after_swap"] >= max(0.4, 3 * chance), r
