"""Vision path: tower ops vs numpy references, placeholders, loss mask and weights, prefill,
bad input, VQA report (image-text data and packing: test_vlm_data.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import ConfigError, from_dict
from hybridmoe_jax.data import images as images_lib
from hybridmoe_jax.data import multimodal
from hybridmoe_jax.config.run import VisionDataConfig
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer, IMAGE_PAD_ID
from hybridmoe_jax.infer import Engine
from hybridmoe_jax.layers import vision as V
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.train import step as step_lib
from tests._support import rel_rms, tiny_model_config
from tests.conftest import load_config
from tests.vision.helpers import P, VIS, rand_img as _rand_img, vlm_cfg as _vlm_cfg


@nnx.jit
def _fwd(model, tokens, images, grid, index):
  return model(tokens, images=images, image_grid=grid, image_index=index)[0]


@nnx.jit
def _tower_fwd(tower, images, grid):
  return tower(images, grid)


# ------------------------------------------------------------------------------ tower ops


def test_patchify_matches_loops():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 8, 12, 3)).astype(np.float32)
  got = np.asarray(V.patchify(jnp.asarray(x), P))
  assert got.shape == (2, 2 * 3, P * P * 3)
  for n in range(2):
    for i in range(2):
      for j in range(3):
        ref = x[n, i * P:(i + 1) * P, j * P:(j + 1) * P].reshape(-1)
        np.testing.assert_array_equal(got[n, i * 3 + j], ref)


def test_merge_groups_2x2_blocks():
  gh, gw, d = 4, 6, 5
  x = np.random.default_rng(1).normal(size=(2, gh * gw, d)).astype(np.float32)
  got = np.asarray(V.merge2x2(jnp.asarray(x), gh, gw))
  assert got.shape == (2, (gh // 2) * (gw // 2), 4 * d)
  grid = x.reshape(2, gh, gw, d)
  for r in range(gh // 2):
    for c in range(gw // 2):
      ref = np.concatenate([grid[:, 2 * r + dy, 2 * c + dx] for dy in (0, 1) for dx in (0, 1)],
                           -1)
      np.testing.assert_array_equal(got[:, r * (gw // 2) + c], ref)


def _bilinear_ref(table, h, w):
  """numpy half-pixel-centre bilinear resize of table [G, G, D] to [h, w, D]."""
  g = table.shape[0]

  def axis(n):
    src = np.clip((np.arange(n) + 0.5) * g / n - 0.5, 0, g - 1)
    lo = np.floor(src).astype(int)
    return lo, np.minimum(lo + 1, g - 1), src - lo

  y0, y1, fy = axis(h)
  x0, x1, fx = axis(w)
  out = np.zeros((h, w, table.shape[2]))
  for i in range(h):
    for j in range(w):
      top = table[y0[i], x0[j]] * (1 - fx[j]) + table[y0[i], x1[j]] * fx[j]
      bot = table[y1[i], x0[j]] * (1 - fx[j]) + table[y1[i], x1[j]] * fx[j]
      out[i, j] = top * (1 - fy[i]) + bot * fy[i]
  return out


def test_position_interpolation_exact_at_native_and_bilinear_elsewhere():
  table = np.random.default_rng(2).normal(size=(4, 4, 3)).astype(np.float32)
  grid = jnp.asarray([[4, 4], [2, 6], [8, 4]], jnp.int32)
  got = np.asarray(V.interpolate_pos_table(jnp.asarray(table), grid, 8, 8)).reshape(3, 8, 8, 3)
  np.testing.assert_array_equal(got[0, :4, :4], table)      # native size: bit-exact
  np.testing.assert_allclose(got[1, :2, :6], _bilinear_ref(table, 2, 6), atol=1e-6)
  np.testing.assert_allclose(got[2, :8, :4], _bilinear_ref(table, 8, 4), atol=1e-6)


def _tower():
  return V.VisionTower(VIS, 8, eps=1e-5, dtype="float32", rngs=nnx.Rngs(0))


def test_encoder_bidirectional_within_image_never_across_images():
  tower = _tower()
  rng = np.random.default_rng(3)
  imgs = rng.random((2, 16, 16, 3)).astype(np.float32)
  grid = jnp.asarray([[4, 4], [2, 4]], jnp.int32)   # image 1: real 8 x 16 pixels
  f = lambda x: np.asarray(_tower_fwd(tower, jnp.asarray(x), grid))
  base = f(imgs)
  assert base.shape == (2, 4, 8)
  # Last pixel block of image 0 changes its FIRST merged token: attention is bidirectional.
  x = imgs.copy()
  x[0, 12:, 12:] += 0.5
  out = f(x)
  assert np.abs(out[0, 0] - base[0, 0]).max() > 1e-4
  np.testing.assert_array_equal(out[1], base[1])           # the other image is untouched
  # Padding rows of image 1 (beyond its 2 patch rows) do not reach its real tokens.
  x = imgs.copy()
  x[1, 8:] = 0.9
  out = f(x)
  np.testing.assert_allclose(out[1, :2], base[1, :2], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(out[0], base[0])


# ------------------------------------------------------------------------ processor, data


@pytest.mark.parametrize("h, w", [(8, 8), (16, 24), (32, 16), (24, 32)])
def test_placeholders_equal_tower_tokens(h, w):
  proc = multimodal.Processor(VIS)
  img = _rand_img(np.random.default_rng(4), h, w)
  doc = proc("a <image> b", [img])
  k = (h // (2 * P)) * (w // (2 * P))
  assert int(np.sum(doc.tokens == IMAGE_PAD_ID)) == k
  assert doc.grids == [(h // P, w // P)]
  batch = multimodal.inference_batch(doc, VIS)
  s = batch["images"].shape[2]
  feats = _tower_fwd(_tower(), jnp.asarray(batch["images"][0]),
                     jnp.asarray(batch["image_grid"][0]))
  real = np.asarray(V.patch_mask(jnp.asarray(batch["image_grid"][0]) // 2, s // (2 * P),
                                 s // (2 * P)))
  assert feats.shape[1] == (s // (2 * P)) ** 2 and int(real.sum()) == k
  # The placeholders index exactly the real merged tokens of slot 0, in raster order.
  idx = batch["image_index"][0]
  np.testing.assert_array_equal(idx[idx >= 0], np.flatnonzero(real[0]))
  assert np.all(doc.tokens[idx >= 0] == IMAGE_PAD_ID)


def test_embed_inputs_replaces_exactly_the_placeholders():
  cfg = _vlm_cfg(("mla",))
  model = HybridLM(cfg, rngs=nnx.Rngs(0))
  proc = multimodal.Processor(cfg.vision)
  rng = np.random.default_rng(5)
  sizes = ((32, 32), (32, 16))
  doc = proc("x<image>yz<image>", [_rand_img(rng, h, w) for h, w in sizes])
  b = multimodal.inference_batch(doc, cfg.vision)
  parts = nnx.jit(lambda m, t, i, g, x: (m.embed_inputs(t, i, g, x), m.embed(t),
                                           m.image_features(i, g)))
  x, text, feats = map(np.asarray, parts(model, *(jnp.asarray(b[k]) for k in (
      "tokens", "images", "image_grid", "image_index"))))
  pl = doc.tokens == IMAGE_PAD_ID
  np.testing.assert_array_equal(x[0, ~pl], text[0, ~pl])
  np.testing.assert_array_equal(x[0, pl], feats[0, b["image_index"][0][pl]])
  want = sum(multimodal.tokens_per_image(h, w, cfg.vision.patch_size) for h, w in sizes)
  assert len(set(b["image_index"][0][pl].tolist())) == pl.sum() == want > 2


def test_no_loss_on_image_positions_and_delimiters():
  cfg = _vlm_cfg(("mla",))
  model = HybridLM(cfg, rngs=nnx.Rngs(1))
  proc = multimodal.Processor(cfg.vision)
  doc = proc("ab<image>cd", [_rand_img(np.random.default_rng(6), 16, 16)])
  b = {k: jnp.asarray(v) for k, v in multimodal.inference_batch(doc, cfg.vision).items()}
  gd, params, rest = nnx.split(model, nnx.Param, ...)
  extras = {k: b[k] for k in step_lib.IMAGE_BATCH_KEYS}
  nll, (count, _) = jax.jit(step_lib._forward_nll, static_argnums=0)(
      gd, params, nnx.State({}), rest, b["tokens"], b["segment_ids"], extras)
  logits = np.asarray(_fwd(model, b["tokens"], *extras.values())[0], np.float64)
  toks = doc.tokens
  # Independent reference: targets are the text bytes and EOS only.
  keep = [t for t in range(len(toks) - 1) if toks[t + 1] < 256 or toks[t + 1] == 258]
  assert int(count) == len(keep) == 2 + 2 + 1
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  ref = sum(logz[t] - logits[t, toks[t + 1]] for t in keep)
  assert abs(float(nll) - ref) < 1e-3 * abs(ref)


def test_loss_weights_weigh_each_target_token():
  cfg = _vlm_cfg(("mla",))
  model = HybridLM(cfg, rngs=nnx.Rngs(3))
  proc = multimodal.Processor(cfg.vision, prompt_loss_weight=0.5)
  text = "xy<image>z 12\n"
  doc = proc(text, [_rand_img(np.random.default_rng(14), 16, 16)],
             answer_spans=[(text.index(" 12"), len(text))])
  b = {k: jnp.asarray(v) for k, v in multimodal.inference_batch(doc, cfg.vision).items()}
  gd, params, rest = nnx.split(model, nnx.Param, ...)
  extras = {k: b[k] for k in step_lib.IMAGE_BATCH_KEYS + (step_lib.LOSS_WEIGHTS,)}
  fwd = jax.jit(step_lib._forward_nll, static_argnums=0)
  nll, (wsum, _) = fwd(gd, params, nnx.State({}), rest, b["tokens"], b["segment_ids"], extras)
  logits = np.asarray(_fwd(model, b["tokens"], *[extras[k] for k in step_lib.IMAGE_BATCH_KEYS]
                           )[0], np.float64)
  toks = doc.tokens
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  # Independent reference: target t + 1 weighs 1 in " 12\n", 0.5 on other text and EOS,
  # 0 on image tokens.
  ans = len(toks) - 1 - len(" 12\n")
  w = [0.0 if toks[t + 1] > 258 else (1.0 if ans <= t + 1 < len(toks) - 1 else 0.5)
       for t in range(len(toks) - 1)]
  ref = sum(wt * (logz[t] - logits[t, toks[t + 1]]) for t, wt in enumerate(w))
  assert abs(float(wsum) - sum(w)) < 1e-6 and sum(w) == 4 * 1.0 + 4 * 0.5
  assert abs(float(nll) - ref) < 1e-3 * abs(ref)


# ------------------------------------------------------------------------ prefill == forward


def test_prefill_with_images_equals_full_forward():
  cfg = _vlm_cfg()
  model = HybridLM(cfg, rngs=nnx.Rngs(2))
  proc = multimodal.Processor(cfg.vision)
  rng = np.random.default_rng(8)
  doc = proc("hi <image> and <image>: ", [_rand_img(rng, 32, 32), _rand_img(rng, 16, 32)],
             eos=False)
  b = multimodal.inference_batch(doc, cfg.vision)
  keys = {k: jnp.asarray(b[k]) for k in step_lib.IMAGE_BATCH_KEYS}
  full = np.asarray(_fwd(model, jnp.asarray(b["tokens"]), *keys.values()))
  engine = Engine(model, max_len=64, prefill_chunk=16)   # 3 chunks; images cross chunk edges
  n = len(doc.tokens)
  assert n > 32
  logits, cache = engine.prefill(b["tokens"], images=b)
  assert rel_rms(logits[0], full[0, n - 1]) < 1e-4
  nxt = int(np.argmax(full[0, n - 1]))
  step, _ = engine.decode_step(jnp.asarray([nxt]), cache)
  toks2 = np.concatenate([b["tokens"], [[nxt]]], 1)
  idx2 = np.concatenate([b["image_index"], [[-1]]], 1)
  full2 = np.asarray(_fwd(model, jnp.asarray(toks2), keys["images"], keys["image_grid"],
                          jnp.asarray(idx2)))
  assert rel_rms(step[0], full2[0, n]) < 1e-4


# ---------------------------------------------------------------------------- bad input


def test_bad_images_are_rejected_with_clear_messages():
  proc = multimodal.Processor(VIS)
  with pytest.raises(images_lib.ImageError, match="not a multiple of 2 \\* patch_size = 8"):
    proc("<image>", [np.zeros((12, 16, 3), np.uint8)])
  doc = multimodal.Processor(VIS, pad_images=True)("<image>", [np.ones((12, 16, 3), np.uint8)])
  assert doc.images[0].shape == (16, 16, 3) and doc.images[0][12:].max() == 0
  with pytest.raises(images_lib.ImageError, match="4 channels.*num_channels = 3"):
    proc("<image>", [np.zeros((8, 8, 4), np.uint8)])
  with pytest.raises(images_lib.ImageError, match="dtype int64"):
    proc("<image>", [np.zeros((8, 8, 3), np.int64)])
  with pytest.raises(images_lib.ImageError, match="\\[0, 1\\]"):
    proc("<image>", [np.full((8, 8, 3), 2.0, np.float32)])
  with pytest.raises(images_lib.ImageError, match="largest bucket"):
    proc("<image>", [np.zeros((40, 8, 3), np.uint8)])
  with pytest.raises(ValueError, match="2 <image> marker\\(s\\) but 1 image"):
    proc("<image><image>", [np.zeros((8, 8, 3), np.uint8)])
  with pytest.raises(ValueError, match="1 <image> marker\\(s\\) but 2 image"):
    proc("<image>", [np.zeros((8, 8, 3), np.uint8)] * 2)


def test_vision_config_errors_name_the_field():
  with pytest.raises(ConfigError, match="model.vision.image_buckets"):
    dataclasses.replace(VIS, image_buckets=(12,))
  with pytest.raises(ConfigError, match="model.vision.num_heads"):
    dataclasses.replace(VIS, num_heads=3)
  with pytest.raises(ConfigError, match="model.vision.num_layers"):
    dataclasses.replace(VIS, num_layers=-1)
  dataclasses.replace(VIS, num_layers=0)            # depth 0 is allowed
  assert ByteTokenizer().vocab_size == 259 and ByteTokenizer(vision=True).vocab_size == 262
  cfg = _vlm_cfg(("mla",))
  for field, value in (("prompt_loss_weight", -0.1), ("answer_loss_weight", 0.0),
                       ("question_weights", {"count": 1.0, "where": 0.0, "colour": 1.0}),
                       ("question_weights", {"count": 1.0, "where": 1.0})):
    vc = load_config("tiny_vlm").data.vision
    vc[field] = value
    with pytest.raises(ConfigError, match=f"data.vision.{field}"):
      from_dict(VisionDataConfig, vc, "data.vision").check_against(cfg.vision)


def test_engine_rejects_images_for_a_text_model():
  cfg = tiny_model_config(num_layers=1, layer_kinds=("mla",), moe={"first_dense_layers": 1})
  model = HybridLM(cfg, rngs=nnx.Rngs(0))
  engine = Engine(model, max_len=16)
  with pytest.raises(ValueError, match="without a vision tower"):
    engine.prefill(np.ones((1, 4), np.int32), images={"images": np.zeros((1, 1, 8, 8, 3))})


def test_vqa_report_and_quadrant_swap_run_on_an_untrained_model():
  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.evals import vqa
  cfg = _vlm_cfg(("mla",))
  engine = Engine(HybridLM(cfg, rngs=nnx.Rngs(4)), max_len=128, prefill_chunk=64)
  r = vqa.evaluate_vqa(engine, num_images=2, seed=5, sides=(32,), channels=3,
                       max_new_tokens=2)
  assert set(r["per_type"]) == set(images_lib.QUESTION_TYPES)
  assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["blank_image_accuracy"] <= 1.0
  assert set(r["quadrant_swap"]) == {"where", "colour"}
  for sw in r["quadrant_swap"].values():
    assert sw["scenes"] == 2 and 0.0 <= sw["answer_changed"] <= 1.0
  text = vqa.format_vqa(r)
  assert "swap top-left <-> bottom-right, where" in text and "colour (2 scenes)" in text
