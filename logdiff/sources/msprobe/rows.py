"""The row table a dump does not write: each row's token id, position and sequence, rebuilt per engine.

* HF: tensors are ``[B, L, ...]``. Token ids are the embedding's input; a row is real where the 4-D attention
  mask the decoder layer got lets some query attend its key column (no mask: no padding); positions are the
  layer's ``position_ids`` kwarg; the sequence is the batch row.
* vLLM: tensors are the flat batch ``[T, ...]``. Rows split into segments where the position restarts at 0
  (a new request's prefill) or does not follow the previous row (another request); a forward with as many
  logits rows as rows is all decode, one row per segment. A segment at position 0 opens a sequence; one at
  position p > 0 continues an open sequence whose next position is p: the one whose last logits' argmax is
  the segment's first token first (a greedy sample), then the one seen earliest (vLLM's persistent batch
  order). A segment no sequence continues is counted and left out, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


def hf_rows(ids: Any, mask: Any, position_ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token ids, positions, valid) of an HF forward's ``[B, L]`` rows, flattened batch-major."""
    import torch

    B, L = ids.shape
    if mask is None:
        valid = torch.ones(B, L, dtype=torch.bool)
    elif mask.dtype == torch.bool:  # sdpa: [B, 1, Lq, Lk]; a key column no query attends is padding
        valid = mask[:, 0].any(dim=1)
    else:  # eager: additive float mask, finfo.min where masked
        valid = (mask[:, 0] > torch.finfo(mask.dtype).min / 2).any(dim=1)
    pos = position_ids.expand(B, L) if position_ids is not None else torch.arange(L).expand(B, L)
    return (ids.reshape(-1).long().numpy(), pos.reshape(-1).long().numpy(), valid.reshape(-1).numpy())


def segments(positions: np.ndarray, logits_rows: int | None) -> list[tuple[int, int]]:
    """A vLLM forward's rows as ``(start, end)`` runs, each one request's rows."""
    T = len(positions)
    if logits_rows == T:
        return [(i, i + 1) for i in range(T)]
    cuts = [0] + [i for i in range(1, T) if positions[i] == 0 or positions[i] != positions[i - 1] + 1] + [T]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


@dataclass
class VllmSequences:
    """The requests a vLLM dump's forwards fed, numbered in the order their prefills appeared."""

    next_pos: dict[int, int] = field(default_factory=dict)  # open sequence -> the position it feeds next
    predicted: dict[int, int] = field(default_factory=dict)  # sequence -> argmax of its last logits row
    prompt_lens: dict[int, int] = field(default_factory=dict)
    unmatched_rows: int = 0

    def assign(self, tokens: np.ndarray, positions: np.ndarray, runs: list[tuple[int, int]]) -> np.ndarray:
        """Each row's sequence id (-1: no open sequence continues it, counted in ``unmatched_rows``)."""
        seq = np.full(len(tokens), -1, dtype=np.int64)
        taken: set[int] = set()
        for a, b in runs:
            p = int(positions[a])
            if p == 0:
                s = len(self.next_pos)
                self.prompt_lens[s] = b - a
            else:
                open_ = [s for s, n in self.next_pos.items() if n == p and s not in taken]
                if not open_:
                    self.unmatched_rows += b - a
                    continue
                s = min(open_, key=lambda s: (self.predicted.get(s) != int(tokens[a]), s))
                if b - a > 1 and self.prompt_lens.get(s) == p:  # a prefill's later chunk
                    self.prompt_lens[s] = p + b - a
            taken.add(s)
            seq[a:b] = s
            self.next_pos[s] = int(positions[b - 1]) + 1
        return seq
