"""``logdiff.integrations.trl`` without a TRL run: what it refuses, what it logs, what it puts in the logs.

The real loop is ``tests/test_trl_grpo.py``; these are the parts a failing or misused run reaches.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from logdiff.integrations import trl as logdiff_trl


def _trainer() -> SimpleNamespace:
    generation = SimpleNamespace(llm=object(), generate=lambda *a, **k: "generated", sync_weights=lambda: "synced")
    return SimpleNamespace(vllm_generation=generation, state=SimpleNamespace(global_step=0),
                           _get_per_token_logps_and_entropies=lambda *a, **k: "logps")


def test_a_trainer_without_a_colocated_engine_or_a_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="no colocated vLLM engine"):
        logdiff_trl.instrument(SimpleNamespace(vllm_generation=None), "out")
    with pytest.raises(ValueError, match="every=0"):
        logdiff_trl.instrument(_trainer(), "out", every=0)


def test_close_puts_the_trainers_own_functions_back() -> None:
    trainer = _trainer()
    generation = trainer.vllm_generation
    generate, sync, logps = generation.generate, generation.sync_weights, trainer._get_per_token_logps_and_entropies
    run = logdiff_trl.instrument(trainer, "out", every=2)
    assert generation.generate is not generate and generation.sync_weights is not sync
    trainer.state.global_step = 1  # not a captured step: TRL's own functions run, nothing is recorded
    assert generation.sync_weights() == "synced" and generation.generate() == "generated" and run._armed is None
    run.close()
    assert generation.generate is generate and generation.sync_weights is sync
    assert trainer._get_per_token_logps_and_entropies is logps


def test_a_failure_is_logged_and_the_run_goes_on_unless_strict(caplog: pytest.LogCaptureFixture) -> None:
    run = logdiff_trl.instrument(_trainer(), "out")
    with caplog.at_level("WARNING", logger="logdiff.trl"):
        run._failed("step 3: no comparison (InputError: nothing common)", RuntimeError("x"))
    assert run.errors == ["step 3: no comparison (InputError: nothing common)"]
    assert "logdiff step 3: no comparison" in caplog.text
    strict = logdiff_trl.instrument(_trainer(), "out", strict=True)
    with pytest.raises(RuntimeError, match="x"):
        strict._failed("step 3", RuntimeError("x"))


def test_the_summary_counts_causes_per_class_and_says_where_it_starts() -> None:
    result = {"logprobs": {"abs_diff_max": 0.03, "abs_diff_mean": 0.002}, "verdict": "mixed",
              "first_divergence": {"boundary": "model.layers.1.self_attn.rope_q", "layer": 1},
              "causes": [{"class": "operator_path", "kind": "reduction_order", "boundary": "a"},
                         {"class": "operator_path", "kind": "position_offset", "boundary": "b"},
                         {"class": "framework_difference", "kind": "dtype", "boundary": "model"}]}
    out = logdiff_trl.summarize(result)
    assert out["metrics"] == {"gap_max": 0.03, "gap_mean": 0.002, "first_divergence_layer": 1.0,
                              "causes/operator_path": 2.0, "causes/framework_difference": 1.0,
                              "causes/not_judged": 0.0}
    assert "first divergence at model.layers.1.self_attn.rope_q" in out["line"]
    assert "1 framework_difference, 2 operator_path" in out["line"] and out["line"].endswith("mixed")
    equal = logdiff_trl.summarize({"logprobs": {"abs_diff_max": 0.0, "abs_diff_mean": 0.0}, "causes": [],
                                   "first_divergence": None, "verdict": "consistent"})
    assert math.isnan(equal["metrics"]["first_divergence_layer"]) and "no divergence; no cause" in equal["line"]


def test_the_worker_runs_jobs_after_the_step_and_a_full_queue_waits_with_one_line_when_asked(
        caplog: pytest.LogCaptureFixture) -> None:
    import threading

    from logdiff.integrations.trl.background import Worker

    gate, done = threading.Event(), []
    worker = Worker(queue=1, when_full="wait")
    worker.submit("step 0", lambda: lambda: (gate.wait(5), done.append(0)))
    worker.submit("step 1", lambda: lambda: done.append(1))  # queued behind step 0: no wait
    assert done == [] and worker.pending() == 2  # the caller did not wait for either
    with caplog.at_level("WARNING", logger="logdiff.trl"):
        threading.Timer(0.2, gate.set).start()
        worker.submit("step 2", lambda: lambda: done.append(2))  # full: waits for step 0 to finish
    assert caplog.text.count("logdiff step 2 waits") == 1 and worker.waited_s > 0
    worker.finish()
    assert done == [0, 1, 2] and worker.pending() == 0
    worker.submit("step 3", lambda: lambda: 1 / 0)
    worker.finish()
    with pytest.raises(ZeroDivisionError):
        worker.raise_error()  # a job's failure reaches the caller's thread, once
    worker.raise_error()
    worker.close()


def test_a_full_queue_skips_the_step_at_once_and_names_its_bundles_for_an_offline_compare(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``when_full="skip"`` (the default): a step that finds the worker's queue full neither waits nor copies the
    model; one line names the step and the ``logdiff compare`` of its bundles, and ``run.skipped`` lists it. The
    negative control: with a free slot the same call prepares and runs its job."""
    import threading
    import time

    gate, done = threading.Event(), []
    run = logdiff_trl.instrument(_trainer(), tmp_path, compare="after")
    try:
        worker = run._worker
        assert worker.submit("step 0", lambda: lambda: (gate.wait(5), done.append(0)))
        assert worker.submit("step 1", lambda: lambda: done.append(1))  # the queue's one waiting place
        prepared: list[int] = []
        assert not worker.submit("step 2", lambda: prepared.append(2) or (lambda: done.append(2)))
        assert prepared == [] and worker.skipped == 1
        start = time.perf_counter()
        with caplog.at_level("WARNING", logger="logdiff.trl"):
            run._compare_later(5, lambda copy: None, None)  # full: its model copy would fail on this fake trainer
        assert time.perf_counter() - start < 1.0 and not gate.is_set()  # no wait for the running comparison
        assert run.skipped == [5] and run.errors == []
        line = caplog.text
        assert line.count("logdiff step 5: not compared") == 1
        assert f"logdiff compare {tmp_path / 'step-000005' / 'train'} {tmp_path / 'step-000005' / 'infer'}" in line
        gate.set()
        worker.finish()
        assert done == [0, 1]
        assert worker.submit("step 6", lambda: prepared.append(6) or (lambda: done.append(6)))  # a slot is free
        worker.finish()
        assert prepared == [6] and done == [0, 1, 6]
    finally:
        gate.set()
        run.close()


