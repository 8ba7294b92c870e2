"""rl.losses against loop-style numpy references written here from DESIGN s9's formulas."""

from __future__ import annotations

import functools
import math
import re

import jax
import numpy as np
import pytest

from hybridmoe_jax.rl import losses

EPS_LOW, EPS_HIGH = 0.2, 0.28

# The token functions, jitted once per module (hyper-parameters closed over).
_clipped = jax.jit(functools.partial(losses.clipped_token_loss, eps_low=EPS_LOW,
                                     eps_high=EPS_HIGH))
_gspo = jax.jit(functools.partial(losses.gspo_token_loss, eps_low=EPS_LOW, eps_high=EPS_HIGH))
_agg = {mode: jax.jit(functools.partial(losses.aggregate, mode=mode))
        for mode in losses.AGG_MODES}
_kl = {kind: jax.jit(functools.partial(losses.kl_tokens, kind=kind)) for kind in losses.KL_KINDS}


# ------------------------------------------------------------------------- numpy references

def _ref_advantages(r, g, mode, eps=1e-6):
  out = []
  for i in range(len(r)):
    members = [r[j] for j in range(len(r)) if g[j] == g[i]]
    mean = sum(members) / len(members)
    if mode == "grpo":
      std = math.sqrt(sum((x - mean)**2 for x in members) / len(members))
      out.append((r[i] - mean) / (std + eps))
    elif mode == "drgrpo":
      out.append(r[i] - mean)
    else:
      others = [r[j] for j in range(len(r)) if g[j] == g[i] and j != i]
      out.append(r[i] - sum(others) / len(others) if others else 0.0)
  return np.array(out)


def _ref_aggregate(v, m, mode, norm_len=None):
  b, t = v.shape
  if mode == "token-mean":
    num = sum(v[i, j] * m[i, j] for i in range(b) for j in range(t))
    den = sum(m[i, j] for i in range(b) for j in range(t))
    return num / den if den else 0.0
  if mode == "seq-mean-token-mean":
    rows = []
    for i in range(b):
      n = sum(m[i])
      if n:
        rows.append(sum(v[i, j] * m[i, j] for j in range(t)) / n)
    return sum(rows) / len(rows) if rows else 0.0
  total = sum(v[i, j] * m[i, j] for i in range(b) for j in range(t))
  return total / (b * (norm_len or t))


# -------------------------------------------------------------------------------- host side

REWARDS = np.array([1.0, 0.0, 0.5, 2.0, 3.0, 3.0, 0.25, 1.0, -1.0])
GROUPS = np.array([7, 2, 7, 2, 40, 40, 9, 7, 2])  # unsorted ids; {40}: all equal; {9}: one


@pytest.mark.parametrize("mode", losses.ADV_MODES)
def test_advantages_match_the_loop_reference(mode):
  got = losses.advantages(REWARDS, GROUPS, mode, ddof=0)   # the reference's population std
  assert got.dtype == np.float32 and got.shape == REWARDS.shape
  np.testing.assert_allclose(got, _ref_advantages(REWARDS, GROUPS, mode), rtol=1e-6, atol=1e-6)
  assert got[4] == got[5] == 0.0 and got[6] == 0.0  # all-equal group, group of one


@pytest.mark.parametrize("mode", losses.ADV_MODES)
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_advantages_of_all_equal_groups_are_exactly_zero(mode, eps):
  # 0.1 x 3 has a float mean != 0.1: grpo's std of the rounding error used to give +-0.8
  # (eps 0) or 1e-11; a group of one gave 0 / 0 = NaN at eps 0. Documented: 0 in every mode.
  rewards = np.array([0.1, 0.1, 0.1, 0.7, 0.0, 1.0])
  groups = np.array([5, 5, 5, 3, 8, 8])
  with np.errstate(all="raise"):
    got = losses.advantages(rewards, groups, mode, eps=eps)
  np.testing.assert_array_equal(got[:4], np.zeros(4))
  assert np.all(np.isfinite(got)) and got[4] < 0 < got[5]


def test_advantage_modes_relate_as_documented():
  # rloo = n / (n - 1) * drgrpo inside a group of n.
  dr = losses.advantages(REWARDS, GROUPS, "drgrpo")
  rloo = losses.advantages(REWARDS, GROUPS, "rloo")
  np.testing.assert_allclose(rloo[[0, 2, 7]], 1.5 * dr[[0, 2, 7]], rtol=1e-6)
  grpo = losses.advantages(REWARDS[:3], np.zeros(3, int), "grpo", eps=0.0, ddof=0)
  assert abs(float(np.mean(grpo))) < 1e-6 and abs(float(np.std(grpo)) - 1.0) < 1e-6


