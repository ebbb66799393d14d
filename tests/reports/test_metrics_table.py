"""The report's metrics table: every metric logdiff computes has a readable label, the metrics come in
groups (the rest folded away), and any number of pairs fits a 1,280 px page in a real headless Chromium
with no horizontal scroll, of the page or of a table. Negative controls force a table wider than the
page and show the fit check fails.

The metrics are ``compare.token_metrics`` on small synthetic logprobs, so a key a new metric adds
is checked here the day it is computed. Screenshots of the 2- and 8-pair tables go to
$LOGDIFF_SCREENSHOT_DIR (default: a tmp dir).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from logdiff.reports.format import METRIC_ALIASES, METRICS, current_names
from logdiff.reports.html import render_html
from logdiff.reports.metric_groups import GROUPS, REST, group_metrics

from logdiff.comparison.metrics import token_metrics

CATALOGUE = {key: label for key, label, *_ in METRICS}
PATH_NAMES = ["vllm", "vllm-prefill", "vllm-fp8-kv-cache", "vllm-chunked-prefill", "sglang-triton-attention",
              "vllm-cuda-graphs", "vllm-speculative-decode", "vllm-tensor-parallel-2", "sglang", "vllm-tp4",
              "vllm-fp8-weights", "vllm-flashinfer"]


def _logprobs(seed: int, noise: float) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Training logprobs, inference logprobs ``noise`` away, and inference top-1 ids (a few flipped)."""
    rng = np.random.default_rng(seed)
    train = [rng.normal(-1.5, 0.8, n) for n in (24, 17, 30)]
    infer = [t + rng.normal(0.0, noise, t.shape) for t in train]
    flips = [(rng.random(t.shape) < noise).astype(float) for t in train]
    return train, infer, flips


def emitted_keys() -> set[str]:
    """Every metric key ``token_metrics`` writes, under its current name (reports read deprecated aliases as those)."""
    train, infer, flips = _logprobs(0, 0.3)
    masks = [[1] * len(t) for t in train]
    masks[1][3] = 0
    zeros = [np.zeros_like(t) for t in train]
    return set(current_names(token_metrics(train, infer, zeros, flips, masks)))


def unlabelled(keys) -> list[str]:
    """The keys without a readable catalogue label: none, the raw key, or one still spelled with underscores."""
    return sorted(k for k in keys if not CATALOGUE.get(k) or CATALOGUE[k] == k or "_" in CATALOGUE[k])


def test_every_computed_metric_has_a_readable_label():
    keys = emitted_keys()
    assert len(keys) > 50 and "rollout_is_sequence_seq_fraction_high" in keys
    assert unlabelled(keys) == []


def test_negative_control_an_unlabelled_key_is_caught():
    assert unlabelled({"abs_diff_max", "brand_new_metric"}) == ["brand_new_metric"]


def test_catalogue_keys_and_labels_are_unique():
    keys = [k for k, *_ in METRICS]
    labels = [label for _, label, *_ in METRICS]
    assert len(set(keys)) == len(keys), [k for k in keys if keys.count(k) > 1]
    assert len(set(labels)) == len(labels), [k for k in labels if labels.count(k) > 1]
    assert not set(keys) & set(METRIC_ALIASES)


def test_groups_name_catalogued_keys_once_and_the_rest_takes_every_other():
    named = [k for g in GROUPS for k in g.keys]
    assert len(set(named)) == len(named) and set(named) <= set(CATALOGUE)
    column = {key: 0.5 for key in emitted_keys()} | {"brand_new_metric": 1.0}
    grouped = group_metrics([column])
    assert [g.id for g, _ in grouped] == [g.id for g in GROUPS] + [REST.id]
    shown = [row.key for _, rows in grouped for row in rows]
    assert sorted(shown) == sorted(column)                       # every key once, none lost
    rest = {row.key: row for row in grouped[-1][1]}
    assert "rollout_is_sequence_seq_fraction_high" in rest and "abs_diff_max" not in rest
    assert rest["brand_new_metric"].label == "brand new metric"  # unknown keys: the rest, words for a label


def result_with_pairs(sample: dict, n: int) -> dict:
    """The sample result with ``n`` hf-vs-X pairs whose metrics are ``token_metrics`` (the full key set)."""
    r = copy.deepcopy(sample)
    template = r["pairs"][0]
    pairs = []
    for k in range(n):
        train, infer, flips = _logprobs(k + 1, 0.02 * (k + 1))
        metrics = token_metrics(train, infer, [np.zeros_like(t) for t in train], flips)
        pairs.append({**copy.deepcopy(template), "train": "hf", "infer": PATH_NAMES[k], "metrics": metrics})
    r["pairs"], r["logprobs"] = pairs, pairs[0]["metrics"]
    r["settings"]["is_threshold"] = 2.0
    return r


