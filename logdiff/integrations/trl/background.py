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

The bound: at most ``queue`` comparisons wait behind the one running, so the copies of the model held at once stay
at ``queue + 1``. A step that finds them all taken is **not compared** (``when_full="skip"``, the default): it
does not wait, one log line says which step and where its bundles stay for an offline ``logdiff compare`` (written
whole all the same), and the step is in ``Instrument.skipped``. The step waits for nothing but its capture (and,
for a step compared, its copy of the model). ``when_full="wait"`` keeps every captured step compared instead: a
step that finds the queue full waits for a slot, with one line. Either way, choose ``every`` so that a comparison
finishes within ``every`` steps.

The worker thread runs at the lowest CPU priority (``lower_priority``: nice 19 for that thread alone, Linux only;
the threads torch starts for its kernels inherit it): where it and the training want the same cores, the training
gets them, and the comparison takes what the training leaves.
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

from logdiff.phases import lower_priority

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


class Snapshots:
    """The frozen copies of one model the comparisons use, made once (``snapshot``) and refreshed in place at the
    next compared step (``take``): copying a step's tensors into a copy already made costs the memory traffic of the
    weights alone, where a ``deepcopy`` rebuilt every module, parameter and closure (0.5 to 1.3 CPU s per step on
    SmolLM2 in bfloat16). A copy is held by one comparison at a time (``give_back`` frees it); at most ``queue + 1``
    are made, as many as comparisons run or wait."""

    def __init__(self) -> None:
        self._free: list[Any] = []
        self._lock = threading.Lock()

    def take(self, model: Any) -> Any:
        """A copy of ``model`` as it is now, for one comparison: a free one refreshed, else a new ``snapshot``."""
        with self._lock:
            frozen = self._free.pop() if self._free else None
        return snapshot(model) if frozen is None or not refresh(frozen, model) else frozen

    def give_back(self, frozen: Any) -> None:
        with self._lock:
            self._free.append(frozen)


def refresh(frozen: Any, model: Any) -> bool:
    """Make ``frozen`` (a ``snapshot`` of ``model``) ``model`` as it is now, in place: every parameter and buffer
    copied, each module's training flag and the fused head's temperature (a closure cell, ``fused_head.py``) set;
    False (``frozen`` untouched) where the two no longer have the same modules, or tensors of the same names, shapes
    and dtypes."""
    import torch

    from logdiff.integrations.trl.fused_head import fused_head_temperature

    source = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    target = {**dict(frozen.named_parameters()), **dict(frozen.named_buffers())}
    if (source.keys() != target.keys() or [n for n, _ in model.named_modules()] != [n for n, _ in frozen.named_modules()]
            or any(source[k].shape != t.shape or source[k].dtype != t.dtype for k, t in target.items())):
        return False
    with torch.no_grad():
        for name, t in target.items():
            t.copy_(source[name])
    for copied, live in zip(frozen.modules(), model.modules()):
        copied.training = live.training
    temperature = fused_head_temperature(model)
    if temperature is not None:
        fused_head_temperature(frozen, temperature)
    return True


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


WHEN_FULL = ("skip", "wait")  # what a job submitted to a full queue does: not run, or wait for a slot


class Worker:
    """One daemon thread, at the lowest CPU priority, running jobs in the order given; at most ``queue`` wait behind
    the one running. ``submit`` to a full queue skips the job (``when_full="skip"``) or waits for a slot."""

    def __init__(self, queue: int, name: str = "logdiff-compare", when_full: str = "skip"):
        if queue < 0:
            raise ValueError(f"instrument: queue={queue}, expected 0 or more comparisons waiting")
        if when_full not in WHEN_FULL:
            raise ValueError(f"instrument: when_full={when_full!r}, expected one of {', '.join(WHEN_FULL)}")
        self.queue, self.name, self.when_full = queue, name, when_full
        self._slots = threading.Semaphore(queue + 1)  # the running job and the waiting ones
        self._jobs: queues.Queue[Callable[[], None] | None] = queues.Queue()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # a job's exception, raised by ``raise_error`` in the caller's thread
        self.waited_s = 0.0  # how long steps waited for a free slot, all together (``when_full="wait"``)
        self.skipped = 0  # jobs not run: the queue was full (``when_full="skip"``)

    def submit(self, what: str, prepare: Callable[[], Callable[[], None]]) -> bool:
        """Run ``prepare()`` here once a slot is free (it makes what the job needs from the step: the model's copy),
        then its job in the worker; True. With every slot taken: False at once, nothing prepared or run
        (``when_full="skip"``: the caller says what is left undone), or wait for a slot with one line."""
        if not self._slots.acquire(blocking=False):
            if self.when_full == "skip":
                self.skipped += 1
                return False
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
        return True

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
        lower_priority()
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

