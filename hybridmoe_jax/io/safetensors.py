"""The safetensors file format, read and written one tensor at a time (numpy + json only).

Layout of a file: an 8-byte little-endian unsigned header length n, n bytes of JSON
{name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {str:
str}}, then the data region: each tensor's C-order little-endian bytes at [begin, end)
relative to the region's start. A checkpoint too large for one file is split into shards
plus `model.safetensors.index.json` ({"metadata": .., "weight_map": {name: shard file}}).

Reading never loads a whole file: `SafetensorsFile.read` seeks to one tensor and reads it
into a fresh array (`readinto`, no mmap, so the host memory of a conversion is what it holds
in arrays). Writing declares every tensor's name, dtype and shape up front (the header comes
first) and then takes each tensor's bytes as a stream of chunks, so a tensor may be produced
piece by piece; chunks that are all zeros are skipped with a seek (a hole in a sparse file).
Files are written under a temporary name and renamed when complete.

BF16 arrays use `ml_dtypes.bfloat16` (numpy has no bfloat16; ml_dtypes ships with jax).
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Iterable, NamedTuple, Sequence

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
# safetensors code <-> numpy dtype (little-endian).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_CODES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20      # the format's own limit on the JSON header
_ALIGN = 8                     # data region starts 8-byte aligned (header padded with spaces)


class SafetensorsError(ValueError):
  """A file or index that is not valid safetensors (the message names the file)."""


def dtype_code(dtype) -> str:
  """numpy dtype -> safetensors code ("F32", "BF16", ...); ValueError if unsupported."""
  dt = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
  if dt not in _CODES:
    raise ValueError(f"dtype {dt} has no safetensors code: allowed {sorted(DTYPES)}")
  return _CODES[dt]


class TensorInfo(NamedTuple):
  """Where one tensor lives: file, dtype code, shape and absolute byte range [begin, end)."""

  name: str
  dtype: str
  shape: tuple[int, ...]
  file: str
  begin: int
  end: int

  @property
  def np_dtype(self) -> np.dtype:
    return DTYPES[self.dtype]


class SafetensorsFile:
  """One .safetensors file: its header parsed and checked, tensors read on demand."""

  def __init__(self, path: str):
    self.path = str(path)
    self._f = open(self.path, "rb")
    try:
      self.tensors, self.metadata = self._parse()
    except Exception:
      self._f.close()
      raise

  def _parse(self) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    size = os.fstat(self._f.fileno()).st_size
    raw = self._f.read(8)
    if len(raw) < 8:
      raise SafetensorsError(f"{self.path}: {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > min(_MAX_HEADER, size - 8):
      raise SafetensorsError(f"{self.path}: header length {n} exceeds the file ({size} bytes) "
                             f"or the {_MAX_HEADER}-byte limit: not a safetensors file")
    try:
      header = json.loads(self._f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
      raise SafetensorsError(f"{self.path}: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
      raise SafetensorsError(f"{self.path}: the header is a JSON {type(header).__name__}")
    metadata = header.pop("__metadata__", None) or {}
    base, tensors = 8 + n, {}
    for name, entry in header.items():
      try:
        code, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
      except (KeyError, TypeError, ValueError):
        raise SafetensorsError(f"{self.path}: tensor {name!r} has a malformed entry "
                               f"{entry!r}") from None
      # Sizes and offsets are non-negative integers (JSON true is a Python int: not one).
      if not isinstance(code, str) or not all(
          isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape + (begin, end)):
        raise SafetensorsError(f"{self.path}: tensor {name!r} has a malformed entry "
                               f"{entry!r}: dtype a string, shape and data_offsets "
                               "non-negative integers")
      if code not in DTYPES:
        raise SafetensorsError(f"{self.path}: tensor {name!r} has dtype {code!r}: allowed "
                               f"{sorted(DTYPES)}")
      want = math.prod(shape) * DTYPES[code].itemsize
      if not 0 <= begin <= end or end - begin != want or base + end > size:
        raise SafetensorsError(f"{self.path}: tensor {name!r} ({code} {list(shape)}, {want} "
                               f"bytes) has offsets [{begin}, {end}) outside the "
                               f"{size - base}-byte data region or of the wrong length")
      tensors[name] = TensorInfo(name, code, shape, self.path, base + begin, base + end)
    # No two tensors share bytes (a tensor would read another's values).
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
      if begin_b < end_a:
        raise SafetensorsError(f"{self.path}: tensors {a!r} and {b!r} overlap in the data "
                               "region: not a safetensors file")
    return tensors, metadata

  def info(self, name: str) -> TensorInfo:
    return self.tensors[name]

  def read(self, name: str) -> np.ndarray:
    """The whole tensor `name` as a fresh numpy array (its stored dtype and shape)."""
    info = self.tensors[name]
    return self.read_rows(name, 0, info.shape[0]) if info.shape else self._read(info, 0, 1, ())

  def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of the leading axis of tensor `name` (rank >= 1)."""
    info = self.tensors[name]
    if not info.shape or not 0 <= start <= stop <= info.shape[0]:
      raise IndexError(f"{self.path}: rows [{start}, {stop}) of {name!r} {list(info.shape)}")
    row = math.prod(info.shape[1:])
    return self._read(info, start * row, stop * row, (stop - start,) + info.shape[1:])

  def _read(self, info: TensorInfo, first: int, last: int, shape) -> np.ndarray:
    out = np.empty(shape, info.np_dtype)
    buf = memoryview(out.reshape(-1).view(np.uint8))
    self._f.seek(info.begin + first * info.np_dtype.itemsize)
    got = 0
    while got < len(buf):
      n = self._f.readinto(buf[got:])
      if not n:
        raise SafetensorsError(f"{self.path}: unexpected end of file in {info.name!r}")
      got += n
    return out

  def close(self) -> None:
    self._f.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class CheckpointReader:
  """All tensors of a directory: a sharded checkpoint (index json), or its .safetensors
  files, or a single file. `tensors`: name -> TensorInfo across the files."""

  def __init__(self, path: str):
    path = str(path)
    if os.path.isfile(path):
      files = [path]
    elif os.path.isfile(os.path.join(path, INDEX_FILE)):
      index_path = os.path.join(path, INDEX_FILE)
      try:
        with open(index_path, encoding="utf-8") as f:
          weight_map = json.load(f)["weight_map"]
        files = sorted({os.path.join(path, v) for v in weight_map.values()})
      except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SafetensorsError(f"{index_path}: not a safetensors index ({e!r})") from None
      missing = [f for f in files if not os.path.isfile(f)]
      if missing:
        raise SafetensorsError(f"{index_path} names shard(s) that do not exist: {missing}")
    elif os.path.isdir(path):
      files = sorted(os.path.join(path, n) for n in os.listdir(path)
                     if n.endswith(".safetensors"))
      if not files:
        raise SafetensorsError(f"{path} holds no .safetensors file")
    else:
      raise FileNotFoundError(f"{path}: no such file or directory")
    self.files = {f: SafetensorsFile(f) for f in files}
    self.tensors: dict[str, TensorInfo] = {}
    for sf in self.files.values():
      for name, info in sf.tensors.items():
        if name in self.tensors:
          raise SafetensorsError(f"tensor {name!r} is stored twice: in {self.tensors[name].file}"
                                 f" and {info.file}")
        self.tensors[name] = info

  def info(self, name: str) -> TensorInfo:
    return self.tensors[name]

  def read(self, name: str) -> np.ndarray:
    return self.files[self.tensors[name].file].read(name)

  def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
    return self.files[self.tensors[name].file].read_rows(name, start, stop)

  def close(self) -> None:
    for sf in self.files.values():
      sf.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class Spec(NamedTuple):
  """A tensor to write: name, dtype code and shape."""

  name: str
  dtype: str
  shape: tuple[int, ...]

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def _header(specs: Sequence[Spec], metadata: dict[str, str] | None) -> bytes:
  header: dict = {"__metadata__": dict(metadata)} if metadata else {}
  offset = 0
  for s in specs:
    header[s.name] = {"dtype": s.dtype, "shape": list(s.shape),
                      "data_offsets": [offset, offset + s.nbytes]}
    offset += s.nbytes
  text = json.dumps(header, separators=(",", ":")).encode("utf-8")
  text += b" " * (-(8 + len(text)) % _ALIGN)
  return struct.pack("<Q", len(text)) + text


