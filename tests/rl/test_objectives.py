"""The learner's whole RL objective (rl/learner.policy_objective, driven by the `rl` config)
against float64 numpy references written here from the published objectives, on random
masked batches (ragged rows, an empty row, padding):

  GRPO / Dr.GRPO / RLOO advantages (DeepSeekMath; Liu et al. 2025; Ahmadian et al. 2024),
  the PPO / DAPO clipped surrogate, GSPO (Zheng et al. 2025: the sequence ratio
  s_i = exp(mean_t log rho_t) clipped at its own small range), Kimi k1.5's OPMD, KL k1 / k3,
  and the three loss_agg_modes (Dr.GRPO's: sum / (rows x rl.max_tokens), a constant budget).

Values and gradients (w.r.t. the policy log-probs; the reference's by central differences).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.rl import learner, losses
from hybridmoe_jax.config.rl import RLConfig, RLEnvConfig

ROWS, LEN, BUDGET = 6, 20, 48


def _rl(**kw) -> RLConfig:
  return RLConfig(envs={"arithmetic": RLEnvConfig()}, max_tokens=BUDGET, **kw)


# ------------------------------------------------------------------------- numpy references

def ref_advantages(r, g, mode, ddof=1, eps=1e-6):
  """Per episode, from its group's rewards (loops, float64)."""
  out = np.zeros(len(r))
  for i in range(len(r)):
    members = np.array([r[j] for j in range(len(r)) if g[j] == g[i]], np.float64)
    mean = members.mean()
    if mode == "grpo":
      n = len(members)
      std = np.sqrt(((members - mean)**2).sum() / max(n - ddof, 1))
      out[i] = (r[i] - mean) / (std + eps)
    elif mode == "drgrpo":
      out[i] = r[i] - mean
    else:   # rloo: the leave-one-out baseline
      out[i] = (r[i] - (members.sum() - r[i]) / (len(members) - 1)) if len(members) > 1 else 0
  return out


def ref_aggregate(v, m, mode, budget):
  if mode == "token-mean":
    return (v * m).sum() / m.sum()
  if mode == "seq-mean-token-mean":
    per_row = [(v[i] * m[i]).sum() / m[i].sum() for i in range(len(v)) if m[i].sum() > 0]
    return float(np.mean(per_row))
  return (v * m).sum() / (v.shape[0] * budget)     # Dr. GRPO: a constant generation budget


def ref_objective(lp, b, rl: RLConfig, lp_ref=None) -> float:
  """The scalar loss (to minimise) of one minibatch, float64."""
  m, lp_old, a = b["mask"], b["lp_old"].astype(np.float64), b["advantage"][:, None]
  lp = lp.astype(np.float64)
  if rl.loss == "clip":
    rho = np.exp(lp - lp_old)
    tok = -np.minimum(rho * a, np.clip(rho, 1 - rl.eps_low, 1 + rl.eps_high) * a)
    loss = ref_aggregate(tok, m, rl.loss_agg_mode, rl.max_tokens)
  elif rl.loss == "gspo":
    n = np.maximum(m.sum(1), 1)
    s = np.exp(((lp - lp_old) * m).sum(1) / n)[:, None]
    seq = -np.minimum(s * a, np.clip(s, 1 - rl.gspo_eps_low, 1 + rl.gspo_eps_high) * a)
    loss = ref_aggregate(np.broadcast_to(seq, m.shape), m, rl.loss_agg_mode, rl.max_tokens)
  else:   # opmd: 0.5 (r - mean_g r - tau sum_t log rho)^2, mean over episodes
    resid = b["centered"] - rl.opmd_tau * ((lp - lp_old) * m).sum(1)
    loss = (0.5 * resid**2 * b["valid"]).sum() / b["valid"].sum()
  if rl.kl != "none":
    d = lp_ref.astype(np.float64) - lp
    kl = -d if rl.kl == "k1" else np.exp(d) - d - 1
    loss += rl.kl_beta * ref_aggregate(kl, m, rl.loss_agg_mode, rl.max_tokens)
  return float(loss)


def ref_grad(lp, b, rl, lp_ref=None, h=1e-6):
  """d ref_objective / d lp at the masked positions (central differences, float64)."""
  g = np.zeros(lp.shape)
  base = lp.astype(np.float64)
  for i, t in zip(*np.nonzero(b["mask"])):
    up, down = base.copy(), base.copy()
    up[i, t] += h
    down[i, t] -= h
    g[i, t] = (ref_objective(up, b, rl, lp_ref) - ref_objective(down, b, rl, lp_ref)) / (2 * h)
  return g


