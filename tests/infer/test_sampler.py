"""The one sampler (infer.steps.feed_and_draw_fn): the server's scheduler, generate_stream and
the RL rollouts all step through it; its forced tokens and log-probs against a direct
computation from the prefill logits."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.infer import Engine, SamplingConfig, trace_counts
from hybridmoe_jax.infer.steps import feed_and_draw_fn
from hybridmoe_jax.infer.sampling import sampling_logits
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.rl.rollout import Rollout, RolloutConfig
from hybridmoe_jax.infer import steps
from hybridmoe_jax.serve import batch_engine
from tests._support import tiny_model_config
from tests.infer.helpers import random_tokens


def test_server_and_rollout_share_the_sampler_and_its_log_probs_are_direct():
  tok = ByteTokenizer(chat=True)
  model = HybridLM(tiny_model_config(num_layers=2, layer_kinds=("kda", "mla"),
                                     vocab_size=tok.vocab_size), rngs=nnx.Rngs(0))
  engine = Engine(model, max_len=32, prefill_chunk=8, kv_block=8)
  sampling = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9)
  rollout = Rollout(engine, tok,
                    RolloutConfig(max_tokens=32, max_turn_tokens=4, sampling=sampling), batch=3)
  assert batch_engine._feed_and_draw is steps._feed_and_draw    # the server's calls
  assert rollout._step is feed_and_draw_fn(engine.graphdef, engine.kv_block, split_keys=False)

  tokens = np.asarray(random_tokens(5, 3, 8), np.int32)
  n_valid = np.array([8, 3, 5], np.int32)
  forced = np.array([-1, 11, -1], np.int32)
  keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(
      jnp.array([4, 5, 6], jnp.uint32), jnp.array([8, 3, 5]))
  before = trace_counts().get("feed_and_draw", 0)
  out = rollout._step(engine.state, tokens, n_valid, engine.init_cache(3), keys,
                      np.zeros(3, bool), *rollout._sampling, forced)
  assert trace_counts()["feed_and_draw"] == before + 1
  np.testing.assert_array_equal(out.keys, keys)        # split_keys=False: keys as given

  logits, _ = engine.prefill(tokens, lengths=n_valid)
  dist = sampling_logits(logits, *rollout._sampling)
  drawn = jax.vmap(jax.random.categorical)(keys, dist)
  want = np.where(forced >= 0, forced, np.asarray(drawn))
  np.testing.assert_array_equal(out.token, want)
  pick = lambda x: np.take_along_axis(np.asarray(jax.nn.log_softmax(x, -1)), want[:, None], -1)
  np.testing.assert_allclose(out.logp, pick(logits)[:, 0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out.sample_logp, pick(dist)[:, 0], rtol=1e-5, atol=1e-5)
  assert np.all(np.isfinite(np.asarray(out.sample_logp))[forced < 0])
