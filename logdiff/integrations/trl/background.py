"""The captured steps' comparisons, run after their step by one worker thread, at most ``queue`` waiting.

Why a thread and not a process: the comparison replays the trainer's ops on the trainer's model, and a process
would need that model rebuilt from a copy sent to it (pickled, or saved per step), in a second torch runtime
beside vLLM's. A thread shares the process; what it must not share is the live model, whose weights the next
optimizer step changes while the comparison still reads them (the conformance check's fingerprints, the replay's
forward): the step hands the worker a frozen copy (``snapshot``: the weights only, no gradient, no optimizer
state), and the comparison's recording never touches the trainer's modules. The recorder's process-wide patches
(HF's rope function, the attention registry) act only in the thread that installed them, and one thread records
at a time (``logdiff/probes/record.py``): a captured step's recording waits for a replay in progress, the
trainer's other forwards pass through. numpy and torch release the GIL in their kernels; the comparison's own
Python does not, and shares the trainer's cores (``bench/bench_trl_step.py`` measures both).

The bound: at most ``queue`` comparisons wait behind the one running. A step that finds them all taken **waits**
for one to finish (one log line says so and names ``every``): every captured step is compared, and the copies of
the model held at once stay at ``queue + 1``. Choose ``every`` so that a comparison finishes within ``every``
steps and no step ever waits.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import queue as queues
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("logdiff.trl")


def snapshot(model: Any) -> Any:
    """A frozen copy of ``model`` as it is now: its parameters and buffers copied on their device, nothing that
    trains (no gradient, ``requires_grad`` off). The optimizer's state is not the model's and is not copied.

    The forwards set on a module instance are rebound to the copy (``_rebound``): TRL's fused-head forward and
    accelerate's autocast wrapper are closures over the *original* model's ``forward``, which ``copy.deepcopy``
    keeps as they are (it copies no function), so the copy's ``forward`` would run the live model: the weights the
    optimizer is changing, and modules the comparison's recorder never hooked (its replay recorded no boundary)."""
    import copy

    import torch

    memo: dict[int, Any] = {}
    with torch.no_grad():
        frozen = copy.deepcopy(model, memo)
    for module in frozen.modules():
        for name, value in list(vars(module).items()):
            if callable(value) and not isinstance(value, torch.nn.Module) and name not in ("_parameters", "_buffers"):
                rebound = _rebound(value, memo, {})
                if rebound is not value:
                    object.__setattr__(module, name, rebound)
    frozen.requires_grad_(False)
    return frozen


