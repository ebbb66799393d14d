"""The scan result as typed objects, and their one serialization to result.json.

A scan builds a ``ScanResult`` in stages, each a value handed on rather than a
dict filled in by whoever comes next:

* ``pipeline.measure`` runs the paths and compares them: ``paths``,
  ``sequences``, one ``Pair`` per (training path, inference path), and what
  ``locate`` found (``Located``);
* ``diagnose``, ``routing`` and ``sampling`` each return their findings
  (``Findings``, the ``moe`` section), which ``pipeline.scan`` adds;
* ``ScanResult.conclude`` derives ``verdict`` and ``cause_groups`` from the
  causes, in one place.

``to_dict`` writes exactly the JSON that docs/result-schema.md documents (the
contract, with ``schema_version``); ``reports/`` and ``logdiff check`` read that
JSON back. The sections whose shape docs/result-schema.md spells out field by
field and that one module computes whole (the metrics, the contracts, the
``moe`` section, the attribution summary) stay JSON objects (``Json``) here.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from logdiff.comparison.cause import Cause, Findings, Json, merge_causes, verdict
from logdiff.reports.schema import SCHEMA_VERSION


@dataclass
class ScanSettings:
    """``settings``: the options the scan ran with."""

    seed: int
    depth: str
    consistent: bool
    overrides: dict[str, dict[str, Any]]  # {"train": {...}, "infer": {...}}
    sequence_source: str  # probe | jsonl | prompts | dump
    trust_remote_code: bool
    is_threshold: float


@dataclass
class PathInfo:
    """One entry of ``paths``: a path's name, role and mode, and its engine's version and settings."""

    name: str
    role: str  # train | infer
    mode: str  # forward | decode | prefill | recorded
    engine: str
    version: str | None
    settings: dict[str, Any]

    @classmethod
    def of(cls, name: str, role: str, mode: str, info: Json) -> PathInfo:
        """From an engine's ``info()`` (``engine``, ``version``, ``settings``)."""
        return cls(name, role, mode, info["engine"], info.get("version"), dict(info.get("settings") or {}))


@dataclass
class SequencesInfo:
    """``sequences``: how many, where they came from, and their lengths."""

    count: int
    source: str
    format: str | None  # the --sequences file's layout (docs/rollout-dumps.md)
    prompt_lens: list[int]
    response_lens: list[int]


@dataclass
class Pair:
    """One (training path, inference path) comparison; ``located`` at ``--depth modules|ops``."""

    train: str
    infer: str
    metrics: Json
    per_position: Json
    histogram: Json
    worst: Json
    first_divergence: Json | None = None
    introducing_ops: list[Json] | None = None
    boundaries: list[Json] | None = None
    #: (train logprobs, infer logprobs, response masks) per sequence, for the closure (never serialized)
    tokens: Any = field(default=None, repr=False, compare=False)

    @property
    def bitwise_equal(self) -> bool:
        """Whether every scored token's logprob is bitwise equal on both paths."""
        return self.metrics["bitwise_equal_fraction"] == 1.0

    @property
    def located(self) -> bool:
        return self.boundaries is not None

    def to_dict(self) -> Json:
        out = {k: getattr(self, k) for k in ("train", "infer", "metrics", "per_position", "histogram", "worst")}
        if self.located:
            out.update(first_divergence=self.first_divergence, introducing_ops=self.introducing_ops,
                       boundaries=self.boundaries)  # fmt: skip
        return out


@dataclass
class Located:
    """What ``locate`` found for the primary pair (the others' findings sit on their ``Pair``)."""

    first_divergence: Json | None = None
    introducing_ops: list[Json] = field(default_factory=list)
    divergence_table: Json | None = None
    op_trace: Json | None = None
    first_nonfinite: Json | None = None
    warnings: list[str] = field(default_factory=list)
    unresolved: list[Json] = field(default_factory=list)  # locate's unjudged boundaries, for conformance


