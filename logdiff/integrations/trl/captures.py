"""The two sides of a captured TRL step, and the trainer's captured call run again.

``engine_capture`` records the colocated vLLM engine's rollout (the worker plugin's capture, installed on the
in-process driver worker for one ``generate``); ``trainer_capture`` records the trainer's no-grad pass, with
the per-token logprobs of TRL's fused head (which never calls ``lm_head``) and the temperature that head
applies (``fused_head.py``). ``Rerun`` is the trainer's captured ``_get_per_token_logps_and_entropies`` call,
which the in-step comparison's replay runs again (``bundle_feed.CapturedCall``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from logdiff.integrations.trl.fused_head import applied_temperature


def engine_capture(llm: Any, out_dir: Path, window: int | str) -> Any:
    """Record the in-process engine ``llm``'s forwards into the bundle at ``out_dir`` while the block runs (the
    worker plugin's capture on the driver worker, removed after: ``logdiff.sources.vllm.capture.recording``); its
    files are finished by the writer's thread after the block (``VllmCapture.wait``)."""
    from logdiff.records.sketch import Window
    from logdiff.sources.vllm.capture import recording

    return recording(llm.llm_engine.model_executor.driver_worker.model_runner, out_dir, Window.parse(window),
                     wait=False)


@contextlib.contextmanager
def trainer_capture(trainer: Any, out_dir: Path, window: int | str, failed: Any) -> Iterator[Any]:
    """Record the trainer's forwards into the bundle at ``out_dir`` while the block runs, with each fused-head
    forward's own per-token logprobs (``Capture.token_logprobs``: the head never calls ``lm_head``); a forward
    whose logprobs cannot be recorded goes to ``failed(what, error)``. The files are finished by the writer's thread
    after the block (``Capture.wait``)."""
    from logdiff.sources.hf.capture import capture

    model = trainer.accelerator.unwrap_model(trainer.model)

    def record(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        try:
            _fused_logprobs(cap, kwargs, output)
        except Exception as e:  # noqa: BLE001 - a misread forward must not break the trainer's
            failed(f"{out_dir}: a forward's token logprobs were not recorded ({type(e).__name__}: {e})", e)

    with capture(model, out_dir, role="train", window=window, wait=False) as cap:
        # what TRL's scoring does to the logits: it divides them by GRPOConfig.temperature (the value its fused head
        # holds: fused_head.py), and applies none of the top-k, top-p, min-p or penalties it forwards to vLLM
        # (trl/trainer/grpo_trainer.py, TRL 1.16)
        cap.applied_processing(temperature=applied_temperature(trainer, model))
        hook = model.register_forward_hook(record, with_kwargs=True)
        try:
            yield cap
        finally:
            hook.remove()


def _fused_logprobs(cap: Any, kwargs: dict[str, Any], output: Any) -> None:
    """A fused-head forward's ``log_probs`` ``[batch, length - 1]`` (column ``t`` scores ``input_ids[:, t + 1]``)
    as token logprobs, from the first column whose label is scored (TRL masks the prompt with -100)."""
    lp, labels, ids = getattr(output, "log_probs", None), kwargs.get("labels"), kwargs.get("input_ids")
    if lp is None or labels is None or ids is None:
        return  # an unfused forward: its logits are recorded at lm_head
    scored = (labels[:, 1:] != -100).any(0).nonzero()
    if not len(scored):
        return
    first = int(scored[0]) + 1  # the first scored token's column in input_ids
    cap.token_logprobs(lp[:, first - 1 :], start=first, token_ids=ids[:, first:])


class Rerun:
    """The captured ``_get_per_token_logps_and_entropies`` call, run again by the comparison's replay
    (``bundle_feed.CapturedCall``) inside the same step: same model, arguments, no-grad and TRL's own autocast. Its
    token logprobs must equal the captured call's bit for bit (``warning`` says where not): the whole step is
    then reproduced, not only each replayed op."""

    def __init__(self, call: Any, captured: Any):
        self.call, self.captured, self.got = call, captured, None

    def __call__(self) -> Any:
        self.got = self.call()
        return self.got

    def warning(self) -> str | None:
        import torch

        if self.got is None:
            return None
        a, b = self.captured[0], self.got[0]
        if a.shape == b.shape and torch.equal(a, b):
            return None
        diff = (a.float() - b.float()).abs().nan_to_num(float("inf")).max().item() if a.shape == b.shape else None
        what = f"max |Δ| {diff:.3g}" if diff is not None else f"shape {list(b.shape)} vs {list(a.shape)}"
        return (f"the captured step's own call, run again, gave other token logprobs than the step ({what}): the "
                "trainer's forward is not a function of its inputs here, so its replay is not the captured step")
