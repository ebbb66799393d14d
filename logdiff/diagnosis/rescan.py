"""Reruns of one scan with changed settings: the reference rerun and attribution's rescans.

A ``Rescanner`` is the one object that knows how to scan the same tokens again
(the pipeline passes ``pipeline.measure`` on the scan's own tokens: the pooled
engines are reused and only the primary pair is scored, so each costs one pass
of each side), and it remembers each configuration's result so that no
configuration is scanned twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from logdiff.config import ScanConfig
    from logdiff.result import ScanResult


class Rescanner:
    """Reruns of one scan with changed settings, for classification and attribution.

    ``measure(cfg)`` runs the paths of ``cfg`` and locates their divergence,
    without diagnosing it (the pipeline passes ``pipeline.measure`` on the
    scan's own tokens).
    """

    def __init__(self, measure: Callable[[ScanConfig], ScanResult]):
        self._measure = measure
        self._logdiffs: dict[tuple, float] = {}

    def rescan(self, cfg: ScanConfig) -> ScanResult:
        """The undiagnosed result of ``cfg``."""
        return self._measure(cfg)

    def logdiff(self, cfg: ScanConfig) -> float:
        """The primary pair's max |logprob difference| under ``cfg``, each configuration scanned once."""
        if self._key(cfg) not in self._logdiffs:
            self.remember(cfg, float(self._measure(cfg).primary.metrics["abs_diff_max"]))
        return self._logdiffs[self._key(cfg)]

    def remember(self, cfg: ScanConfig, logdiff: float) -> None:
        """Record ``cfg``'s logdiff, measured elsewhere (the scan being diagnosed)."""
        self._logdiffs[self._key(cfg)] = logdiff

    @staticmethod
    def _key(cfg: ScanConfig) -> tuple:
        return (cfg.consistent_kernels, cfg.consistent, cfg.infer_ckpt, tuple(sorted(cfg.train_set.items())),
                tuple(sorted(cfg.infer_set.items())))  # fmt: skip
