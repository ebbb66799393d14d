"""The rows an HF ``score`` computed, kept for ``full_logprobs`` of the same sequences (no second forward)."""

from __future__ import annotations

from typing import Any

import numpy as np

from logdiff.sources.base import TokenSequence


class ScoredRows:
    """The fp32 log-softmax rows one ``score`` computed at the response positions of its first sequences, kept
    (up to ``KEEP`` positions) so that ``full_logprobs`` of the same sequences needs no forward of its own."""

    KEEP = 256  # positions: the sampling fit's MAX_FIT_POSITIONS (at a 32k vocabulary, 32 MB)

    def __init__(self, tokens: list[tuple[int, ...]]):
        self.tokens = tokens
        self.rows: list[np.ndarray] = []
        self.positions = 0

    @classmethod
    def of(cls, seqs: list[TokenSequence]) -> ScoredRows:
        return cls([(*s.prompt_ids, -1, *s.response_ids) for s in seqs])

    def add(self, logprobs: Any) -> None:
        """The next sequence's ``[response_len, vocab]`` rows, while fewer than ``KEEP`` positions are kept."""
        if self.positions < self.KEEP:
            self.rows.append(logprobs.detach().float().numpy())
            self.positions += len(self.rows[-1])

    def rows_for(self, seqs: list[TokenSequence], limit: int) -> list[np.ndarray] | None:
        """The kept rows of ``seqs``' first sequences, covering ``limit`` positions as ``full_logprobs`` would;
        None unless these are the scored sequences and enough was kept."""
        if ScoredRows.of(seqs).tokens != self.tokens:
            return None
        out, total = [], 0
        for rows in self.rows:
            if total >= limit:
                return out
            out.append(rows)
            total += len(rows)
        return out if total >= limit or len(out) == len(seqs) else None
