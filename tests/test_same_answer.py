"""The same answer everywhere (issue 48, item 7): one pair of paths, three channels, the same causes.

The pair is the demo Qwen3 in bf16 against the CPU vLLM, and the three channels are

* ``logdiff scan`` (the python API ``logdiff.scan``), with the engine's setting as ``--set infer.KEY=VALUE``;
* ``logdiff compare`` of the bundles a TRL GRPO step captured, offline (no engine);
* the compare ``logdiff.integrations.trl.instrument`` ran inside that TRL loop.

The TRL side is tests/test_trl_sampling.py's one run (``trl_sampled``), where each step samples under another
setting; three of its steps are the scenarios here:

* top-p 0.8 on the engine only (a sampling difference);
* top-k 5 on the engine only (another sampling step, another value);
* the defaults: a stock bf16 pair, whose gap is kernels only.

What must agree, and why not more:

* the offline compare and the in-loop one read the same bundles through the same code: their framework
  differences are equal (each cause's class, kind, boundary and ``differs``), and so are the gap and the
  verdict. The in-loop compare also has the trainer's live model, with the step's weights, and replays the
  captured call on it; offline, those weights are gone (the trainer moved on: ``--model``'s checkpoint is
  refused at every later step), so an op the loop's replay classifies may stay ``not_judged`` offline. What
  the offline compare does name is the loop's: never another class;
* the scan and the bundles agree on the classes and kinds of the framework differences, and on the naming
  of a sampling setting as a user reads it: ``top-p = 0.8`` (the label and value both evidence lines carry).
  ``differs`` is each record's own key (the scan's contract field ``sampling_top_p``, the bundle record's
  ``top_p``), and the scan may add a second ``sampling_semantics`` cause from the numbers (its fit of the
  truncated support), which the records make unnecessary: so the kinds are compared as sets;
* a stock pair is operator paths only on every channel (no framework difference anywhere). The operator-path
  kinds themselves are not compared across scan and loop: the scan scores its own probe sequences, TRL its
  own left-padded batch (which adds ``position_offset``), so which kernels show a difference there differs.

Not covered: an fp32 trainer against a bf16 engine (the ``dtype`` cause) has no scan form (``--dtype`` sets both
paths); tests/test_trl_grpo.py holds the in-loop side of it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from trl_runs import SAMPLING_STEPS as STEPS

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (pip install "
                                 "'logdiff[trl]')")]

#: the scenarios: name -> (the TRL step's settings, the scan's infer settings, the label = value a user reads)
SCENARIOS = {"top_p": ({"top_p": 0.8}, {"top_p": 0.8}, "top-p = 0.8"),
             "top_k": ({"top_k": 5}, {"top_k": 5}, "top-k = 5"),
             "stock": ({}, {}, None)}
#: the scan's probe set (small: the logprobs and the modules, no attribution)
SCAN = {"num_sequences": 4, "prompt_len": 12, "response_len": 8, "depth": "modules", "attribute": False}


def _step(name: str) -> int:
    return [s for s, _ in STEPS].index(SCENARIOS[name][0])


@pytest.fixture(scope="module")
def channels(qwen3: Path, trl_sampled: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """scenario -> {"scan", "compare", "loop"}: each channel's result dict."""
    import logdiff
    from logdiff.commands.compare import compare_bundles

    out = {}
    for name, (_, infer_set, _) in SCENARIOS.items():
        step = trl_sampled["out"] / f"step-{_step(name):06d}"
        # TRL asks vLLM for processed logprobs: the scan's engine does the same
        infer = {**infer_set, "logprobs_mode": "processed_logprobs"} if infer_set else {}
        out[name] = {"scan": logdiff.scan(qwen3, infer=["vllm"], infer_set=infer, **SCAN),
                     "compare": compare_bundles(step / "train", step / "infer").to_dict(),
                     "loop": trl_sampled["results"][_step(name)]}
    return out


def _framework(result: dict[str, Any]) -> set[tuple[str, str]]:
    return {(c["class"], c["kind"]) for c in result["causes"] if c["class"] == "framework_difference"}


def _exact(result: dict[str, Any]) -> list[tuple[Any, ...]]:
    return sorted((c["class"], c["kind"], c["boundary"], tuple(c.get("differs") or ())) for c in result["causes"])


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_compare_offline_is_the_loops_answer(channels: dict, name: str) -> None:
    got = channels[name]
    offline, loop = _exact(got["compare"]), _exact(got["loop"])
    framework = [c for c in offline if c[0] == "framework_difference"]
    assert framework == [c for c in loop if c[0] == "framework_difference"], (offline, loop)
    judged = [c for c in offline if c[0] != "not_judged"]
    assert judged and set(judged) <= set(loop), (offline, loop)  # the loop's replay adds, never contradicts
    assert got["compare"]["verdict"] == got["loop"]["verdict"]
    assert got["compare"]["logprobs"]["abs_diff_max"] == pytest.approx(got["loop"]["logprobs"]["abs_diff_max"])


@pytest.mark.parametrize("name", ["top_p", "top_k"])
def test_a_sampling_difference_is_the_same_cause_on_every_channel(channels: dict, name: str) -> None:
    label = SCENARIOS[name][2]
    for channel, result in channels[name].items():
        assert _framework(result) == {("framework_difference", "sampling_semantics")}, (channel, result["causes"])
        evidence = [e for c in result["causes"] if c["kind"] == "sampling_semantics" for e in c["evidence"]]
        assert any(label in e for e in evidence), (channel, label, evidence)
        assert result["verdict"] in ("framework_difference", "mixed"), (channel, result["verdict"])


def test_a_stock_pair_is_operator_paths_on_every_channel(channels: dict) -> None:
    for channel, result in channels["stock"].items():
        assert _framework(result) == set(), (channel, result["causes"])
        assert any(c["class"] == "operator_path" for c in result["causes"]), (channel, result["causes"])
        assert result["verdict"] == "operator_path", (channel, result["verdict"])