class SafetensorsWriter:
  """Writes one file whose tensors (names, dtypes, shapes) are declared up front, in order.

  `write(name, chunks)` takes the next declared tensor as an iterable of arrays whose bytes,
  concatenated, are the tensor in C order (any chunk shapes; each is cast to the declared
  dtype only if it already has it: a mismatch is an error, never a silent conversion).
  `close()` checks every tensor was written and renames `<path>.partial` to `path`.
  sparse: all-zero chunks become holes (seek) instead of written zeros.
  """

  def __init__(self, path: str, specs: Sequence[Spec], *, metadata: dict[str, str] | None = None,
               sparse: bool = True):
    self.path = str(path)
    if os.path.exists(self.path):
      raise FileExistsError(f"{self.path} exists; refusing to overwrite it")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
      raise ValueError(f"{self.path}: duplicate tensor names in {names}")
    self.specs = list(specs)
    self.sparse = sparse
    self._next = 0
    self._tmp = self.path + ".partial"
    self._f = open(self._tmp, "wb")
    head = _header(self.specs, metadata)
    self._f.write(head)
    self.size = len(head) + sum(s.nbytes for s in self.specs)

  def write(self, name: str, chunks: Iterable[np.ndarray]) -> None:
    """Append tensor `name` (the next declared one) from its chunks."""
    if self._next >= len(self.specs) or self.specs[self._next].name != name:
      want = self.specs[self._next].name if self._next < len(self.specs) else "nothing"
      raise ValueError(f"{self.path}: got tensor {name!r}, expected {want!r} next")
    spec = self.specs[self._next]
    want_dtype, done = DTYPES[spec.dtype], 0
    for chunk in chunks:
      chunk = np.asarray(chunk)
      if chunk.dtype != want_dtype:
        raise ValueError(f"{self.path}: tensor {name!r} is declared {spec.dtype} but a chunk "
                         f"has dtype {chunk.dtype}")
      raw = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
      done += raw.size
      if done > spec.nbytes:
        raise ValueError(f"{self.path}: tensor {name!r} got more than its {spec.nbytes} bytes "
                         f"({spec.dtype} {list(spec.shape)})")
      if self.sparse and not raw.any():
        self._f.seek(raw.size, os.SEEK_CUR)
      else:
        self._f.write(memoryview(raw))
      # Drop this chunk before the producer makes the next: one chunk alive at a time.
      del chunk, raw
    if done != spec.nbytes:
      raise ValueError(f"{self.path}: tensor {name!r} got {done} bytes, expected {spec.nbytes} "
                       f"({spec.dtype} {list(spec.shape)})")
    self._next += 1

  def close(self) -> None:
    """Finish the file (the size fixed even if it ends in a hole) and move it in place."""
    if self._next != len(self.specs):
      left = [s.name for s in self.specs[self._next:]]
      self.abort()
      raise ValueError(f"{self.path}: {len(left)} declared tensor(s) never written: {left[:5]}")
    self._f.truncate(self.size)
    self._f.close()
    os.replace(self._tmp, self.path)

  def abort(self) -> None:
    """Drop the unfinished file."""
    if not self._f.closed:
      self._f.close()
    if os.path.exists(self._tmp):
      os.remove(self._tmp)