def test_page_shows_each_metric_once_per_block_of_pairs(sample_result):
    html = render_html(result_with_pairs(sample_result, 8))
    for key in emitted_keys():                                  # all 8 pairs side by side: one row each
        assert html.count(f'<tr data-key="{key}">') == 1, key
    assert html.count('<col class="c-value">') == 8 * (len(GROUPS) + 1)
    stacked = render_html(result_with_pairs(sample_result, 12))   # 12: two blocks of 6, one above the other
    assert stacked.count('<tr data-key="abs_diff_max">') == 2
    assert stacked.count('<col class="c-value">') == 12 * (len(GROUPS) + 1)
    assert '<details class="metric-group rest" id="metrics-rest">' in html    # folded: no "open"
    assert "T = 2 (--is-threshold)" in html


FIT_JS = """
    const doc = document.scrollingElement, folded = el => el.closest('details:not([open])') !== null;
    const tables = [...document.querySelectorAll('#metrics table.metrics')];
    const section = document.getElementById('metrics-section').getBoundingClientRect();
    return {view: window.innerWidth, page: doc.scrollWidth,
            tables: tables.map(t => ({scroll: t.scrollWidth, client: t.clientWidth,
                                      boxScroll: t.parentElement.scrollWidth, boxClient: t.parentElement.clientWidth,
                                      right: t.getBoundingClientRect().right, visible: !folded(t)})),
            sectionRight: section.right,
            labels: [...document.querySelectorAll('#metrics tr[data-key]')].filter(r => !folded(r))
                      .map(r => [r.dataset.key, r.querySelector('.m-label').innerText.trim(),
                                 r.querySelector('.m-verl, .m-key').innerText.trim()])};"""


def fit_problems(facts: dict) -> list[str]:
    """What overflows: the page, a table's own content, a table's box, or a table past its section."""
    problems = [] if facts["page"] <= facts["view"] else [f"page scrolls: {facts['page']} > {facts['view']}"]
    for i, t in enumerate(facts["tables"]):
        if not t["visible"]:
            continue
        if t["scroll"] > t["client"]:
            problems.append(f"table {i} content {t['scroll']} > {t['client']}")
        if t["boxScroll"] > t["boxClient"]:
            problems.append(f"table {i} scrolls in its box: {t['boxScroll']} > {t['boxClient']}")
        if t["right"] > facts["sectionRight"]:
            problems.append(f"table {i} ends at {t['right']}, past its section at {facts['sectionRight']}")
    return problems


def _load(driver, html: str, path) -> dict:
    path.write_text(html, encoding="utf-8")
    driver.set_window_size(1280, 900)
    driver.get(path.resolve().as_uri())
    assert driver.execute_script("return window.innerWidth") == 1280
    return driver.execute_script(FIT_JS)


def _open_rest(driver) -> dict:
    driver.execute_script("document.querySelectorAll('#metrics details').forEach(d => d.open = true)")
    return driver.execute_script(FIT_JS)


@pytest.mark.parametrize("n_pairs", [1, 2, 4, 8, 12])
def test_metrics_fit_1280_px_for_any_number_of_pairs(browser, sample_result, save_metrics_shot, tmp_path, n_pairs):
    html = render_html(result_with_pairs(sample_result, n_pairs))
    folded = _load(browser, html, tmp_path / "report.html")
    assert fit_problems(folded) == [], folded
    blocks = 1 if n_pairs <= 8 else 2                          # more than 8 pairs: stacked
    assert sum(t["visible"] for t in folded["tables"]) == len(GROUPS) * blocks     # the rest is folded
    shown = _open_rest(browser)
    assert fit_problems(shown) == [], shown
    if n_pairs in (2, 8):
        save_metrics_shot(browser, f"metrics-{n_pairs}-pairs")
    assert len(shown["labels"]) == len(emitted_keys()) * blocks
    for key, label, name in shown["labels"]:                   # what a reader sees: the label, then the verl name
        assert label == CATALOGUE.get(key) and label != key and name, (key, label, name)


OVERFLOWS = {   # each makes a metrics table wider than the page in its own way
    "wide-table": "table.metrics { min-width: 1400px; }",                    # scrolls inside its box
    "wide-page": ".metric-box { overflow: visible; } table.metrics { min-width: 1400px; }",   # the page scrolls
    "long-cell": "table.metrics td.num { white-space: nowrap; overflow-wrap: normal; }"      # a value runs past
                 f" table.metrics td.num::after {{ content: '{'0' * 200}'; }}",           # the table's edge
}


@pytest.mark.parametrize("style", OVERFLOWS.values(), ids=OVERFLOWS.keys())
def test_negative_control_an_overflowing_table_fails_the_fit_check(browser, sample_result, tmp_path, style):
    html = render_html(result_with_pairs(sample_result, 2)).replace("</head>", f"<style>{style}</style></head>", 1)
    _load(browser, html, tmp_path / "wide.html")
    facts = _open_rest(browser)
    assert fit_problems(facts), facts


@pytest.fixture
def save_metrics_shot(screenshot_dir):
    """save(driver, stem): the metrics section at 1,280 px, the rest unfolded, as STEM.png under screenshot_dir."""

    def save(driver, stem: str):
        height = int(driver.execute_script("return document.documentElement.scrollHeight"))
        driver.set_window_size(1280, min(height + 100, 16000))
        path = screenshot_dir / f"{stem}.png"
        driver.find_element("id", "metrics-section").screenshot(str(path))
        driver.set_window_size(1280, 900)
        assert path.stat().st_size > 10_000
        return path

    return save