def _rebound(value: Any, memo: dict[int, Any], seen: dict[int, Any]) -> Any:
    """``value`` with every reference to an object ``copy.deepcopy`` copied (``memo``: the original's id -> its
    copy) replaced by the copy, through bound methods, ``functools.partial`` and the cells of closures, nested
    (``seen``: what is being rebuilt, so that a function closing over itself ends), and the callable attributes of a
    callable object; anything else as it is (a module or tensor of the model is in ``memo``)."""
    import types

    key = id(value)
    if key in seen:
        return seen[key]
    copied = memo.get(key)
    if copied is not None and copied is not memo.get(id(memo)):  # deepcopy keeps its originals under id(memo)
        return copied
    if isinstance(value, types.MethodType):
        func, owner = _rebound(value.__func__, memo, seen), _rebound(value.__self__, memo, seen)
        return value if func is value.__func__ and owner is value.__self__ else types.MethodType(func, owner)
    if isinstance(value, functools.partial):
        func = _rebound(value.func, memo, seen)
        args = tuple(_rebound(a, memo, seen) for a in value.args)
        kwargs = {k: _rebound(v, memo, seen) for k, v in value.keywords.items()}
        same = func is value.func and all(a is b for a, b in zip(args, value.args)) and all(
            kwargs[k] is v for k, v in value.keywords.items())
        return value if same else functools.partial(func, *args, **kwargs)
    if isinstance(value, types.FunctionType) and value.__closure__:
        cells = tuple(types.CellType() for _ in value.__closure__)
        rebuilt = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, cells)
        seen[key] = rebuilt
        changed = False
        for cell, old in zip(cells, value.__closure__):
            try:
                content = old.cell_contents
            except ValueError:  # an empty cell (a name not yet bound where the function was made)
                continue
            new = _rebound(content, memo, seen)
            changed |= new is not content
            cell.cell_contents = new
        if not changed:
            del seen[key]
            return value
        rebuilt.__kwdefaults__ = value.__kwdefaults__
        rebuilt.__dict__.update(value.__dict__)  # functools.wraps' __wrapped__ and the rest
        rebuilt.__qualname__, rebuilt.__module__, rebuilt.__doc__ = value.__qualname__, value.__module__, value.__doc__
        return rebuilt
    if (callable(value) and isinstance(getattr(value, "__dict__", None), dict)
            and not isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType))):
        # a callable object holding the forward it wraps (accelerate's ``ConvertOutputsToFp32``): a shallow copy
        # with its callable attributes rebound (made without ``copy.copy``: that one refuses to be pickled)
        attrs = dict(vars(value))
        try:
            clone = object.__new__(type(value))
        except TypeError:  # a type ``object.__new__`` cannot make: left as it is
            return value
        seen[key] = clone
        changed = False
        for name, attr in attrs.items():
            if callable(attr):
                attrs[name] = _rebound(attr, memo, seen)
                changed |= attrs[name] is not attr
        if not changed:
            del seen[key]
            return value
        vars(clone).update(attrs)
        return clone
    return value


class Worker:
    """One daemon thread running jobs in the order given; ``submit`` waits while ``queue`` jobs wait already."""

    def __init__(self, queue: int, name: str = "logdiff-compare"):
        if queue < 0:
            raise ValueError(f"instrument: queue={queue}, expected 0 or more comparisons waiting")
        self.queue, self.name = queue, name
        self._slots = threading.Semaphore(queue + 1)  # the running job and the waiting ones
        self._jobs: queues.Queue[Callable[[], None] | None] = queues.Queue()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # a job's exception, raised by ``raise_error`` in the caller's thread
        self.waited_s = 0.0  # how long steps waited for a free slot, all together

    def submit(self, what: str, prepare: Callable[[], Callable[[], None]]) -> None:
        """Run ``prepare()`` here once a slot is free (it makes what the job needs from the step: the model's copy),
        then its job in the worker. Waits, with one line, while every slot is taken."""
        if not self._slots.acquire(blocking=False):
            log.warning("logdiff %s waits: %d comparison(s) still running or queued (queue=%d); capture less often "
                        "(a larger every=) so that one finishes between two captures", what, self.queue + 1,
                        self.queue)
            start = time.perf_counter()
            self._slots.acquire()
            self.waited_s += time.perf_counter() - start
        try:
            job = prepare()
        except BaseException:
            self._slots.release()
            raise
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._jobs.put(functools.partial(contextvars.copy_context().run, job))  # the step's context variables

    def pending(self) -> int:
        """Jobs submitted and not finished."""
        return self._jobs.unfinished_tasks

    def finish(self) -> None:
        """Block until every submitted job has run."""
        self._jobs.join()

    def close(self) -> None:
        """Finish every job, then end the thread."""
        if self._thread is None:
            return
        self._jobs.put(None)
        self._thread.join()
        self._thread = None

    def raise_error(self) -> None:
        """Raise (once) what a job raised, in the calling thread."""
        error, self.error = self.error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                job()
            except BaseException as e:  # noqa: BLE001 - kept for the trainer's thread (``raise_error``)
                self.error = e
            finally:
                if job is not None:
                    self._slots.release()
                self._jobs.task_done()


class TrainEnd:
    """A trainer callback that finishes the pending comparisons when training ends (TRL calls every other
    event too: nothing to do)."""

    def __init__(self, finish: Any):
        self.finish = finish

    def on_train_end(self, *_: Any, **__: Any) -> None:
        self.finish()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda *_, **__: None
        raise AttributeError(name)

