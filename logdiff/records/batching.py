"""A trainer's batch rows as the sequences they hold: left and right padding, packed rows.

Frameworks batch sequences three ways, and a capture must record each sequence
as itself whatever the batching (``capture.py`` numbers them, ``feed.py`` pairs
them with the other side's by token ids):

* **right padding**: a row's real tokens first, pads after them. The pads are
  invalid rows (the attention mask's zeros), not part of the sequence.
* **left padding** (TRL): pads first. HF (transformers 5.x) with an attention
  mask and no ``position_ids`` feeds positions ``0..L-1`` to every row, so a
  left-padded row's real tokens sit at positions ``pad..L-1``: its RoPE sees
  positions shifted by the pad count, where vLLM starts the same tokens at 0.
  That shift is real (a ``position_ids`` framework difference), so it is kept,
  not hidden: the sequence's tokens are numbered from 0 (the coordinate every
  record uses, so the sequence pairs with the other side's by its ids) and the
  model position of its first token is its *offset*. A trainer that passes
  ``position_ids = attention_mask.cumsum(-1) - 1`` has offset 0.
* **packed rows** (verl's ``use_remove_padding``, HF's ``DataCollatorWithFlattening``):
  several sequences in one row, each starting where the positions restart
  (a position not above the one before it) or where ``cu_seqlens`` (indices into
  the flattened batch: ``cu_seq_lens_q`` in HF's flash-attention kwargs) starts a
  segment. Each segment is its own sequence; its offset is its first position
  (0 when the positions restart at 0).

A row's first segment with no pad before it keeps its positions as they are
(offset 0): a KV-cache step continues a sequence, its positions are absolute.

Pure numpy: no torch, so the rules are tested on their own (tests/test_capture_batching.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise

import numpy as np


@dataclass
class Split:
    """Each element of a flattened ``[B, L]`` batch as (sequence, position in the sequence), and each new
    sequence's offset (the model position its position 0 was fed at)."""

    seq: np.ndarray  # int64 [B * L]: the sequence id (``first`` + its index here), -1 for invalid elements
    pos: np.ndarray  # int64 [B * L]: the position within its sequence (the model's position where invalid)
    valid: np.ndarray  # bool [B * L]
    offsets: list[int]  # per new sequence, in order

    @property
    def count(self) -> int:
        return len(self.offsets)


def split_rows(positions: np.ndarray, valid: np.ndarray, first: int = 0, starts: Iterable[int] = ()) -> Split:
    """The sequences of a batch whose elements the model fed at ``positions`` ``[B, L]``, real where ``valid``;
    ``starts``: flat indices (``b * L + l``) where a packed segment begins (``cu_seqlens``); numbered from
    ``first``."""
    positions = np.asarray(positions, dtype=np.int64)
    valid = np.asarray(valid, dtype=bool)
    if positions.shape != valid.shape or positions.ndim != 2:
        raise ValueError(f"positions {positions.shape} and validity {valid.shape} must both be [batch, length]")
    batch, length = positions.shape
    seq = np.full(batch * length, -1, dtype=np.int64)
    pos = positions.reshape(-1).copy()
    starts = {int(s) for s in starts}
    offsets: list[int] = []
    for b in range(batch):
        idx = np.nonzero(valid[b])[0]
        if not len(idx):
            continue
        p = positions[b, idx]
        new = np.zeros(len(idx), dtype=bool)
        new[0] = True
        new[1:] = p[1:] <= p[:-1]  # the positions restart: a packed row's next sequence
        new |= np.asarray([b * length + int(i) in starts for i in idx], dtype=bool)
        bounds = [*np.nonzero(new)[0].tolist(), len(idx)]
        for k, (lo, hi) in enumerate(pairwise(bounds)):
            # a row's first segment with no pad before it continues a sequence (a KV-cache step): absolute positions
            offset = int(p[lo]) if k > 0 or idx[0] > 0 else 0
            flat = b * length + idx[lo:hi]
            seq[flat] = first + len(offsets)
            pos[flat] = p[lo:hi] - offset
            offsets.append(offset)
    return Split(seq, pos, valid.reshape(-1).copy(), offsets)


def segment_starts(cu_seqlens: Iterable[int] | None) -> list[int]:
    """The flat indices where packed segments begin, from ``cu_seqlens`` (``[0, n0, n0 + n1, ...]``)."""
    if cu_seqlens is None:
        return []
    return [int(s) for s in list(cu_seqlens)[:-1]]
