"""Map the rows an engine computes back to (sequence, absolute position).

Every probe speaks one coordinate system: ``(sequence index, absolute token
position)``, where the sequence index is the position of the sequence in the
scan's list and the position counts prompt + response from 0. Engines lay
tokens out differently, so each forward pass gets a ``RowMap``: for every
token row of that pass (in the engine's own order), the sequence and position
it holds, and whether it is a real token (padding and foreign requests are not).

* **A padded batch** ``[B, L, H]`` (``padded_rows``: HF's full forward): row ``b * L + l``.
  The batch's sequence indices come from the engine (``Engine._begin_pass``), positions from
  ``position_ids``, and ``attention_mask`` marks padding (left or right).
* **A padded KV-cache decode step** ``[B, 1, H]``: the same function. Only the last ``L``
  columns of the (growing) attention mask belong to the step's tokens; rows
  fed after a sequence ended (the engine keeps decoding a pad token for rows
  whose response is shorter) have a position past the sequence and are dropped.
* **A packed batch** ``[num_tokens, H]`` (``packed_rows``: vLLM's): one flat batch that mixes
  prefill chunks and decode tokens of several requests. ``query_start_loc``
  (from the attention metadata in vLLM's forward context) splits it into one
  segment per request, in the order of the model runner's ``input_batch.req_ids``;
  ``positions`` (the model forward's argument) gives each row's absolute
  position, so chunked prefill needs no bookkeeping. **Request -> sequence:**
  ``LLM.generate`` names the i-th prompt of a call ``str(counter + i)`` and the
  engine core prefixes a random suffix (``"7-1a2b3c4d"``); the engine tells the
  probe the counter value before each call (``request_base``), so the sequence
  index is ``int(req_id.split("-")[0]) - request_base``. Ids outside the call
  map to no sequence.

Rows of a captured tensor are found by ``lead_dims``: the smallest number of
leading dimensions whose product is the pass's row count (``[B, L, H]`` -> 2,
``[B * L, E]`` -> 1, ``[T, heads, D]`` -> 1); the remaining dimensions flatten
into the row's width. Tensors in ``[B, heads, L, D]`` order are permuted first.
``view_rows`` finds which rows of a base tensor a view covers (HF log_softmax
is taken over slices of the logits tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class RowMap:
    """For each token row of one forward pass: sequence index, absolute position, validity."""

    seq: np.ndarray  # int64 [R]
    pos: np.ndarray  # int64 [R]
    valid: np.ndarray  # bool [R]

    def __len__(self) -> int:
        return len(self.seq)

    def take(self, rows: np.ndarray) -> RowMap:
        """The map of a subset of rows (e.g. the rows vLLM computes logits for)."""
        rows = np.asarray(rows, dtype=np.int64)
        return RowMap(self.seq[rows], self.pos[rows], self.valid[rows])

    @property
    def num_valid(self) -> int:
        return int(self.valid.sum())


def padded_rows(
    batch: Sequence[int],
    position_ids: Any,
    attention_mask: Any | None,
    lengths: Sequence[int],
) -> RowMap:
    """Row map of a padded forward over ``[B, L]`` tokens (full forward or a decode step).

    ``batch[b]`` is the scan's index of row ``b``; ``lengths[s]`` is sequence
    ``s``'s total length (prompt + response, or prompt + the response length to
    come while sampling).
    """
    pos = position_ids.detach().cpu().numpy().astype(np.int64)
    if pos.ndim == 1:
        pos = pos[None, :]
    b, length = pos.shape
    if len(batch) != b:
        raise ValueError(f"the forward has {b} rows but the engine announced {len(batch)} sequences")
    seq = np.repeat(np.asarray(batch, dtype=np.int64), length).reshape(b, length)
    if attention_mask is not None:
        valid = attention_mask[:, -length:].detach().cpu().numpy().astype(bool)
    else:
        valid = np.ones((b, length), dtype=bool)
    limit = np.asarray(lengths, dtype=np.int64)[seq]
    valid &= (pos >= 0) & (pos < limit)
    return RowMap(seq.reshape(-1), pos.reshape(-1), valid.reshape(-1))


def request_index(req_id: str, request_base: int, count: int) -> int:
    """The scan's sequence index of a serving engine's request id (``"<counter>-<suffix>"``), or -1 if it is
    not from this call."""
    head = str(req_id).split("-", 1)[0]
    if not head.isdigit():
        return -1
    i = int(head) - request_base
    return i if 0 <= i < count else -1


def packed_rows(
    positions: Any,
    query_start_loc: Any,
    req_ids: Sequence[str],
    sequences: Sequence[int],
    request_base: int,
    lengths: Sequence[int],
) -> RowMap:
    """Row map of one packed forward over a flattened ``[num_tokens]`` batch (request r's rows: ``qsl[r]:qsl[r + 1]``).

    ``sequences[i]`` is the scan's index of the i-th prompt of the current
    ``generate`` call (usually ``i``).
    """
    pos = positions.detach().cpu().numpy().astype(np.int64).reshape(-1)
    qsl = np.asarray(query_start_loc.detach().cpu().numpy() if hasattr(query_start_loc, "detach") else query_start_loc)
    qsl = qsl.astype(np.int64).reshape(-1)
    n = len(pos)
    seq = np.full(n, -1, dtype=np.int64)
    num_reqs = len(qsl) - 1
    for r in range(num_reqs):
        i = request_index(req_ids[r], request_base, len(sequences)) if r < len(req_ids) else -1
        if i >= 0:
            seq[qsl[r] : qsl[r + 1]] = sequences[i]
    valid = seq >= 0
    if valid.any():
        limit = np.zeros(n, dtype=np.int64)
        limit[valid] = np.asarray(lengths, dtype=np.int64)[seq[valid]]
        valid &= (pos >= 0) & (pos < limit)
    return RowMap(seq, pos, valid)


def lead_dims(shape: Sequence[int], rows: int) -> int:
    """The number of leading dims whose product is ``rows`` (the token dims)."""
    prod = 1
    for k, s in enumerate(shape):
        if prod == rows and k > 0:
            return k
        prod *= s
    if prod == rows:
        return len(shape)
    raise ValueError(f"cannot find {rows} token rows in a tensor of shape {tuple(shape)}")


@dataclass(frozen=True)
class Layout:
    """How a captured tensor holds token rows: an optional permute, then ``[rows, width]``."""

    perm: tuple[int, ...] | None = None  # e.g. (0, 2, 1, 3) for [B, heads, L, D]

    def to_rows(self, t: Any, rows: int) -> Any:
        """``[rows, width]`` view/copy of ``t``."""
        if self.perm is not None:
            t = t.permute(*self.perm)
        lead_dims(t.shape, rows)  # raises if the tensor does not hold these rows
        return t.reshape(rows, -1)

    def from_rows(self, r: Any, like: Any) -> Any:
        """Inverse of ``to_rows``: a tensor shaped like ``like`` holding rows ``r``."""
        if self.perm is None:
            return r.reshape(like.shape).to(like.dtype)
        permuted = like.permute(*self.perm).shape
        inv = tuple(int(i) for i in np.argsort(self.perm))
        return r.reshape(permuted).permute(*inv).to(like.dtype)


PLAIN = Layout()
HEADS_FIRST = Layout((0, 2, 1, 3))  # HF attention tensors [B, heads, L, D] -> [B, L, heads, D]


def view_rows(view: Any, base: Any) -> np.ndarray | None:
    """Which rows of ``base`` (``[..., V]`` flattened to rows of V) a 2-D view ``[n, V]`` covers.

    Returns None when ``view`` is not a row-strided view of ``base``'s storage.
    """
    if view.dim() != 2 or base.shape[-1] != view.shape[-1] or view.dtype != base.dtype:
        return None
    try:
        same = view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    except RuntimeError:
        return None
    if not same or view.stride(-1) != 1 or not base.is_contiguous():
        return None
    width = base.shape[-1]
    start = view.storage_offset() - base.storage_offset()
    step = view.stride(0)
    if start < 0 or start % width or step % width:
        return None
    rows = start // width + np.arange(view.shape[0], dtype=np.int64) * (step // width)
    if rows.size and rows[-1] >= base.numel() // width:
        return None
    return rows
