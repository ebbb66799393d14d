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
  training job: such a rescan raises, and the diagnosis says which check it skipped and why.

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

        if cfg.train_set or cfg.infer_set or cfg.infer_ckpt is not None:
            raise RuntimeError("a config or weight lever cannot be applied to engines that are running a training job")
        only = cfg.consistent_kernels if cfg.consistent else None
        with _run_unchanged(self.train.model):
            with self._consistent(self.train, cfg.consistent, only):
                train = self.train.score(self.seqs)[0]
            with self._consistent(self.infer, cfg.consistent, only):
                infer = self.infer.prefill_scores(self.seqs)
        pair = compare_pair(train, infer, self.seqs, None, cfg.is_threshold)
        self.runs += 1
        if not cfg.consistent:
            self.baseline = dict(pair.metrics)
        return SimpleNamespace(primary=pair)

    @staticmethod
    def _consistent(engine: Any, on: bool, only: tuple[str, ...] | None) -> Any:
        return engine.consistent(only) if on else contextlib.nullcontext()

    def note(self, captured: dict[str, Any]) -> str:
        """One line: where the rescans ran, and their baseline against the captured step's gap."""
        live = self.baseline
        gap = f"max |Δ logprob| {live['abs_diff_max']:.3g}" if live else "not measured"
        return (f"live engines: {self.runs} rescans (the reference-kernel rerun where conformance left an op "
                "undecided, and attribution's) ran in this process over the step's tokens, on the trainer's model "
                "(logdiff's forward: right padding, positions from 0, log_softmax) and the colocated vLLM engine's "
                f"prefill; their gap without a lever: {gap} (the captured step's: "
                f"{float(captured.get('abs_diff_max') or 0.0):.3g}), so the shares are of that gap")


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
