"""Capture inside vLLM's worker processes: a vLLM general plugin, switched on by ``LOGDIFF_CAPTURE=DIR``.

logdiff registers ``register`` under vLLM's ``vllm.general_plugins`` entry point
group, so vLLM calls it in every process it starts: the front end, the engine
core and each worker. Without ``LOGDIFF_CAPTURE`` it returns at once (importing
this module costs numpy and logdiff's bundle code: no torch, no vLLM). With it, it
wraps the worker's ``load_model``: once a worker has loaded its model, a
``VllmCapture`` is installed on it, recording every forward of that worker into
``DIR`` (role ``infer``) as the worker's rank, until the worker shuts down: whole
records for the first ``LOGDIFF_CAPTURE_WINDOW`` decoder layers (2; ``all`` for
every layer) and those of no layer, row sketches for the rest (``logdiff/records/sketch.py``).
Nothing in the user's code changes: a verl or OpenRLHF rollout worker gets it from
the environment variable alone, at any tensor-parallel size, in vLLM's multi-process
engine or in-process.

``VllmCapture`` is ``probes.capture.Capture`` (the same ``Recorder``, taps and
``BundleSink``) with what a serving engine needs instead of a trainer's batch:

* sequences are not known in advance: each new request id becomes the next
  capture sequence, in order of first sight (every rank of a ``tp`` group sees
  the same batches, so they number alike). A step's rows are the forward's
  flattened tokens; each carries (sequence, position, token id), from vLLM's
  ``query_start_loc``, the batch's request ids and the ``positions`` it was fed;
* each record's placement comes from the producing layer's type
  (``placements.py``); norms, RoPE, attention and the activation follow their
  inputs; logits are trimmed to the real vocabulary;
* the rank's layout is vLLM's parallel state: its world rank, and the ranks of its
  ``tp``, ``pp``, ``dp`` and (for MoE) ``ep`` groups;
* the metadata holds the architecture, the HF config, the contract and (unsharded)
  the weight fingerprints the vLLM engine reads (``contract.py``), the vLLM version
  and, per sequence, the request id, its prompt length and every id known of it (prompt and sampled output,
  from the runner's request state). The last sampled token of a request is never
  fed, so it is only there, not in the row tables (``Bundle.sequences``). Each sequence's ``sampling``
  holds the settings the sampler applied to its request, read from the sampler's input
  (``sampler_records.py``; ``logdiff/records/processing.py``).

**Weight syncs.** An RL loop loads the trainer's weights into the running engine through the
model's ``load_weights`` (TRL: once per tensor; verl's ``_update_weights``;
``logdiff.sync_vllm_weights`` inside vLLM's layer-wise reload) or the runner's ``reload_weights``.
``install`` wraps both on the worker's model instance: a load only marks the weights dirty, and the
next recorded step's start hashes them again (one re-fingerprint per sync, however many calls) as
the next weight *version* (0: as loaded). Each step's manifest entry carries its
``weight_version``; the metadata's ``weight_versions`` holds each version's ``fingerprints`` (or
``fingerprints_error``), its ``first_step`` and the ``loads`` (calls) that made it, and
``fingerprints`` stays the current version's. ``logdiff compare`` judges weights against the
versions the matched sequences' steps ran with (``logdiff.comparison.bundle_weights``).

**A compiled engine.** vLLM compiles its model (torch.compile) and replays CUDA graphs unless
it is built with ``enforce_eager=True``; TRL and verl build it so by default. The compiled code
runs no module hooks, so only the logits (computed outside the compiled graph) are recorded.
The metadata says so twice: ``compilation`` (vLLM's compilation mode, CUDA-graph mode and
``enforce_eager``, read from the runner's config at install) and ``hooks_fired`` (false once a
recorded step held logits but no module boundary; ``hookless_steps`` counts them), and
``logdiff compare`` turns either into one warning line with the fix (``logdiff.comparison.bundle_checks``).

Each step is written when vLLM has sampled from it (the model runner's
``sample_tokens`` returns), so a killed run leaves a readable bundle; the capture
closes (last manifest) when the worker shuts down, or at interpreter exit.
Dummy forwards (memory profiling, warm-up) have no requests and are not recorded.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from logdiff.probes.capture import PATH, Capture, row_keys
from logdiff.records.layout import REPLICATE, ParallelLayout, Placement
from logdiff.records.sketch import Window
from logdiff.sources.vllm.taps import TAPS

ENV = "LOGDIFF_CAPTURE"
WINDOW_ENV = "LOGDIFF_CAPTURE_WINDOW"  # decoder layers kept whole, or "all" (``sketch.Window``; default 2)
_INSTALLED = "_logdiff_capture"  # the worker's (capture, the ExitStack holding its recording)
_IDLE = "idle"  # the recorder's path for forwards that are not recorded
_HEAD = frozenset({"logits", "log_softmax"})  # what a step records outside the model's modules


def register() -> None:
    """vLLM's general-plugin entry point: patch the worker's model loading when ``LOGDIFF_CAPTURE`` is set."""
    if not os.environ.get(ENV):
        return
    from vllm.v1.worker.gpu_worker import Worker  # the CUDA worker; vLLM's CPU worker derives from it

    if getattr(Worker.load_model, "_logdiff", False):  # plugins may be loaded more than once
        return
    load_model, shutdown = Worker.load_model, Worker.shutdown

    def load_model_and_capture(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = load_model(self, *args, **kwargs)
        try:
            install(self, os.environ[ENV])
        except Exception as e:  # noqa: BLE001 - a capture that cannot start must not stop the engine
            logging.getLogger("logdiff").warning("logdiff: no capture in this worker (%s: %s)", type(e).__name__, e)
        return out

    def shutdown_and_close(self: Any) -> Any:
        installed = getattr(self, _INSTALLED, None)
        if installed is not None:
            installed[1].close()  # the capture's last manifest, and the patches undone
        return shutdown(self)

    load_model_and_capture._logdiff = True  # type: ignore[attr-defined]
    Worker.load_model, Worker.shutdown = load_model_and_capture, shutdown_and_close


def install(worker: Any, out_dir: str | Path) -> VllmCapture:
    """Start recording every forward of ``worker`` (a vLLM worker whose model is loaded) into ``out_dir``, for the
    worker's life (``recording``, never left: the worker's shutdown or the interpreter's exit closes it)."""
    lifetime = contextlib.ExitStack()  # held by the worker: a collected generator would undo the recording's patches
    capture = lifetime.enter_context(recording(worker.model_runner, out_dir, Window.parse(os.environ.get(WINDOW_ENV) or 2)))
    setattr(worker, _INSTALLED, (capture, lifetime))
    atexit.register(capture.close)
    return capture


