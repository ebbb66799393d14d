"""A cause of the divergence, the findings of a diagnosis step, and the verdict they add up to.

This module only holds values: ``classify`` and ``conformance`` decide a
cause's class and kind, ``attribute`` fills its share, ``sampling`` and the
NaN/inf finding add their own; ``result.ScanResult`` merges ``Findings`` and
asks ``verdict`` once, in ``conclude``. Nothing here imports the rest of the
diagnosis, so every step can import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Json = dict[str, Any]  # a JSON object whose fields docs/result-schema.md documents

# Ops whose arithmetic the consistent kernels replace, by correspondence kind.
FAMILY = {
    "linear": "linear",
    "logits": "linear",
    "norm": "rms_norm",
    "add": "rms_norm",  # the residual add is fused into vLLM's add+norm kernel
    "rope": "rope",
    "attn": "attention",
    "act": "silu_and_mul",
    "router": "moe",
    "moe": "moe",
    "log_softmax": "log_softmax",
}


@dataclass
class Cause:
    """One cause of the divergence (docs/result-schema.md *Causes*; docs/causes.md lists the kinds)."""

    boundary: str
    layer: int | None
    op_kind: str  # the boundary's kind: linear, norm, rope, attn, ...
    family: str | None  # the reference-kernel family that neutralises it
    class_: str  # "class" in JSON: operator_path | framework_difference | not_judged
    kind: str
    evidence: list[str]
    fix: str
    share: float | None = None  # attribution: its part of the mean |Δ logprob| gap (its lever's Shapley share, split)
    necessity: bool | None = None  # attribution: whether the gap stays open with every other cause fixed
    differs: list[str] = field(default_factory=list)  # the contract keys / weight names behind it
    paths: list[str] | None = None  # the paths that show it (non_finite, sampling)
    sampling: Json | None = None  # per path, the sampling fit (logdiff/diagnosis/sampling.py)
    conformance: Json | None = None  # per side, its error against the exact function and the bound (conformance.py)

    def to_dict(self) -> Json:
        out = {k: getattr(self, k) for k in ("boundary", "layer", "op_kind", "family")}
        out["class"] = self.class_
        out.update({k: getattr(self, k) for k in ("kind", "evidence", "fix", "share", "necessity", "differs")})
        out.update({k: getattr(self, k) for k in ("paths", "sampling", "conformance") if getattr(self, k) is not None})
        return out


@dataclass
class Findings:
    """What one diagnosis step concluded: causes, warnings, and the contracts or attribution it measured."""

    causes: list[Cause] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    contracts: Json | None = None
    attribution: Json | None = None


def merge_causes(causes: list[Cause], new: list[Cause]) -> None:
    """Add ``new`` to ``causes``; one already at the same boundary with the same kind takes its evidence."""
    for c in new:
        same = next((x for x in causes if (x.boundary, x.kind) == (c.boundary, c.kind)), None)
        if same is None:
            causes.append(c)
            continue
        same.evidence += [e for e in c.evidence if e not in same.evidence]
        same.differs = list(dict.fromkeys([*same.differs, *c.differs]))
        same.paths = c.paths if c.paths is not None else same.paths
        if c.sampling is not None:  # a fit from the numbers names the concrete setting
            same.sampling, same.fix = c.sampling, c.fix


def framework_cause(
    boundary: str, op_kind: str, kind: str, evidence: list[str], fix: str, differs: list[str] | None = None
) -> Cause:
    """A ``framework_difference`` at ``boundary`` (an op of ``op_kind``) found outside the per-op classification."""
    return Cause(boundary, None, op_kind, FAMILY.get(op_kind), "framework_difference", kind, evidence, fix,
                 differs=list(differs or []))  # fmt: skip


def verdict(causes: list[Cause], consistent: bool, unexplained: bool = False) -> str:
    """The overall verdict from the classified causes: ``not_judged`` causes decide nothing (only
    ``not_judged`` causes: ``divergent``, the cause not classified). ``unexplained``: part of the gap enters
    after the last compared boundary and no cause identifies it (``diagnosis/closure.py``); that part is no
    operator path's, whatever the causes before it are, so it decides the verdict."""
    if consistent:
        return "consistent"
    if unexplained:
        return "unexplained"
    classes = {c.class_ for c in causes} - {"not_judged"}
    if not classes:
        return "divergent"
    if len(classes) == 2:
        return "mixed"
    return classes.pop()
