"""HTML report, string level: self-contained, escaped, graceful without optional fields, small."""

from __future__ import annotations

import json
import math
import re

import pytest

from logdiff.reports.charts import heatmap_data
from logdiff.reports.html import csp_hash, embed_json, render_html


def _data_block(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="logdiff-data">(.*?)</script>', html, re.S)
    assert m, "no data block"

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    return json.loads(m.group(1), parse_constant=no_constants)


def _scripts(html: str) -> list[str]:
    return re.findall(r"<script\b[^>]*>(.*?)</script>", html, re.S)


def test_sample_renders_every_section(sample_result):
    html = render_html(sample_result)
    for anchor in ('id="verdict"', 'id="causes"', 'id="heatmap"', 'id="metrics"', 'id="first-divergence"',
                   'id="contracts"', 'id="moe"', 'id="introducing"', 'id="paths"', 'id="warnings"'):
        assert anchor in html, anchor
    assert ">mixed</span>" in html
    assert html.count('<tr class="cause">') == 2
    assert "training/rollout_probs_diff_max" in html and "rollout_corr/k3_kl" in html
    assert "0.32.0" in html and "5.19.0" in html                       # both paths' versions
    assert 'id="incomplete"' not in html


def test_no_remote_references(sample_result):
    html = render_html(sample_result)
    assert "http://" not in html and "https://" not in html
    assert not re.search(r"""\b(src|href)\s*=\s*["']?(?!data:)[a-z]+:""", html, re.I)
    assert "@import" not in html and "url(" not in html


def test_page_is_small(sample_result):
    size = len(render_html(sample_result).encode("utf-8"))
    assert size < 300_000, size


def test_data_block_is_strict_json_and_matches_the_table(sample_result):
    data = _data_block(render_html(sample_result))
    hm = data["heatmap"]
    table = sample_result["divergence_table"]
    assert hm["labels"] == table["boundaries"]
    assert len(hm["values"]) == len(table["boundaries"]) and len(hm["cols"]) == len(table["positions"])
    assert hm["first"] == {"row": 1, "col": sample_result["first_divergence"]["position"]}
    assert hm["response_start"] == 16
    assert hm["values"][0] == [0.0] * len(table["positions"])            # embed_tokens: bitwise equal
    assert all(v is None for v in hm["values"][table["boundaries"].index("model.layers.0.mlp.experts")])


def test_inline_script_is_allowed_by_the_csp_and_nothing_else(sample_result):
    html = render_html(sample_result)
    scripts = _scripts(html)
    assert len(scripts) == 2                                          # the data block and the page script
    import html as htmllib

    csp = htmllib.unescape(re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html).group(1))
    assert "default-src 'none'" in csp
    assert csp_hash(scripts[1]) in csp
    assert csp_hash(scripts[1] + " ") not in csp                      # the hash pins the exact text


def test_injected_markup_is_escaped(injected_result, injected):
    html = render_html(injected_result)
    assert "<img" not in html and "<iframe" not in html and "<svg onload" not in html
    assert "<b>ckpt" not in html and "<u>key" not in html and "<i>v</i>" not in html
    assert "&lt;img src=x onerror=&#34;window.__pwned=1&#34;&gt;" in html
    assert "&lt;b&gt;ckpt&lt;/b&gt;&amp;amp;" in html
    assert len(_scripts(html)) == 2                                   # no </script> broke out
    data = _data_block(html)                                          # and the data block still parses
    assert injected["boundary"] in data["heatmap"]["labels"]
    assert injected["model"] not in html


def test_embed_json_escapes_everything_that_could_end_a_script():
    text = str(embed_json({"s": "</script><!-- & \u2028 \u2029 >"}))
    for bad in ("<", ">", "&", "\u2028", "\u2029"):
        assert bad not in text
    assert json.loads(text) == {"s": "</script><!-- & \u2028 \u2029 >"}


def test_logprobs_depth_degrades_gracefully(logprobs_depth_result):
    html = render_html(logprobs_depth_result)
    assert 'id="heatmap"' not in html and 'id="no-heatmap"' in html
    assert "--depth logprobs" in html
    assert 'id="causes"' not in html and 'id="no-causes"' in html
    assert 'id="moe"' not in html and 'id="introducing"' not in html
    assert _data_block(html) == {"heatmap": None}
    assert 'id="metrics"' in html and ">divergent</span>" in html


