"""Module-depth probes on a live engine, attached only inside a ``with`` block.

``Recorder`` hooks every module of an engine's real ``nn.Module`` and asks the
engine for the rest (``Engine.probes()``, an ``EngineProbes``): the taps that
map its modules to the adapter's boundaries, each forward's row map, the
functions it calls outside modules (HF's ``apply_rotary_pos_emb``, attention
function and log_softmax; vLLM's logits processor and sampler log_softmax) and
whether a live op can be replayed. Everything installed is removed on exit,
also when the block raises (TransformerLens/nnsight style: no hook outlives
its context). The recorder itself never asks which engine it records.

Threads: a recording patches process-wide functions (HF's ``apply_rotary_pos_emb`` in the model's modeling
module, transformers' attention registry), so one thread records at a time (``_RECORDING``, held from install to
uninstall: two recordings' patches always nest, undone newest first), and a patched function records only in
the thread that installed it (``recording`` is False elsewhere): a trainer's forward in the main thread passes
through the patches of a comparison's replay running in another (``logdiff.integrations.trl``).

How a value becomes a boundary record:

1. The engine announces each pass (``Engine._begin_pass``): which path it is
   (``vllm`` decode, ``vllm-prefill``, ``hf``, ``hf-decode``), which sequences
   it runs and, for a serving engine, the request counter. Passes of paths nobody
   asked for are ignored.
2. When the model's forward starts (or its decoder's alone, ``model.base_model``:
   a fused log-prob head calls it, then its own kernel on ``lm_head.weight``),
   the engine's probes build the pass's ``RowMap`` (row -> sequence, position; ``align``), or the caller's ``rows``
   does (a capture in a vLLM worker numbers requests as it first sees them).
   The fed token ids are checked against the sequences; a row that does not
   match is dropped and counted as misaligned.
3. Module hooks keep a call stack of names (so vLLM's one shared
   ``rotary_emb`` is told apart per layer) and fire the engine's taps that
   match; each tap yields boundary tensors, which become ``[rows, width]`` and
   go to the pass's sinks.
4. Sinks: the first path's passes go to a ``store.PathStore`` on disk; the
   second path's go to a ``summary.PathComparer`` per stored path, which
   compares on the spot and, with the ``replay.ReplaySpec`` an engine's probes
   attach, re-runs the live op on the stored path's inputs. An MoE model's router rows
   also go to a ``routing.RouterSink`` per (role, path), kept in memory for the
   routing diagnostics.

``session.ProbeSession`` owns the temporary directory, the stores and
comparers of one scan, and hands ``locate`` what it needs per (train, infer) pair.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from logdiff.probes import selection
from logdiff.probes.align import HEADS_FIRST, PLAIN, Layout, RowMap
from logdiff.probes.correspondence import CorrespondenceMap, Tap
from logdiff.probes.ops import OpTracer
from logdiff.phases import COSTS_ON, add_cost
from logdiff.probes.patching import Patches

def _timed_hooks(rec: Recorder) -> tuple[Callable[..., None], Callable[..., None]]:
    """The recorder's two hooks, each call's time added to ``COSTS["hooks (<pass>)"]`` (``logdiff.phases``:
    ``LOGDIFF_COSTS=1``): a capture's Python per hook, its copies and in-hook sketches included."""
    import time

    def timed(hook: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any, **kwargs: Any) -> None:
            path = rec.pass_.path if rec.pass_ is not None else None
            if path is None:
                return hook(*args, **kwargs)
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return hook(*args, **kwargs)
            finally:
                add_cost(f"hooks ({path})", time.perf_counter() - wall, time.thread_time() - cpu)

        return run

    return timed(rec._pre), timed(rec._post)


_DECODER_LAYER = re.compile(r"^model\.layers\.\d+$")
#: held by the thread whose recording's patches are installed (re-entrant: a recording inside a recording)
_RECORDING = threading.RLock()


@dataclass
class Pass:
    """One announced pass: its path, the sequences it runs and their known token ids."""

    path: str
    sequences: list[int]
    request_base: int | None
    sinks: list[Any]
    lengths: list[int]
    known: np.ndarray  # [num_sequences, max_len] token ids, -1 where unknown


