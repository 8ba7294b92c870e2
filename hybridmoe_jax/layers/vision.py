"""The native vision tower (DESIGN s5): pixels -> d_model tokens, 4 pixels-patches per token.

Conventions: N images (each padded to one square bucket of S x S pixels), C channels, p patch
side, Gh = Gw = S / p padded patch grid, (h, w) the real patch grid of an image (even, <= S/p),
D tower width, d model width, G the native side of the learned position table.

    images [N, S, S, C] float  --patchify-->  [N, Gh*Gw, p*p*C]
      --bias-free linear + interp(pos table)(h, w)-->  [N, Gh*Gw, D]
      --L x bidirectional pre-norm blocks (keys masked to the image's real patches)-->
      --RMSNorm, 2x2 merge-->  [N, Gh/2*Gw/2, 4D]  --MLP (gelu) -> RMSNorm-->  [N, K, d]

Each image is its own batch row of the encoder, so it never attends to another image; inside
an image attention is bidirectional. Patches outside the real (h, w) grid are padding: masked
as keys, and their outputs are never read (the model gathers only real merged tokens).
Every tensor stays at rank <= 6 (jaxlib CPU segfaults on some rank-8 reductions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.config import VisionConfig
from hybridmoe_jax.layers.linear import linear
from hybridmoe_jax.layers.norms import RMSNorm


def patchify(images: jax.Array, p: int) -> jax.Array:
  """[N, H, W, C] -> [N, (H/p)*(W/p), p*p*C], patches in raster order, pixels (y, x, c)."""
  n, h, w, c = images.shape
  x = images.reshape(n, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(n, (h // p) * (w // p), p * p * c)


def merge2x2(x: jax.Array, gh: int, gw: int) -> jax.Array:
  """[N, gh*gw, D] -> [N, (gh/2)*(gw/2), 4D]: each 2x2 block of patches becomes one token,
  features ordered (dy, dx, D)."""
  n, _, d = x.shape
  x = x.reshape(n, gh // 2, 2, gw // 2, 2, d).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(n, (gh // 2) * (gw // 2), 4 * d)


def interp_weights(size: jax.Array, out_len: int, native: int) -> jax.Array:
  """Bilinear (half-pixel centres) resampling matrix from `native` table rows to `size` rows.

  size [N] int (the real grid side per image); returns [N, out_len, native] float32 whose row
  i (< size) holds the two weights of source coordinate (i + 0.5) * native / size - 0.5,
  clamped to the table. At size == native the coordinate is exactly i: a one-hot row, so the
  table is reproduced exactly. Rows i >= size are padding (finite, never read).
  """
  size = jnp.maximum(size.astype(jnp.float32), 1.0)[:, None]
  i = jnp.arange(out_len, dtype=jnp.float32)[None, :]
  src = jnp.clip((i + 0.5) * (native / size) - 0.5, 0.0, native - 1.0)
  lo = jnp.floor(src)
  frac = src - lo
  lo = lo.astype(jnp.int32)
  hi = jnp.minimum(lo + 1, native - 1)
  eye = jnp.arange(native)
  return ((eye == lo[..., None]) * (1.0 - frac)[..., None]
          + (eye == hi[..., None]) * frac[..., None])


def interpolate_pos_table(table: jax.Array, grid: jax.Array, gh: int, gw: int) -> jax.Array:
  """table [G, G, D], grid [N, 2] int (h, w) -> positions [N, gh*gw, D] (float32)."""
  # Separable bilinear interpolation: rows, then columns (two small matmuls, no gather).
  g = table.shape[0]
  ry = interp_weights(grid[:, 0], gh, g)
  rx = interp_weights(grid[:, 1], gw, g)
  pos = jnp.einsum("nia,abd,njb->nijd", ry, table.astype(jnp.float32), rx)
  return pos.reshape(pos.shape[0], gh * gw, -1)


def patch_mask(grid: jax.Array, gh: int, gw: int) -> jax.Array:
  """grid [N, 2] (h, w) -> bool [N, gh*gw]: True on the image's real patches."""
  rows = jnp.arange(gh)[None, :, None] < grid[:, 0, None, None]
  cols = jnp.arange(gw)[None, None, :] < grid[:, 1, None, None]
  return (rows & cols).reshape(grid.shape[0], gh * gw)


