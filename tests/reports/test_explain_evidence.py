"""`logdiff explain` tells the whole truth, briefly (issue 52, item 3).

"How sure" counts each cause's evidence by kind (conformance against the exact function, a contract
or weight difference, the reference-kernel rerun), read from the causes' own fields; ``--evidence``
shows every evidence line; the attribution reads as action (what the fixes do together, which alone
make the gap worse) and "Next" never suggests one family at a time when singles widen the gap. Each
has its negative control: no conformance, no differing contract, levers that each help alone.
"""

from __future__ import annotations

import copy
import json

import pytest
from logdiff.reports import explain, shares, validate_result
from logdiff.reports.evidence import how_sure, kinds
from typer.testing import CliRunner

from logdiff.cli import app

WITHIN = {"train": {"error": 0.8, "bound": 3.0, "rows": 64, "function": "rope(rotary_dim=64, style=neox)"},
          "infer": {"error": 1.1, "bound": 3.0, "rows": 64, "function": "rope(rotary_dim=64, style=neox)"}}
CONCLUSION = ("both sides are within their rounding bounds of the exact function: the same function, computed in a "
              "different order or precision")


def _conformance_decided(result: dict) -> dict:
    """The result as today's diagnosis writes it: every cause decided by conformance, no rerun line."""
    r = copy.deepcopy(result)
    for c in r["causes"]:
        c["conformance"] = copy.deepcopy(WITHIN)
        c["evidence"] = [("local error 0.0156 with both sides fed the same inputs (0.7 units of the output dtype's "
                          "spacing)"), "no contract or weight this op reads differs (rope_theta)",
                         "conformance: train (hf) is 0.8 units ..., within its rounding bound of 3",
                         "conformance: infer (vllm) is 1.1 units ..., within its rounding bound of 3", CONCLUSION,
                         "kernel:rope: Shapley share ...", "with every other cause neutralised, max |Δ logprob| is 0.03"]
    from logdiff.reports.groups import group_causes

    r["cause_groups"] = group_causes(r["causes"])
    return r


def _how_sure(text: str) -> str:
    return text[text.index("How sure:"):text.index("\n\n", text.index("How sure:"))]


def test_how_sure_counts_the_conformance_check_that_decided_every_cause(layered) -> None:
    r = _conformance_decided(layered(4))
    n = len(r["causes"])
    assert validate_result(r) == []
    sure = _how_sure(explain(r))
    assert f"what each of the {n} causes rests on" in sure
    assert f"on that side's own inputs): {n}, all with both sides within their rounding bounds" in sure
    assert "a contract or weight difference read from the loaded engines: 0" in sure
    assert "rerunning both engines with the reference kernels: 0" in sure


def test_how_sure_without_conformance_counts_none_and_the_rerun_where_it_ran(layered) -> None:
    """Negative control: the layered result's causes carry no conformance, only a rerun line each."""
    r = layered(4)
    n = len(r["causes"])
    sure = _how_sure(explain(r))
    assert "on that side's own inputs): 0\n" in sure + "\n"
    assert f"rerunning both engines with the reference kernels: {n}" in sure


def test_how_sure_counts_a_side_outside_and_contract_differences_by_kind(layered) -> None:
    r = _conformance_decided(layered(2))
    r["causes"][0]["conformance"]["infer"]["error"] = 40.0  # one side computes another function
    r["causes"][1].update({"class": "framework_difference", "kind": "config_contract", "differs": ["rope_theta"]})
    r["causes"][2].pop("conformance")
    n = len(r["causes"])
    sure = _how_sure(explain(r))
    assert f"own inputs): {n - 1}: {n - 2} with both sides within" in sure and "1 with a side outside" in sure
    assert "a contract or weight difference read from the loaded engines: 1" in sure
    assert kinds(r["causes"][1]) == ["conformance", "contract"]  # a cause can rest on several kinds
    nan = {"boundary": "model.layers.1.mlp.down_proj", "class": "framework_difference", "kind": "non_finite",
           "differs": ["model.layers.1.mlp.down_proj.weight"], "evidence": ["NaN in the weights"]}
    assert kinds(nan) == ["values"]  # its differs are the weights holding NaN, not a weight difference
    assert any("NaN/inf found in the values: 1" in line for line in how_sure({"causes": [nan]}))


def test_explain_shows_the_deciding_evidence_and_every_line_with_evidence(layered) -> None:
    r = _conformance_decided(layered(2))
    brief, full = explain(r), explain(r, evidence=True)
    group = r["cause_groups"][0]
    lines = group["evidence"]
    assert all(f"evidence: {e}" in full for e in lines)
    shown = [e for e in lines if f"evidence: {e}" in brief]
    assert shown == lines[:1]  # the measured error, then the conformance summary instead of its raw lines
    assert "evidence: conformance: both sides within their rounding bounds at 2 of 2 sites" in brief
    assert f"({len(lines) - 1} more evidence lines: logdiff explain --evidence)" in brief
    assert "more evidence line" not in full