def test_the_comparison_thread_runs_at_the_lowest_priority_and_the_training_thread_keeps_its_own() -> None:
    """The worker's jobs run at nice 19, and so do the threads they start (torch's kernel threads are started by
    the thread that first runs a kernel); the submitting thread's priority is left as it was."""
    import os
    import sys
    import threading

    from logdiff.integrations.trl.background import Worker

    if not sys.platform.startswith("linux"):
        pytest.skip("a thread's own nice value is Linux's")

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before, seen = nice(), {}

    def job() -> None:
        seen["worker"] = nice()
        child = threading.Thread(target=lambda: seen.__setitem__("child", nice()))
        child.start()
        child.join()

    worker = Worker(queue=0)
    worker.submit("step 0", lambda: job)
    worker.finish()
    worker.close()
    assert seen == {"worker": 19, "child": 19} and nice() == before


def test_the_snapshot_runs_its_own_modules_where_a_forward_wrapper_closes_over_the_live_model() -> None:
    """TRL's fused-head forward and accelerate's autocast wrapper are closures over the original model's ``forward``:
    a plain ``deepcopy``'s forward runs the live model (the negative control); ``snapshot``'s runs the copy."""
    import copy
    import functools
    import types

    import torch

    from logdiff.integrations.trl.background import snapshot

    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    original_forward = model.forward  # TRL's pattern: the wrapper calls the bound forward it found

    @functools.wraps(type(model).forward)
    def fused_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original_forward(*args, **kwargs)

    class ConvertOutputs:  # accelerate's ``ConvertOutputsToFp32``: an object holding the forward it wraps
        def __init__(self, forward: Any):
            self.forward = forward

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.forward(*args, **kwargs)

        def __getstate__(self) -> Any:
            raise TypeError("not picklable")

    model.forward = types.MethodType(fused_forward, model)
    converted = ConvertOutputs(model.forward.__func__)
    model.forward = types.MethodType(lambda self, *a, **k: converted(self, *a, **k), model)  # accelerate's order

    def ran(m: torch.nn.Module, x: torch.Tensor) -> list[str]:
        seen: list[str] = []
        hooks = [mod.register_forward_hook(lambda *_, tag=tag: seen.append(tag)) for tag, mod in
                 (("live", model[0]), ("copy", m[0]))]
        try:
            m(x)
        finally:
            for h in hooks:
                h.remove()
        return seen

    x = torch.ones(1, 3)
    assert ran(copy.deepcopy(model), x) == ["live"]  # the bug: the copy's forward runs the live model
    frozen = snapshot(model)
    assert ran(frozen, x) == ["copy"] and not frozen[0].weight.requires_grad
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the optimizer's step after the snapshot: the copy keeps the step's weights
    assert not torch.equal(frozen(x), model(x))
    # the next compared step refreshes that copy in place: the live weights now, its own modules still
    from logdiff.integrations.trl.background import Snapshots, refresh

    assert refresh(frozen, model) and torch.equal(frozen(x), model(x)) and ran(frozen, x) == ["copy"]
    pool = Snapshots()
    first = pool.take(model)
    second = pool.take(model)  # the first is still held by a comparison: a copy of its own
    assert second is not first
    pool.give_back(first)
    with torch.no_grad():
        model[0].weight.mul_(-2.0)
    again = pool.take(model)
    assert again is first and torch.equal(again(x), model(x)) and not torch.equal(second(x), model(x))
    model.add_module("extra", torch.nn.Identity())  # another model now: not refreshed, a new snapshot instead
    assert not refresh(first, model) and pool.take(model) is not first
