"""Causes grouped by (class, kind, family): the grouping itself, and the terminal summary that shows
the groups in one screen at 80 columns and more at 200.

``demo_scan_result.json`` is a real demo-style scan (the bf16 Qwen3 test model, HF against the CPU vLLM,
--depth modules, 20 causes in three families), trimmed of the per-pair boundary rows; it was written
before ``cause_groups`` existed, so it also exercises the fallback. ``layered_result`` (conftest.py)
(the ``layered`` fixture) is a synthetic 24-layer result with 120 causes.
"""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from logdiff.reports import explain, validate_result
from logdiff.reports.groups import cause_groups, describe_sites, group_causes
from logdiff.reports.terminal import print_summary

FAMILIES = {"rms_norm", "rope", "attention"}


def _render(result: dict, width: int) -> str:
    console = Console(record=True, no_color=True, width=width, file=io.StringIO())
    print_summary(result, console)
    return console.export_text()


def _screen_lines(text: str, width: int) -> int:
    """Lines on a terminal of ``width`` columns, soft-wrapped long lines counted as the rows they take."""
    return sum(max(1, -(-len(line) // width)) for line in text.splitlines())


def _cause_rows(text: str, families: set[str] = FAMILIES) -> list[list[str]]:
    """The causes table's body: one list of lines per row (a row starts at a line naming its family)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Causes:"))
    rule = next(i for i in range(start, len(lines)) if set(lines[i].strip()) == {"─"})
    rows: list[list[str]] = []
    for line in lines[rule + 1:]:
        if not line.strip() or line.startswith(("fix ", "Key metrics", "Share:")):
            break
        if line.split()[0] in families:
            rows.append([line])
        else:
            rows[-1].append(line)
    return rows


def test_demo_scan_groups_into_its_three_families(demo_result):
    groups = group_causes(demo_result["causes"], summed=False)  # written before Shapley shares
    assert {g["family"] for g in groups} == FAMILIES
    assert sum(g["count"] for g in groups) == len(demo_result["causes"]) == 20
    assert sorted(s for g in groups for s in g["sites"]) == sorted(c["boundary"] for c in demo_result["causes"])
    rope = next(g for g in groups if g["family"] == "rope")
    assert (rope["class"], rope["kind"], rope["layers"]) == ("operator_path", "intermediate_precision",
                                                             "layers 0–3: rope_k, rope_q")
    norm = next(g for g in groups if g["family"] == "rms_norm")
    assert norm["layers"] == "layers 0–3: post_attention_layernorm; layers 1–3: input_layernorm; model.norm"
    assert all(g["necessity"] is True and isinstance(g["share"], float) and g["fix"] for g in groups)
    assert cause_groups(demo_result) == groups                      # no cause_groups field: grouped on the fly


def test_groups_split_by_class_and_kind_not_only_family():
    """Negative control: causes of one family but another kind or class are separate rows."""
    base = {"evidence": [], "fix": "f", "share": None, "necessity": None, "family": "rms_norm"}
    causes = [{**base, "boundary": "model.layers.0.input_layernorm", "class": "operator_path", "kind": "fused_vs_unfused"},
              {**base, "boundary": "model.layers.1.input_layernorm", "class": "operator_path", "kind": "fused_vs_unfused"},
              {**base, "boundary": "model.layers.0.input_layernorm", "class": "framework_difference",
               "kind": "config_mismatch", "share": 0.5, "necessity": True, "fix": "g"},
              {**base, "boundary": "model.norm", "class": "operator_path", "kind": "reduction_order"}]
    groups = group_causes(causes)
    assert [(g["class"], g["kind"], g["count"]) for g in groups] == [
        ("framework_difference", "config_mismatch", 1), ("operator_path", "fused_vs_unfused", 2),
        ("operator_path", "reduction_order", 1)]                   # framework first, then by share
    assert groups[1]["layers"] == "layers 0–1: input_layernorm"
    assert groups[1]["share"] is None and groups[1]["necessity"] is None


def test_share_is_the_sum_and_necessity_any():
    """A lever's share is split among its causes, so a group's is their sum; unmeasured ones do not count."""
    causes = [{"boundary": f"model.layers.{n}.mlp.down_proj", "class": "operator_path", "kind": "reduction_order",
               "family": "linear", "evidence": [], "fix": "x", "share": s, "necessity": nec}
              for n, (s, nec) in enumerate([(0.1, False), (0.3, True), (None, None)])]
    (g,) = group_causes(causes)
    assert g["share"] == pytest.approx(0.4) and g["necessity"] is True and g["count"] == 3
    shapley = {"causes": causes, "attribution": {"closed": 0.4, "levers": []}}
    assert cause_groups(shapley)[0]["share"] == pytest.approx(0.4)


def test_a_result_before_shapley_shares_groups_by_the_largest():
    """Control: before Shapley attribution every cause carried its lever's whole share; summing would count
    it once per site."""
    causes = [{"boundary": f"model.layers.{n}.mlp.down_proj", "class": "operator_path", "kind": "reduction_order",
               "family": "linear", "evidence": [], "fix": "x", "share": 0.3, "necessity": True} for n in range(4)]
    legacy = {"causes": causes, "attribution": {"baseline_abs_diff_max": 0.1, "levers": [],
                                                "residual_abs_diff_max": 0.0}}
    assert cause_groups(legacy)[0]["share"] == 0.3


def test_describe_sites():
    assert describe_sites(["model.layers.3.self_attn.rope_q"]) == "layer 3: rope_q"
    sites = [f"model.layers.{n}.mlp.down_proj" for n in (0, 1, 2, 5, 7, 8)] + ["logits", "model.layers.9.mlp.up_proj"]
    assert describe_sites(sites) == "layers 0–2, 5, 7–8: down_proj; layer 9: up_proj; logits"


def test_result_cause_groups_are_read_first(demo_result):
    demo_result["cause_groups"] = [{"class": "operator_path", "kind": "k", "family": "only", "sites": ["x"],
                                    "layers": "x", "share": None, "necessity": None, "fix": ""}]
    assert [g["family"] for g in cause_groups(demo_result)] == ["only"]


def test_cause_groups_validate_and_a_broken_one_does_not(demo_result):
    demo_result["cause_groups"] = group_causes(demo_result["causes"])
    demo_result["timings"] = {"load": 12.5, "attribute": 30.0}
    demo_result["peak_rss_bytes"] = 3 * 2**30
    assert validate_result(demo_result) == []
    del demo_result["cause_groups"][0]["family"]
    demo_result["timings"]["load"] = -1
    errors = validate_result(demo_result)
    assert any("cause_groups[0]" in e and "family" in e for e in errors), errors
    assert any("timings.load" in e for e in errors), errors


@pytest.mark.parametrize("width", [80, 200])
def test_demo_summary_fits_the_terminal(demo_result, width):
    text = _render(demo_result, width)
    assert "first divergence: model.layers.0.self_attn.rope_q" in text
    rows = _cause_rows(text)
    assert len(rows) == 3 and {r[0].split()[0] for r in rows} == FAMILIES
    assert all(len(r) <= 2 for r in rows), rows                     # no cell wraps over 2 lines
    table = text[text.index("Causes:"):]
    assert max(len(line.rstrip()) for line in table.splitlines()) <= width
    assert "20 ops in 3 groups" in text
    if width == 80:
        assert _screen_lines(text, width) <= 40, text
        assert "verl name" not in text and "fix rope:" in text     # fixes under the table
    else:
        assert re.search(r"share\s+necessary\s+fix", text) and "training/rollout_probs_diff_max" in text
        assert _screen_lines(text, width) < _screen_lines(_render(demo_result, 80), 80)


@pytest.mark.parametrize("width", [80, 200])
def test_24_layer_summary_is_still_one_screen(layered, width):
    result = layered(24)
    text = _render(result, width)
    rows = _cause_rows(text)
    assert len(rows) == 3 and all(len(r) <= 2 for r in rows), rows
    assert "120 ops in 3 groups" in text and "layers 0–23: rope_q, rope_k" in text
    assert _screen_lines(text, width) <= 40
    assert text.count("model.layers.") <= 3                         # sites are described, not listed


def test_explain_uses_the_same_groups(demo_result):
    text = explain(demo_result)
    why = text[text.index("Why:"):text.index("How sure")]
    assert why.count("\n  - ") == 3
    for g in group_causes(demo_result["causes"]):
        assert f"{g['family']}) at {g['count']} sites, {g['layers']}" in why


def test_explain_next_steps_are_installed_commands(demo_result, sample_result):
    for result in (demo_result, sample_result):
        nxt = explain(result).split("Next: ", 1)[1]
        assert "bench/" not in nxt and ".py" not in nxt
        assert "logdiff " in nxt


def test_html_report_shows_one_row_per_group_with_every_site(layered):
    from logdiff.reports.html import render_html

    result = layered(24)
    html = render_html(result)
    assert html.count('<tr class="cause">') == 3
    assert "layers 0–23: rope_q, rope_k" in html and "(120 ops in 3 groups)" in html
    for g in result["cause_groups"]:
        assert html.count(g["fix"]) == 1                               # one fix per family, not per op
    sites = html[html.index('id="causes"'):html.index('id="heatmap-section"')]
    for c in result["causes"]:                                         # every op, folded under its group
        assert c["boundary"].replace(".", ".<wbr>") in sites
