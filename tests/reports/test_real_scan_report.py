"""The report of a real scan (demo Qwen3, HF against vLLM, --depth modules) in headless Chromium.

The model directory's name carries markup, so the page must show it as inert text.
The screenshot lands in $LOGDIFF_SCREENSHOT_DIR. (The README's pictures, docs/img/report.png and
report-heatmap.png, are of the demo's own report, demo/scan/report.html, taken the same way: 1,360 px wide.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from logdiff.cli import app

INJECTED = "<img src=x onerror=window.__pwned=1>"


@pytest.mark.vllm
def test_real_scan_report_in_chromium(qwen3: Path, tmp_path: Path, browser, check_report_page, save_screenshots) -> None:
    model = tmp_path / INJECTED
    model.symlink_to(qwen3, target_is_directory=True)
    out = tmp_path / "scan"
    args = ["scan", str(model), "--infer", "vllm", "--depth", "modules", "--num-sequences", "4",
            "--prompt-len", "12", "--response-len", "12", "--out", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    result = json.loads((out / "result.json").read_text())
    assert result["model"] == str(model) and result["causes"] and result["divergence_table"]
    groups = result["cause_groups"]                          # filled by the pipeline: every cause in one group
    assert sorted(s for g in groups for s in g["sites"]) == sorted(c["boundary"] for c in result["causes"])
    assert result["timings"]["attribute"] > 0 and result["peak_rss_bytes"] > 0
    html = (out / "report.html").read_text()
    assert not re.search(r"https?://", html), "the report must not reference remote assets"
    assert INJECTED not in html  # escaped wherever it appears

    facts = check_report_page(browser, out / "report.html", result["verdict"])
    assert INJECTED in facts["model"]  # shown as text
    assert facts["canvas"]["painted"] > 0 and facts["canvas"]["colours"] > 1  # the heatmap drew
    assert facts["causes"] == len(groups)
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe
    top, full = save_screenshots(browser, "report-real-scan")
    assert top.stat().st_size > 10_000 and full.stat().st_size > top.stat().st_size // 2
