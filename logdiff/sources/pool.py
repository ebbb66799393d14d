"""Loaded engines, reused across scans in one process: the pool.

Loading an engine is the slow part of a scan, so engines stay loaded by (name, spec). One
pool is current at a time (``engine_pool`` scopes another, e.g. for a test); an exclusive
engine (vLLM holds process-wide state) evicts every other instance of its class first, in
whichever pool it lives. This is the one place that process-wide state lives, with its
reset (``release_all``); it finds engine classes through ``registry`` and is imported by no
engine.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from contextvars import ContextVar

from logdiff.sources.base import Engine, EngineSpec
from logdiff.sources.registry import get_engine


class EnginePool:
    """Loaded engines by (name, spec): loading is the slow part, so scans reuse them.

    One pool is current at a time (``engine_pool`` scopes another, e.g. for a
    test). An exclusive engine (vLLM holds process-wide state) evicts every
    other instance of its class first, in whichever pool it lives.
    """

    def __init__(self) -> None:
        self._engines: dict[tuple[str, EngineSpec], Engine] = {}
        _POOLS.add(self)

    def __contains__(self, key: tuple[str, EngineSpec]) -> bool:
        return key in self._engines

    def __len__(self) -> int:
        return len(self._engines)

    def acquire(self, name: str, spec: EngineSpec) -> Engine:
        """The loaded engine for (name, spec), loading it on first use."""
        key = (name, spec)
        cls = get_engine(name)
        cls.check_available()  # on every use (the environment may have changed), before evicting a working sibling
        if key in self._engines:
            return self._engines[key]
        if cls.exclusive:
            for pool in list(_POOLS):
                pool._evict(cls)
        engine = cls(spec)
        self._engines[key] = engine
        return engine

    def release(self) -> None:
        """Close every engine of this pool."""
        while self._engines:
            self._engines.popitem()[1].close()

    def _evict(self, cls: type[Engine]) -> None:
        for key in [k for k, e in self._engines.items() if type(e) is cls]:
            self._engines.pop(key).close()


_POOLS: weakref.WeakSet[EnginePool] = weakref.WeakSet()
_CURRENT: ContextVar[EnginePool] = ContextVar("logdiff_engine_pool", default=EnginePool())


def current_pool() -> EnginePool:
    """The pool scans load engines into: the process-wide one, unless ``engine_pool`` scoped another."""
    return _CURRENT.get()


@contextlib.contextmanager
def engine_pool(pool: EnginePool | None = None) -> Iterator[EnginePool]:
    """Scans inside the block use ``pool`` (a fresh one by default), released on exit if fresh."""
    scoped = pool if pool is not None else EnginePool()
    token = _CURRENT.set(scoped)
    try:
        yield scoped
    finally:
        _CURRENT.reset(token)
        if pool is None:
            scoped.release()


def acquire(name: str, spec: EngineSpec) -> Engine:
    """A loaded engine for (name, spec) from the current pool, reused across scans in this process."""
    return current_pool().acquire(name, spec)


def release_all() -> None:
    """Close every engine of the current pool."""
    current_pool().release()
