"""Shared test support: error measures and closeness checks.

Every measure takes (got, want): the value under test first, the reference second. The
reference is the denominator, so the order matters.
"""

import numpy as np


def rel_err(got, want) -> float:
  """max |got - want| / max |want|, in float64."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


def rel_rms(got, want) -> float:
  """rms(got - want) / rms(want), in float64."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.sqrt(np.mean((got - want) ** 2)) / (np.sqrt(np.mean(want ** 2)) + 1e-30))


def assert_close(got, want, rtol, what="", *, atol=1e-6):
  """fla's convention: got is finite and max abs error <= atol, or relative RMS error < rtol."""
  assert np.isfinite(np.asarray(got, np.float32)).all(), f"{what}: not finite"
  err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
  rel = rel_rms(got, want)
  assert err <= atol or rel < rtol, f"{what}: max abs {err}, rel rms {rel} (tol {rtol})"
