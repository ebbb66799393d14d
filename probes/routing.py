"""MoE router logits per token on every path, and the expert ids a routing replay forces.

The analysis lives in ``logdiff/diagnosis/routing.py``; an engine forces its
routers itself (``Engine.forced_routing``: the HF engine's in
``logdiff/sources/hf/routing.py``).

* **Recording.** ``RouterSink`` is one more sink of the ``Recorder``: it keeps
  the router boundaries' rows (``kind == "router"`` in the correspondence map,
  vLLM's router linear and HF's TopKRouter logits alike) in memory as fp32,
  addressed by (sequence, position), the way ``store.PathStore`` addresses
  everything else. Router logits are ``num_experts`` wide, so keeping them for
  every layer costs little, and they outlive the probe session's temporary
  directory. Which experts a side chose is recomputed from its own logits
  with its own routing rule (``top_k``), so no engine internals beyond the
  router's output are needed.
* **Routing replay.** ``ForcedIds``: per layer, the expert ids another path
  chose for each (sequence, position), which an engine's ``forced_routing``
  makes its routers take.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from logdiff.probes.align import RowMap
from logdiff.probes.correspondence import CorrespondenceMap


@dataclass
class RouterLogits:
    """One router boundary's logits on one path: ``[num_sequences, max_len, num_experts]`` fp32."""

    boundary: str
    layer: int | None
    values: np.ndarray
    present: np.ndarray  # [num_sequences, max_len] bool: which rows the path computed
    dtype: str  # the engine's dtype of the logits (bfloat16, float32, ...)


@dataclass
class RouterSink:
    """Keeps one path's router rows (a ``Recorder`` sink; other boundaries are ignored)."""

    cmap: CorrespondenceMap
    num_sequences: int
    max_len: int
    logits: dict[str, RouterLogits] = field(default_factory=dict)
    wants_replay = False

    def emit(self, name: str, rows: Any, rmap: RowMap, replay: Any = None) -> None:
        b = self.cmap.get(name)
        if b is None or b.kind != "router":
            return
        idx = np.nonzero(rmap.valid & (rmap.pos < self.max_len))[0]
        if not len(idx):
            return
        values = rows[idx].float().cpu().numpy()
        rec = self.logits.get(name)
        if rec is None:
            dtype = str(rows.dtype).replace("torch.", "")
            shape = (self.num_sequences, self.max_len, values.shape[-1])
            rec = RouterLogits(name, b.layer, np.zeros(shape, np.float32), np.zeros(shape[:2], bool), dtype)
            self.logits[name] = rec
        rec.values[rmap.seq[idx], rmap.pos[idx]] = values
        rec.present[rmap.seq[idx], rmap.pos[idx]] = True


def router_boundaries(cmap: CorrespondenceMap) -> list[str]:
    """The correspondence map's router boundaries, in semantic order."""
    return [b.name for b in cmap.boundaries if b.kind == "router"]


@dataclass
class ForcedIds:
    """Expert ids to force per token: ``ids[layer]`` is ``[num_sequences, max_len, k]``, -1 where unknown."""

    ids: Mapping[int, np.ndarray]
    lengths: list[int]  # each sequence's total length (prompt + response)