@contextlib.contextmanager
def recording(runner: Any, out_dir: str | Path, window: Window | None = None,
              wait: bool = True) -> Iterator[VllmCapture]:
    """Record every forward of the worker whose model runner is ``runner`` into ``out_dir`` while the block runs
    (an in-process engine's, for one RL step: ``logdiff.integrations.trl``), then put everything back:

    * each step is written when vLLM has sampled from it (the runner's ``sample_tokens`` returns): its logits
      and log_softmax are recorded by then;
    * every weight load marks the capture's weights dirty (``VllmCapture.weights_loaded``): the model's
      ``load_weights`` (the instance's, which a CUDA-graph wrapper forwards to) and the runner's
      ``reload_weights`` (vLLM's in-place reload, whose kernel-format path copies without ``load_weights``);
    * ``wait=False``: leaving the block does not wait for the bundle's writer thread (``VllmCapture.wait``)."""
    from logdiff.probes.patching import Patches

    layout = vllm_layout()
    capture = VllmCapture(runner, out_dir, layout, worker_meta(runner, len(layout.group("tp"))), window, wait)
    with Patches() as patches:
        capture.__enter__()
        patches.on_exit(capture.close)
        for owner, name in ((runner.get_model(), "load_weights"), (runner, "reload_weights")):
            method = getattr(owner, name, None)
            if method is not None:
                patches.set(owner, name, _notifying(method, capture))
        patches.set(runner, "sample_tokens", _flushing(runner.sample_tokens, capture))
        sampler = getattr(runner, "sampler", None)
        if sampler is not None:  # what the sampler applied to each request (``sampler_records.py``)
            from logdiff.sources.vllm.sampler_records import wrap_sampler

            patches.set(sampler, "forward", wrap_sampler(sampler, runner, capture.sampled))
        yield capture


