"""The scan's settings as one dataclass, shared by the CLI and the Python API."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from logdiff.diagnosis.settings import ATTRIBUTION_GAMES, KERNEL_FAMILIES  # noqa: F401 - the scan checks its options against them
from logdiff.errors import InputError
from logdiff.sources import DEFAULT_INFER, DEFAULT_TRAIN
from logdiff.sources.base import DTYPES

DEPTHS = ("logprobs", "modules", "ops")


@dataclass
class ScanConfig:
    """What to compare and how; mirrors ``logdiff scan``'s options."""

    model: Path
    ckpt: Path | None = None
    train: str = DEFAULT_TRAIN
    infer: list[str] = field(default_factory=lambda: [DEFAULT_INFER])
    dtype: str = "bfloat16"
    sequences: Path | None = None
    prompts: Path | None = None
    num_sequences: int = 8
    prompt_len: int = 16
    response_len: int = 32
    seed: int = 0
    infer_ckpt: Path | None = None
    train_set: dict[str, Any] = field(default_factory=dict)
    infer_set: dict[str, Any] = field(default_factory=dict)
    depth: str = "logprobs"
    consistent: bool = False
    #: with ``consistent``, install only these op families (None: all of them)
    consistent_kernels: tuple[str, ...] | None = None
    #: at depth modules|ops, measure each cause's share and necessity (``attribution`` says how)
    attribute: bool = True
    #: how attribution measures each set of levers: ``patched`` (one training forward whose ops take the error the
    #: inference side's recorded ops introduced, confirmed by one rescan; rescans where the records cannot) or
    #: ``rescan`` (end-to-end rescans)
    attribution: str = "patched"
    #: at depth modules|ops, replay the training path's ops on every inference path's inputs, not only on the
    #: primary path's (the one the diagnosis reads); each replayed path costs one more training forward
    replay_all_paths: bool = False
    #: at depth ops, the module to trace (default: the first divergent one)
    drill: str | None = None
    #: at depth modules|ops, keep whole rows of the first ``window`` decoder layers only (and of the records of no
    #: layer), compare the others by row sketches; None: every boundary whole (``probes/windowed.py``)
    window: int | None = None
    #: batch-invariance probe: score the sequences at these batch sizes on the first inference engine
    batch_sizes: tuple[int, ...] | None = None
    #: let transformers and vLLM run Python code that ships with the model (auto_map)
    trust_remote_code: bool = False
    device: str = "auto"  # where the HF paths compute (vLLM uses its own platform's device)
    #: score exactly these sequences (responses included) instead of loading or sampling any:
    #: the diagnosis's rescans replay the first scan's tokens (Python API only, not a CLI option)
    replay: tuple[Any, ...] | None = None
    #: score each engine's primary path only (its first: vLLM's decode, not its prompt-logprobs prefill); the
    #: diagnosis's rescans read the primary pair alone (Python API only, not a CLI option)
    primary_path_only: bool = False
    #: T of the rollout_is_* metrics (weights truncated to <= T) and the k1 rollout_rs_* bounds [1/T, T] (verl's 2.0)
    is_threshold: float = 2.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.depth not in DEPTHS:
            raise InputError(f"--depth must be one of {', '.join(DEPTHS)}, not {self.depth!r}")
        if self.sequences is not None and self.prompts is not None:
            raise InputError("give either --sequences or --prompts, not both")
        if not self.infer:
            raise InputError("give at least one --infer engine")
        unknown = set(self.consistent_kernels or ()) - set(KERNEL_FAMILIES)
        if unknown:
            raise InputError(f"--consistent-kernels: unknown {', '.join(sorted(unknown))}; choose from {', '.join(KERNEL_FAMILIES)}")
        if self.batch_sizes is not None and (len(self.batch_sizes) < 2 or min(self.batch_sizes) < 1):
            raise InputError("--batch-compositions needs at least two batch sizes >= 1, e.g. 1,4")
        if self.response_len < 1:
            raise InputError("--response-len must be at least 1")
        if self.num_sequences < 1 or self.prompt_len < 1:
            raise InputError("--num-sequences and --prompt-len must be at least 1")
        if not re.fullmatch(r"auto|cpu|mps|(cuda|npu|xpu)(:\d+)?", self.device):
            raise InputError(f"--device must be auto, cpu, cuda[:N], npu[:N], xpu[:N] or mps, not {self.device!r}")
        if isinstance(self.is_threshold, bool) or not isinstance(self.is_threshold, (int, float)) \
                or not 1.0 < self.is_threshold < float("inf"):
            raise InputError(f"--is-threshold must be a finite number > 1 (bounds [1/T, T]), not {self.is_threshold!r}")
        if self.attribution not in ATTRIBUTION_GAMES:
            raise InputError(f"--attribution must be one of {', '.join(ATTRIBUTION_GAMES)}, not {self.attribution!r}")
        if self.drill is not None and self.depth != "ops":
            raise InputError("--drill needs --depth ops (it names the module whose aten ops are traced)")
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 0 or self.depth == "logprobs"):
            raise InputError(f"--window needs --depth modules or ops and a number of layers >= 0, not {self.window!r}")
        if self.consistent_kernels is not None and not self.consistent:
            raise InputError("--consistent-kernels needs --consistent")
        from logdiff.commands.options import validate_side

        validate_side("train", [self.train], self.train_set)
        validate_side("infer", list(self.infer), self.infer_set)
        self._check_engines()

    def _check_engines(self) -> None:
        """What the chosen engines say they cannot do with these settings, refused before anything loads."""
        from logdiff.sources.registry import get_engine

        needs = {"capture": f"--depth {self.depth}"} if self.depth != "logprobs" else {}
        if self.consistent:
            needs["consistent"] = "--consistent"
        for name in dict.fromkeys([self.train, *self.infer]):
            missing = [flag for capability, flag in needs.items() if capability not in get_engine(name).capabilities]
            if missing:
                raise InputError(f"{' and '.join(missing)}: engine {name} has no such capability "
                                 f"(it declares {', '.join(sorted(get_engine(name).capabilities)) or 'none'})")
        for name in self.infer:
            why = get_engine(name).out_of_process(self.infer_set)
            if why and (self.depth != "logprobs" or self.consistent):
                raise InputError(f"--infer {name}: {why}, which a scan cannot hook or patch; use --depth logprobs "
                                 "without --consistent, or capture the engine where it runs and compare offline "
                                 "with logdiff compare (docs/capture.md)")
        if self.consistent and self.train_set.get("tensor_parallel_size", 1) != 1:
            for name in self.infer:
                if not get_engine(name).fixed_order_rows:
                    raise InputError(f"--consistent with --set train.tensor_parallel_size: {name}'s consistent mode "
                                     "has no fixed-order row-parallel reduction, so it cannot match a "
                                     "tensor-parallel training path bitwise")


def parse_value(text: str) -> Any:
    """``1e-2`` -> 0.01, ``true`` -> True, ``[1,2]`` -> list; anything else stays a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_sets(items: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``--set train.KEY=VALUE`` / ``--set infer.KEY=VALUE`` into two dicts."""
    sides: dict[str, dict[str, Any]] = {"train": {}, "infer": {}}
    for item in items:
        side, dot, rest = item.partition(".")
        key, eq, value = rest.partition("=")
        if side not in sides or not dot or not eq or not key:
            raise InputError(f"--set expects train.KEY=VALUE or infer.KEY=VALUE, got {item!r}")
        sides[side][key] = parse_value(value)
    return sides["train"], sides["infer"]