class VisionBlock(nnx.Module):
  """Pre-norm bidirectional self-attention + pre-norm GELU MLP; RMSNorm, no biases."""

  def __init__(self, cfg: VisionConfig, *, eps: float, dtype: str, rngs: nnx.Rngs):
    d = cfg.width
    self.heads = cfg.num_heads
    self.attn_norm = RMSNorm(d, eps=eps)
    self.qkv = linear(d, 3 * d, dtype=dtype, rngs=rngs)
    self.out = linear(d, d, dtype=dtype, rngs=rngs)
    self.mlp_norm = RMSNorm(d, eps=eps)
    self.up = linear(d, cfg.mlp_dim, dtype=dtype, rngs=rngs)
    self.down = linear(cfg.mlp_dim, d, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    """x [N, L, D], mask bool [N, L] (real patches) -> [N, L, D]."""
    n, length, d = x.shape
    hd = d // self.heads
    q, k, v = jnp.split(self.qkv(self.attn_norm(x)).reshape(n, length, 3 * self.heads, hd),
                        3, axis=2)
    s = jnp.einsum("nqhd,nkhd->nhqk", q.astype(jnp.float32), k.astype(jnp.float32))
    s = jnp.where(mask[:, None, None, :], s * hd ** -0.5, -1e30)
    a = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("nhqk,nkhd->nqhd", a, v.astype(jnp.float32)).astype(x.dtype)
    x = x + self.out(o.reshape(n, length, d))
    return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class VisionTower(nnx.Module):
  """Images -> projected tokens for the decoder (see the module docstring)."""

  def __init__(self, cfg: VisionConfig, d_model: int, *, eps: float, dtype: str,
               rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = jnp.dtype(dtype)
    p, c, d = cfg.patch_size, cfg.num_channels, cfg.width
    self.patch_embed = linear(p * p * c, d, dtype=dtype, rngs=rngs)
    # std 0.5, comparable to the embedding of an inked patch: with the usual 0.02 the 2-D
    # position is drowned by the content of non-blank patches and a small model is slow to
    # learn which image token answers a "top left" question.
    self.pos_table = nnx.Param(0.5 * jax.random.normal(rngs.params(),
                                                       (cfg.native_grid, cfg.native_grid, d)))
    self.blocks = nnx.List([VisionBlock(cfg, eps=eps, dtype=dtype, rngs=rngs)
                            for _ in range(cfg.num_layers)])
    self.merge_norm = RMSNorm(d, eps=eps)
    hidden = cfg.projector_dim or d_model
    self.proj_in = linear(4 * d, hidden, dtype=dtype, rngs=rngs)
    self.proj_out = linear(hidden, d_model, dtype=dtype, rngs=rngs)
    self.proj_norm = RMSNorm(d_model, eps=eps)

  def __call__(self, images: jax.Array, grid: jax.Array) -> jax.Array:
    """images [N, S, S, C] float (S a multiple of 2p), grid [N, 2] int32 real (h, w) patch
    counts (even; 0 for an empty slot) -> tokens [N, (S/2p)^2, d] in the compute dtype,
    raster order over the padded merged grid (token (r, c) at r * S/2p + c)."""
    p = self.cfg.patch_size
    n, hs, ws, _ = images.shape
    gh, gw = hs // p, ws // p
    x = self.patch_embed(patchify(images.astype(self.dtype), p))
    x = x + interpolate_pos_table(self.pos_table[...], grid, gh, gw).astype(x.dtype)
    mask = patch_mask(grid, gh, gw)
    # An empty slot has no real patch: let it attend to itself so the softmax stays finite.
    mask = mask.at[:, 0].set(True)
    for block in self.blocks:
      x = block(x, mask)
    x = merge2x2(self.merge_norm(x), gh, gw)
    return self.proj_norm(self.proj_out(jax.nn.gelu(self.proj_in(x))))