def shard_specs(specs: Sequence[Spec], max_shard_bytes: int) -> list[list[Spec]]:
  """Split `specs` (in order) into consecutive shards of at most max_shard_bytes each (a
  tensor larger than that gets a shard of its own)."""
  shards: list[list[Spec]] = [[]]
  size = 0
  for s in specs:
    if shards[-1] and size + s.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(s)
    size += s.nbytes
  return shards


class ShardedWriter:
  """Writes `specs` (in order) into `directory` as one file `<prefix>.safetensors`, or, past
  max_shard_bytes, as `<prefix>-0000i-of-0000n.safetensors` shards plus the index json."""

  def __init__(self, directory: str, specs: Sequence[Spec], *, prefix: str = "model",
               max_shard_bytes: int = 5 * 2**30, metadata: dict[str, str] | None = None,
               sparse: bool = True):
    self.directory = str(directory)
    shards = shard_specs(specs, max_shard_bytes)
    n = len(shards)
    self.names = ([f"{prefix}.safetensors"] if n == 1 else
                  [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    self._shards = shards
    self._metadata, self._sparse = metadata, sparse
    self._where = {s.name: i for i, shard in enumerate(shards) for s in shard}
    self._current: tuple[int, SafetensorsWriter] | None = None
    self.total_bytes = sum(s.nbytes for s in specs)

  def write(self, name: str, chunks: Iterable[np.ndarray]) -> None:
    i = self._where[name]
    if self._current is None or self._current[0] != i:
      if self._current is not None:
        self._current[1].close()
      self._current = (i, SafetensorsWriter(os.path.join(self.directory, self.names[i]),
                                            self._shards[i], metadata=self._metadata,
                                            sparse=self._sparse))
    self._current[1].write(name, chunks)

  def close(self) -> None:
    if self._current is not None:
      self._current[1].close()
    if len(self.names) > 1:
      index = {"metadata": {"total_size": self.total_bytes},
               "weight_map": {name: self.names[i] for name, i in self._where.items()}}
      with open(os.path.join(self.directory, INDEX_FILE), "x", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)

  def abort(self) -> None:
    if self._current is not None:
      self._current[1].abort()
