"""Whether a ``--set`` value fits a config field: recursive, against the field's annotation.

``conform(annotation, value, current)`` returns the value to apply (an int
given for a float becomes that float) or raises ``Mismatch`` saying where in
the value (``rope_parameters.rope_theta``, ``layer_types[2]``) it went wrong
and what was expected there. It understands what transformers' config classes
annotate their fields with:

- plain classes (``int``, ``float``, ``bool``, ``str``, ``torch.dtype``): a bool
  is never an int, an int is accepted for a float, floats must be finite;
- ``X | None``, ``Optional[X]``, ``Union[...]``: the first arm that fits; when none
  does, the error of the arm that got deepest into the value (the most precise),
  or of the one arm that took the value's kind (a dict for a TypedDict);
- ``Literal[...]``: one of its values;
- ``list[X]``, ``tuple[X, ...]``, ``dict[K, V]`` (JSON object keys are strings, so a
  digit string is accepted for an ``int`` key and converted);
- a ``TypedDict`` (RoPE's ``RopeParameters``): no unknown keys (a key the current
  value holds is known: the config reads it), each value checked against its
  hint; a key whose hint admits None may be omitted;
- a nested config (``PreTrainedConfig`` subclass): a dict whose keys are checked
  against that class's fields, merged onto the current sub-config;
- ``ClassVar``: a class constant (``model_type``), never a setting;
- no annotation (``NO_ANNOTATION``), a bare ``dict`` / ``list``, or one we cannot
  read: the current value's shape, recursively (a dict's known keys keep their
  types; a key the current value lacks, or a current None, takes any value).

Nothing here imports transformers or torch at import time, and nothing is
cached: the annotations are read per call from the config class.
"""

from __future__ import annotations

import math
import re
import sys
import types
import typing
from typing import Any

#: the field has no annotation: the current value's shape decides
NO_ANNOTATION = object()
#: the field has no current value (a key the current dict lacks)
MISSING = object()


class Mismatch(Exception):
    """``value`` does not fit: ``path`` (keys and indices into it) and ``problem`` ("must be float").

    ``wrong_kind``: the value is not of the expected kind at all (a str for a float), as
    opposed to of the right kind but wrong inside (an infinite float, a dict with an unknown key).
    """

    def __init__(self, path: tuple[Any, ...], problem: str, wrong_kind: bool = True):
        super().__init__(problem)
        self.path = path
        self.problem = problem
        self.wrong_kind = wrong_kind

    def where(self, key: str) -> str:
        """``key`` followed by the path into the value: ``rope_parameters.rope_theta``, ``layer_types[2]``."""
        out = key
        for part in self.path:
            out += f".{part}" if isinstance(part, str) and part.isidentifier() else f"[{part!r}]"
        return out


def field_hints(cls: type) -> dict[str, Any]:
    """A config class's field annotations, resolved where they can be.

    ``typing.get_type_hints`` fails as a whole on one name imported only under
    ``TYPE_CHECKING`` (transformers' ``"str | torch.dtype | None"``), so each string
    annotation is then resolved alone, in its module's namespace plus the modules
    already imported; one that still cannot be read stays a string (the current
    value's shape decides for it).
    """
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - a forward reference only importable under TYPE_CHECKING
        pass
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        ann = klass.__dict__.get("__annotations__")
        if isinstance(ann, dict):
            out.update({k: _resolve(a, klass) for k, a in ann.items()})
    return out


def _resolve(annotation: Any, owner: type) -> Any:
    if not isinstance(annotation, str):
        return annotation
    namespace = dict(vars(sys.modules.get(owner.__module__, typing)))
    for name in re.findall(r"[A-Za-z_]\w*", annotation):
        if name not in namespace and name in sys.modules:  # ``torch`` in ``torch.dtype``
            namespace[name] = sys.modules[name]
    try:
        return eval(annotation, namespace)  # noqa: S307 - an annotation of an imported class, as get_type_hints does
    except Exception:  # noqa: BLE001 - a name not imported anywhere
        return annotation


