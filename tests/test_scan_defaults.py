"""What `logdiff scan MODEL` does without flags (issue 13): it answers where and why.

The default depth is modules (hooks, first divergence, classification, attribution) for `scan`
and logprobs for `check`; result.json records each phase's wall time and the peak memory; progress
rows appear on stderr only on a terminal and never with --quiet. The cheap path is HF against its
own KV-cache decode, with a one-sided eps so that the engines differ on every CPU (a framework
difference at the first RMSNorm, whatever the ISA's kernels do).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from logdiff.cli import app
from logdiff.commands import cli_app

FAST = ["--infer", "hf-decode", "--num-sequences", "2", "--prompt-len", "8", "--response-len", "6"]
EPS = ["--set", "infer.rms_norm_eps=1e-3"]


def _scan(args: list[str], out: Path) -> tuple[dict, str]:
    res = CliRunner().invoke(app, args + ["--json", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text()), res.output


def test_scan_defaults_to_where_and_why(qwen3: Path, tmp_path: Path) -> None:
    result, output = _scan(["scan", str(qwen3), *FAST, *EPS], tmp_path / "r.json")
    assert result["settings"]["depth"] == "modules"
    fd = result["first_divergence"]
    assert fd is not None and fd["boundary"] == "model.layers.0.input_layernorm"
    assert f"first divergence: {fd['boundary']}" in output
    groups = result["cause_groups"]
    assert any(g["class"] == "framework_difference" and g["kind"] == "config_contract" for g in groups), groups
    assert sorted(s for g in groups for s in g["sites"]) == sorted(c["boundary"] for c in result["causes"])
    assert "Causes:" in output and result["attribution"]["levers"]
    timings = result["timings"]
    for phase in ("stage", "load", "sample", "score:hf", "compare", "locate", "preflight", "attribute"):
        assert timings[phase] >= 0, (phase, timings)
    # (load may take ~0 s: an earlier test can have pooled the engines already, in any test order)
    assert sum(timings.values()) > 0 and result["peak_rss_bytes"] > 100 * 2**20
    assert result["scratch_bytes"] > 0  # the inference paths' rows, written to the scan's row stores
    assert "took " in output and "peak memory" in output and "of scratch written" in output
    assert "attribution rescan" not in output                    # CliRunner is not a terminal: no progress


def test_depth_logprobs_is_the_quick_screen_and_check_defaults_to_it(qwen3: Path, tmp_path: Path) -> None:
    """Negative control for the default: the quick screen localizes nothing; check keeps it as its default."""
    quick, _ = _scan(["scan", str(qwen3), *FAST, *EPS, "--depth", "logprobs"], tmp_path / "q.json")
    assert quick["settings"]["depth"] == "logprobs"
    assert quick["first_divergence"] is None and quick["causes"] == [] and quick["verdict"] == "divergent"
    assert "locate" not in quick["timings"] and "load" in quick["timings"] and quick["scratch_bytes"] is None
    gated, _ = _scan(["check", str(qwen3), *FAST, "--max-abs-diff", "100"], tmp_path / "c.json")
    assert gated["settings"]["depth"] == "logprobs"


@pytest.mark.parametrize("quiet", [False, True])
def test_progress_rows_on_a_terminal_only_without_quiet(qwen3: Path, tmp_path: Path, monkeypatch, quiet) -> None:
    buf = io.StringIO()
    monkeypatch.setattr(cli_app, "stderr_console", lambda: Console(file=buf, force_terminal=True, width=120))
    args = ["scan", str(qwen3), *FAST, "--depth", "logprobs", "--seed", "1"] + (["--quiet"] if quiet else [])
    _scan(args, tmp_path / "r.json")
    shown = buf.getvalue()
    if quiet:
        assert "loading" not in shown and "score:" not in shown
    else:
        for text in ("stage", "check_weights", "load", "sample", "score:hf", "0:00:"):
            assert text in shown, text


def test_check_classifies_when_a_gate_reads_the_causes(qwen3: Path, tmp_path: Path) -> None:
    """--fail-on framework_difference needs the causes: check then runs at modules depth and the gate fires."""
    out = tmp_path / "r.json"
    args = ["check", str(qwen3), *FAST, *EPS, "--fail-on", "framework_difference", "--no-attribute", "--json", str(out)]
    res = CliRunner().invoke(app, args)
    result = json.loads(out.read_text())
    assert result["settings"]["depth"] == "modules" and res.exit_code == 1, res.output
    assert "FAIL fail-on framework_difference" in res.output