@dataclass
class ScanResult:
    """One scan's result; ``to_dict()`` is result.json (docs/result-schema.md)."""

    model: str
    checkpoint: str | None
    infer_checkpoint: str | None
    architecture: str
    dtype: str
    settings: ScanSettings
    environment: Json
    paths: list[PathInfo]
    sequences: SequencesInfo
    pairs: list[Pair]
    located: Located = field(default_factory=Located)
    warnings: list[str] = field(default_factory=list)
    causes: list[Cause] = field(default_factory=list)
    non_finite: Json | None = None
    contracts: Json | None = None
    moe: Json | None = None
    attribution: Json | None = None
    batch_invariance: Json | None = None
    rollout_replay: Json | None = None
    closure: Json | None = None  # what the causes account for of the gap (logdiff/diagnosis/closure.py)
    classified: bool = False  # whether diagnosis ran (``--depth modules|ops``)
    verdict: str = "divergent"
    cause_groups: list[Json] = field(default_factory=list)
    timings: dict[str, float] | None = None
    peak_rss_bytes: int | None = None
    scratch_bytes: int | None = None  # what the scan's row stores wrote to scratch files (None: nothing recorded)
    complete: bool = True
    created: str = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))

    @property
    def primary(self) -> Pair:
        """The pair the top-level findings are about: the training path against the first inference path."""
        return self.pairs[0]

    def warn(self, *messages: str) -> None:
        """Add warnings, each once, in order."""
        self.warnings += [m for m in dict.fromkeys(messages) if m not in self.warnings]

    def add(self, found: Findings) -> None:
        """Take one diagnosis step's findings (the diagnosis, the sampling check)."""
        self.warn(*found.warnings)
        merge_causes(self.causes, found.causes)
        self.contracts = found.contracts if found.contracts is not None else self.contracts
        self.attribution = found.attribution if found.attribution is not None else self.attribution

    def conclude(self) -> None:
        """Set ``verdict`` and ``cause_groups`` from the causes.

        Without causes the verdict is ``consistent`` when the logprobs are bitwise
        equal (the primary pair once diagnosed, every pair otherwise) and
        ``divergent`` when not; with causes it is their class (or ``mixed``);
        ``unexplained`` wherever the closure found a part of the gap that enters
        after the last compared boundary and no cause identifies.
        """
        from logdiff.reports.groups import group_causes

        pairs = [self.primary] if self.classified else self.pairs
        unexplained = bool((self.closure or {}).get("unexplained_max"))
        self.verdict = verdict(self.causes, consistent=not self.causes and all(p.bitwise_equal for p in pairs),
                               unexplained=unexplained)
        self.cause_groups = group_causes([c.to_dict() for c in self.causes])

    def to_dict(self) -> Json:
        """result.json: the documented fields, in the documented order."""
        out: Json = {
            "schema_version": SCHEMA_VERSION,
            "tool": {"name": "logdiff", "version": metadata.version("logdiff")},
            "created": self.created,
            "complete": self.complete,
            "warnings": list(self.warnings),
            "model": self.model,
            "checkpoint": self.checkpoint,
            "infer_checkpoint": self.infer_checkpoint,
            "architecture": self.architecture,
            "dtype": self.dtype,
            "settings": vars(self.settings).copy(),
            "environment": self.environment,
            "paths": [vars(p).copy() for p in self.paths],
            "sequences": vars(self.sequences).copy(),
            "pairs": [p.to_dict() for p in self.pairs],
            "logprobs": self.primary.metrics,
            "first_divergence": self.located.first_divergence,
            "introducing_ops": self.located.introducing_ops,
            "causes": [c.to_dict() for c in self.causes],
            "verdict": self.verdict,
            "closure": self.closure,
            "non_finite": self.non_finite,
            "divergence_table": self.located.divergence_table,
            "contracts": self.contracts,
            "moe": self.moe,
            "batch_invariance": self.batch_invariance,
            "rollout_replay": self.rollout_replay,
        }
        if self.located.op_trace is not None:
            out["op_trace"] = self.located.op_trace
        if self.attribution is not None:
            out["attribution"] = self.attribution
        out["cause_groups"] = self.cause_groups
        if self.timings is not None:
            out["timings"], out["peak_rss_bytes"] = self.timings, self.peak_rss_bytes
            out["scratch_bytes"] = self.scratch_bytes
        return out