def describe(annotation: Any) -> str:
    """``float``, ``int | None``, ``list[str]``, ``RopeParameters``, ``one of 'a', 'b'``."""
    if annotation is NO_ANNOTATION or annotation is Any:
        return "any value"
    if annotation is type(None) or annotation is None:
        return "None"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is not None and args:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join('...' if a is Ellipsis else describe(a) for a in args)}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def like(current: Any) -> Any:
    """The annotation the current value implies (``NO_ANNOTATION`` keeps its dict's per-key shapes)."""
    if current is None or current is MISSING:
        return Any
    if isinstance(current, (bool, int, float, str)):
        return type(current)
    return NO_ANNOTATION


def conform(annotation: Any, value: Any, current: Any = MISSING, path: tuple[Any, ...] = ()) -> Any:
    """``value`` as it fits ``annotation`` (coerced), else ``Mismatch``; ``current`` guides unannotated parts."""
    if annotation is NO_ANNOTATION:
        return _by_current(value, current, path)
    if annotation is Any:
        return _any(value, path)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return _union(args, value, current, path)
    if origin is typing.ClassVar:
        raise Mismatch(path, "is a constant of the config class, not a setting")
    if origin is typing.Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise Mismatch(path, f"must be {describe(annotation)}")
    if annotation is type(None) or annotation is None:
        if value is None:
            return None
        raise Mismatch(path, "must be None")
    if typing.is_typeddict(annotation):
        return _typed_dict(annotation, value, current, path)
    if origin in (list, tuple, set, frozenset) or annotation in (list, tuple):
        return _sequence(origin or annotation, args, value, current, path)
    if origin is dict or annotation is dict:
        return _mapping(args, value, current, path)
    if isinstance(annotation, type):
        if _is_config_class(annotation):
            return _sub_config(annotation, value, current, path)
        return _instance(annotation, value, path)
    return _by_current(value, current, path)  # a string annotation, a TypeVar...: not readable


