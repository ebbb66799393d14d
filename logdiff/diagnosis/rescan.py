"""Reruns of one scan with changed settings: the reference rerun and attribution's rescans.

A ``Rescanner`` is the one object that knows how to scan the same tokens again
(the pipeline passes ``pipeline.measure`` on the scan's own tokens: the pooled
engines are reused and only the primary pair is scored, ``primary_path_only``,
so each costs one pass of each side), and it remembers each configuration's
metrics (the primary pair's metrics dict, ``compare.token_metrics``) so that no
configuration is scanned twice: the reference rerun, attribution's subsets of
levers and the scan being diagnosed itself (``remember``) share one cache.

``patched``: where the scan asked for ``--attribution patched``, the game that
measures attribution's sets of levers without rescans
(``attribute_patched.PatchedGame``), which ``attribute`` takes from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from logdiff.comparison.result import ScanResult
    from logdiff.diagnosis.settings import RunSettings


class Rescanner:
    """Reruns of one scan with changed settings, for classification and attribution.

    ``measure(cfg)`` runs the paths of ``cfg`` and locates their divergence,
    without diagnosing it (the pipeline passes ``pipeline.measure`` on the
    scan's own tokens).
    """

    def __init__(self, measure: Callable[[RunSettings], ScanResult], patched: Any = None):
        self._measure = measure
        self._metrics: dict[tuple, dict[str, Any]] = {}
        self.patched = patched  # attribute_patched.PatchedGame, or None: attribution rescans

    def rescan(self, cfg: RunSettings) -> ScanResult:
        """The undiagnosed result of ``cfg`` (not cached: its depth may differ)."""
        return self._measure(cfg)

    def metrics(self, cfg: RunSettings) -> dict[str, Any]:
        """The primary pair's metrics under ``cfg``, each configuration scanned once."""
        if not self.knows(cfg):
            self.remember(cfg, self._measure(cfg).primary.metrics)
        return self._metrics[self._key(cfg)]

    def logdiff(self, cfg: RunSettings) -> float:
        """The primary pair's max |logprob difference| under ``cfg`` (``metrics``' ``abs_diff_max``)."""
        return float(self.metrics(cfg)["abs_diff_max"])

    def knows(self, cfg: RunSettings) -> bool:
        """Whether ``cfg``'s metrics are known already (``metrics`` would not rescan)."""
        return self._key(cfg) in self._metrics

    def remember(self, cfg: RunSettings, metrics: dict[str, Any]) -> None:
        """Record ``cfg``'s metrics, measured elsewhere (the scan being diagnosed)."""
        self._metrics[self._key(cfg)] = dict(metrics)

    @staticmethod
    def _key(cfg: RunSettings) -> tuple:
        """The configuration's key; a structured ``--set`` value (``rope_parameters``, a dict) keys by its items."""
        from logdiff.sources.base import hashable

        return (hashable(cfg.consistent_kernels), cfg.consistent, cfg.infer_ckpt, hashable(cfg.train_set),
                hashable(cfg.infer_set))  # fmt: skip