def test_the_cli_flag_shows_every_evidence_line(sample_result, tmp_path) -> None:
    path = tmp_path / "result.json"
    path.write_text(json.dumps(sample_result))
    runner = CliRunner()
    brief = runner.invoke(app, ["explain", str(path)])
    full = runner.invoke(app, ["explain", str(path), "--evidence"])
    assert brief.exit_code == full.exit_code == 0, brief.output + full.output
    every = [e for c in sample_result["causes"] for e in c["evidence"]]
    assert all(e in full.output for e in every)
    assert not all(e in brief.output for e in every) and "--evidence" in brief.output


def _demo_attribution(result: dict) -> dict:
    """The demo's attribution (issue 52): together the three fixes close the gap; alone, attention widens the mean
    gap by 14%, rope widens both, rms_norm narrows the mean gap but nearly doubles the max."""
    r = copy.deepcopy(result)
    a = r["attribution"]
    base, top = a["baseline"], a["baseline_abs_diff_max"]
    alone = {"kernel:attention": (1.14, 1.012), "kernel:rope": (1.037, 1.85), "kernel:rms_norm": (0.97, 1.85)}
    for lever in a["levers"]:
        mean, peak = alone[lever["lever"]]
        lever.update(alone_abs_diff_mean=base * mean, alone=top * peak)
    return r


def test_attribution_reads_as_action_and_next_keeps_the_fixes_together(layered) -> None:
    r = _demo_attribution(layered(4))
    assert validate_result(r) == []
    text = explain(r)
    assert "interaction" not in text and "Each fixed alone, their effects add up" not in text
    assert "attention widens the mean gap by 14% and the max by 1.2%" in text
    assert "rms_norm narrows the mean gap by 3% but widens the max by 85%" in text
    assert "Alone, each widens the mean or the max gap: apply the fixes together, not one at a time." in text
    next_ = text[text.index("Next:"):]
    assert "--consistent-kernels rope,attention,rms_norm` applies these fixes together" in next_
    assert "which kernel family buys what" not in next_ and "one family at a time" in next_
    assert shares.worse_alone(r) == ["rope", "attention", "rms_norm"]


def test_fixes_that_each_help_alone_are_said_so_and_next_may_go_family_by_family(layered) -> None:
    """Negative control: every lever narrows both gaps alone."""
    r = _demo_attribution(layered(4))
    for lever in r["attribution"]["levers"]:
        lever.update(alone_abs_diff_mean=r["attribution"]["baseline"] * 0.6,
                     alone=r["attribution"]["baseline_abs_diff_max"] * 0.9)
    text = explain(r)
    assert "Each narrows the gap on its own." in text and "apply the fixes together" not in text
    assert shares.worse_alone(r) == []
    assert "`--consistent-kernels FAMILY` which kernel family buys what" in text


def test_one_widening_lever_is_named_alone(layered) -> None:
    r = _demo_attribution(layered(4))
    for lever in r["attribution"]["levers"]:
        if lever["lever"] != "kernel:attention":
            lever.update(alone_abs_diff_mean=r["attribution"]["baseline"] * 0.6,
                         alone=r["attribution"]["baseline_abs_diff_max"] * 0.9)
    assert "Alone, attention widens the mean or the max gap: apply the fixes together" in explain(r)


@pytest.mark.parametrize("width", [80, 120])
def test_terminal_and_html_show_the_action_too(layered, width) -> None:
    import io

    from logdiff.reports.html import render_html
    from logdiff.reports.terminal import print_summary
    from rich.console import Console

    r = _demo_attribution(layered(4))
    console = Console(record=True, no_color=True, width=width, file=io.StringIO())
    print_summary(r, console)
    flat = " ".join(console.export_text().split())
    assert "Alone, each widens the mean or the max gap: apply the fixes together, not one at a time." in flat
    assert "apply the fixes together, not one at a time" in render_html(r)


def test_the_demo_scan_reads_as_the_issue_asks(demo_v2) -> None:
    """The real demo result (data/demo_scan_v2.json): the first divergence starts at position 1 (its worst row is
    22, the position the result used to name), conformance decided all 20 causes, every fix alone widens the gap
    and Next keeps them together, and the RoPE fix talks about RoPE."""
    assert validate_result(demo_v2) == []
    text = explain(demo_v2)
    assert ("first part at model.layers.0.self_attn.rope_q (position 1, sequence 0; largest |Δ| 0.0312 at position "
            "22 (response token 7), sequence 5)") in text
    assert "own inputs): 20, all with both sides within their rounding bounds" in _how_sure(text)
    assert "Alone, each widens the mean or the max gap: apply the fixes together, not one at a time." in text
    assert "`--consistent-kernels attention,rms_norm,rope` applies these fixes together" in text
    rope = next(g for g in demo_v2["cause_groups"] if g["family"] == "rope")
    assert "logdiff.kernels.rope" in rope["fix"] and "silu" not in rope["fix"]
