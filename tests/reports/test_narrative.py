"""`logdiff explain`: the account follows the result, for each verdict."""

from __future__ import annotations

import copy

from logdiff.reports import explain


def test_mixed_result_names_both_classes_and_framework_first(sample_result) -> None:
    text = explain(sample_result)
    assert text.startswith(f"Verdict: {sample_result['verdict']}.")
    why = text.split("Why:", 1)[1]
    assert "framework difference" in why and "operator path" in why
    assert why.index("framework difference") < why.index("operator path")
    assert sample_result["first_divergence"]["boundary"] in text
    assert "fix the framework differences first" in text


def test_consistent_result_says_nothing_to_fix(sample_result) -> None:
    r = copy.deepcopy(sample_result)
    r.update(verdict="consistent", causes=[], first_divergence=None)
    text = explain(r)
    assert "agree bit for bit" in text and "nothing to fix" in text and "Why:" not in text


def test_unprobed_divergence_asks_for_module_depth(logprobs_depth_result) -> None:
    r = copy.deepcopy(logprobs_depth_result)
    r["verdict"] = "divergent"
    text = explain(r)
    assert "--depth modules" in text and "Why:" not in text
