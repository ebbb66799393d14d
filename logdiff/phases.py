"""Scan progress and per-phase wall time, through the pipeline's one ``progress`` callback.

The pipeline, ``diagnose`` and ``attribute`` report what they do by calling
``progress(msg)``. A call may also name the phase it starts (``phase="load"``)
and, in a counted phase, how far it is (``step=(k, n)``: rescan k of n).
``Phases`` is that callable: it times each phase (``timings``: phase name ->
seconds, summed when a phase recurs) and passes every update to a listener,
which is the CLI's rich progress display (logdiff/commands/cli_app.py), or a plain
``msg -> None`` function (``Phases.of``). Nothing here knows about terminals.

``peak_rss_bytes`` reads the process's peak resident set size, for the scan's cost line and
the capture's writer, whose host copies are bounded by a share of it (``bundle_writer.HOLD_SHARE``).
``getrusage(RUSAGE_SELF).ru_maxrss`` is in KiB on Linux and in bytes on macOS.

``costs``: where a captured step's time goes (``bench/bench_trl_step.py``'s breakdown). Off unless the
environment sets ``LOGDIFF_COSTS=1`` when this module is first imported; then each ``timed(part)`` block adds its
calls, wall seconds and its own thread's CPU seconds to ``COSTS[part]`` (any thread: the writer's too). Off, a
timed block costs one global test: the hooks it wraps run hundreds of times per step.

``lower_priority``: the thread that calls it (logdiff's own, beside a training step) at the lowest CPU priority.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size in bytes; None where ``resource`` is missing (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


@dataclass(frozen=True)
class Update:
    """One progress report: the phase, what it does now, how far (step of total) and since when."""

    phase: str
    message: str
    step: Optional[int]
    total: Optional[int]
    started: float  # the phase's start, on ``time.monotonic``'s clock


Listener = Callable[[Update], None]


def silent(msg: str, **_: Any) -> None:
    """A progress callback that shows nothing (the default of every function that reports progress)."""


class Phases:
    """The ``progress`` callable that also times each phase of a scan."""

    def __init__(self, listener: Optional[Listener] = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.timings: dict[str, float] = {}
        self._listener = listener
        self._clock = clock
        self._phase: Optional[str] = None
        self._started = clock()

    @classmethod
    def of(cls, progress: Any) -> "Phases":
        """``progress`` itself when it is a ``Phases``, else one that passes each message to it."""
        if isinstance(progress, Phases):
            return progress
        if progress is None or progress is silent:
            return cls()
        return cls(lambda update: progress(update.message))

    def __call__(self, msg: str, phase: Optional[str] = None, step: Optional[tuple[int, int]] = None) -> None:
        """Report ``msg``; with ``phase``, a new phase starts (unless it is the current one)."""
        if phase is not None and phase != self._phase:
            self._stop()
            self._phase, self._started = phase, self._clock()
        if self._listener is not None:
            k, n = step if step is not None else (None, None)
            self._listener(Update(self._phase or "scan", msg, k, n, self._started))

    def _stop(self) -> None:
        if self._phase is not None:
            elapsed = self._clock() - self._started
            self.timings[self._phase] = round(self.timings.get(self._phase, 0.0) + elapsed, 3)
        self._phase = None

    def close(self) -> dict[str, float]:
        """Stop the current phase's clock; the timings so far."""
        self._stop()
        return dict(self.timings)


#: part -> [calls, wall seconds, CPU seconds of the thread that ran it] (``LOGDIFF_COSTS=1``; see the module docstring)
COSTS: dict[str, list[float]] = {}
COSTS_ON = os.environ.get("LOGDIFF_COSTS") == "1"
_COSTS_LOCK = threading.Lock()


class _Timed:
    __slots__ = ("part", "wall", "cpu")

    def __init__(self, part: str):
        self.part = part

    def __enter__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def __exit__(self, *_: Any) -> None:
        add_cost(self.part, time.perf_counter() - self.wall, time.thread_time() - self.cpu)


_UNTIMED = contextlib.nullcontext()  # reusable: one object for every untimed block


def timed(part: str) -> Any:
    """A block whose wall and thread CPU seconds go to ``COSTS[part]`` when costs are on (else nothing)."""
    return _Timed(part) if COSTS_ON else _UNTIMED


def add_cost(part: str, wall: float, cpu: float, calls: int = 1) -> None:
    with _COSTS_LOCK:
        row = COSTS.setdefault(part, [0, 0.0, 0.0])
        row[0] += calls
        row[1] += wall
        row[2] += cpu


def costs_since(before: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """``COSTS`` minus an earlier ``{part: [calls, wall, cpu]}`` copy of it: {part: {calls, wall_s, cpu_s}}."""
    with _COSTS_LOCK:
        now = {k: list(v) for k, v in COSTS.items()}
    out = {}
    for part, (calls, wall, cpu) in now.items():
        c0, w0, p0 = before.get(part, (0, 0.0, 0.0))
        if calls - c0:
            out[part] = {"calls": int(calls - c0), "wall_s": wall - w0, "cpu_s": cpu - p0}
    return out


def costs_copy() -> dict[str, list[float]]:
    with _COSTS_LOCK:
        return {k: list(v) for k, v in COSTS.items()}


def lower_priority() -> None:
    """The calling thread, and the threads it starts from now on, at the lowest CPU priority (nice 19). Linux only:
    there a thread has a nice value of its own (``setpriority`` on its thread id); elsewhere the call would renice
    the whole process, and nothing is done. A kernel that refuses (a sandbox) leaves the priority as it is.

    Two of logdiff's threads run beside a training step, and take what CPU the step leaves: the bundle writers
    (``records/bundle_writer.py``) and the TRL comparisons (``integrations/trl/background.py``)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError as e:
        import logging

        logging.getLogger("logdiff").debug("logdiff: a thread keeps its CPU priority (%s)", e)
