"""The safetensors reader / writer: format bytes, dtypes, streaming, shards, holes, errors."""

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest

from hybridmoe_jax.io import safetensors as st
from tests._support import load_safetensors, save_safetensors


def _arrays():
  rng = np.random.default_rng(0)
  return {"a.f32": rng.normal(size=(3, 5)).astype(np.float32),
          "b.bf16": rng.normal(size=(4, 2, 3)).astype(ml_dtypes.bfloat16),
          "c.f16": rng.normal(size=(7,)).astype(np.float16),
          "d.i64": np.arange(6, dtype=np.int64).reshape(2, 3),
          "e.i32": np.array(-5, np.int32)}


def test_round_trip_and_byte_layout(tmp_path):
  path = tmp_path / "x.safetensors"
  arrays = _arrays()
  save_safetensors(path, arrays, metadata={"format": "pt"})
  raw = path.read_bytes()
  (n,) = struct.unpack("<Q", raw[:8])
  assert (8 + n) % 8 == 0                              # data region 8-byte aligned
  header = json.loads(raw[8:8 + n])
  assert header["__metadata__"] == {"format": "pt"}
  assert header["b.bf16"]["dtype"] == "BF16" and header["b.bf16"]["shape"] == [4, 2, 3]
  begin, end = header["a.f32"]["data_offsets"]
  np.testing.assert_array_equal(
      np.frombuffer(raw[8 + n + begin:8 + n + end], "<f4").reshape(3, 5), arrays["a.f32"])
  back = load_safetensors(path)
  for k, a in arrays.items():
    assert back[k].dtype == a.dtype and back[k].shape == a.shape
    assert back[k].tobytes() == a.tobytes()
  with st.SafetensorsFile(path) as f:
    np.testing.assert_array_equal(f.read_rows("b.bf16", 1, 3), arrays["b.bf16"][1:3])


def test_streamed_chunks_holes_and_refusals(tmp_path):
  path = tmp_path / "s.safetensors"
  big = st.Spec("z", "F32", (1024, 1024))               # 4 MiB of zeros -> a hole
  w = st.SafetensorsWriter(path, [st.Spec("x", "F32", (4, 3)), big])
  with pytest.raises(ValueError, match="got tensor 'z', expected 'x' next"):
    w.write("z", [])
  w.write("x", [np.ones((2, 3), np.float32), np.full((6,), 2, np.float32)])
  with pytest.raises(ValueError, match="declared F32 but a chunk has dtype float64"):
    w.write("z", [np.zeros(3)])
  w2 = st.SafetensorsWriter(tmp_path / "t.safetensors", [st.Spec("x", "F32", (4,))])
  with pytest.raises(ValueError, match="got 8 bytes, expected 16"):
    w2.write("x", [np.zeros(2, np.float32)])
  w2.abort()
  w = st.SafetensorsWriter(path, [st.Spec("x", "F32", (4, 3)), big])
  w.write("x", [np.ones((2, 3), np.float32), np.full((6,), 2, np.float32)])
  w.write("z", (np.zeros(2**18, np.float32) for _ in range(4)))
  w.close()
  assert not os.path.exists(str(path) + ".partial")
  assert os.stat(path).st_blocks * 512 < 2**20          # sparse: the zeros take no blocks
  with st.SafetensorsFile(path) as f:
    np.testing.assert_array_equal(f.read("x"), [[1] * 3] * 2 + [[2] * 3] * 2)
    assert not f.read("z").any()
  with pytest.raises(FileExistsError, match="refusing to overwrite"):
    st.SafetensorsWriter(path, [])


def test_sharded_directory(tmp_path):
  arrays = _arrays()
  specs = [st.Spec(k, st.dtype_code(a.dtype), a.shape) for k, a in arrays.items()]
  w = st.ShardedWriter(tmp_path, specs, max_shard_bytes=64)
  for k, a in arrays.items():
    w.write(k, [a])
  w.close()
  index = json.loads((tmp_path / st.INDEX_FILE).read_text())
  assert len(set(index["weight_map"].values())) == len(w.names) > 1
  with st.CheckpointReader(tmp_path) as r:
    assert set(r.tensors) == set(arrays)
    for k, a in arrays.items():
      assert r.read(k).tobytes() == a.tobytes()


def test_corrupt_files_are_named(tmp_path):
  bad = tmp_path / "bad.safetensors"
  bad.write_bytes(struct.pack("<Q", 10**6) + b"{}")
  with pytest.raises(st.SafetensorsError, match="bad.safetensors: header length 1000000"):
    st.SafetensorsFile(bad)
  head = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
  bad.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 8)   # data cut short
  with pytest.raises(st.SafetensorsError, match="tensor 'w' .* outside the 8-byte data region"):
    st.SafetensorsFile(bad)
  head = json.dumps({"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}).encode()
  bad.write_bytes(struct.pack("<Q", len(head)) + head + b"\0")
  with pytest.raises(st.SafetensorsError, match="dtype 'Q7'"):
    st.SafetensorsFile(bad)


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]},     # offsets not integers
    {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]},
    {"dtype": "F32", "shape": [-1, -1], "data_offsets": [0, 4]},    # negative sizes
    {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": "ab", "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]},      # JSON true is no size
    {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]},
])
def test_hostile_header_entries_are_named_safetensors_errors(tmp_path, entry):
  bad = tmp_path / "bad.safetensors"
  head = json.dumps({"w": entry}).encode()
  bad.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 8)
  with pytest.raises(st.SafetensorsError, match="bad.safetensors: tensor 'w' has a malformed"):
    st.SafetensorsFile(bad)


def test_overlapping_tensors_are_refused(tmp_path):
  bad = tmp_path / "bad.safetensors"
  head = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "v": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                     "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}}).encode()
  bad.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 8)
  with pytest.raises(st.SafetensorsError, match="tensors 'w' and 'v' overlap"):
    st.SafetensorsFile(bad)