def _any(value: Any, path: tuple[Any, ...]) -> Any:
    """Any JSON value; its floats still finite."""
    if isinstance(value, float) and not math.isfinite(value):
        raise Mismatch(path, "must be a finite number", wrong_kind=False)
    if isinstance(value, dict):
        return {k: _any(v, (*path, k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_any(v, (*path, i)) for i, v in enumerate(value)]
    return value


def _by_current(value: Any, current: Any, path: tuple[Any, ...]) -> Any:
    """No usable annotation: the current value's shape, recursively."""
    if isinstance(current, dict):
        if not isinstance(value, dict):
            raise Mismatch(path, "must be a dict (JSON object), as it is now")
        return {k: conform(like(current.get(k, MISSING)), v, current.get(k, MISSING), (*path, k))
                for k, v in value.items()}  # fmt: skip
    if isinstance(current, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            raise Mismatch(path, "must be a list, as it is now")
        kinds = {like(c) for c in current}
        if len(kinds) != 1:  # empty, or of mixed kinds: any items
            return _any(value, path)
        item = kinds.pop()
        return [conform(item, v, current[0], (*path, i)) for i, v in enumerate(value)]
    if is_config_object(current):
        return _sub_config(type(current), value, current, path)
    annotation = like(current)
    if annotation is NO_ANNOTATION:  # an object of another kind: its type
        return _instance(type(current), value, path)
    return conform(annotation, value, current, path)


def _union(args: tuple[Any, ...], value: Any, current: Any, path: tuple[Any, ...]) -> Any:
    """The first arm ``value`` fits; else the deepest arm's mismatch (it got furthest into the value)."""
    misses: list[Mismatch] = []
    for arm in args:
        try:
            return conform(arm, value, current, path)
        except Mismatch as e:
            misses.append(e)
    deepest = max(misses, key=lambda m: len(m.path))
    if len(deepest.path) > len(path):
        raise deepest
    specific = [m for m in misses if not m.wrong_kind]  # an arm of the value's own kind
    if len(specific) == 1:
        raise specific[0]
    expected = " | ".join(describe(a) for a in args)
    raise Mismatch(path, f"must be {expected}")


def _instance(cls: type, value: Any, path: tuple[Any, ...]) -> Any:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if cls is float:
        if not number:
            raise Mismatch(path, "must be float")
        if not math.isfinite(value):
            raise Mismatch(path, "must be a finite number", wrong_kind=False)
        return float(value)
    if cls is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise Mismatch(path, "must be int")
    if cls in (dict, list, tuple):
        return conform(cls, value, MISSING, path)
    if isinstance(value, cls):
        return value
    raise Mismatch(path, f"must be {describe(cls)}")


def _sequence(kind: Any, args: tuple[Any, ...], value: Any, current: Any, path: tuple[Any, ...]) -> Any:
    if not isinstance(value, (list, tuple)):
        raise Mismatch(path, f"must be a list ({describe(kind[args] if args else kind)})")
    if not args:  # a bare list: the current value's items decide
        return _by_current(value, current if isinstance(current, (list, tuple)) else [], path)
    if kind is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise Mismatch(path, f"must have {len(args)} items", wrong_kind=False)
        return [conform(a, v, MISSING, (*path, i)) for i, (a, v) in enumerate(zip(args, value))]
    return [conform(args[0], v, MISSING, (*path, i)) for i, v in enumerate(value)]


def _mapping(args: tuple[Any, ...], value: Any, current: Any, path: tuple[Any, ...]) -> Any:
    if not isinstance(value, dict):
        raise Mismatch(path, "must be a dict (JSON object)")
    if not args:  # a bare dict: the current value's keys decide (a nested config's, its fields)
        return _by_current(value, current if isinstance(current, dict) or is_config_object(current) else {}, path)
    key_type, value_type = args
    out = {}
    for k, v in value.items():
        if key_type is int and isinstance(k, str) and k.lstrip("-").isdigit():
            k = int(k)  # a JSON object's keys are strings
        out[conform(key_type, k, MISSING, (*path, k))] = conform(value_type, v, MISSING, (*path, k))
    return out


def _typed_dict(td: Any, value: Any, current: Any, path: tuple[Any, ...]) -> Any:
    if not isinstance(value, dict):
        raise Mismatch(path, f"must be a dict (JSON object) of {td.__name__}")
    known = current if isinstance(current, dict) else {}
    hints = {**{k: like(v) for k, v in known.items()}, **field_hints(td)}  # a key the config has is read
    unknown = [k for k in value if k not in hints]
    if unknown:
        raise Mismatch(path, f"has no key {unknown[0]!r} ({td.__name__} keys: {', '.join(hints)})", wrong_kind=False)
    required = getattr(td, "__required_keys__", frozenset(hints))
    missing = [k for k in hints if k in required and k not in value and not _admits_none(hints[k])]
    if missing:
        raise Mismatch(path, f"needs key {missing[0]!r} ({td.__name__})", wrong_kind=False)
    return {k: conform(hints[k], v, known.get(k, MISSING), (*path, k)) for k, v in value.items()}


def _admits_none(annotation: Any) -> bool:
    if annotation is type(None) or annotation is None or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    return origin in (typing.Union, types.UnionType) and any(_admits_none(a) for a in typing.get_args(annotation))


def _is_config_class(cls: type) -> bool:
    """A transformers config class (a nested config), checked without importing transformers."""
    return any(k.__name__ in ("PreTrainedConfig", "PretrainedConfig") for k in cls.__mro__)


def is_config_object(obj: Any) -> bool:
    return not isinstance(obj, type) and _is_config_class(type(obj))


def _sub_config(cls: type, value: Any, current: Any, path: tuple[Any, ...]) -> Any:
    """A nested config: a dict of its fields, each checked, merged onto the current sub-config (a dict)."""
    if is_config_object(value):
        value = value.to_dict()
    if not isinstance(value, dict):
        raise Mismatch(path, f"must be a dict (JSON object) of {cls.__name__} keys")
    hints = field_hints(cls)
    base = current.to_dict() if is_config_object(current) else {}
    out = dict(base)
    for k, v in value.items():
        now = getattr(current, k, MISSING) if is_config_object(current) else MISSING
        if k in hints:
            out[k] = conform(hints[k], v, now, (*path, k))
        elif now is not MISSING:
            out[k] = conform(NO_ANNOTATION, v, now, (*path, k))
        else:
            raise Mismatch(path, f"has no key {k!r} ({cls.__name__})", wrong_kind=False)
    return out
