"""Engine settings given with ``--set``: their types and ranges, and which engines read them.

Checked before anything loads, from the engines' declared ``options`` alone, so
a bad value is one line and exit 2 instead of a crash (or a silent no-op) after
a model load. Keys that no engine declares are config overrides
(``logdiff.commands.overrides`` checks those against the model's config class).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from logdiff.errors import InputError

#: attention implementations the transformers paths are documented and tested with
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
#: logprobs modes that give logprobs (vLLM's *_logits modes return logits)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def _positive_number(v: Any) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    return None if ok else "a finite number > 0"


def _count(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else "an integer >= 1"


def _top_k(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= -1 else "an integer >= -1 (0 or -1: off)"


def _top_p(v: Any) -> str | None:
    return None if _positive_number(v) is None and v <= 1 else "a number in (0, 1]"


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else "one of " + ", ".join(choices)


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "true or false"


#: well-known option -> check (None when the value is fine, else what it must be)
RULES: dict[str, Callable[[Any], str | None]] = {
    "temperature": _positive_number,
    "top_k": _top_k,
    "top_p": _top_p,
    "attn_implementation": _one_of(*ATTN_IMPLEMENTATIONS),
    "batch_size": _count,
    "padding_side": _one_of("right", "left"),
    "max_num_batched_tokens": _count,
    "max_num_seqs": _count,
    "max_model_len": _count,
    "enable_prefix_caching": _bool,
    "logprobs_mode": _one_of(*LOGPROBS_MODES),
    "grad": _bool,
    "tensor_parallel_size": _count,
    "fsdp_size": _count,
    "quantization": lambda v: None if isinstance(v, str) and v else "a vLLM quantization method name (fp8, ...)",
    "consistent_quantization": _one_of("int8-w8a8"),
}


def all_options() -> dict[str, list[str]]:
    """Option key -> the registered engines that read it."""
    from logdiff.sources.registry import engine_names, get_engine

    owners: dict[str, list[str]] = {}
    for name in engine_names():
        for key in get_engine(name).options:
            owners.setdefault(key, []).append(name)
    return owners


def validate_side(side: str, engines: list[str], settings: dict[str, Any]) -> None:
    """InputError for an option with a bad value, or one that none of this side's engines reads."""
    from logdiff.sources.registry import get_engine

    owners = all_options()
    for key, value in settings.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"--set {side}.{key}={value}: not a finite number")
        if key not in owners:
            continue  # a config override
        users = [e for e in dict.fromkeys(engines) if key in get_engine(e).options]
        if not users:
            raise InputError(
                f"--set {side}.{key}: {key} is an option of {', '.join(owners[key])}, "
                f"not used by {', '.join(dict.fromkeys(engines))} (the {side} side's engines)"
            )
        rule = RULES.get(key)
        problem = rule(value) if rule is not None else None
        if problem:
            raise InputError(f"--set {side}.{key}={value!r}: must be {problem}")


def is_option(key: str) -> bool:
    """Whether ``key`` is an engine option (of any registered engine) rather than a config key."""
    return key in all_options()
