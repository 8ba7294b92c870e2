"""First-fit packing of tokenized documents into rows of exactly `seq_len` tokens.

Input elements: {"tokens": int32 [n]} with any n >= 0, one per document (with
`loss_weights=True` also {"loss_weights": float32 [n]}).
Output elements: {"tokens", "segment_ids", "positions"}, each int32 [seq_len]:
  segment_ids  1, 2, 3, ... per document piece within the row, 0 on padding;
  positions    0-based index inside that piece (0 exactly where a segment starts), 0 on padding;
  tokens       the document's ids, `pad_id` on padding;
  loss_weights (with loss_weights=True) float32 [seq_len]: each token's weight, cut and placed
               with its token, 0 on padding.

Two grain steps, both checkpointable (get_state/set_state restore to the exact element):
1. A flat map cuts each document into pieces of at most seq_len tokens. grain's packers never
   split an element (an element longer than a row would be an error), so without this long
   documents could not be packed; with it no token is dropped or duplicated. Piece j+1 of a
   document becomes a new segment (segment-local positions restart at 0) in a later row: the
   model resets its KDA state and attention mask at every segment start, so a piece never sees
   its predecessor and its positions must agree with that.
2. `grain.experimental.FirstFitPackIterDataset`: open `num_packing_bins` rows, put each piece
   into the first row with room, and when a piece fits nowhere emit all rows (shuffled with
   `seed`) and start over. More bins means less padding and more mixing of documents.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np

class _SplitIntoPieces(grain.experimental.FlatMapTransform):
  """{"tokens": [n]} -> ceil(n / seq_len) elements {"tokens": [<= seq_len]}, in order (with
  loss_weights, their "loss_weights" cut at the same places)."""

  def __init__(self, seq_len: int, loss_weights: bool = False):
    self.seq_len, self.loss_weights = seq_len, loss_weights
    # Only FlatMapMapDataset reads max_fan_out; the iterator version used here does not.
    self.max_fan_out = 1 << 30

  def flat_map(self, element) -> Sequence[dict[str, np.ndarray]]:
    tokens = np.asarray(element["tokens"], np.int32)
    if tokens.ndim != 1:
      raise ValueError(f"packing expects 1-D token arrays, got shape {tokens.shape}")
    cuts = range(0, len(tokens), self.seq_len)
    if not self.loss_weights:
      return [{"tokens": tokens[i:i + self.seq_len]} for i in cuts]
    weights = np.asarray(element["loss_weights"], np.float32)
    if weights.shape != tokens.shape:
      raise ValueError(f"packing: loss_weights shape {weights.shape} != tokens {tokens.shape}")
    return [{"tokens": tokens[i:i + self.seq_len], "loss_weights": weights[i:i + self.seq_len]}
            for i in cuts]


def _rename(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  out = {
      "tokens": row["tokens"],
      "segment_ids": row["tokens_segment_ids"],
      "positions": row["tokens_positions"],
  }
  if "loss_weights" in row:
    out["loss_weights"] = row["loss_weights"].astype(np.float32)
  return out


def pack_documents(ds: grain.IterDataset, *, seq_len: int, pad_id: int, seed: int,
                   num_packing_bins: int = 16, loss_weights: bool = False) -> grain.IterDataset:
  """Packs a stream of documents into fixed rows (see the module docstring).

  Args:
    ds: elements {"tokens": int32 [n]} (other keys are dropped).
    seq_len: row length T.
    pad_id: token id written into padding cells (not 0 for a byte tokenizer: byte 0 is real).
    seed: seeds the order in which a packed group of rows is emitted.
    num_packing_bins: rows filled at once.
    loss_weights: carry each element's "loss_weights" float32 [n] into the rows (0 on padding).

  Returns:
    IterDataset of {"tokens", "segment_ids", "positions"}: int32 [T] each (and
    "loss_weights" float32 [T] with loss_weights).
  """
  if seq_len < 1 or num_packing_bins < 1:
    raise ValueError(f"seq_len ({seq_len}) and num_packing_bins ({num_packing_bins}) must be "
                     ">= 1")
  pieces = grain.experimental.FlatMapIterDataset(ds, _SplitIntoPieces(seq_len, loss_weights))
  lengths, padding = {"tokens": seq_len}, {"tokens": pad_id}
  if loss_weights:
    lengths["loss_weights"], padding["loss_weights"] = seq_len, 0.0
  packed = grain.experimental.FirstFitPackIterDataset(
      pieces, length_struct=lengths, num_packing_bins=num_packing_bins, seed=seed,
      shuffle_bins=True, padding_struct=padding)
  return packed.map(_rename)


def unpack_row(row: dict[str, np.ndarray]) -> list[np.ndarray]:
  """Inverse of packing for one row: the token pieces in segment order.

  Args:
    row: {"tokens", "segment_ids"}: int [T].

  Returns:
    one int32 array per segment id 1, 2, ..., padding excluded.
  """
  seg = np.asarray(row["segment_ids"])
  tokens = np.asarray(row["tokens"], np.int32)
  return [tokens[seg == s] for s in range(1, int(seg.max(initial=0)) + 1)]
