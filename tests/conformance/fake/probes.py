"""The fake engine's ``EngineProbes``: one unpadded sequence per forward, every op a module."""

from __future__ import annotations

from typing import Any

from logdiff.probes import align
from logdiff.probes.align import RowMap
from logdiff.probes.correspondence import CorrespondenceMap, Tap


class FakeProbes:
    def __init__(self, engine: Any):
        self.engine = engine

    def taps(self, cmap: CorrespondenceMap) -> list[Tap]:
        return self.engine.tap_mapping.taps(cmap)

    def install(self, rec: Any) -> None:
        return None  # nothing runs outside the model's modules

    def begin_step(self, rec: Any, args: tuple, kwargs: dict) -> None:
        return None

    def rows(self, rec: Any, p: Any, args: tuple, kwargs: dict) -> RowMap:
        return align.padded_rows(p.sequences, kwargs["positions"], None, p.lengths)

    def step_kind(self, ids: Any) -> str:
        return "prefill"

    def end_step(self, rec: Any, output: Any) -> None:
        return None

    def after_module(self, rec: Any, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        return None

    def replay(self, rec: Any, name: str, module: Any, args: tuple, tap: Tap, value: Any) -> Any:
        return None

    def reset(self) -> None:
        return None