class EngineProbes(Protocol):
    """What a recorder asks of the engine it hooks (``Engine.probes()``: one fresh instance per recording).

    Every engine-specific step of a recording lives behind this: the rest of the
    recorder is the same for any engine.
    """

    def taps(self, cmap: CorrespondenceMap) -> list[Tap]:
        """Where this engine's modules expose ``cmap``'s boundaries (the engine's ``TapMapping``)."""

    def install(self, rec: Recorder) -> None:
        """Wrap what the engine computes outside its modules (through ``rec.patches``, undone on exit)."""

    def begin_step(self, rec: Recorder, args: tuple, kwargs: dict) -> None:
        """The model's forward starts (before its row map is built): read the batch's layout once."""

    def rows(self, rec: Recorder, p: Pass, args: tuple, kwargs: dict) -> RowMap:
        """Row -> (sequence, position) of the forward starting now (``align``)."""

    def step_kind(self, ids: Any) -> str:
        """``prefill`` or ``decode``: which kind of step the forward starting now is."""

    def end_step(self, rec: Recorder, output: Any) -> None:
        """The model's forward returned ``output``."""

    def after_module(self, rec: Recorder, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        """A module outside the decoder stack returned (a logits processor the engine calls itself)."""

    def replay(self, rec: Recorder, name: str, module: Any, args: tuple, tap: Tap, value: Any) -> Any:
        """A ``replay.ReplaySpec`` re-running the live op that produced boundary ``name``, or None."""

    def reset(self) -> None:
        """The recording ended: drop what the last forwards left (their outputs, their batch)."""


class Recorder:
    """Hooks on one engine; records boundaries into per-path sinks."""

    def __init__(
        self,
        engine: Any,
        cmap: CorrespondenceMap,
        sinks_for: Callable[[str], list[Any]],
        seqs: list[Any],
        response_len: int,
        tracer: OpTracer | None = None,
        rows: Callable[[tuple, dict], RowMap] | None = None,
    ):
        self.engine = engine
        self.probes: EngineProbes = engine.probes()  # NotImplementedError: an engine that cannot be probed
        self.rows = rows  # a caller's row map of each forward (a capture that numbers sequences as it sees them)
        self.cmap = cmap
        self.sinks_for = sinks_for
        self.seqs = seqs
        self.response_len = response_len
        self.tracer = tracer
        self.warnings: list[str] = []
        self.owners: dict[str, str] = {}  # boundary -> module (call-stack name) that produced it
        self.misaligned_rows = 0
        self.steps = 0
        self.patches = Patches()  # every hook and patch of this recording, undone on exit
        self.stack: list[tuple[str, Any]] = []  # (call-stack name, module) of the modules running now
        self.context: dict[str, Any] = {}  # this layer's boundary values so far (replays read their inputs here)
        self.pass_: Pass | None = None
        self.rmap: RowMap | None = None  # rows of the forward running now
        self.last_rmap: RowMap | None = None  # rows of the last forward (what logits and log_softmax run after)
        self._paused = False
        self._tap_cache: dict[tuple[str, str], list[tuple[Tap, list[str | None]]]] = {}
        self._compiled = [(t, t.regex()) for t in self.probes.taps(cmap)]
        self._child_names: dict[tuple[int, int], str | None] = {}
        self._roots: set[int] = set()  # the modules whose forward is a step: the model's, its decoder's
        self._thread: int | None = None  # the thread that installed the recording (the only one it records)

    # ---- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Recorder:
        _RECORDING.acquire()
        self._thread = threading.get_ident()
        try:
            self.model = self.engine.module()
            self.names = {id(m): n for n, m in self.model.named_modules()}
            base = getattr(self.model, "base_model", None)  # an HF decoder that a fused head calls alone
            self._roots = {id(self.model)} | ({id(base)} if id(base) in self.names else set())
            self._leaves = {id(m) for _, m in self.model.named_modules() if not m._modules}
            pre, post = _timed_hooks(self) if COSTS_ON else (self._pre, self._post)
            for _, m in self.model.named_modules():
                h1 = m.register_forward_pre_hook(pre, with_kwargs=True)
                h2 = m.register_forward_hook(post, with_kwargs=True, always_call=True)
                self.patches.on_exit(h1.remove)
                self.patches.on_exit(h2.remove)
            self.use_tracer(self.tracer)
            self.probes.install(self)
            self.patches.set(self.engine, "listener", self)
        except BaseException:
            self._uninstall()
            raise
        return self

    def use_tracer(self, tracer: OpTracer | None) -> None:
        """Trace ops into ``tracer`` (``--depth ops``) whenever recording is not paused (a replay pauses it)."""
        self.tracer = tracer
        if tracer is not None:
            tracer.active = lambda: not self._paused

    def __exit__(self, *exc: Any) -> None:
        self._uninstall()
        if self.misaligned_rows:
            self.warn(f"{self.misaligned_rows} token rows did not carry the expected token ids and were dropped")

    def _uninstall(self) -> None:
        try:
            self.patches.close()
            self.probes.reset()
            self.pass_ = None
            self.rmap = self.last_rmap = None
            self.context.clear()
            self.stack.clear()
        finally:
            if self._thread is not None:
                self._thread = None
                _RECORDING.release()

    def warn(self, msg: str) -> None:
        if msg not in self.warnings:
            self.warnings.append(msg)

    @property
    def recording(self) -> bool:
        """A pass someone asked for is running in this recording's thread, and no replay has paused the recording."""
        return self.pass_ is not None and not self._paused and threading.get_ident() == self._thread

    @property
    def wants_replay(self) -> bool:
        """Whether a sink of the running pass re-runs live ops (worth building their replays)."""
        return self.pass_ is not None and any(getattr(s, "wants_replay", False) for s in self.pass_.sinks)

    # ---- passes and steps -----------------------------------------------------------------

    def begin_pass(self, path: str, sequences: list[int], request_base: int | None = None) -> None:
        """Called by the engine before it runs ``sequences`` as path ``path``."""
        sinks = self.sinks_for(path)
        if not sinks:
            self.pass_ = None
            return
        lengths = [
            len(s.prompt_ids) + (len(s.response_ids) if s.response_ids else self.response_len) for s in self.seqs
        ]
        known = np.full((len(self.seqs), max(lengths)), -1, dtype=np.int64)
        for i, s in enumerate(self.seqs):
            ids = list(s.prompt_ids) + list(s.response_ids or [])
            known[i, : len(ids)] = ids
        self.pass_ = Pass(path, list(sequences), request_base, sinks, lengths, known)

    def _begin_step(self, args: tuple, kwargs: dict) -> None:
        assert self.pass_ is not None
        p = self.pass_
        try:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                raise ValueError("the forward got no input_ids")
            self.probes.begin_step(self, args, kwargs)
            rmap = self.rows(args, kwargs) if self.rows is not None else self.probes.rows(self, p, args, kwargs)
        except Exception as e:  # noqa: BLE001 - a pass we cannot align is reported, not fatal
            self.warn(f"{p.path}: could not align a forward pass to token positions ({type(e).__name__}: {e})")
            self.rmap = None
            return
        flat = ids.reshape(-1).detach().cpu().numpy().astype(np.int64)
        v = np.nonzero(rmap.valid)[0]
        inside = rmap.pos[v] < p.known.shape[1]
        v = v[inside]
        expected = p.known[rmap.seq[v], rmap.pos[v]]
        wrong = v[(expected >= 0) & (expected != flat[v])]
        if len(wrong):
            self.misaligned_rows += len(wrong)
            rmap.valid[wrong] = False
        self.rmap = rmap
        self.steps += 1
        if self.tracer is not None:
            self.tracer.step = self.probes.step_kind(ids)

    def _end_step(self, output: Any) -> None:
        self.probes.end_step(self, output)
        self.last_rmap = self.rmap
        self.rmap = None
        self.context.clear()

    # ---- module hooks ---------------------------------------------------------------------

    def _resolve(self, module: Any) -> str:
        if self.stack:
            parent_name, parent = self.stack[-1]
            key = (id(parent), id(module))
            if key not in self._child_names:
                self._child_names[key] = next((k for k, v in parent._modules.items() if v is module), None)
            attr = self._child_names[key]
            if attr is not None:
                return f"{parent_name}.{attr}" if parent_name else attr
        return self.names.get(id(module), type(module).__name__)

    def _pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self._paused or self.pass_ is None:
            return None
        name = self._resolve(module)
        self.stack.append((name, module))
        if self.tracer is not None:
            self.tracer.enter(name)
        if len(self.stack) == 1 and id(module) in self._roots:
            self._begin_step(args, kwargs)
        if _DECODER_LAYER.match(name):
            self.context.clear()
        if self.rmap is not None:
            value = args[0] if args else next((v for v in kwargs.values() if _is_tensor(v)), None)
            if value is not None:
                self._taps(name, module, "input", value, args, kwargs)
        return None

    def _post(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if not self.stack or self.stack[-1][1] is not module:
            return None
        name = self.stack[-1][0]
        try:
            if not self._paused:
                if self.rmap is not None:
                    self._taps(name, module, "output", output, args, kwargs)
                if len(self.stack) == 1 and id(module) in self._roots:
                    self._end_step(output)
                elif len(self.stack) == 1:
                    self.probes.after_module(self, module, args, kwargs, output)
        finally:
            self.stack.pop()
            if self.tracer is not None:
                self.tracer.exit(name)
        return None

    def _matching(self, name: str, source: str, module: Any) -> list[tuple[Tap, list[str | None]]]:
        """The taps module ``name``'s ``source`` side feeds, each with the boundary names it yields there (None: a
        name the adapter does not map); found once per module and side (the hooks run per module call)."""
        key = (name, source)
        hit = self._tap_cache.get(key)
        if hit is None:
            hit = []
            for tap, rx in self._compiled:
                if tap.source != source:
                    continue
                if not self.cmap.mapped and id(module) not in self._leaves:
                    continue
                m = rx.match(name)
                if m:
                    layer = m.groupdict().get("N")
                    names = self.cmap.names_for(tap, int(layer) if layer is not None else None, name)
                    hit.append((tap, [None if self.cmap.mapped and n is not None and self.cmap.get(n) is None else n
                                      for n in names]))
            self._tap_cache[key] = hit
        return hit

    def _taps(self, name: str, module: Any, source: str, value: Any, args: tuple, kwargs: dict) -> None:
        matching = self._matching(name, source, module)
        if not matching:
            return
        replays = self.wants_replay
        for tap, names in matching:
            tensors = self.select(tap.select, value)
            if tensors is None:
                continue
            for bname, t in zip(names, tensors):
                if bname is None or t is None:
                    continue
                self.context[bname] = t
                if tap.emit:
                    spec = self.probes.replay(self, bname, module, args, tap, t) if replays else None
                    # an input tap reads a value its parent computed (a residual add, act * up)
                    owner = self.stack[-2][0] if source == "input" and len(self.stack) >= 2 else name
                    layout = HEADS_FIRST if tap.select == "heads_first" else PLAIN
                    self.emit(bname, t, layout, self.rmap, spec, owner)

    def select(self, how: str, value: Any) -> list[Any] | None:
        """The tensors a tap's ``select`` pulls out of a module's input or output (``selection.select``)."""
        caller = self.stack[-2][1] if len(self.stack) >= 2 else None
        return selection.select(how, value, caller, self.warn)

    def emit(
        self, name: str, tensor: Any, layout: Layout, rmap: RowMap | None, spec: Any, owner: str | None = None
    ) -> None:
        """Send boundary ``name``'s value (rows ``rmap``) to the pass's sinks, with its replay ``spec``."""
        if rmap is None or self.pass_ is None:
            return
        try:
            rows = layout.to_rows(tensor.detach(), len(rmap))
        except ValueError as e:
            self.warn(f"{self.pass_.path}: {name}: {e}")
            return
        self.owners.setdefault(name, owner or (self.stack[-1][0] if self.stack else name))
        self._paused = True
        try:
            for sink in self.pass_.sinks:
                sink.emit(name, rows, rmap, spec if getattr(sink, "wants_replay", False) else None)
        except Exception as e:  # noqa: BLE001 - a probe must never break the engine's own run
            self.warn(f"{self.pass_.path}: probe failed at {name} ({type(e).__name__}: {e}); values incomplete")
        finally:
            self._paused = False

    # ---- what engines' probes use -------------------------------------------------------------

    @contextlib.contextmanager
    def traced(self, function: str) -> Iterator[str]:
        """Trace a function the engine calls outside modules as a pseudo-module ``<caller>.<function>``."""
        name = f"{self.stack[-1][0]}.{function}" if self.stack else function
        on = self.tracer is not None and self.recording
        if on:
            self.tracer.enter(name)
        try:
            yield name
        finally:
            if on:
                self.tracer.exit(name)


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)
