"""The checks that need live engines, inside an RL framework's process (``instrument(..., diagnosis=True)``).

``logdiff compare`` of two bundles has no engine to rerun, so a captured step gets no reference-kernel rerun and
no attribution. Where the rollout engine runs in the trainer's process (TRL's ``vllm_mode="colocate"``), both
engines are live at the captured step, with the step's weights: ``LiveRescans`` is the scan's ``measure``
(``diagnosis.rescan.Rescanner``) on them, over the step's common sequences, at ``--depth logprobs``:

* the training side: the trainer's model itself, through the HF engine (``sources.hf``, ``model=``): one
  teacher-forced forward of logdiff's (right-padded, positions from 0), ``torch.log_softmax`` of its logits;
* the inference side: the colocated ``vllm.LLM`` itself, through the vLLM engine (``llm=``): its prefill path
  (``prompt_logprobs`` of prompt + response, raw logprobs whatever its ``logprobs_mode``); an engine logdiff did
  not build has no ``ForcedTokens`` processor to replay a decode;
* a configuration's consistent kernels (a kernel lever) installed on both for the rescan (``Engine.consistent``),
  removed after. A weight or config lever (an override) cannot be applied to engines that are running a
  training job: such a rescan raises, and the diagnosis says which check it skipped and why;
* a quantized engine (TRL's vLLM on an INT8 checkpoint): ``infer_checkpoint`` is its checkpoint, so the
  comparison offers the ``quantization`` lever (``diagnosis/attribute.py``), the inference side unquantized on
  the trainer's weights. It is taken in place (``sources/vllm/unquantized.py``: the quantized linears compute
  on the trainer's weights while the rescan runs), once the engine's quantized weights are checked to be the
  trainer's through the scheme (a stale engine raises: the action would change its stale weights too).
  Consistent mode's kernels are not combined with it (the kernel levers' rescans would patch the same linears):
  such a coalition raises ``InputError``, and attribution measures the game without the kernel levers, as a
  scan of a quantized engine does (``attribution.fallback`` says so).

These paths are not the captured ones (TRL's fused head, left padding and autocast; vLLM's sampled decode), so
the rescans measure each lever on a baseline of their own: ``remember`` is ignored (the empty set of levers is
measured on the live paths too), and ``note`` gives both gaps. Nothing changes the run: no gradient, the torch
generator's state put back after vLLM's requests (each samples one token), the engine's requests finished before
the step goes on, the model's kernels restored on exit. A module-depth rescan (the reference rerun where the
logprobs do not become equal) is not run here: the diagnosis then classifies by contract and noise floor, and says
so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from logdiff.diagnosis.rescan import Rescanner


class LiveRescans(Rescanner):
    """A ``Rescanner`` over the live training model and the live vLLM engine (module docstring)."""

    def __init__(self, model: Any, llm: Any, dtype: str):
        from logdiff.sources.base import EngineSpec
        from logdiff.sources.registry import get_engine

        name = str(getattr(model.config, "_name_or_path", "") or "live model")
        self.train = get_engine("hf")(EngineSpec(name, dtype, (), (), 0, False, "cpu"), model)
        self.infer = get_engine("vllm")(EngineSpec(name, dtype), llm=llm)
        self.llm, self.model = llm, model
        self.infer_checkpoint = _quantized_checkpoint(llm)  # where the comparison offers the quantization lever
        self.seqs: list[Any] = []
        self.baseline: dict[str, Any] | None = None  # the live paths' metrics without a lever
        self.runs = 0  # the rescans measured so far
        super().__init__(self._measure)

    def remember(self, cfg: Any, metrics: dict[str, Any]) -> None:
        """The captured pair's metrics are not this game's empty set: it is measured on the live paths."""

    def metrics(self, cfg: Any) -> dict[str, Any]:
        """The live pair's metrics under ``cfg``, each configuration measured once (``remember`` stores nothing)."""
        key = self._key(cfg)
        if key not in self._metrics:
            self._metrics[key] = dict(self._measure(cfg).primary.metrics)
        return self._metrics[key]

    def for_sequences(self, seqs: list[Any]) -> LiveRescans:
        self.seqs = seqs
        return self

    def rescan(self, cfg: Any) -> Any:
        """A whole rescan: at ``--depth logprobs`` only (its metrics); a module-depth one raises."""
        if cfg.depth != "logprobs":
            raise RuntimeError("a module-depth rerun does not run inside the training loop (only logprobs-depth "
                               "rescans of the live engines)")
        return self._measure(cfg)

    def _measure(self, cfg: Any) -> Any:
        """The primary pair's metrics under ``cfg``'s kernels, whatever its depth (``metrics`` reads no more)."""
        from logdiff.comparison.metrics import compare_pair

        if cfg.train_set or cfg.infer_set or (cfg.infer_ckpt is not None and self.infer_checkpoint is None):
            raise RuntimeError("a config or weight lever cannot be applied to engines that are running a training job")
        unquantize = self.infer_checkpoint is not None and cfg.infer_ckpt is None
        if unquantize and cfg.consistent:
            from logdiff.errors import InputError

            raise InputError("the live engine's quantization lever computes its linears on the trainer's weights in "
                             "place, where consistent mode would patch them too")
        only = cfg.consistent_kernels if cfg.consistent else None
        with _run_unchanged(self.train.model):
            with self._consistent(self.train, cfg.consistent, only):
                train = self.train.score(self.seqs)[0]
            with self._consistent(self.infer, cfg.consistent, only), self._unquantized(unquantize):
                infer = self.infer.prefill_scores(self.seqs)
        pair = compare_pair(train, infer, self.seqs, None, cfg.is_threshold)
        self.runs += 1
        if not cfg.consistent and not unquantize:
            self.baseline = dict(pair.metrics)
        return SimpleNamespace(primary=pair)

    @staticmethod
    def _consistent(engine: Any, on: bool, only: tuple[str, ...] | None) -> Any:
        return engine.consistent(only) if on else contextlib.nullcontext()

    def _unquantized(self, on: bool) -> Any:
        """The quantization lever in place: the engine's quantized linears on the trainer's weights (checked first)."""
        if not on:
            return contextlib.nullcontext()
        from logdiff.sources.vllm.consistent import engine_objects
        from logdiff.sources.vllm.quantized_sync import engine_scheme
        from logdiff.sources.vllm.unquantized import unquantized, weights_problem

        model, _ = engine_objects(self.llm)
        weights = dict(self.model.named_parameters())
        problem = weights_problem(model, weights, engine_scheme(self.llm))
        if problem:
            raise RuntimeError(f"the quantization lever cannot be taken in place: {problem}")
        return unquantized(model, weights)

    def note(self, captured: dict[str, Any]) -> str:
        """One line: where the rescans ran, and their baseline against the captured step's gap."""
        live = self.baseline
        gap = f"max |Δ logprob| {live['abs_diff_max']:.3g}" if live else "not measured"
        return (f"live engines: {self.runs} rescans (the reference-kernel rerun where conformance left an op "
                "undecided, and attribution's) ran in this process over the step's tokens, on the trainer's model "
                "(logdiff's forward: right padding, positions from 0, log_softmax) and the colocated vLLM engine's "
                f"prefill; their gap without a lever: {gap} (the captured step's: "
                f"{float(captured.get('abs_diff_max') or 0.0):.3g}), so the shares are of that gap")


def _quantized_checkpoint(llm: Any) -> Any:
    """The checkpoint of a live vLLM engine that runs quantized (its ``model_config.model``), else None."""
    from pathlib import Path

    from logdiff.sources.vllm.quantized_sync import engine_scheme

    return Path(llm.llm_engine.model_config.model) if engine_scheme(llm) is not None else None


@contextlib.contextmanager
def _run_unchanged(model: Any) -> Iterator[None]:
    """No gradient, no autocast (consistent kernels fix their own precisions; the stock forward runs in the model's
    dtype): the forward accelerate wrapped in the trainer's autocast (``_original_forward`` kept beside it by
    ``Accelerator.prepare``) is the unwrapped one while the block runs; and the torch generator as it was (each
    vLLM request samples a token from it)."""
    import torch

    from logdiff.probes.patching import Patches

    device = next(model.parameters()).device.type
    with torch.random.fork_rng(devices=[] if device == "cpu" else None), torch.no_grad(), \
            torch.autocast(device, enabled=False), Patches() as patches:
        if "_original_forward" in model.__dict__:
            patches.set(model, "forward", model.__dict__["_original_forward"])
        yield
