"""The training model's distribution at some positions, compressed for the sampling fits.

``sampling`` (the temperature and BOS fits) and ``truncation`` (which support a sampler kept) both read
the trainer's full-vocabulary log-probabilities through ``Reference``; it lives here, below both, so that
neither imports the other back. It imports nothing of logdiff.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np


@dataclass
class Reference:
    """The training model's distribution at some positions, compressed for the fits.

    Per row: the scored token's log-probability at T = 1 (``chosen``) and the
    vocabulary as ``(values, weights)``: the ``EXACT`` largest log-probabilities
    one by one, the rest in ``BINS`` equal-width bins, each held as its count and
    the log of its mean probability. The log-partition ``log sum_v w exp(v / T)``
    is then exact at T = 1 and close elsewhere, at [N, EXACT + BINS] instead of
    [N, vocab] (a 150k vocabulary costs the same as a 4k one). Each column also
    keeps the log-probability interval it covers (``intervals``), so a
    truncation that cuts inside a bin keeps its part of it (``truncation``).
    """

    chosen: np.ndarray  # [N]
    values: np.ndarray  # [N, M], descending within the exact part
    weights: np.ndarray  # [N, M]
    tops: np.ndarray | None = None  # [N, M] each column's largest log-probability (None: the values)
    widths: np.ndarray | None = None  # [N, M] the width of its interval (None: 0, one token per column)

    EXACT: ClassVar[int] = 128
    BINS: ClassVar[int] = 256

    @classmethod
    def of(cls, logprobs: np.ndarray, tokens: np.ndarray) -> Reference:
        """Compress [N, V] log-probabilities (T = 1) and their scored tokens."""
        lp = np.asarray(logprobs, np.float64)
        n = len(lp)
        chosen = lp[np.arange(n), np.asarray(tokens, np.int64)]
        ordered = -np.sort(-lp, axis=-1)
        exact, tail = ordered[:, : cls.EXACT], ordered[:, cls.EXACT :]
        if tail.shape[1] == 0:
            return cls(chosen, exact, np.ones_like(exact), exact, np.zeros_like(exact))
        hi, lo = tail[:, :1], tail[:, -1:]
        width = np.maximum(hi - lo, 1e-12) / cls.BINS
        idx = np.minimum(((hi - tail) / width).astype(np.int64), cls.BINS - 1) + cls.BINS * np.arange(n)[:, None]
        counts = np.bincount(idx.ravel(), minlength=n * cls.BINS).reshape(n, cls.BINS)
        mass = np.bincount(idx.ravel(), weights=np.exp(tail - hi).ravel(), minlength=n * cls.BINS).reshape(n, cls.BINS)
        with np.errstate(divide="ignore"):
            binned = np.where(counts > 0, hi + np.log(np.maximum(mass, 1e-300) / np.maximum(counts, 1)), -1e4)
        tops = hi - width * np.arange(cls.BINS)[None, :]  # bin b holds the log-probabilities in (top - width, top]
        widths = np.concatenate([np.zeros_like(exact), np.broadcast_to(width, tops.shape)], 1)
        return cls(chosen, np.concatenate([exact, binned], 1), np.concatenate([np.ones_like(exact), counts], 1),
                   np.concatenate([exact, tops], 1), widths)  # fmt: skip

    @classmethod
    def concat(cls, parts: Sequence[Reference]) -> Reference:
        fields = [np.concatenate([getattr(p, f) for p in parts]) for f in ("chosen", "values", "weights")]
        spans = [np.concatenate(x) for x in zip(*(p.intervals() for p in parts))] if parts else [None, None]
        return cls(*fields, *spans)

    def rows(self, keep: np.ndarray) -> Reference:
        tops, widths = self.intervals()
        return Reference(self.chosen[keep], self.values[keep], self.weights[keep], tops[keep], widths[keep])

    def intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """(largest log-probability, width) of each column's interval: ``[top - width, top]``."""
        if self.tops is None or self.widths is None:
            return self.values, np.zeros_like(self.values)
        return self.tops, self.widths

    def __len__(self) -> int:
        return len(self.chosen)

    def tempered(self, temperature: float) -> np.ndarray:
        """Each row's scored-token logprob under ``softmax(logits / T)``."""
        z = self.values / temperature
        top = z[:, 0]  # the largest log-probability sits first
        lse = top + np.log((self.weights * np.exp(z - top[:, None])).sum(-1))
        return self.chosen / temperature - lse
