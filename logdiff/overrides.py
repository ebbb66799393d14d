"""``--set`` config overrides: checked before any engine loads, read back after.

Before loading (``check_before_load``), every override is type-checked against
the model's config class (its annotations, the RoPE parameters' TypedDict, or
the current value's type) and the config it produces must still fit the
weights, so ``rms_norm_eps=abc`` or ``hidden_size=128`` is one line and exit 2
rather than an engine's traceback. An integer given for a float field becomes
that float.

After loading (``check_applied``), each ``--set`` key is compared with what the
loaded engine actually uses: its effective contract (``Engine.contract``: the
eps in the norm modules, the RoPE base, whether the head is tied), else its
loaded config, and its effective engine options. An override that did not
take effect (``tie_word_embeddings`` in vLLM) would report "nothing differs"
for a mismatch the user set up on purpose, so it is an error naming the key
and the engine.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any

from logdiff.errors import InputError

#: keys whose effective value the contract reader reads from the loaded modules
CONTRACT_KEYS = ("rms_norm_eps", "rope_theta", "tie_word_embeddings", "vocab_size", "sliding_window",
                 "num_experts_per_tok", "norm_topk_prob")  # fmt: skip
_MISSING = object()


def _annotations(cls: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        ann = klass.__dict__.get("__annotations__")
        if isinstance(ann, dict):
            out.update(ann)
    return out


def _accepts(annotation: Any, value: Any) -> tuple[bool, Any]:
    """(does ``value`` fit ``annotation``, the value to use); ints are accepted where floats are."""
    if annotation is Any:
        return True, value
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            ok, coerced = _accepts(arg, value)
            if ok:
                return True, coerced
        return False, value
    if annotation is type(None):
        return value is None, value
    if origin is not None:
        annotation = origin
    if not isinstance(annotation, type):
        return True, value  # a TypedDict, a Literal...: not ours to judge
    if annotation is float:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number, float(value) if number else value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    return isinstance(value, annotation), value


def _type_name(annotation: Any) -> str:
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _check_one(config: Any, side: str, key: str, value: Any) -> Any:
    """The value to apply for ``key`` (coerced), or InputError."""
    from transformers.modeling_rope_utils import RopeParameters

    where = f"--set {side}.{key}={value!r}"
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{where}: not a finite number")
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and (key in rope or key in RopeParameters.__annotations__):
        annotation = RopeParameters.__annotations__.get(key, Any)
    elif key in _annotations(type(config)):
        annotation = _annotations(type(config))[key]
    elif hasattr(config, key):
        current = getattr(config, key)
        annotation = Any if current is None else float if isinstance(current, float) else type(current)
    else:
        raise InputError(f"--set {side}.{key}: the model config has no key {key!r}")
    ok, coerced = _accepts(annotation, value)
    if not ok:
        raise InputError(f"{where}: {key} must be {_type_name(annotation)} in {type(config).__name__}")
    return coerced


def check_before_load(staged: Any, side: str, overrides: dict[str, Any], trust_remote_code: bool = False) -> None:
    """Type-check ``overrides`` (coercing them in place) and check the weights still fit the config."""
    if not overrides:
        return
    from transformers import AutoConfig

    from logdiff.probes import checkpoint
    from logdiff.engines.hf.loading import apply_override

    config = AutoConfig.from_pretrained(str(staged.path), trust_remote_code=trust_remote_code)
    for key, value in list(overrides.items()):
        overrides[key] = _check_one(config, side, key, value)
        try:
            apply_override(config, key, overrides[key])
        except InputError:
            raise
        except Exception as e:  # noqa: BLE001 - the config class's own validators
            raise InputError(f"--set {side}.{key}={value!r}: {_last_line(e)}") from None
    items = ", ".join(f"{side}.{k}={v!r}" for k, v in overrides.items())
    try:
        config.validate()
        checkpoint.check_weights(staged, config=config)
    except InputError as e:
        raise InputError(f"--set {items}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a config the model class cannot be built from
        raise InputError(f"--set {items}: the model cannot be built with this config ({_last_line(e)})") from None


def _last_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


def _loaded_value(engine: Any, key: str) -> Any:
    """What the loaded engine computes with for config key ``key``."""
    if key in CONTRACT_KEYS:
        contract = engine.contract()
        if key == "sliding_window" or contract.get(key) is not None:  # None: no window
            return contract.get(key)
    config = engine.loaded_config()
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and key in rope:
        return rope[key]
    return getattr(config, key, _MISSING)


def _same(want: Any, have: Any) -> bool:
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (want, have))
    if numbers:
        return math.isclose(float(want), float(have), rel_tol=1e-6, abs_tol=0.0)
    return want == have


def check_applied(engine: Any, side: str, settings: dict[str, Any]) -> None:
    """InputError naming the key and engine when a ``--set`` value is not what the loaded engine uses."""
    from logdiff.options import is_option

    try:
        options = engine.effective_options()
    except NotImplementedError:
        return  # an engine without read-back support (a third-party plug-in)
    for key, want in settings.items():
        if key in engine.options:
            have = options.get(key, _MISSING)
        elif is_option(key):
            continue  # another engine's option on this side
        else:
            have = _loaded_value(engine, key)
        if have is _MISSING:
            continue  # not readable on this engine
        if not _same(want, have):
            raise InputError(
                f"--set {side}.{key}={want!r} did not take effect on {engine.name}: the loaded engine "
                f"uses {key} = {have!r}"
            )
