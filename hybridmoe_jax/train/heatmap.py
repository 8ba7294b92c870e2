"""A dependency-free PNG heatmap (zlib + struct) for the expert-load matrix [layers, E]."""

from __future__ import annotations

import struct
import zlib

import numpy as np

# A few stops of the viridis colour map; values in between are interpolated.
_STOPS = np.array([
    [68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37],
], dtype=np.float64)


def colorize(values: np.ndarray, vmin: float | None = None,
             vmax: float | None = None) -> np.ndarray:
  """Map a 2-D float array to uint8 RGB [H, W, 3] (low: purple, high: yellow)."""
  v = np.asarray(values, dtype=np.float64)
  lo = np.nanmin(v) if vmin is None else vmin
  hi = np.nanmax(v) if vmax is None else vmax
  t = np.clip((v - lo) / (hi - lo), 0.0, 1.0) if hi > lo else np.zeros_like(v)
  t = np.nan_to_num(t) * (len(_STOPS) - 1)
  i = np.minimum(t.astype(np.int64), len(_STOPS) - 2)
  f = (t - i)[..., None]
  rgb = _STOPS[i] * (1 - f) + _STOPS[i + 1] * f
  return np.round(rgb).astype(np.uint8)


def _chunk(kind: bytes, data: bytes) -> bytes:
  return (struct.pack(">I", len(data)) + kind + data
          + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def encode_png(rgb: np.ndarray) -> bytes:
  """Encode uint8 RGB [H, W, 3] as PNG bytes (8-bit truecolour, no filtering)."""
  rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
  h, w, c = rgb.shape
  if c != 3:
    raise ValueError(f"expected [H, W, 3] RGB, got shape {rgb.shape}")
  rows = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1)
  header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
  return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
          + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)) + _chunk(b"IEND", b""))


def write_heatmap(path: str, values: np.ndarray, cell: int = 16,
                  vmin: float | None = None, vmax: float | None = None) -> None:
  """Write `values` [rows, cols] as a PNG with `cell` x `cell` pixels per entry."""
  rgb = colorize(values, vmin, vmax)
  rgb = np.repeat(np.repeat(rgb, cell, axis=0), cell, axis=1)
  with open(path, "wb") as f:
    f.write(encode_png(rgb))


def decode_png(data: bytes) -> np.ndarray:
  """Decode a PNG written by `encode_png` (filter type 0 only); for tests."""
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  pos, idat, w, h = 8, b"", 0, 0
  while pos < len(data):
    (n,) = struct.unpack(">I", data[pos:pos + 4])
    kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
    (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
    assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, "bad CRC"
    if kind == b"IHDR":
      w, h = struct.unpack(">II", body[:8])
    elif kind == b"IDAT":
      idat += body
    pos += 12 + n
  rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)
  assert not rows[:, 0].any(), "only filter type 0 is supported"
  return rows[:, 1:].reshape(h, w, 3)
