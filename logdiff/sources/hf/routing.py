"""The HF engine's routing replay: its routers take the expert ids another path chose.

``forced_routing`` patches every HF router (through the adapter's ``router``)
so that each token takes the expert ids in ``ForcedIds``; the router weights
are recomputed as normal (fp32 softmax of the HF path's own logits at the
forced ids, renormalized when the router does, times the router's
``routed_scaling_factor`` where it has one (DeepSeek-V2); for a sigmoid grouped
router, the adapter's ``routing_rule_of``: the sigmoid scores there,
renormalized, times the routed scaling). Which token a router row belongs to
comes from ``align.padded_rows`` and the engine's ``_begin_pass``
announcements, as in the recorder. Tokens the other path has no ids for keep
their own routing, and so does every token when the two paths route to a
different number of experts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from logdiff.probes import align
from logdiff.probes.align import RowMap
from logdiff.probes.patching import Patches
from logdiff.probes.routing import ForcedIds


class _Passes:
    """Stands in for the recorder as the engine's ``listener``: tracks rows -> (sequence, position)."""

    def __init__(self, lengths: list[int]):
        self.lengths = lengths
        self.batch: list[int] | None = None
        self.rmap: RowMap | None = None

    def begin_pass(self, path: str, sequences: list[int], request_base: int | None = None) -> None:
        self.batch = list(sequences)

    def on_forward(self, _module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.batch is None or ids is None:
            self.rmap = None
            return
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        self.rmap = align.padded_rows(self.batch, pos, kwargs.get("attention_mask"), self.lengths)


@contextlib.contextmanager
def forced_routing(engine: Any, forced: ForcedIds) -> Iterator[dict[str, int]]:
    """Inside the block, the HF ``engine``'s routers take ``forced`` expert ids (weights recomputed).

    Yields counters: ``tokens`` routed and ``forced`` (tokens whose ids were replaced).
    """
    from logdiff.probes.arch import adapter_of

    model = engine.module()
    arch = adapter_of(model)
    passes = _Passes(forced.lengths)
    counts = {"tokens": 0, "forced": 0}
    with Patches() as patches:
        handle = model.register_forward_pre_hook(passes.on_forward, with_kwargs=True)
        patches.on_exit(handle.remove)
        patches.set(engine, "listener", passes)
        for n, layer in enumerate(arch.layers(model)):
            router = arch.router(layer)
            if router is not None and n in forced.ids:
                renormalize = arch.router_renormalizes_of(router)
                rule = arch.routing_rule_of(router) if hasattr(arch, "routing_rule_of") else None
                if rule is None:  # softmax top-k; DeepSeek-V2's router scales its weights too
                    rule = {"scoring": "softmax", "scaling": float(getattr(router, "routed_scaling_factor", 1.0))}
                forward = _forced_forward(router.forward, forced.ids[n], renormalize, passes, counts, rule)
                patches.set(router, "forward", forward)
        yield counts


def _forced_forward(
    orig: Any, table: np.ndarray, renormalize: bool, passes: _Passes, counts: dict[str, int], rule: dict[str, Any]
) -> Any:
    """A router forward that returns the forced ids where known, with weights from its own logits
    (``rule``: the scoring, softmax or sigmoid, and the scaling of the weights)."""
    import torch

    def forward(hidden_states: Any) -> tuple[Any, Any, Any]:
        logits, weights, ids = orig(hidden_states)
        rmap = passes.rmap
        counts["tokens"] += int(ids.shape[0])
        if rmap is None or len(rmap) != ids.shape[0]:
            return logits, weights, ids
        inside = rmap.valid & (rmap.seq < table.shape[0]) & (rmap.pos < table.shape[1])
        want = np.full((len(rmap), table.shape[2]), -1, dtype=np.int64)
        want[inside] = table[rmap.seq[inside], np.minimum(rmap.pos[inside], table.shape[1] - 1)]
        known = (want >= 0).all(-1)
        if want.shape[1] != ids.shape[1] or not known.any():
            return logits, weights, ids
        counts["forced"] += int(known.sum())
        new_ids = torch.as_tensor(want, device=ids.device).clamp(min=0)
        new_ids = torch.where(torch.as_tensor(known, device=ids.device)[:, None], new_ids, ids)
        scores = torch.sigmoid(logits.float()) if rule["scoring"] == "sigmoid" else torch.softmax(logits.float(), -1)
        probs = scores.gather(1, new_ids)
        if renormalize:
            probs = probs / (probs.sum(-1, keepdim=True) + (1e-20 if "n_group" in rule else 0.0))
        if rule["scaling"] != 1.0:
            probs = probs * rule["scaling"]
        new_weights = torch.where(torch.as_tensor(known, device=ids.device)[:, None], probs.to(weights.dtype), weights)
        return logits, new_weights, new_ids

    return forward
