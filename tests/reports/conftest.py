"""Fixtures for the reports tests: the sample result, variants of it, and a headless Chromium.

``sample_result`` is a fresh deep copy of data/sample_result.json (regenerate it
with data/make_sample.py), so tests may mutate it freely. ``browser`` is a
module-scoped headless Chromium driven by selenium; it skips (with the reason)
only when chromium, chromedriver or selenium is missing.
"""

from __future__ import annotations

import copy
import os
import json
import shutil
import tempfile
from pathlib import Path

import pytest

DATA = Path(__file__).with_name("data")
SAMPLE_PATH = DATA / "sample_result.json"

INJECTED_MODEL = '/models/<img src=x onerror="window.__pwned=1">'
INJECTED_BOUNDARY = 'model.layers.1.mlp</script><script>window.__pwned=2</script>'

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-dev-shm-usage", "--window-size=1360,900", "--hide-scrollbars"]


@pytest.fixture(scope="session")
def sample_json() -> dict:
    return json.loads(SAMPLE_PATH.read_text(encoding="utf-8"))


@pytest.fixture
def sample_result(sample_json) -> dict:
    return copy.deepcopy(sample_json)


@pytest.fixture
def logprobs_depth_result(sample_result) -> dict:
    """The sample as a --depth logprobs scan would write it: nothing localized."""
    r = sample_result
    r["settings"]["depth"] = "logprobs"
    r.update(first_divergence=None, introducing_ops=[], causes=[], verdict="divergent",
             divergence_table=None, contracts=None, moe=None, batch_invariance=None, warnings=[])
    return r


def inject(result: dict) -> dict:
    """Put markup into every kind of string the page shows: paths, names, evidence, token text."""
    result["model"] = INJECTED_MODEL
    result["checkpoint"] = "<b>ckpt</b>&amp;"
    result["warnings"].append('<iframe src="javascript:window.__pwned=3"></iframe>')
    names = result["divergence_table"]["boundaries"]
    names[names.index("model.layers.1.mlp")] = INJECTED_BOUNDARY
    result["causes"][0]["evidence"].append('<img src=y onerror="window.__pwned=4">')
    result["causes"][1]["fix"] = "<script>window.__pwned=5</script>"
    result["causes"][1]["boundary"] = 'model.<img src=q onerror="window.__pwned=8">.attn' 
    result["pairs"][0]["worst"]["token_text"] = '"><svg onload="window.__pwned=6">'
    result["contracts"]["train"]["<u>key</u>"] = "<i>v</i>"
    result["paths"][1]["settings"]["note"] = "</td></tr></table><img src=z onerror=window.__pwned=7>"
    return result


@pytest.fixture
def injected_result(sample_result) -> dict:
    return inject(sample_result)


@pytest.fixture
def injected() -> dict:
    """The injected strings the tests look for."""
    return {"model": INJECTED_MODEL, "boundary": INJECTED_BOUNDARY}


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium (selenium) with browser console logging on."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_bin = shutil.which("chromedriver")
    if not chromium or not driver_bin:
        pytest.skip("chromium and chromedriver are needed for the browser test "
                    f"(found chromium={chromium}, chromedriver={driver_bin})")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    profile = tempfile.mkdtemp(prefix="logdiff-chromium-")
    for arg in CHROMIUM_ARGS + [f"--user-data-dir={profile}"]:
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(driver_bin))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


_PAGE_FACTS_JS = """
    const c = document.getElementById('heatmap');
    const out = {verdict: document.getElementById('verdict').textContent.trim(),
                 drawn: document.documentElement.getAttribute('data-heatmap'),
                 pwned: typeof window.__pwned,
                 imgs: document.querySelectorAll('img, iframe, object, embed').length,
                 scripts: document.scripts.length,
                 causes: document.querySelectorAll('#causes tbody tr.cause').length,
                 model: document.getElementById('model').textContent};
    if (c) {
      const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
      let painted = 0; const colours = new Set();
      for (let i = 0; i < d.length; i += 4 * 7) {
        if (d[i + 3] && (d[i] < 250 || d[i + 1] < 250 || d[i + 2] < 250)) {
          painted++; colours.add(d[i] << 16 | d[i + 1] << 8 | d[i + 2]);
        }
      }
      out.canvas = {w: c.width, h: c.height, painted: painted, colours: colours.size};
    }
    return out;"""


@pytest.fixture
def check_report_page():
    """check(driver, html_path, verdict) -> facts: loads the page and asserts what every report must do
    (the verdict shown, only the page's own two scripts, no injected element or script ran)."""

    def check(driver, path: Path, verdict: str) -> dict:
        driver.get_log("browser")                               # drop what earlier pages logged
        driver.get(Path(path).resolve().as_uri())
        facts = driver.execute_script(_PAGE_FACTS_JS)
        assert facts["verdict"] == verdict, facts
        assert facts["scripts"] == 2, facts
        assert facts["pwned"] == "undefined", "injected markup ran"
        assert facts["imgs"] == 0, "injected markup created elements"
        return facts

    return check


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory) -> Path:
    """$LOGDIFF_SCREENSHOT_DIR, or a fresh tmp dir."""
    where = os.environ.get("LOGDIFF_SCREENSHOT_DIR")
    path = Path(where) if where else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def save_screenshots(screenshot_dir):
    """save(driver, stem) -> (first screen, whole page) PNG paths under screenshot_dir; also writes
    STEM-heatmap.png (the heatmap section) when the page has one."""

    def save(driver, stem: str) -> tuple[Path, Path]:
        driver.set_window_size(1360, 900)
        driver.execute_script("window.scrollTo(0, 0)")
        top = screenshot_dir / f"{stem}.png"
        driver.save_screenshot(str(top))
        height = int(driver.execute_script("return document.documentElement.scrollHeight"))
        driver.set_window_size(1360, min(height + 140, 16000))
        full = screenshot_dir / f"{stem}-full.png"
        driver.save_screenshot(str(full))
        sections = driver.find_elements("css selector", "#heatmap-section")
        if sections:                                            # the heatmap alone, for a README
            sections[0].screenshot(str(screenshot_dir / f"{stem}-heatmap.png"))
        driver.set_window_size(1360, 900)
        return top, full

    return save