# ------------------------------------------------------------------------------ the batches

def random_batch(seed: int, adv_mode: str, *, log_ratio_scale: float = 0.3, length=LEN):
  """ROWS ragged rows (row 4 empty: dropped / padding), masked prompt columns, random
  rewards in 2 groups of 3 -> advantages by the numpy reference."""
  rng = np.random.default_rng(seed)
  mask = np.zeros((ROWS, length), np.float32)
  for i, n in enumerate([7, 12, 3, 15, 0, 9]):
    start = rng.integers(1, 4)
    mask[i, start:start + n] = 1
  lp_old = rng.uniform(-4.0, -0.05, (ROWS, length)).astype(np.float32) * mask
  lp = (lp_old + rng.normal(0, log_ratio_scale, (ROWS, length)).astype(np.float32)) * mask
  lp_ref = (lp_old + rng.normal(0, 0.2, (ROWS, length)).astype(np.float32)) * mask
  rewards = rng.uniform(0, 1, ROWS)
  groups = np.array([0, 0, 0, 1, 1, 1])
  valid = np.array([1, 1, 1, 1, 0, 1], np.float32)
  b = {"mask": mask, "lp_old": lp_old,
       "advantage": (ref_advantages(rewards, groups, adv_mode) * valid).astype(np.float32),
       "centered": (ref_advantages(rewards, groups, "drgrpo") * valid).astype(np.float32),
       "valid": valid}
  return lp, lp_ref, b


def _objective(lp, b, rl, lp_ref):
  jb = {k: jnp.asarray(v) for k, v in b.items()}
  ref = None if lp_ref is None else jnp.asarray(lp_ref)
  return learner.policy_objective(jnp.asarray(lp), jb, rl, ref)


# ------------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("ddof", [0, 1])
def test_advantages_match_the_reference(mode, ddof):
  rng = np.random.default_rng(3)
  r = rng.uniform(-1, 2, 23)
  g = rng.integers(0, 6, 23) * 7 + 100            # unsorted, sparse ids; some singletons
  got = losses.advantages(r, g, mode, ddof=ddof)
  np.testing.assert_allclose(got, ref_advantages(r, g, mode, ddof), rtol=1e-5, atol=1e-6)


def test_grpo_ddof_default_is_the_sample_std():
  """ddof 1 (TRL / verl) by default: rewards (0, 1) give advantages -+1/sqrt(2)."""
  got = losses.advantages(np.array([0.0, 1.0]), np.array([0, 0]), "grpo", eps=0.0)
  np.testing.assert_allclose(got, [-2**-0.5, 2**-0.5], rtol=1e-6)
  assert _rl().adv_std_ddof == 1
  pop = losses.advantages(np.array([0.0, 1.0]), np.array([0, 0]), "grpo", eps=0.0, ddof=0)
  np.testing.assert_allclose(pop, [-1.0, 1.0], rtol=1e-6)


CASES = ([(loss, agg, kl) for loss in ("clip", "gspo")
          for agg, kl in itertools.product(losses.AGG_MODES, ("none", "k1", "k3"))]
         + [("opmd", "token-mean", kl) for kl in ("none", "k1", "k3")])


@pytest.mark.parametrize("loss,agg,kl", CASES)
def test_objective_value_and_gradient_match_the_reference(loss, agg, kl):
  adv_mode = ("grpo", "drgrpo", "rloo")[CASES.index((loss, agg, kl)) % 3]
  lp, lp_ref, b = random_batch(CASES.index((loss, agg, kl)), adv_mode,
                               log_ratio_scale=1e-5 if loss == "gspo" else 0.3)
  if loss == "gspo":   # rows 0, 2, 5 outside the sequence range on the advantage's side
    shift = np.array([2e-3, 1e-4, 2e-3, 1e-4, 0.0, 2e-3]) * np.sign(b["advantage"])
    lp = (lp + shift[:, None] * b["mask"]).astype(np.float32)
  rl = _rl(loss=loss, loss_agg_mode=agg, advantage=adv_mode, kl=kl,
           kl_beta=0.05 if kl != "none" else 0.0, opmd_tau=0.7)
  ref = lp_ref if kl != "none" else None
  value, metrics = _objective(lp, b, rl, ref)
  want = ref_objective(lp, b, rl, ref)
  np.testing.assert_allclose(float(value), want, rtol=2e-5, atol=1e-7)
  grad = jax.grad(lambda x: _objective(x, b, rl, ref)[0])(jnp.asarray(lp))
  want_g = ref_grad(lp, b, rl, ref)
  scale = np.abs(want_g).max()
  np.testing.assert_allclose(np.asarray(grad) * b["mask"], want_g, rtol=0,
                             atol=2e-4 * scale + 1e-8)
  assert not np.asarray(grad)[b["mask"] == 0].any()      # padding and prompts: no gradient
  if loss == "gspo":   # the random batch has clipped and unclipped rows
    assert 0 < float(metrics["clip_fraction"]) < 1