def test_signal_mask_drops_all_equal_groups():
  got = losses.signal_mask(REWARDS, GROUPS)
  want = np.array([len({REWARDS[j] for j in range(9) if GROUPS[j] == GROUPS[i]}) > 1
                   for i in range(9)])
  assert got.dtype == bool
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(want, [1, 1, 1, 1, 0, 0, 0, 1, 1])


def test_overlong_penalty_regions():
  lengths = np.array([0, 12, 13, 16, 20, 21, 50])
  got = losses.overlong_penalty(lengths, max_len=20, buffer=8, factor=0.5)
  # 0 up to 12; linear (12 - L) / 8 * 0.5 in (12, 20]; -0.5 beyond 20.
  want = [0, 0, -1 / 16, -0.25, -0.5, -0.5, -0.5]
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_array_equal(losses.overlong_penalty(lengths, max_len=20, buffer=0),
                                np.zeros(7))
  np.testing.assert_allclose(losses.overlong_penalty(lengths, max_len=20, buffer=20),
                             [0, -0.6, -0.65, -0.8, -1, -1, -1], rtol=1e-6)


@pytest.mark.parametrize("call, fragment", [
    (lambda: losses.advantages(REWARDS, GROUPS, "ppo"), "mode = 'ppo': allowed one of"),
    (lambda: losses.advantages(REWARDS, GROUPS[:3], "grpo"), "groups: allowed an int array"),
    (lambda: losses.advantages(REWARDS, GROUPS * 1.0, "grpo"), "groups: allowed an int array"),
    (lambda: losses.advantages(REWARDS[None], GROUPS[None], "grpo"), "rewards: allowed a 1-D"),
    (lambda: losses.advantages([1.0, np.nan], [0, 0], "rloo"), "rewards: allowed finite"),
    (lambda: losses.advantages(REWARDS, GROUPS, "grpo", eps=-1.0), "eps = -1.0"),
    (lambda: losses.signal_mask(REWARDS, GROUPS[1:]), "groups: allowed"),
    (lambda: losses.overlong_penalty([5], max_len=10, buffer=11),
     "buffer = 11: allowed an int in [0"),
    (lambda: losses.overlong_penalty([5], max_len=10, buffer=-1), "buffer = -1"),
    (lambda: losses.overlong_penalty([5], max_len=0, buffer=0), "max_len = 0"),
    (lambda: losses.overlong_penalty([-1], max_len=10, buffer=2), "lengths: allowed"),
    (lambda: losses.overlong_penalty([5], max_len=10, buffer=2, factor=-1), "factor = -1"),
])
def test_host_side_errors(call, fragment):
  with pytest.raises(ValueError, match=re.escape(fragment)):
    call()


# ------------------------------------------------------------------------------ aggregation

VALUES = np.array([[1.0, 2.0, 3.0, 4.0],
                   [5.0, 6.0, 7.0, 8.0],
                   [9.0, np.nan, 1.0, 2.0]], np.float32)  # a NaN at a masked position
MASK = np.array([[1, 1, 0, 0],
                 [0, 0, 0, 0],   # a fully masked row
                 [1, 0, 1, 1]], np.float32)


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_aggregate_matches_reference(mode):
  clean = np.nan_to_num(VALUES)
  got = float(_agg[mode](VALUES, MASK))
  np.testing.assert_allclose(got, _ref_aggregate(clean, MASK, mode), rtol=1e-6)
  assert float(_agg[mode](VALUES, np.zeros_like(MASK))) == 0.0  # all-zero mask: 0, not NaN


def test_aggregate_values_by_hand():
  assert float(_agg["token-mean"](VALUES, MASK)) == pytest.approx(15.0 / 5)
  assert float(_agg["seq-mean-token-mean"](VALUES, MASK)) == pytest.approx((1.5 + 4.0) / 2)
  assert float(_agg["seq-mean-token-sum-norm"](VALUES, MASK)) == pytest.approx(15.0 / 12)
  assert float(losses.aggregate(VALUES, MASK, "seq-mean-token-sum-norm", norm_len=6)) \
      == pytest.approx(15.0 / 18)


# --------------------------------------------------------------------------- clipped losses

