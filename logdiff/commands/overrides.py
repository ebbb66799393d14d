"""``--set`` config overrides: checked before any engine loads, read back after.

Before loading (``check_before_load``), every override is checked, recursively,
against the model's config class (``logdiff.commands.override_types``: its annotations,
TypedDicts such as ``RopeParameters``, unions, lists, dicts, Literals, nested
configs, else the current value's shape) and the config it produces must still
fit the weights, so ``rms_norm_eps=abc``, ``rope_parameters={"rope_theta": "x"}``
or ``hidden_size=128`` is one line and exit 2 naming where in the value and
what was expected, rather than an engine's traceback. An integer given for a
float field becomes that float. ``rope_parameters`` is checked as the form the
config has now (one ``RopeParameters``, or one per layer type as in Gemma 3),
and its ``rope_type`` must be one transformers implements. A structured value
reaches the engines as a structure (a dict or list), as JSON gave it.

After loading (``check_applied``), each ``--set`` key is compared with what the
loaded engine actually uses: its effective contract (``Engine.contract``: the
eps in the norm modules, the RoPE base, whether the head is tied), else its
loaded config, and its effective engine options. An override that did not
take effect (``tie_word_embeddings`` in vLLM) would report "nothing differs"
for a mismatch the user set up on purpose, so it is an error naming the key
and the engine. Structured values are compared item by item (``_same``). A key
another one is derived from when transformers builds a config (``max_window_layers``
-> ``layer_types``: ``DERIVED``) must change the derived key as the config class would,
or it did not take effect either: the override is set on the built config.
"""

from __future__ import annotations

import json
import math
import typing
from typing import Any, Optional, TypedDict, Union

from logdiff.commands.override_types import MISSING, NO_ANNOTATION, Mismatch, conform, field_hints, is_config_object
from logdiff.errors import InputError

#: keys whose effective value the contract reader reads from the loaded modules
CONTRACT_KEYS = ("rms_norm_eps", "rope_theta", "tie_word_embeddings", "vocab_size", "sliding_window",
                 "num_experts_per_tok", "norm_topk_prob")  # fmt: skip


def _rope_annotation(current: Any) -> Any:
    """``rope_parameters``: one ``RopeParameters``, or one per layer type (Gemma 3), as the config has it now.

    The config classes annotate it ``RopeParameters | dict | None``, whose bare
    ``dict`` would accept anything; the check uses the two forms transformers reads.
    """
    rope = _rope_parameters()
    per_layer = dict[str, rope]  # type: ignore[valid-type]
    if isinstance(current, dict) and current:
        return Optional[per_layer] if _per_layer(current) else Optional[rope]
    return Optional[Union[rope, per_layer]]


def _rope_parameters() -> Any:
    """transformers' ``RopeParameters`` TypedDict plus the keys its RoPE functions read that it omits."""
    from transformers.modeling_rope_utils import RopeParameters

    hints = {**field_hints(RopeParameters), "truncate": Optional[bool]}  # yarn reads it (gpt-oss)
    return TypedDict("RopeParameters", hints, total=False)  # type: ignore[operator]


def _per_layer(rope: dict) -> bool:
    return bool(rope) and all(isinstance(v, dict) for v in rope.values())


def _field(config: Any, side: str, key: str) -> tuple[Any, Any]:
    """(annotation, current value) of config key ``key``; RoPE keys inside ``rope_parameters`` are its fields."""
    rope = getattr(config, "rope_parameters", None)
    rope_fields = _rope_parameters()
    rope_hints = field_hints(rope_fields)
    if key == "rope_parameters":
        return _rope_annotation(rope), rope
    if isinstance(rope, dict) and key in rope and _per_layer(rope):  # one layer type's RoPE (Gemma 3)
        return rope_fields, rope[key]
    if isinstance(rope, dict) and (key in rope or key in rope_hints):
        return rope_hints.get(key, NO_ANNOTATION), rope.get(key, MISSING)
    hints = field_hints(type(config))
    if key in hints:
        return hints[key], getattr(config, key, MISSING)
    if hasattr(config, key):
        return NO_ANNOTATION, getattr(config, key)
    raise InputError(f"--set {side}.{key}: the model config has no key {key!r}")


def _check_one(config: Any, side: str, key: str, value: Any) -> Any:
    """The value to apply for ``key`` (coerced), or InputError naming where in it and what was expected."""
    where = f"--set {side}.{key}={value!r}"
    annotation, current = _field(config, side, key)
    if typing.get_origin(annotation) is typing.ClassVar:
        raise InputError(f"{where}: {key} is a constant of {type(config).__name__}, not a setting")
    try:
        checked = conform(annotation, value, current)
    except Mismatch as e:
        raise InputError(f"{where}: {e.where(key)} {e.problem} in {type(config).__name__}") from None
    unknown = _unknown_rope_type(key, checked, per_layer_entry=getattr(annotation, "__name__", "") == "RopeParameters")
    if unknown is not None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        known = ", ".join(["default", *ROPE_INIT_FUNCTIONS])
        raise InputError(f"{where}: unknown rope_type {unknown!r}; transformers knows {known}")
    return checked


