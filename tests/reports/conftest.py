"""Fixtures for the reports tests: the sample result, variants of it, and a headless Chromium.

``sample_result`` is a fresh deep copy of data/sample_result.json (regenerate it
with data/make_sample.py), so tests may mutate it freely. ``browser`` is a
module-scoped headless Chromium driven by selenium; it skips (with the reason)
only when chromium, chromedriver or selenium is missing.
"""

from __future__ import annotations

import copy
import json
import os
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


LAYER_OPS = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.q_norm",
             "self_attn.k_norm", "self_attn.rope_q", "self_attn.rope_k", "self_attn.attn_core", "self_attn.o_proj",
             "residual_attn", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.act_mul",
             "mlp.down_proj", "residual_mlp"]

# (op, class, kind, family): the three families of the demo scan (README), at every layer
LAYERED_CAUSES = [("self_attn.rope_q", "intermediate_precision", "rope"),
                  ("self_attn.rope_k", "intermediate_precision", "rope"),
                  ("self_attn.attn_core", "online_softmax_block_size", "attention"),
                  ("input_layernorm", "fused_vs_unfused", "rms_norm"),
                  ("post_attention_layernorm", "fused_vs_unfused", "rms_norm")]
# each family's Shapley share of the mean gap (one lever a family), split among its causes; they sum to 1
LAYERED_SHARES = {"rope": 0.3, "attention": 0.75, "rms_norm": -0.05}


def layered_result(sample: dict, layers: int) -> dict:
    """A schema-valid dense Qwen3-like result with ``layers`` decoder layers: the demo scan's three
    operator-path families (RoPE, attention core, fused add+norm) at every layer, first divergence at
    layer 0's rope_q, and a boundary x position table that grows through the layers."""
    from logdiff.reports.groups import group_causes

    r = copy.deepcopy(sample)
    names = ["model.embed_tokens"] + [f"model.layers.{n}.{op}" for n in range(layers) for op in LAYER_OPS]
    names += ["model.norm", "logits", "log_softmax"]
    positions = r["divergence_table"]["positions"]
    values, err = [], 0.0
    for name in names:
        if name.endswith(("rope_q", "rope_k", "attn_core", "layernorm")) or name == "model.norm":
            err = max(err * 1.05, 3.9e-3)
        values.append([0.0 if (name == "model.embed_tokens" or (err < 4e-3 and p < 6)) else
                       float(f"{err * (1 + (p % 7) / 7):.4g}") for p in positions])
    r["divergence_table"] = {"boundaries": names, "positions": positions, "max_abs_diff": values,
                             "metric": "max_abs_diff"}
    r["first_divergence"] = {"boundary": "model.layers.0.self_attn.rope_q", "layer": 0, "sequence": 0, "position": 6,
                             "response_index": None, "max_abs_diff": 0.0156, "inputs_equal": True,
                             "input_max_abs_diff": 0.0, "worst": {"sequence": 1, "position": 22, "response_index": 6,
                                                                  "max_abs_diff": 0.0156}}
    causes, ops = [], []
    sites = {f: layers * sum(c[2] == f for c in LAYERED_CAUSES) for f in LAYERED_SHARES}
    for n in range(layers):
        for op, kind, family in LAYERED_CAUSES:
            boundary, share = f"model.layers.{n}.{op}", LAYERED_SHARES[family] / sites[family]
            causes.append({"boundary": boundary, "layer": n, "class": "operator_path", "kind": kind,
                           "family": family, "op_kind": family, "share": share, "necessity": True,
                           "evidence": [f"inputs bitwise equal (replay); {family} differs locally",
                                        f"the difference vanishes with the reference {family} kernel"],
                           "fix": f"use one {family} kernel on both sides (logdiff.kernels.{family})",
                           "differs": []})
            ops.append({"boundary": boundary, "layer": n, "local_max_abs_diff": 3.9e-3,
                        "propagated_max_abs_diff": 3.9e-3 * (n + 1), "method": "replay", "inputs_equal": n == 0})
    r["causes"], r["introducing_ops"] = causes, ops
    r["cause_groups"] = group_causes(causes)
    r["attribution"] = layered_attribution(r["logprobs"], sites)
    r["verdict"] = "operator_path"
    r["architecture"] = "Qwen3ForCausalLM"
    r["model"] = f"/models/qwen3-{layers}-layers"
    r["warnings"] = []
    r["contracts"]["differs"] = []
    r["contracts"]["train"]["rms_norm_eps"] = r["contracts"]["infer"]["rms_norm_eps"]
    return r


def layered_attribution(metrics: dict, sites: dict[str, int]) -> dict:
    """The attribution of ``layered_result``: three kernel levers closing the whole gap, interacting."""
    base, top = metrics["abs_diff_mean"], metrics["abs_diff_max"]
    levers = [{"lever": f"kernel:{f}", "causes": sites[f], "share": share, "share_k3_kl": share,
               "alone": top * 1.05, "all_others": top * 0.5, "alone_abs_diff_mean": base * 1.02,
               "all_others_abs_diff_mean": base * 0.4} for f, share in LAYERED_SHARES.items()]
    return {"metric": "abs_diff_mean", "method": "exact", "configurations": 8, "baseline": base, "residual": 0.0,
            "closed": 1.0, "interaction": 3 * -0.02 - 1.0, "closed_k3_kl": 1.0, "baseline_abs_diff_max": top,
            "residual_abs_diff_max": 0.0, "levers": levers}


@pytest.fixture
def layered(sample_json):
    """layered(n) -> a fresh ``layered_result`` with n decoder layers."""
    return lambda layers: layered_result(sample_json, layers)


@pytest.fixture
def demo_result() -> dict:
    """A real demo-style scan (data/demo_scan_result.json), written before ``cause_groups`` existed."""
    return json.loads((DATA / "demo_scan_result.json").read_text(encoding="utf-8"))


@pytest.fixture
def demo_v2() -> dict:
    """The demo scan as ``scripts/demo.sh`` runs it (``logdiff scan demo/qwen3``: HF against the CPU vLLM), schema
    version 2, its pairs' per-boundary rows left out for size (data/demo_scan_v2.json)."""
    return json.loads((DATA / "demo_scan_v2.json").read_text(encoding="utf-8"))


@pytest.fixture
def write_page():
    """``write_page(result, path)``: the rendered report at ``path`` (the CLI writes it through ``logdiff.commands.outputs``)."""
    from logdiff.reports.html import render_html

    def write(result: dict, path: Path) -> Path:
        path.write_text(render_html(result), encoding="utf-8")
        return path

    return write

