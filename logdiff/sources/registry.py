"""The registry of engines: every engine a name stands for, the built-in ones listed here.

The built-in engines (``hf``, ``hf-decode``, ``vllm``, ``vllm-ascend``) are listed by
``_builtin``, which imports their folders on first use; third-party engines (SGLang, Megatron,
a sharded trainer) register through the ``logdiff.sources`` entry-point group, loaded when an
unknown name is asked for, or by ``register``.

The registry lists the implementations and is imported by none of them (design.md: "a
registry that lists implementations does not live in the module the implementations
import"): an engine imports ``base`` (the interface) only, so adding one is its folder and
a line in ``_builtin`` (or an entry point), and no import circle runs through here. The
loaded engines a scan reuses live in ``pool.py``, on top of this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from logdiff.errors import InputError

if TYPE_CHECKING:
    from logdiff.sources.base import Engine

#: engines registered by name beyond the built-in ones (``register``, entry points, a test's ``fake``);
#: the one process-wide table, which ``get_engine`` fills with the built-in ones on first use
ENGINES: dict[str, type[Engine]] = {}


def _builtin() -> tuple[type[Engine], ...]:
    """The engines that ship with logdiff, each its own folder under ``logdiff/sources/``."""
    from logdiff.sources.hf import HFDecode, HFForward
    from logdiff.sources.vllm import VLLMEngine
    from logdiff.sources.vllm_ascend import VLLMAscendEngine

    return (HFForward, HFDecode, VLLMEngine, VLLMAscendEngine)


def register(cls: type[Engine]) -> type[Engine]:
    """Add ``cls`` under ``cls.name`` (replacing any engine of that name); returns ``cls``."""
    ENGINES[cls.name] = cls
    return cls


def _load_builtin() -> None:
    for cls in _builtin():
        ENGINES.setdefault(cls.name, cls)


def get_engine(name: str) -> type[Engine]:
    """The engine class registered under ``name`` (builtin or entry point)."""
    _load_builtin()
    if name not in ENGINES:
        from importlib.metadata import entry_points

        for ep in entry_points(group="logdiff.sources"):
            if ep.name == name:
                register(ep.load())
    if name not in ENGINES:
        raise InputError(f"unknown engine {name!r}; available: {', '.join(sorted(ENGINES))}")
    return ENGINES[name]


def engine_names() -> list[str]:
    """Every registered engine's name, sorted (the built-in ones and those registered so far)."""
    _load_builtin()
    return sorted(ENGINES)