def _unknown_rope_type(key: str, value: Any, per_layer_entry: bool) -> Any:
    """A ``rope_type`` in the checked value that transformers has no RoPE for (None: all known).

    ``per_layer_entry``: ``key`` is one layer type's RoPE (``full_attention`` in Gemma 3).
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if key == "rope_type":
        types_ = [value]
    elif key == "rope_parameters" and isinstance(value, dict):
        ropes = list(value.values()) if _per_layer(value) else [value]
        types_ = [r.get("rope_type") for r in ropes]
    elif per_layer_entry and isinstance(value, dict):
        types_ = [value.get("rope_type")]
    else:
        return None
    return next((t for t in types_ if t is not None and t != "default" and t not in ROPE_INIT_FUNCTIONS), None)


def check_before_load(staged: Any, side: str, overrides: dict[str, Any], trust_remote_code: bool = False) -> None:
    """Type-check ``overrides`` (coercing them in place) and check the weights still fit the config."""
    if not overrides:
        return
    from transformers import AutoConfig

    from logdiff.sources import checkpoint
    from logdiff.sources.hf.loading import apply_override

    config = AutoConfig.from_pretrained(str(staged.path), trust_remote_code=trust_remote_code)
    as_staged = config.to_dict()
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
        if config.to_dict() != as_staged:  # staging checked the weights against the unchanged config
            checkpoint.check_weights(staged, config=config)
    except InputError as e:
        raise InputError(f"--set {items}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a config the model class cannot be built from
        raise InputError(f"--set {items}: the model cannot be built with this config ({_last_line(e)})") from None


def _last_line(e: BaseException) -> str:
    if isinstance(e, KeyError) and len(e.args) == 1:  # str(KeyError) is only the key, quoted
        return f"missing key {e.args[0]!r}"
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


def _loaded_value(engine: Any, key: str) -> Any:
    """What the loaded engine computes with for config key ``key``."""
    if key in CONTRACT_KEYS:
        from logdiff.probes.contracts import applied

        contract = engine.contract()
        if key == "sliding_window" or contract.get(key) is not None:  # None: no window
            return applied(contract.get(key))  # a window read as off is the config's None
    config = engine.loaded_config()
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and key in rope:
        return rope[key]
    return getattr(config, key, MISSING)


def _same(want: Any, have: Any) -> bool:
    """Whether the loaded value is the one asked for: numbers to 1e-6, structures item by item.

    A dict asked for matches a loaded one that holds each of its keys with the same
    value (an engine may fill in defaults: ``rope_theta`` beside ``rope_type``); a key
    asked to be None may be absent. A nested config is compared as its dict.
    """
    if is_config_object(have):
        have = have.to_dict()
    if is_config_object(want):
        want = want.to_dict()
    if isinstance(want, dict):
        return isinstance(have, dict) and all(_same(v, have.get(k)) for k, v in want.items())
    if isinstance(want, (list, tuple)):
        return isinstance(have, (list, tuple)) and len(want) == len(have) and all(map(_same, want, have))
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (want, have))
    if numbers:
        return math.isclose(float(want), float(have), rel_tol=1e-6, abs_tol=0.0)
    try:
        return bool(want == have)
    except Exception:  # noqa: BLE001 - an object whose == is not a bool (a tensor)
        return False


def check_applied(engine: Any, side: str, settings: dict[str, Any]) -> None:
    """InputError naming the key and engine when a ``--set`` value is not what the loaded engine uses."""
    from logdiff.commands.options import is_option

    try:
        options = engine.effective_options()
    except NotImplementedError:
        return  # an engine without read-back support (a third-party plug-in)
    for key, want in settings.items():
        if key in engine.options:
            have = options.get(key, MISSING)
        elif is_option(key):
            continue  # another engine's option on this side
        else:
            have = _loaded_value(engine, key)
        if have is MISSING:
            continue  # not readable on this engine
        if not _same(want, have):
            raise InputError(
                f"--set {side}.{key}={want!r} did not take effect on {engine.name}: the loaded engine "
                f"uses {key} = {have!r}"
            )
    _check_derived(engine, side, settings)


#: config keys transformers derives from others when it builds a config, and the inputs that act through them
#: alone: an override is set on the built config, so changing such an input changes nothing (Qwen2/3: a layer
#: slides from ``max_window_layers`` on where ``use_sliding_window`` is set; an explicit ``layer_types`` in
#: config.json wins over both). ``sliding_window`` also sets the width, which the contract read-back checks.
DERIVED = {"layer_types": ("use_sliding_window", "max_window_layers")}


def _check_derived(engine: Any, side: str, settings: dict[str, Any]) -> None:
    """InputError where an override of a key another one is derived from leaves the derived key as it was,
    while the config class, built with it, would derive another value: the override had no effect on what runs."""
    try:
        config = engine.loaded_config()
    except (NotImplementedError, AttributeError):
        return
    build = getattr(type(config), "from_dict", None)
    for derived, inputs in DERIVED.items():
        given = [k for k in inputs if k in settings]
        have = getattr(config, derived, None)
        if not given or derived in settings or build is None or have is None:
            continue
        try:
            want = getattr(build({**config.to_dict(), derived: None}), derived, None)
        except Exception:  # noqa: BLE001 - a config the class cannot rebuild: nothing to compare
            continue
        if want is not None and list(want) != list(have):
            sets = ", ".join(f"{side}.{k}={settings[k]!r}" for k in given)
            raise InputError(
                f"--set {sets} did not take effect on {engine.name}: transformers derives {derived} from "
                f"{'it' if len(given) == 1 else 'them'} only when it builds the config, and the loaded engine uses "
                f"{derived} = {have!r}; set {side}.{derived}={json.dumps(list(want), separators=(',', ':'))} too"
            )
