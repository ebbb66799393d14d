"""The report of a 24- and a 36-layer scan in headless Chromium: grouped causes and the first divergence above
the fold, the heatmap's layers folded by default (all but the first divergence's), unfolded by a click.

The result is synthetic but schema-valid (``layered`` in conftest.py: the demo scan's three families
at every layer, 120 causes). docs/img/report-24-layers.png is this test's first-screen screenshot
(run with LOGDIFF_SCREENSHOT_DIR=DIR and copy DIR/report-24-layers.png).
"""

from __future__ import annotations

import json

import pytest


FOLD_JS = """
    const c = document.getElementById('heatmap');
    return JSON.parse(c.getAttribute('data-layout'));"""

ABOVE_FOLD_JS = """
    const bottom = el => el.getBoundingClientRect().bottom + window.scrollY;
    const rows = [...document.querySelectorAll('#causes tbody tr.cause')];
    return {fd: bottom(document.getElementById('first-divergence')),
            causes: rows.map(bottom), view: window.innerHeight,
            families: rows.map(r => r.querySelector('.c-kind strong').textContent),
            where: rows.map(r => r.querySelector('.where').textContent)};"""


def _click_label(driver, row: int) -> dict:
    return driver.execute_script("""
        const c = document.getElementById('heatmap'), L = JSON.parse(c.getAttribute('data-layout'));
        const r = c.getBoundingClientRect();
        c.dispatchEvent(new MouseEvent('click', {bubbles: true, clientX: r.left + 4,
                                                 clientY: r.top + L.topH + arguments[0] * L.cellH + L.cellH / 2}));
        return JSON.parse(c.getAttribute('data-layout'));""", row)


def _hover(driver, row: int, col: int) -> str:
    return driver.execute_script("""
        const c = document.getElementById('heatmap'), L = JSON.parse(c.getAttribute('data-layout'));
        const r = c.getBoundingClientRect();
        c.dispatchEvent(new MouseEvent('mousemove', {bubbles: true, clientX: r.left + L.labelW + arguments[1] * L.cellW + 1,
                                                     clientY: r.top + L.topH + arguments[0] * L.cellH + L.cellH / 2}));
        return document.getElementById('heatmap-tip').innerText;""", row, col)


@pytest.mark.parametrize("layers", [24, 36])
def test_deep_model_report(browser, write_page, check_report_page, save_screenshots, layered, tmp_path, layers):
    result = layered(layers)
    page = write_page(result, tmp_path / "report.html")
    browser.set_window_size(1360, 900)
    facts = check_report_page(browser, page, "operator_path")
    assert facts["drawn"] == "drawn" and facts["causes"] == 3
    assert facts["canvas"]["painted"] > 1000, facts["canvas"]

    seen = browser.execute_script(ABOVE_FOLD_JS)
    assert seen["fd"] < seen["view"] and max(seen["causes"]) < seen["view"], seen
    assert set(seen["families"]) == {"rope", "attention", "rms_norm"}
    assert f"layers 0–{layers - 1}: rope_q, rope_k" in seen["where"]

    per_layer = (len(result["divergence_table"]["boundaries"]) - 4) // layers   # less embed, norm, logits, log_softmax
    folded = browser.execute_script(FOLD_JS)
    assert folded["collapsed"] == layers - 1                              # every layer but the first divergence's
    assert folded["rows"] == 4 + per_layer + layers - 1 and folded["firstRow"] >= 0
    assert folded["cellH"] >= 9                                           # few enough rows for names
    top, _ = save_screenshots(browser, f"report-{layers}-layers")
    assert top.stat().st_size > 10_000
    row_of_layer_5 = 1 + per_layer + 4                                    # embed, layer 0 unfolded, layers 1-4 folded
    assert _hover(browser, row_of_layer_5, 0).startswith("layer 5: max over 17 boundaries")

    unfolded = _click_label(browser, row_of_layer_5)                      # a click on its name unfolds layer 5
    assert unfolded["collapsed"] == layers - 2 and unfolded["rows"] == folded["rows"] + per_layer - 1
    assert _hover(browser, row_of_layer_5, 0).splitlines()[0] == "model.layers.5.input_layernorm"
    assert _click_label(browser, row_of_layer_5)["collapsed"] == layers - 1   # and folds it again
    browser.find_element("id", "heatmap-expand").click()
    assert browser.execute_script(FOLD_JS)["rows"] == len(result["divergence_table"]["boundaries"])
    browser.find_element("id", "heatmap-collapse").click()
    assert browser.execute_script(FOLD_JS)["collapsed"] == layers
    assert not [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]


def test_a_few_layers_start_unfolded(browser, write_page, check_report_page, sample_result, tmp_path):
    """Negative control: the 4-layer sample shows every boundary; nothing is folded."""
    page = write_page(sample_result, tmp_path / "report.html")
    check_report_page(browser, page, "mixed")
    layout = browser.execute_script(FOLD_JS)
    assert layout["collapsed"] == 0 and layout["rows"] == len(sample_result["divergence_table"]["boundaries"])
    data = json.loads(browser.execute_script("return document.getElementById('logdiff-data').textContent"))
    assert data["heatmap"]["collapse"] is False and data["heatmap"]["n_layers"] == 4