def _notifying(load: Any, capture: VllmCapture) -> Any:
    def loading(*args: Any, **kwargs: Any) -> Any:
        try:
            return load(*args, **kwargs)
        finally:
            capture.weights_loaded()

    return loading


def _flushing(sample_tokens: Any, capture: VllmCapture) -> Any:
    def sample_and_flush(*args: Any, **kwargs: Any) -> Any:
        out = sample_tokens(*args, **kwargs)
        capture.flush()
        return out

    return sample_and_flush


def vllm_layout() -> ParallelLayout:
    """This worker's ``ParallelLayout`` from vLLM's parallel state (groups it has not set up are left out)."""
    from vllm.distributed import parallel_state as ps

    world = ps.get_world_group()
    groups: dict[str, tuple[int, ...]] = {}
    for name, getter in (("tp", ps.get_tp_group), ("pp", ps.get_pp_group), ("dp", ps.get_dp_group),
                         ("ep", ps.get_ep_group)):  # fmt: skip
        with contextlib.suppress(AssertionError, AttributeError):  # an MoE-only group of a dense model
            ranks = tuple(int(r) for r in getter().ranks)
            if world.rank in ranks:
                groups[name] = ranks
    return ParallelLayout(int(world.rank), int(world.world_size), groups)


def worker_meta(runner: Any, tp_size: int) -> dict[str, Any]:
    """The bundle metadata a worker knows: model, config, vLLM version, the contract the vLLM engine reads, and
    (unsharded only: a rank holds slices) the weight fingerprints the vLLM engine reads."""
    import vllm

    from logdiff.sources.vllm import VLLMEngine
    from logdiff.version import __version__

    model, config = runner.get_model(), runner.model_config.hf_config
    meta: dict[str, Any] = {"logdiff": __version__, "engine": VLLMEngine.name, "mode": VLLMEngine.mode,
                            "version": vllm.__version__, "fuses_add_norm": VLLMEngine.fuses_add_norm,
                            "architecture": (getattr(config, "architectures", None) or [type(model).__name__])[0],
                            "model_type": getattr(config, "model_type", None),
                            "config": json.loads(config.to_json_string()),
                            "logprobs_mode": str(runner.model_config.logprobs_mode),
                            "compilation": compilation_of(runner)}  # fmt: skip
    from logdiff.phases import timed
    from logdiff.sources.vllm.contract import vllm_contract

    try:
        with timed("contract (engine)"):
            meta["contract"] = vllm_contract(model, {"logprobs_mode": meta["logprobs_mode"]})
    except Exception as e:  # noqa: BLE001 - a contract this worker cannot read is noted, not fatal
        meta["contract_error"] = f"{type(e).__name__}: {e}"
    meta.update(weight_fingerprints(model, int(config.vocab_size), tp_size))
    return meta


