"""Terminal summary: verdict first, then causes and key metrics; quiet is one line; no hard-coded colour."""

from __future__ import annotations

import io
import re

from rich.console import Console

from logdiff.reports.terminal import print_summary

COLOUR_SGR = re.compile(r"\x1b\[(?:[0-9;]*;)?(?:3[0-9]|9[0-7]|4[0-9]|10[0-7])(?:;[0-9;]*)?m")


def _record(result: dict, quiet: bool = False, width: int = 140) -> str:
    console = Console(record=True, no_color=True, width=width, file=io.StringIO())
    print_summary(result, console, quiet=quiet)
    return console.export_text()


def test_verdict_first_then_causes_then_metrics(sample_result):
    text = _record(sample_result)
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines[0].startswith("logdiff: mixed")
    assert "max|Δlogprob| 0.1522" in lines[0]
    assert "first divergence model.layers.0.input_layernorm @ position 0" in lines[0]
    i_causes, i_metrics = text.index("Causes"), text.index("Key metrics")
    assert text.index("logdiff: mixed") < i_causes < i_metrics
    assert text.index("config_mismatch") < text.index("attention_reduction_order")   # ranked by share
    for name in ("training/rollout_probs_diff_max", "training/rollout_actor_probs_pearson_corr",
                 "rollout_corr/kl", "rollout_corr/k3_kl", "hf vs vllm-prefill"):
        assert name in text, name
    assert "vllm (vllm 0.32.0, decode)" in text
    assert "warning: model.layers.N.mlp.experts is fused" in text


def test_quiet_prints_only_the_verdict_line(sample_result):
    text = _record(sample_result, quiet=True, width=60)            # narrow: still one line
    assert text.strip().count("\n") == 0
    assert text.startswith("logdiff: mixed")
    assert "Causes" not in text and "Key metrics" not in text


def test_incomplete_shows_in_the_verdict_line(sample_result):
    sample_result["complete"] = False
    assert "(incomplete)" in _record(sample_result, quiet=True)
    assert "stopped early" in _record(sample_result)


def test_consistent_result_has_no_causes_table(logprobs_depth_result):
    r = logprobs_depth_result
    r["verdict"] = "consistent"
    text = _record(r)
    assert text.startswith("logdiff: consistent") and "Causes" not in text and "Key metrics" in text


def test_strings_are_not_read_as_rich_markup(sample_result):
    sample_result["model"] = "/m/[bold red]x[/bold red]"
    sample_result["causes"][0]["kind"] = "[link=file:///etc]kind[/link]"
    text = _record(sample_result)
    assert "/m/[bold red]x[/bold red]" in text
    assert "[link=file:///etc]kind" in text                      # literal (cut to the column's width)


def test_no_colour_codes_when_no_color(sample_result):
    def ansi(no_color: bool) -> str:
        buf = io.StringIO()
        console = Console(file=buf, force_terminal=True, no_color=no_color, width=140, color_system="truecolor")
        print_summary(sample_result, console)
        return buf.getvalue()

    coloured = ansi(no_color=False)
    assert COLOUR_SGR.search(coloured), "negative control: with colour on, colour codes must appear"
    assert not COLOUR_SGR.search(ansi(no_color=True))


def test_no_color_env_is_honoured_by_a_default_console(sample_result, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=140)
    print_summary(sample_result, console)
    assert not COLOUR_SGR.search(buf.getvalue())


def test_a_path_without_a_version_shows_its_engine_alone(sample_result):
    """A bundle may record no engine version (an msprobe dump): "(hf, forward)", not "(hf ?, forward)"."""
    sample_result["paths"][0]["version"] = None
    text = _record(sample_result)
    assert "hf (hf, forward)" in text and " ?," not in text
    assert "vllm (vllm 0.32.0, decode)" in text  # negative control: a version that is there is shown
