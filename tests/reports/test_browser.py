"""The report in a real headless Chromium: it draws, shows the verdict and causes, logs no errors,
and injected markup stays inert. Screenshots go to $LOGDIFF_SCREENSHOT_DIR (default: a tmp dir).

The page checks are the ``check_report_page`` / ``save_screenshots`` fixtures (conftest.py), so an
end-to-end test of a real scan under tests/reports/ can reuse them.
"""

from __future__ import annotations

import re

from logdiff.reports.html import render_html


def _severe(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def test_sample_report_in_chromium(browser, write_page, check_report_page, save_screenshots, sample_result, tmp_path):
    page = write_page(sample_result, tmp_path / "report.html")
    facts = check_report_page(browser, page, "mixed")
    assert facts["drawn"] == "drawn"
    assert facts["canvas"]["painted"] > 1000 and facts["canvas"]["colours"] > 20, facts["canvas"]
    assert facts["causes"] == 2
    assert not _severe(browser), _severe(browser)
    top, full = save_screenshots(browser, "report-sample")
    assert top.stat().st_size > 10_000 and full.stat().st_size > top.stat().st_size
    print(f"\nscreenshots: {top} {full}")


def test_heatmap_hover_shows_boundary_position_value_and_first_divergence(browser, write_page, sample_result, tmp_path):
    page = write_page(sample_result, tmp_path / "report.html")
    browser.get_log("browser")
    browser.get(page.resolve().as_uri())
    tip = browser.execute_script("""
        const c = document.getElementById('heatmap');
        const L = JSON.parse(c.getAttribute('data-layout'));
        const r = c.getBoundingClientRect();
        function hover(row, col) {
          c.dispatchEvent(new MouseEvent('mousemove', {bubbles: true,
            clientX: r.left + L.labelW + col * L.cellW + L.cellW / 2, clientY: r.top + L.topH + row * L.cellH + L.cellH / 2}));
          const t = document.getElementById('heatmap-tip');
          return {hidden: t.hidden, text: t.innerText};
        }
        return {first: hover(1, 0), embed: hover(0, 3), missing: hover(14, 20)};""")
    assert not tip["first"]["hidden"]
    assert tip["first"]["text"].splitlines() == ["model.layers.0.input_layernorm", "position 0",
                                                  "max_abs_diff: 0.0041", "first divergence"]
    assert tip["embed"]["text"].splitlines() == ["model.embed_tokens", "position 3",
                                                  "max_abs_diff: 0 (bitwise equal)"]
    assert tip["missing"]["text"].splitlines()[0] == "model.layers.0.mlp.experts"
    assert tip["missing"]["text"].splitlines()[2] == "max_abs_diff: not recorded"
    assert not _severe(browser), _severe(browser)


def test_injected_markup_stays_inert(browser, write_page, check_report_page, save_screenshots, injected_result, injected,
                                     tmp_path):
    page = write_page(injected_result, tmp_path / "report.html")
    facts = check_report_page(browser, page, "mixed")
    assert facts["model"] == injected["model"]                    # shown as text, exactly
    assert facts["drawn"] == "drawn"                              # the </script> label did not break the data
    assert not _severe(browser), _severe(browser)
    save_screenshots(browser, "report-injected")


def test_negative_control_unescaped_markup_would_run(browser, sample_result, tmp_path):
    """Proves the inertness checks can fail: the same markup pasted raw (and without the CSP) runs."""
    sample_result["model"] = "MODEL_PLACEHOLDER"
    html = render_html(sample_result)
    html = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", html)
    html = html.replace("MODEL_PLACEHOLDER", '<img src="data:," onerror="window.__pwned=1" onload="window.__pwned=1">')
    page = tmp_path / "unsafe.html"
    page.write_text(html, encoding="utf-8")
    browser.get(page.resolve().as_uri())
    browser.implicitly_wait(0)
    pwned = browser.execute_script("return new Promise(r => setTimeout(() => r(typeof window.__pwned), 200))")
    imgs = browser.execute_script("return document.querySelectorAll('img').length")
    assert pwned == "number" and imgs >= 1                      # the model is shown in the header and the run section


def test_logprobs_depth_page_has_no_errors(browser, write_page, check_report_page, logprobs_depth_result, tmp_path):
    page = write_page(logprobs_depth_result, tmp_path / "report.html")
    facts = check_report_page(browser, page, "divergent")
    assert facts["drawn"] is None and "canvas" not in facts and facts["causes"] == 0
    assert not _severe(browser), _severe(browser)


def test_negative_control_blocked_script_is_caught(browser, check_report_page, sample_result, tmp_path):
    """Proves the draw and console checks can fail: a script that no longer matches its CSP hash is
    blocked, so the canvas stays blank and Chromium logs a SEVERE error."""
    html = render_html(sample_result).replace('"use strict";', '"use strict"; ', 1)
    page = tmp_path / "tampered.html"
    page.write_text(html, encoding="utf-8")
    facts = check_report_page(browser, page, "mixed")
    assert facts["drawn"] is None
    assert facts["canvas"]["painted"] == 0
    assert any("Content Security Policy" in e["message"] for e in _severe(browser))
