"""First-fit packing: rows of exactly seq_len, every token exactly once, resumable state."""

import json

import grain
import numpy as np
import pytest

from hybridmoe_jax.data import pack_documents, unpack_row

PAD = -7  # distinct from every token value below


def _docs(lengths):
  # Token value = 10_000 * doc + position, so any piece names its document and offset.
  return [10_000 * i + np.arange(n, dtype=np.int32) for i, n in enumerate(lengths)]


def _packed(docs, seq_len, bins, seed=0):
  ds = grain.MapDataset.source(docs).map(lambda t: {"tokens": t}).to_iter_dataset()
  return pack_documents(ds, seq_len=seq_len, pad_id=PAD, seed=seed, num_packing_bins=bins)


def _check_row(row, seq_len):
  """Segments are 1..k back to back, then padding; positions restart at each segment."""
  assert set(row) == {"tokens", "segment_ids", "positions"}
  for v in row.values():
    assert v.shape == (seq_len,) and v.dtype == np.int32
  seg, pos, tok = row["segment_ids"], row["positions"], row["tokens"]
  n_real = int((seg > 0).sum())
  assert n_real > 0 and (seg[n_real:] == 0).all()
  assert (tok[n_real:] == PAD).all() and (pos[n_real:] == 0).all()
  assert seg[0] == 1 and set(np.diff(seg[:n_real])) <= {0, 1}
  for s in range(1, seg.max() + 1):
    np.testing.assert_array_equal(pos[seg == s], np.arange((seg == s).sum()))


LENGTHS = [0, 1, 5, 16, 17, 40, 3, 33, 2, 64, 7, 15, 100, 1, 9]


@pytest.mark.parametrize("seq_len, bins", [(16, 1), (16, 4), (7, 3), (32, 16), (128, 2)])
def test_every_token_exactly_once(seq_len, bins):
  docs = _docs(LENGTHS)
  rows = list(_packed(docs, seq_len, bins))
  per_doc = {i: [] for i in range(len(docs))}
  for row in rows:
    _check_row(row, seq_len)
    for piece in unpack_row(row):
      assert 1 <= len(piece) <= seq_len
      doc = int(piece[0]) // 10_000
      np.testing.assert_array_equal(piece, piece[0] + np.arange(len(piece)))  # contiguous
      assert (piece // 10_000 == doc).all()
      per_doc[doc].append(piece)
  for i, doc in enumerate(docs):
    got = np.sort(np.concatenate(per_doc[i])) if per_doc[i] else np.zeros(0, np.int32)
    np.testing.assert_array_equal(got, doc)  # no token lost or duplicated
    # A document is cut only into full seq_len pieces plus one remainder.
    assert len(per_doc[i]) == -(-len(doc) // seq_len)
  n_tokens = sum(LENGTHS)
  assert len(rows) >= -(-n_tokens // seq_len)


def test_long_document_is_split_into_full_rows():
  rows = list(_packed(_docs([40]), seq_len=16, bins=4))
  pieces = sorted((p for r in rows for p in unpack_row(r)), key=lambda p: p[0])
  assert [len(p) for p in pieces] == [16, 16, 8]
  np.testing.assert_array_equal(np.concatenate(pieces), np.arange(40))


def test_short_documents_share_a_row():
  rows = list(_packed(_docs([3, 4, 5]), seq_len=16, bins=2))
  assert len(rows) == 1
  np.testing.assert_array_equal(rows[0]["segment_ids"], [1] * 3 + [2] * 4 + [3] * 5 + [0] * 4)
  np.testing.assert_array_equal(rows[0]["positions"][:7], [0, 1, 2, 0, 1, 2, 3])


@pytest.mark.parametrize("bins", [1, 3])
def test_restore_at_every_step(bins):
  docs = _docs(LENGTHS)
  want = list(_packed(docs, 16, bins))
  it = iter(_packed(docs, 16, bins))
  for k in range(len(want)):
    state = json.loads(json.dumps(it.get_state()))  # must survive a checkpoint file
    fresh = iter(_packed(docs, 16, bins))
    fresh.set_state(state)
    rest = list(fresh)
    assert len(rest) == len(want) - k
    for a, b in zip(rest, want[k:]):
      for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    next(it)
