"""Hostile image-text inputs: malformed JSONL lines and image files are skipped as
`ImageJsonlSource` documents (never a crash), and generated scenes too small for the digit
glyph are refused in one line."""

import json

import numpy as np
import pytest

from hybridmoe_jax.data import images as images_lib
from hybridmoe_jax.data.image_text_source import ImageJsonlSource


def test_malformed_lines_are_skipped_not_raised(tmp_path):
  images_lib.write_pnm(str(tmp_path / "ok.ppm"), np.zeros((16, 16, 3), np.uint8))
  good = json.dumps({"image": "ok.ppm", "text": "fine"})
  lines = [good,
           json.dumps({"images": ["ok.ppm", 3], "text": "a path that is a number"}),
           json.dumps({"image": None, "text": "a null path"}),
           '{"image": "ok.ppm", "text": "huge", "n": ' + "1" * 5000 + "}",   # ValueError
           "[" * 100_000,                                                     # RecursionError
           good]
  (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
  src = ImageJsonlSource([str(tmp_path / "d.jsonl")])
  assert len(src) == 2 and src.skipped == {"malformed line": 4}


def test_empty_npy_is_an_image_error(tmp_path):
  (tmp_path / "empty.npy").write_bytes(b"")
  with pytest.raises(images_lib.ImageError, match="empty.npy: unreadable .npy"):
    images_lib.read_image(str(tmp_path / "empty.npy"))
  (tmp_path / "d.jsonl").write_text(json.dumps({"image": "empty.npy", "text": "x"}) + "\n")
  assert ImageJsonlSource([str(tmp_path / "d.jsonl")])[0] == ("<image>\nx", None)


def test_scene_sides_too_small_for_the_glyph_are_refused():
  src = images_lib.SyntheticVQASource(4, seed=0, sides=(10,))   # 5-pixel cells: the glyph fits
  assert all(src[i][1][0].shape == (10, 10, 3) for i in range(4))
  with pytest.raises(ValueError, match=r"sides must be >= 10 pixels .* got \(8, 16\)"):
    images_lib.SyntheticVQASource(4, seed=0, sides=(8, 16))
