"""A run trained on 8 devices loads for evaluation / serving on one (hybridmoe_jax.loading places
every leaf on this process's default device instead of the devices that saved it)."""

import jax
import numpy as np
from flax import nnx

from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.loading import load_model
from hybridmoe_jax.train.loop import train_and_evaluate
from tests.conftest import load_config
from tests._support import set_tiny_model


def test_a_run_saved_on_a_mesh_of_8_loads_on_one_device(tmp_path):
  assert len(jax.devices()) >= 8, "tests/parallel runs with 8 simulated devices"
  config = load_config("tiny")
  set_tiny_model(config)
  config.model.moe.latent_dim = 8
  config.mesh.update(data=2, fsdp=1, expert=4)
  config.train.update(dict(steps=2, batch_size=8, seq_len=32, warmup=1, log_every=1,
                           eval_every=0, eval_batches=1, checkpoint_every=0,
                           heatmap_every=0, async_checkpoints=False))
  state = train_and_evaluate(run_config_from_dict(config), str(tmp_path / "w"))["state"]
  model, info = load_model(workdir=str(tmp_path / "w"))
  assert info["step"] == 2 and info["skipped"] == []
  got = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert {x.sharding.device_set.pop() for x in got} == {jax.devices()[0]}
  want = jax.tree.leaves(state.params)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
