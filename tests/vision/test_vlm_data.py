"""Image-text data: answer-span loss weights, packing, synthetic scenes, readers, JSONL source
and the VLM pipeline (tower and model checks are in test_vision.py)."""

import dataclasses
import json

import numpy as np
import pytest

from hybridmoe_jax.config import ConfigError, from_dict
from hybridmoe_jax.data import images as images_lib
from hybridmoe_jax.data import multimodal
from hybridmoe_jax.data import vlm_pipeline
from hybridmoe_jax.data.image_text_source import ImageJsonlSource
from hybridmoe_jax.data.tokenizers.byte import IMAGE_END_ID, IMAGE_PAD_ID, IMAGE_START_ID
from hybridmoe_jax.config.run import DataConfig
from tests.conftest import load_config
from tests.vision.helpers import P, VIS, rand_img as _rand_img, vlm_cfg as _vlm_cfg


def test_answer_spans_weigh_the_prompt_down():
  proc = multimodal.Processor(VIS, prompt_loss_weight=0.25, answer_loss_weight=2.0)
  text = "Q: é?\n<image>\nA: 7\n"
  span = (text.index(" 7\n"), len(text))
  img = _rand_img(np.random.default_rng(12), 16, 8)
  doc = proc(text, [img], answer_spans=[span])
  plain = proc(text, [img])
  np.testing.assert_array_equal(doc.tokens, plain.tokens)
  w, toks = doc.weights, doc.tokens
  assert w.shape == toks.shape and w.dtype == np.float32
  img_pos = (toks == IMAGE_START_ID) | (toks == IMAGE_PAD_ID) | (toks == IMAGE_END_ID)
  np.testing.assert_array_equal(plain.weights, np.where(img_pos, 0.0, 1.0))  # no spans
  assert np.all(w[img_pos] == 0.0)
  n_ans = len(" 7\n".encode())
  np.testing.assert_array_equal(w[-1 - n_ans:-1], 2.0)       # the answer bytes
  assert w[-1] == 0.25                                          # EOS belongs to the prompt
  prompt = w[1:-1 - n_ans][~img_pos[1:-1 - n_ans]]
  assert prompt.size == len("Q: é?\n\nA:".encode()) and np.all(prompt == 0.25)  # é: 2 bytes
  with pytest.raises(ValueError, match="answer span"):
    proc(text, [img], answer_spans=[(3, len(text) + 1)])
  with pytest.raises(ConfigError, match="prompt_loss_weight"):
    multimodal.Processor(VIS, prompt_loss_weight=1.5)
  with pytest.raises(ConfigError, match=r"answer_loss_weight.*\(0, 100\]"):
    multimodal.Processor(VIS, answer_loss_weight=0.0)


def test_packed_loss_weights_follow_their_tokens():
  rng = np.random.default_rng(13)
  docs = []
  for i in range(12):
    text = "q" * int(rng.integers(1, 20)) + "<image>" + "a" * int(rng.integers(1, 9))
    docs.append((text, [_rand_img(rng, 8, 8)], ((text.index(">") + 1, len(text)),)))
    docs.append("plain text " * int(rng.integers(1, 4)))
  proc = multimodal.Processor(VIS, prompt_loss_weight=0.0)
  it = multimodal.VLMPackedIterator(docs, proc, seq_len=40, batch_size=2, drop_remainder=False)
  toks, wts = [], []
  for b in it:
    assert b["loss_weights"].dtype == np.float32
    assert np.all(b["loss_weights"][b["segment_ids"] == 0] == 0.0)   # padding
    live = b["segment_ids"] > 0
    toks.append(b["tokens"][live])
    wts.append(b["loss_weights"][live])
  ref = [proc(d) if isinstance(d, str) else proc(d[0], d[1], answer_spans=d[2]) for d in docs]
  np.testing.assert_array_equal(np.concatenate(toks), np.concatenate([d.tokens for d in ref]))
  np.testing.assert_array_equal(np.concatenate(wts), np.concatenate([d.weights for d in ref]))
  # Answers ("a" bytes) weigh 1, their questions 0, plain text 1.
  all_t, all_w = np.concatenate(toks), np.concatenate(wts)
  assert np.all(all_w[all_t == ord("a")] == 1.0) and np.all(all_w[all_t == ord("q")] == 0.0)
  assert np.all(all_w[all_t == ord("p")] == 1.0)