def test_clipped_loss_below_inside_above_the_range():
  rho = np.array([0.5, 0.9, 1.0, 1.2, 1.5], np.float32)
  lp_old = np.full((2, 5), -1.0, np.float32)
  lp = lp_old + np.log(rho)[None]
  adv = np.array([2.0, -3.0], np.float32)
  loss, clipped = _clipped(lp, lp_old, adv)
  want_loss = np.zeros((2, 5))
  want_flag = np.zeros((2, 5), bool)
  for i in range(2):
    for t in range(5):
      plain = rho[t] * adv[i]
      cut = min(max(rho[t], 1 - EPS_LOW), 1 + EPS_HIGH) * adv[i]
      want_loss[i, t] = -min(plain, cut)
      want_flag[i, t] = cut < plain
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  np.testing.assert_array_equal(clipped, want_flag)
  # A > 0 clips above 1 + eps_high only; A < 0 below 1 - eps_low only.
  np.testing.assert_array_equal(want_flag, [[0, 0, 0, 0, 1], [1, 0, 0, 0, 0]])


def test_clipped_loss_gradient_is_zero_where_clipped():
  lp_old = np.zeros((1, 3), np.float32)
  lp = np.log(np.array([[0.5, 1.1, 1.5]], np.float32))
  grad = jax.grad(lambda x: _clipped(x, lp_old, np.array([1.0], np.float32))[0].sum())(lp)
  np.testing.assert_allclose(grad, [[-0.5, -1.1, 0.0]], rtol=1e-5)


def _gspo_case():
  rng = np.random.default_rng(0)
  lp_old = rng.uniform(-3, -0.1, (4, 5)).astype(np.float32)
  mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [0, 1, 1, 0, 1]],
                  np.float32)
  delta = np.zeros((4, 5), np.float32)
  delta[0, :3] = [0.1, -0.05, 0.02]   # s in range
  delta[1] = 0.5                      # s = e^0.5 above 1 + eps_high
  delta[3, [1, 2, 4]] = [-0.1, 0.0, 0.05]
  return lp_old + delta, lp_old, mask, np.array([1.5, 2.0, 0.7, -1.0], np.float32)


def test_gspo_value_and_clip_flags():
  lp, lp_old, mask, adv = _gspo_case()
  loss, clipped = _gspo(lp, lp_old, mask, adv)
  for i in range(4):
    n = mask[i].sum()
    s = math.exp(sum(mask[i, t] * (lp[i, t] - lp_old[i, t]) for t in range(5)) / n) if n else 1.0
    cut = min(max(s, 1 - EPS_LOW), 1 + EPS_HIGH)
    np.testing.assert_allclose(loss[i], np.full(5, -min(s * adv[i], cut * adv[i])), rtol=1e-5)
    assert bool(clipped[i]) == (cut * adv[i] < s * adv[i])
  np.testing.assert_array_equal(clipped, [False, True, False, False])


def test_gspo_gradient_matches_the_hand_derivation():
  lp, lp_old, mask, adv = _gspo_case()
  agg = _agg["seq-mean-token-mean"]
  grad = jax.jit(jax.grad(lambda x: agg(_gspo(x, lp_old, mask, adv)[0], mask)))(lp)
  rows = sum(1 for i in range(4) if mask[i].sum() > 0)
  want = np.zeros((4, 5))
  for i in (0, 3):  # unclipped rows: -A_i s_i m_t / (n_i * rows); row 1 is clipped -> 0
    n = mask[i].sum()
    s = math.exp(sum(mask[i, t] * (lp[i, t] - lp_old[i, t]) for t in range(5)) / n)
    for t in range(5):
      want[i, t] = -adv[i] * s * mask[i, t] / (n * rows)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_opmd_value_and_gradient():
  lp, lp_old, mask, _ = _gspo_case()
  c = np.array([0.5, -0.25, 0.1, 0.0], np.float32)
  tau = 0.3
  fn = jax.jit(functools.partial(losses.opmd_seq_loss, tau=tau))
  got = fn(lp, lp_old, mask, c)
  grad = jax.grad(lambda x: fn(x, lp_old, mask, c).sum())(lp)
  for i in range(4):
    sum_lr = sum(mask[i, t] * (lp[i, t] - lp_old[i, t]) for t in range(5))
    resid = c[i] - tau * sum_lr
    assert float(got[i]) == pytest.approx(0.5 * resid**2, rel=1e-5, abs=1e-8)
    np.testing.assert_allclose(grad[i], [-resid * tau * mask[i, t] for t in range(5)],
                               rtol=1e-5, atol=1e-7)


