"""Shared test helpers."""

import importlib.util
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_config(name: str):
  """Load configs/<name>.py and return its get_config() ConfigDict."""
  spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def rel_rms(ref, x) -> float:
  """rms(ref - x) / rms(ref), in float64."""
  ref = np.asarray(ref, np.float64)
  x = np.asarray(x, np.float64)
  return float(np.sqrt(np.mean((ref - x) ** 2)) / (np.sqrt(np.mean(ref ** 2)) + 1e-30))