def _docs(n, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    k = int(rng.integers(0, 3))
    text = "".join("w" * int(rng.integers(1, 30)) + "<image>" for _ in range(k))
    text += "t" * int(rng.integers(0, 90))
    out.append((text, [_rand_img(rng, int(rng.choice([8, 16])), 16) for _ in range(k)]))
  return out


def test_packing_never_splits_an_image_and_keeps_every_token():
  docs = _docs(40)
  proc = multimodal.Processor(VIS)
  it = multimodal.VLMPackedIterator(docs, proc, seq_len=48, batch_size=4,
                                    drop_remainder=False)
  pieces = {}
  for batch in it:
    for r in range(4):
      toks, seg, idx = batch["tokens"][r], batch["segment_ids"][r], batch["image_index"][r]
      starts, ends = np.flatnonzero(toks == IMAGE_START_ID), np.flatnonzero(toks == IMAGE_END_ID)
      assert len(starts) == len(ends) <= VIS.max_images_per_row
      half = batch["images"].shape[2] // (2 * P)
      for m, (a, e) in enumerate(zip(starts, ends)):
        assert a < e and seg[a] == seg[e]
        h, w = batch["image_grid"][r, m]
        assert e - a - 1 == (h // 2) * (w // 2)       # every placeholder of the image is here
        assert np.all(idx[a + 1:e] // (half * half) == m)
      assert np.all((toks == IMAGE_PAD_ID) == (idx >= 0))
      for s in range(1, seg.max(initial=0) + 1):
        pieces.setdefault(len(pieces), toks[seg == s])
  got = np.concatenate(list(pieces.values()))
  want = np.concatenate([proc(t, i).tokens for t, i in docs])
  np.testing.assert_array_equal(got, want)  # nothing dropped, duplicated or reordered


def test_packer_state_resumes_exactly():
  docs = _docs(60, seed=1)
  mk = lambda: multimodal.VLMPackedIterator(docs, multimodal.Processor(VIS), seq_len=40,
                                            batch_size=2, drop_remainder=True)
  a = mk()
  next(a)
  state = a.get_state()
  want = next(a)
  b = mk()
  b.set_state(json.loads(json.dumps(state)))
  got = next(b)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k])


def test_batches_use_the_smallest_bucket():
  proc = multimodal.Processor(VIS)
  rng = np.random.default_rng(7)
  small = [("<image>q", [_rand_img(rng, 16, 8)])] * 3
  big = small + [("<image>q", [_rand_img(rng, 24, 16)])]
  for docs, side in ((small, 16), (big, 32)):
    b = next(multimodal.VLMPackedIterator(docs, proc, seq_len=64, batch_size=2,
                                          drop_remainder=False))
    assert b["images"].shape[2:4] == (side, side)


def test_synthetic_scenes_render_their_truth():
  src = images_lib.SyntheticVQASource(20, seed=3, sides=(16, 32))
  for i in range(20):
    truth = src.truth(i)
    img = images_lib.render_scene(truth)
    cell = truth.side // 2
    for k, (d, col) in enumerate(zip(truth.digits, truth.colours)):
      block = img[(k // 2) * cell:(k // 2 + 1) * cell, (k % 2) * cell:(k % 2 + 1) * cell]
      ink = block.any(-1)
      if d is None:
        assert not ink.any()
        continue
      ys, xs = np.nonzero(ink)
      crop = ink[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
      scale = images_lib.glyph_scale(cell)
      assert crop[::scale, ::scale].shape == (5, 3) or d in (1, 7)  # 1 / 7 lack a column
      assert set(map(tuple, block[ink])) == {images_lib.COLOURS[col]}
    text, imgs, *spans = src[i]
    n_qa = min(images_lib.QA_PER_DOC, len(images_lib.questions(truth)))
    assert text.count("<image>") == len(imgs) in (1, n_qa)
    assert all(np.array_equal(x, img) for x in imgs)
    asked = [(q, a) for _, q, a in images_lib.questions(truth) if f"Q: {q}\n" in text]
    assert len(asked) == (0 if text.startswith("<image>") else n_qa)
    for q, a in asked:
      assert images_lib.vqa_text(q, a) in text
    # Q/A documents mark exactly their answers " <a>\n", in order; captions mark nothing.
    answers = sorted(asked, key=lambda qa: text.index(f"Q: {qa[0]}\n"))
    assert [text[a:b] for a, b in (spans[0] if spans else ())] == [f" {a}\n" for _, a in answers]
    if len(imgs) == 1:
      assert images_lib.caption(truth) in text


def test_pnm_and_npy_roundtrip(tmp_path):
  img = _rand_img(np.random.default_rng(9), 8, 16)
  images_lib.write_pnm(str(tmp_path / "a.ppm"), img)
  np.testing.assert_array_equal(images_lib.read_image(str(tmp_path / "a.ppm")), img)
  images_lib.write_pnm(str(tmp_path / "g.pgm"), img[..., 0])
  np.testing.assert_array_equal(images_lib.read_image(str(tmp_path / "g.pgm")), img[..., :1])
  (tmp_path / "t.ppm").write_text("P3\n# comment\n2 1\n15\n15 0 0  0 15 0\n")
  np.testing.assert_array_equal(images_lib.read_image(str(tmp_path / "t.ppm")),
                                [[[255, 0, 0], [0, 255, 0]]])
  np.save(tmp_path / "n.npy", img)
  np.testing.assert_array_equal(images_lib.read_image(str(tmp_path / "n.npy")), img)
  (tmp_path / "bad.ppm").write_bytes(b"P6\n4 4\n255\n\x00\x01")
  with pytest.raises(images_lib.ImageError, match="truncated"):
    images_lib.read_image(str(tmp_path / "bad.ppm"))


def test_jsonl_source_counts_and_skips_missing_and_corrupt_images(tmp_path):
  img = _rand_img(np.random.default_rng(10), 16, 16)
  images_lib.write_pnm(str(tmp_path / "ok.ppm"), img)
  (tmp_path / "corrupt.ppm").write_bytes(b"P6\n16 16\n255\nxx")
  lines = [{"image": "ok.ppm", "text": "good <image> one"},
           {"image": "missing.ppm", "text": "gone"},
           {"image": "corrupt.ppm", "text": "broken"},
           "not json",
           {"images": ["ok.ppm"], "text": "no marker"}]
  (tmp_path / "d.jsonl").write_text("\n".join(l if isinstance(l, str) else json.dumps(l)
                                              for l in lines))
  src = ImageJsonlSource([str(tmp_path / "d.jsonl")])
  assert len(src) == 3
  assert src.skipped == {"missing image file": 1, "malformed line": 1}
  assert all(len(src[i]) == 2 for i in range(3))   # no answer_spans: full loss everywhere
  assert src[2][0].startswith("<image>") and src[1][1] is None
  it = multimodal.VLMPackedIterator(src, multimodal.Processor(VIS), seq_len=64,
                                    batch_size=1, drop_remainder=False)
  rows = list(it)                                # the corrupt image is skipped, no crash
  assert len(rows) == 1 and sum(it.skipped.values()) == 1
  assert int((rows[0]["image_grid"][0, :, 0] > 0).sum()) == 2


def test_jsonl_answer_spans_shift_with_prepended_markers(tmp_path):
  images_lib.write_pnm(str(tmp_path / "a.ppm"), _rand_img(np.random.default_rng(15), 16, 16))
  lines = [{"image": "a.ppm", "text": "what? 4", "answer_spans": [[5, 7]]},
           {"image": "a.ppm", "text": "<image> what? 4", "answer_spans": [[13, 15]]},
           {"image": "a.ppm", "text": "bad", "answer_spans": [[2, 9]]},
           {"image": "a.ppm", "text": "bad", "answer_spans": "x"}]
  (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(l) for l in lines))
  src = ImageJsonlSource([str(tmp_path)])
  assert len(src) == 2 and src.skipped == {"malformed line": 2}
  for i in range(2):
    text, _, spans = src[i]
    assert [text[a:b] for a, b in spans] == [" 4"]


def test_vlm_pipeline_from_jsonl_and_config_checks(tmp_path):
  cfg = _vlm_cfg(("mla",))
  rng = np.random.default_rng(11)
  lines = []
  for i in range(8):
    images_lib.write_pnm(str(tmp_path / f"{i}.ppm"), _rand_img(rng, 16, 16))
    lines.append({"image": f"{i}.ppm", "text": f"picture {i}"})
  lines.append({"image": "nope.ppm", "text": "missing"})
  (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(l) for l in lines))
  data = load_config("tiny_vlm").data
  data.vision.source, data.vision.paths, data.vision.share = "jsonl", (str(tmp_path),), 1.0
  data.heldout_fraction = 0.25
  data = from_dict(DataConfig, data, "data")
  out = vlm_pipeline.build_vlm_train_and_eval(data, cfg.vision, vocab_size=cfg.vocab_size,
                                            seq_len=32, batch_size=2, seed=0)
  assert len(out.train_source) == 6 and len(out.heldout_source) == 2
  batch = next(out.train)
  assert batch["images"].shape == (2, cfg.vision.max_images_per_row, 16, 16, 3) and (batch["image_index"] >= 0).sum() >= 2
  with pytest.raises(ConfigError, match="data.vision.share"):
    dataclasses.replace(data.vision, share=0.0)
  data = dataclasses.replace(data, vision=dataclasses.replace(data.vision, sides=(12,)))
  with pytest.raises(ConfigError, match="data.vision.sides"):
    vlm_pipeline.build_vlm_train_and_eval(data, cfg.vision, vocab_size=cfg.vocab_size,
                                        seq_len=32, batch_size=2, seed=0)