def test_minimal_result_renders(sample_result):
    keep = ["schema_version", "tool", "created", "complete", "warnings", "model", "checkpoint",
            "infer_checkpoint", "architecture", "dtype", "settings", "environment", "paths", "sequences",
            "pairs", "logprobs", "first_divergence", "introducing_ops", "causes", "verdict"]
    minimal = {k: sample_result[k] for k in keep}
    minimal["pairs"] = [{"train": "hf", "infer": "vllm", "metrics": {"abs_diff_max": 0.0, "abs_diff_mean": 0.0},
                         "per_position": {"abs_diff_mean": [0.0] * 4, "abs_diff_max": [0.0] * 4},
                         "histogram": {"edges": [0.0, 1e-8], "counts": [4]}, "worst": None}]
    minimal.update(logprobs={"abs_diff_max": 0.0, "abs_diff_mean": 0.0}, first_divergence=None,
                   introducing_ops=[], causes=[], verdict="consistent", warnings=[])
    html = render_html(minimal)
    assert ">consistent</span>" in html and "Every position is bitwise equal" in html
    assert render_html({})                                            # even an empty dict does not crash


def test_incomplete_is_prominent(sample_result):
    sample_result["complete"] = False
    sample_result["warnings"].append("vllm: engine crashed after 2 of 4 sequences")
    html = render_html(sample_result)
    assert 'id="incomplete"' in html
    assert html.index('id="incomplete"') < html.index('id="causes-section"')
    assert "engine crashed after 2 of 4 sequences" in html


def test_contract_and_weight_differences_are_highlighted(sample_result):
    html = render_html(sample_result)
    assert html.count('<tr class="differs">') == 1
    assert re.search(r'<tr class="differs"><td class="mono">rms_norm_eps</td><td class="mono">1e-06</td>'
                     r'<td class="mono">1e-05</td>', html)
    sample_result["contracts"]["weights"].update(fingerprint_infer="sha256:0000",
                                                 differs=["model.layers.1.mlp.down_proj.weight"])
    html = render_html(sample_result)
    assert html.count('<tr class="differs">') == 3
    assert "model.layers.1.mlp.down_proj.weight" in html


def test_non_finite_values_render_and_stay_strict_json(sample_result):
    table = sample_result["divergence_table"]["max_abs_diff"]
    table[5][7], table[6][8] = math.nan, math.inf
    sample_result["pairs"][0]["metrics"]["kl_k3"] = math.inf
    html = render_html(sample_result)
    values = _data_block(html)["heatmap"]["values"]
    assert values[5][7] == "NaN" and values[6][8] == "Infinity"
    assert re.search(r'<td class="num mono">inf</td>', html)


def test_wide_tables_are_downsampled_and_say_so():
    rows, cols = 300, 4096
    table = {"boundaries": [f"model.layers.{i // 15}.op{i % 15}" for i in range(rows)],
             "positions": list(range(cols)),
             "max_abs_diff": [[((i * 7 + j * 13) % 97) * 1e-4 for j in range(cols)] for i in range(rows)],
             "metric": "max_abs_diff"}
    table["max_abs_diff"][123][4001] = 5.0                            # the max must survive pooling
    hm = heatmap_data(table, {"boundary": table["boundaries"][123], "position": 4001})
    assert len(hm["values"]) * len(hm["cols"]) <= 200_000
    assert len(hm["cols"]) < cols and hm["note"] and "Downsampled" in hm["note"]
    col = hm["first"]["col"]
    assert hm["first"]["row"] == 123 and hm["cols"][col][0] <= 4001 <= hm["cols"][col][1]
    assert hm["values"][123][col] == 5.0
    html_size = len(json.dumps(hm))
    assert html_size < 3_000_000, html_size


def test_pooling_keeps_nan_and_ignores_missing():
    table = {"boundaries": ["a"], "positions": list(range(200)), "metric": "max_abs_diff",
             "max_abs_diff": [[None] * 100 + [1e-3] * 99 + [math.nan]]}
    hm = heatmap_data(table, None)
    assert hm["cols"] == [[p, p] for p in range(200)]                 # 200 columns fit: no pooling
    row = hm["values"][0]
    assert row[0] is None and row[150] == 0.001 and row[199] == "NaN"


def test_reports_package_does_not_import_torch_or_logdiff_core():
    import subprocess
    import sys

    code = ("import sys, json; import logdiff.reports as r; "
            "from logdiff.reports import html, terminal, schema, charts, format; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers') "
            "or (m.startswith('logdiff.') and not m.startswith('logdiff.reports') and m != 'logdiff.version'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize("module", ["__init__", "html", "terminal", "schema", "charts", "format"])
def test_reports_sources_import_only_reports(module):
    import ast
    from pathlib import Path

    import logdiff.reports

    path = Path(logdiff.reports.__file__).with_name(f"{module}.py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        for name in names:
            top = name.split(".")[0]
            assert top not in ("torch", "vllm", "transformers", "kernels", "probes", "reports"), name
            assert not (top == "logdiff" and not name.startswith("logdiff.reports")), name