def test_kl_estimators():
  lp = np.array([[-1.0, -2.0, -0.5, -3.0]], np.float32)
  ref = np.array([[-1.0, -1.0, -2.0, -3.0 + 1e-4]], np.float32)
  k1, k3 = np.asarray(_kl["k1"](lp, ref)), np.asarray(_kl["k3"](lp, ref))
  for t in range(4):
    d = float(ref[0, t]) - float(lp[0, t])
    assert k1[0, t] == pytest.approx(-d, abs=1e-6)
    assert k3[0, t] == pytest.approx(math.exp(d) - d - 1, rel=1e-4, abs=1e-9)
  assert k1[0, 0] == 0.0 and k3[0, 0] == 0.0 and np.all(k3 >= 0)
  grad = jax.grad(lambda x: _kl["k3"](x, ref).sum())(lp)  # d k3 / d lp = 1 - exp(ref - lp)
  np.testing.assert_allclose(grad, 1 - np.exp(ref - lp), rtol=1e-5, atol=1e-6)
  rng = np.random.default_rng(1)
  a, b = (rng.normal(0, 1e-3, (8, 16)).astype(np.float32) for _ in range(2))
  assert np.all(np.asarray(_kl["k3"](a, b)) >= 0)


def test_entropy_and_ratio_stats():
  logits = np.array([[[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, -np.inf, -1.0]]], np.float32)
  h = np.asarray(jax.jit(losses.entropy_from_logits)(logits))
  z = np.exp([2.0, 0.0, -1.0])
  p = z / z.sum()
  np.testing.assert_allclose(h, [[math.log(4), -sum(q * math.log(q) for q in p)]], rtol=1e-5)
  lp_old = np.zeros((2, 3), np.float32)
  lp = np.log(np.array([[0.5, 2.0, 9.0], [1.25, 1.0, 1.0]], np.float32))
  mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  stats = jax.jit(losses.ratio_stats)(lp, lp_old, mask)
  on = [0.5, 2.0, 1.25]
  assert float(stats["ratio_mean"]) == pytest.approx(sum(on) / 3, rel=1e-6)
  assert float(stats["ratio_max"]) == pytest.approx(2.0, rel=1e-6)
  assert float(stats["ratio_min"]) == pytest.approx(0.5, rel=1e-6)
  assert float(stats["approx_kl"]) == pytest.approx(
      sum(x - 1 - math.log(x) for x in on) / 3, rel=1e-5)
  empty = jax.jit(losses.ratio_stats)(lp, lp_old, np.zeros_like(mask))
  assert {k: float(v) for k, v in empty.items()} == {
      "ratio_mean": 1.0, "ratio_max": 1.0, "ratio_min": 1.0, "approx_kl": 0.0}


@pytest.mark.parametrize("call, fragment", [
    (lambda: losses.aggregate(VALUES, MASK, "sum"), "mode = 'sum': allowed one of"),
    (lambda: losses.aggregate(VALUES, MASK[:, :2], "token-mean"), "allowed equal [B, T]"),
    (lambda: losses.aggregate(VALUES, MASK, "seq-mean-token-sum-norm", norm_len=0),
     "norm_len = 0"),
    (lambda: losses.clipped_token_loss(VALUES, VALUES, np.ones(2), eps_low=0.2, eps_high=0.2),
     "adv: allowed shape [B] = (3,)"),
    (lambda: losses.clipped_token_loss(VALUES, VALUES, np.ones(3), eps_low=1.0, eps_high=0.2),
     "eps_low = 1.0: allowed"),
    (lambda: losses.gspo_token_loss(VALUES, VALUES, MASK, np.ones(3), eps_low=0.1,
                                    eps_high=-0.1), "eps_high = -0.1"),
    (lambda: losses.opmd_seq_loss(VALUES, VALUES, MASK, np.ones(3), tau=0.0), "tau = 0.0"),
    (lambda: losses.opmd_seq_loss(VALUES, VALUES, MASK, np.ones(4), tau=1.0),
     "centered_reward: allowed shape"),
    (lambda: losses.kl_tokens(VALUES, VALUES, "k2"), "kind = 'k2': allowed one of"),
    (lambda: losses.entropy_from_logits(VALUES), "logits: allowed shape [B, T, V]"),
])
def test_token_level_errors(call, fragment):
  with pytest.raises(ValueError, match=re.escape(fragment)):
    call()