def weight_fingerprints(model: Any, vocab_size: int, tp_size: int) -> dict[str, Any]:
    """``{"fingerprints": ...}`` of the weights the worker's model holds now, or ``{"fingerprints_error": why}``
    (at TP > 1 a rank holds slices: none are hashed)."""
    if tp_size > 1:
        return {"fingerprints_error": f"weights sharded over {tp_size} ranks: not hashed on one rank"}
    from logdiff.phases import timed
    from logdiff.sources.vllm.contract import vllm_fingerprints

    try:
        with timed("fingerprints (engine)"):
            return {"fingerprints": vllm_fingerprints(model, vocab_size)}
    except Exception as e:  # noqa: BLE001 - a worker whose weights cannot be hashed is noted, not fatal
        return {"fingerprints_error": f"{type(e).__name__}: {e}"}


def compilation_of(runner: Any) -> dict[str, Any]:
    """How vLLM runs the worker's model: its compilation mode and CUDA-graph mode (names), ``enforce_eager``,
    and ``compiled``: whether either is on, so that module hooks cannot fire (None where a field is absent)."""
    model_config = getattr(runner, "model_config", None)
    config = getattr(getattr(runner, "vllm_config", None), "compilation_config", None)
    mode, graphs = getattr(config, "mode", None), getattr(config, "cudagraph_mode", None)

    def name(value: Any) -> str | None:
        return None if value is None else str(getattr(value, "name", value))

    on = [v is not None and name(v) not in ("NONE", "0") for v in (mode, graphs)]
    eager = getattr(model_config, "enforce_eager", None)
    return {"mode": name(mode), "cudagraph_mode": name(graphs), "enforce_eager": eager,
            "compiled": any(on) if config is not None else None}


def _hashed(meta: dict[str, Any]) -> dict[str, Any]:
    """The fingerprints (or why none) of ``meta``, as a ``weight_versions`` entry holds them."""
    return {k: meta[k] for k in ("fingerprints", "fingerprints_error") if k in meta}


class _Sequence:
    """One request as the recorder reads a sequence: the ids fed per position so far (-1 where none was)."""

    def __init__(self, request_id: str, state: Any):
        self.request_id, self.state = request_id, state  # the runner's CachedRequestState, kept after it ends
        self.prompt_ids: list[int] = []
        self.response_ids: list[int] = []
        self.sampling: dict[str, Any] | None = None  # what the sampler applied to it (``sampler_records.py``)

    def feed(self, positions: np.ndarray, tokens: np.ndarray) -> None:
        if len(positions) and int(positions.max()) >= len(self.prompt_ids):
            self.prompt_ids.extend([-1] * (int(positions.max()) + 1 - len(self.prompt_ids)))
        for p, t in zip(positions.tolist(), tokens.tolist()):
            self.prompt_ids[p] = t

    def meta(self) -> dict[str, Any]:
        """Request id, prompt length and every id known of it: the prompt, then the sampled ids (the last one
        never fed); where the runner kept no state, the fed ids."""
        prompt = list(getattr(self.state, "prompt_token_ids", None) or [])
        sampling = {} if self.sampling is None else {"sampling": self.sampling}
        if not prompt:
            return {"request_id": self.request_id, "prompt_len": None, "ids": list(self.prompt_ids), **sampling}
        out = [int(t) for t in getattr(self.state, "output_token_ids", []) if t >= 0]  # -1: async placeholders
        return {"request_id": self.request_id, "prompt_len": len(prompt), "ids": [int(t) for t in prompt] + out,
                **sampling}


class _WorkerView:
    """What ``Recorder`` needs of an engine, for a vLLM worker: its module, its runner, its probes."""

    tap_mapping = TAPS
    listener: Any = None

    def __init__(self, runner: Any):
        self._runner = runner

    def module(self) -> Any:
        return self._runner.get_model()

    def runner(self) -> Any:
        return self._runner

    def probes(self) -> Any:
        from logdiff.sources.vllm.probes import VLLMProbes

        return VLLMProbes(self)