def test_drgrpo_loss_is_unchanged_when_the_batch_is_padded_to_twice_the_length():
  lp, lp_ref, b = random_batch(11, "drgrpo")
  rl = _rl(advantage="drgrpo", loss_agg_mode="seq-mean-token-sum-norm", kl="k3", kl_beta=0.1)
  pad = lambda x: np.pad(x, ((0, 0), (0, LEN)))           # noqa: E731
  wide = {k: pad(v) if v.ndim == 2 else v for k, v in b.items()}
  short, _ = _objective(lp, b, rl, lp_ref)
  long, _ = _objective(pad(lp), wide, rl, pad(lp_ref))
  assert float(short) == pytest.approx(float(long), rel=1e-6)
  assert float(short) == pytest.approx(ref_objective(lp, b, rl, lp_ref), rel=2e-5)
  # the normaliser is rows x rl.max_tokens, not rows x T
  tok = -np.minimum(np.exp(lp - b["lp_old"]) * b["advantage"][:, None],
                    np.clip(np.exp(lp - b["lp_old"]), 0.8, 1.28) * b["advantage"][:, None])
  assert float(_objective(lp, b, _rl(advantage="drgrpo",
                                     loss_agg_mode="seq-mean-token-sum-norm"), None)[0]) == \
      pytest.approx((tok * b["mask"]).sum() / (ROWS * BUDGET), rel=1e-5)


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_gspo_sequence_clip_acts_at_its_own_range(adv):
  """Every row's sequence ratio 1e-3 outside GSPO's range on the advantage's side: all rows
  clipped, zero gradient; at 1e-4 (inside 3e-4 / 4e-4) none clipped, gradient A s / (n R).
  With the token range (0.2 / 0.28) neither would clip."""
  rng = np.random.default_rng(0)
  mask = np.ones((3, 8), np.float32)
  lp_old = rng.uniform(-3, -0.1, (3, 8)).astype(np.float32)
  b = {"mask": mask, "lp_old": lp_old, "advantage": np.full(3, adv, np.float32),
       "centered": np.zeros(3, np.float32), "valid": np.ones(3, np.float32)}
  rl = _rl(loss="gspo", loss_agg_mode="seq-mean-token-mean")
  for shift, clipped in ((1e-3 * adv, 1.0), (1e-4 * adv, 0.0)):
    lp = lp_old + np.float32(shift)
    _, metrics = _objective(lp, b, rl, None)
    assert float(metrics["clip_fraction"]) == clipped
    grad = np.asarray(jax.grad(lambda x: _objective(x, b, rl, None)[0])(jnp.asarray(lp)))
    if clipped:
      assert not grad.any()
    else:
      np.testing.assert_allclose(grad, -adv * np.exp(shift) / (8 * 3), rtol=1e-4)


def test_a_target_outside_the_nucleus_gives_a_zero_ratio_and_finite_losses():
  """lp at the floor (the current policy's nucleus dropped the sampled token): rho ~ 0 for
  the clip loss, finite OPMD and k3 values."""
  lp, lp_ref, b = random_batch(5, "grpo")
  lp = lp.copy()
  lp[0, np.flatnonzero(b["mask"][0])[0]] = learner.LOGP_FLOOR
  for loss in ("clip", "gspo", "opmd"):
    value, m = _objective(lp, b, _rl(loss=loss, kl="k3", kl_beta=0.1), lp_ref)
    assert np.isfinite(float(value)) and float(m["ratio_min"]) < 1e-30


@pytest.mark.parametrize("field,value,fragment", [
    ("gspo_eps_low", -1e-4, r"`rl.gspo_eps_low` = -0.0001 is invalid: allowed a number in "
                            r"\[0, 1\]"),
    ("gspo_eps_high", 20.0, r"`rl.gspo_eps_high` = 20.0 is invalid"),
    ("adv_std_ddof", 2, r"`rl.adv_std_ddof` = 2 is invalid: allowed one of \(0, 1\)"),
    ("temperature", 0.0, r"`rl.temperature` = 0.0 is invalid: allowed a number in \(0, 100\]"),
])
def test_config_errors_are_one_line(field, value, fragment):
  with pytest.raises(ConfigError, match=fragment) as e:
    _rl(**{field: value})
  assert "\n" not in str(e.value)
