"""Shapley shares in every renderer: what they sum to, and what a negative one means, said in words.

``layered(24)`` (conftest.py) has a Shapley attribution whose three family shares (75%, 30%, −5%)
sum to ``closed`` = 100%; ``sample_result`` has two positive shares summing to 95%;
``demo_result`` was written before Shapley attribution and keeps its old words.
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from logdiff.reports import explain, validate_result
from logdiff.reports import shares
from logdiff.reports.groups import cause_groups
from logdiff.reports.html import render_html
from logdiff.reports.terminal import print_summary


def _render(result: dict, width: int) -> str:
    console = Console(record=True, no_color=True, width=width, file=io.StringIO())
    print_summary(result, console)
    return console.export_text()


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_layered_shares_add_up_to_closed_and_validate(layered):
    result = layered(24)
    assert validate_result(result) == []
    closed = result["attribution"]["closed"]
    assert sum(c["share"] for c in result["causes"]) == pytest.approx(closed)
    assert sum(g["share"] for g in cause_groups(result)) == pytest.approx(closed)


@pytest.mark.parametrize("width", [80, 200])
def test_terminal_says_what_shares_sum_to_and_what_negative_means(layered, width):
    text = _render(layered(24), width)
    flat = _flat(text)
    assert "the shares sum to 100%, what all fixes together close" in flat
    # what to do, in plain words (issue 52): every lever alone widens the layered result's gap
    assert "Alone, each widens the mean or the max gap: apply the fixes together, not one at a time." in flat
    assert "interaction" not in flat
    assert "A negative share: on average, fixing that cause widens the gap" in flat


def test_terminal_share_lines_fit_80_columns(layered, sample_result):
    for result in (layered(24), sample_result):
        text = _render(result, 80)
        start = text.index("Share:")
        block = text[start:text.index("fix ", start)]
        assert all(len(line.rstrip()) <= 80 for line in block.splitlines()), block


def test_no_negative_share_no_negative_words(sample_result):
    """Control: the sample's shares are positive; the note says what they sum to, and nothing of negatives."""
    flat = _flat(_render(sample_result, 80))
    assert "the shares sum to 95%" in flat and "negative" not in flat
    assert "negative" not in explain(sample_result)


def test_a_result_before_shapley_keeps_its_old_words(demo_result):
    """Control: no attribution.closed, no Shapley note (its shares meant something else)."""
    assert shares.note(demo_result) is None
    assert "Shapley" not in _render(demo_result, 80) and "Shapley" not in render_html(demo_result)
    assert "neutralising it alone" in explain(demo_result)


def test_explain_says_each_share_and_what_a_negative_one_means(layered):
    why = explain(layered(24))
    line = next(x for x in why.splitlines() if "rms_norm)" in x)
    assert "its share of the mean gap is -5% (negative: on average, fixing it widens the gap" in line
    assert "its share of the mean gap is 75%." in why
    assert "the shares sum to 100%" in why


def test_html_says_what_shares_sum_to_and_marks_the_negative_row(layered):
    html = render_html(layered(24))
    causes = html[html.index('id="causes"'):html.index('id="heatmap-section"')]
    assert causes.count('class="muted share-note"') == 1               # the one negative group only
    row = causes[causes.index("rms_norm"):]
    assert row.index("share-note") < row.index("</tr>")
    assert "the shares sum to 100%, what all fixes together close" in causes
    assert "fraction of the final max" not in causes                  # the old words are for old results


def test_sampled_attribution_says_so(layered):
    result = layered(24)
    result["attribution"].update(method="sampled", permutations=16)
    assert validate_result(result) == []
    assert "estimated from 16 sampled orders" in shares.note(result)
    del result["attribution"]["permutations"]
    assert any("permutations" in e for e in validate_result(result))