class VllmCapture(Capture):
    """Records every forward of one vLLM worker's model into its part of a bundle (see the module docstring)."""

    base_steps = False  # vLLM calls the whole model; its steps come from the runner's batch

    def __init__(self, runner: Any, out_dir: str | Path, layout: ParallelLayout, meta: dict[str, Any],
                 window: Window | None = None, wait: bool = True):
        super().__init__(runner.get_model(), _WorkerView(runner), out_dir, "infer", layout, meta, window=window,
                         wait=wait)
        self.runner = runner
        self.vocab = int(getattr(self.model.config, "vocab_size", 0)) or None
        self._seq_of: dict[str, int] = {}
        self._step_rows: Any = None
        self._closed = False
        self._step_names: set[str] | None = None  # the records of the step being recorded (None: not recorded)
        self._steps = self._hookless = 0  # recorded steps; those with logits but no module boundary
        self.rows = self._rows  # the recorder takes each forward's rows from ``_begin_step``'s request map
        self.tp_size = len(layout.group("tp"))
        self.weight_version, self._loads = 0, 0  # weight loads since the version was hashed (dirty when > 0)
        self._versions = [{**_hashed(meta), "first_step": None, "loads": 0}]
        self.writer.meta_update({"weight_versions": self._versions})

    def weights_loaded(self) -> None:
        """A weight load into the model (a sync): hashed again at the next recorded step's start, not here (TRL
        loads one tensor per call)."""
        self._loads += 1

    def _next_weight_version(self) -> None:
        """The weights loaded since the last version, hashed as the next one (its fingerprints become the
        metadata's ``fingerprints``)."""
        hashed = weight_fingerprints(self.model, int(self.runner.model_config.hf_config.vocab_size), self.tp_size)
        self.weight_version += 1
        self._versions.append({**hashed, "first_step": None, "loads": self._loads})
        self._loads = 0
        meta = self.writer.manifest["meta"]
        for key in ("fingerprints", "fingerprints_error"):
            meta.pop(key, None)
        self.writer.meta_update({**hashed, "weight_versions": self._versions})

    def sampled(self, request_id: str | None, read: Any) -> None:
        """The sampler is about to sample for ``request_id``: its settings (``read()``, called once per request, in
        a recorded step only) become its sequence's ``sampling`` record; ``request_id`` None: ``read`` is the error
        that reading the batch raised (a warning)."""
        if request_id is None:
            self._warn(f"the sampler's settings could not be read ({type(read).__name__}: {read})")
            return
        index = self._seq_of.get(request_id)
        if self._closed or self._step_names is None or index is None or self.sequences[index].sampling is not None:
            return
        self.sequences[index].sampling = read()

    def flush(self) -> None:
        """Write the step recorded so far (vLLM has sampled from it) and the manifest; a step that cannot be
        written is a warning (the engine runs on)."""
        if self._closed:
            return
        try:
            self._count_step()
            self.writer.meta_update(self._sequences_meta())
            self.writer.end_step()
        except Exception as e:  # noqa: BLE001 - a probe must never break the engine's own run
            self._warn(f"a step could not be written ({type(e).__name__}: {e})")

    def close(self) -> None:
        """Stop recording and write the last manifest (idempotent: the worker's shutdown, then atexit)."""
        if self._closed:
            return
        self.writer.meta_update(self._sequences_meta())
        self._closed = True
        self.__exit__(None, None, None)

    def _count_step(self) -> None:
        """Count the step just recorded, and whether it held logits but no module boundary (a compiled model)."""
        names, self._step_names = self._step_names, None
        if names:
            self._steps += 1
            self._hookless += int(names <= _HEAD)
            self.writer.meta_update({"hooks_fired": self._hookless == 0, "hookless_steps": self._hookless,
                                     "recorded_steps": self._steps})

    def _sequences_meta(self) -> dict[str, Any]:
        """Per sequence its request id, prompt length and known ids; the prompt lengths by sequence id too."""
        sequences = [s.meta() for s in self.sequences]
        return {"sequences": sequences,
                "prompt_lens": {str(i): s["prompt_len"] for i, s in enumerate(sequences) if s["prompt_len"]}}

    # ---- steps -------------------------------------------------------------------------------

    def _begin_step(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Before each forward: number new requests, write the step's row table, announce the pass (a forward
        the capture cannot read is a warning and goes unrecorded)."""
        self._step_rows = None
        try:
            self._announce(args, kwargs)
        except Exception as e:  # noqa: BLE001 - a probe must never break the engine's own run
            self._warn(f"a forward was not recorded ({type(e).__name__}: {e})")
            self._step_rows = None
            self._recorder.begin_pass(_IDLE, [])

    def _announce(self, args: tuple, kwargs: dict) -> None:
        from logdiff.probes.align import RowMap

        try:
            qsl, req_ids = self._recorder.probes.read_batch()  # the recorder reads the same, once
        except Exception:  # noqa: BLE001 - a dummy forward (profiling, warm-up) has no batch to read
            req_ids = []
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if self._closed or not req_ids or ids is None or pos is None:
            self._recorder.begin_pass(_IDLE, [])
            return
        ids = ids.detach().cpu().numpy().reshape(-1).astype(np.int64)
        pos = pos.detach().cpu().numpy().reshape(-1).astype(np.int64)
        seq = np.full(len(ids), -1, dtype=np.int64)
        for r, rid in enumerate(req_ids):
            seq[qsl[r] : qsl[r + 1]] = self._sequence(rid)
        valid = (seq >= 0) & (pos >= 0)
        for s in np.unique(seq[valid]):
            mine = valid & (seq == s)
            self.sequences[s].feed(pos[mine], ids[mine])
        if self._loads:
            self._next_weight_version()
        self.writer.begin_step(ids, pos, seq, valid, {"weight_version": self.weight_version})
        version = self._versions[self.weight_version]
        if version["first_step"] is None:
            version["first_step"] = len(self.writer.manifest["steps"])  # the step begun (the one before is written)
        keys = row_keys(seq, pos)
        self._order = np.argsort(keys, kind="stable")
        self._keys = keys[self._order]
        self._placements = {}
        self._step_rows = RowMap(seq, pos, valid)
        self._step_names = set()
        self._recorder.begin_pass(PATH, [int(s) for s in np.unique(seq[valid])])

    def _warn(self, message: str) -> None:
        if message not in self._recorder.warnings:
            self._recorder.warnings.append(message)

    def _rows(self, args: tuple, kwargs: dict) -> Any:
        """The recorder's row map of the forward: the one ``_begin_step`` built (a copy: the recorder edits it)."""
        from logdiff.probes.align import RowMap

        rows = self._step_rows
        if rows is None:
            raise RuntimeError("a vLLM forward the capture did not announce")
        return RowMap(rows.seq.copy(), rows.pos.copy(), rows.valid.copy())

    def _sequence(self, request_id: str) -> int:
        index = self._seq_of.get(request_id)
        if index is None:
            index = self._seq_of[request_id] = len(self.sequences)
            self.sequences.append(_Sequence(request_id, self.runner.requests.get(request_id)))
        return index

    # ---- records -----------------------------------------------------------------------------

    def _record(self, name: str, rows: Any, seq: np.ndarray, pos: np.ndarray, placement: Placement | None,
                index: np.ndarray | None = None) -> None:
        if name in ("logits", "log_softmax") and self.vocab and rows.shape[-1] > self.vocab:
            rows = rows[..., : self.vocab]  # a vocabulary padded past the config's
        super()._record(name, rows, seq, pos, placement, index)
        if self._step_names is not None:
            self._step_names.add(name)

    def _placement(self, name: str, width: int) -> Placement:
        from logdiff.sources.vllm.placements import vllm_placement

        owner = self.modules.get(self._recorder.owners.get(name, name))
        placement = vllm_placement(owner, name, width) if owner is not None else None
        if placement is not None:
            return placement
        boundary = self.cmap.get(name)
        for source in boundary.inputs if boundary is not None else ():
            if source in self._placements:
                return self._placements[source]
        return REPLICATE
