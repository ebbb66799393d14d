"""result.json schema: the sample validates, broken variants do not, and the schema matches the doc."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from logdiff.reports.schema import READ_VERSIONS, SCHEMA_VERSION, load_result, load_schema, validate_result

DOC = Path(__file__).resolve().parents[2] / "docs" / "result-schema.md"


def test_schema_is_a_valid_draft_2020_12_schema():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(load_schema())
    assert load_schema()["properties"]["schema_version"]["enum"] == list(READ_VERSIONS)
    assert SCHEMA_VERSION == max(READ_VERSIONS)


def test_sample_is_valid(sample_result):
    assert validate_result(sample_result) == []


def test_logprobs_depth_result_is_valid(logprobs_depth_result):
    assert validate_result(logprobs_depth_result) == []


def test_optional_fields_may_be_absent_and_unknown_fields_are_allowed(sample_result):
    for key in ("divergence_table", "contracts", "moe", "batch_invariance"):
        del sample_result[key]
    sample_result["future_field"] = {"anything": [1, 2]}
    sample_result["pairs"][0]["metrics"]["new_metric"] = 0.5
    assert validate_result(sample_result) == []


def _set(result: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = result
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is _DELETE:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value


_DELETE = object()

# (where, new value, a fragment the error must contain): each one must be rejected.
BROKEN = [
    ("verdict", _DELETE, "'verdict' is a required property"),
    ("verdict", "probably_fine", "$.verdict"),
    ("schema_version", 3, "$.schema_version"),
    ("created", "yesterday", "$.created"),
    ("dtype", "bf16", "$.dtype"),
    ("tool.name", "otherdiff", "$.tool.name"),
    ("settings.depth", "layers", "$.settings.depth"),
    ("paths.0.role", "infer", "$.paths[0].role"),
    ("paths.1.mode", "sample", "$.paths[1].mode"),
    ("logprobs.abs_diff_max", _DELETE, "'abs_diff_max' is a required property"),
    ("logprobs.abs_diff_mean", -0.1, "$.logprobs.abs_diff_mean"),
    ("pairs.0.metrics.bitwise_equal_fraction", 1.5, "$.pairs[0].metrics.bitwise_equal_fraction"),
    ("pairs.0.histogram.counts", [1, 2], "edges has 11 entries"),
    ("pairs.0.histogram.edges.0", 1e-9, "edges[0]"),
    ("pairs.0.per_position.abs_diff_mean", [0.1], "$.pairs[0].per_position"),
    ("pairs.1.infer", "hf", "not a path with role 'infer'"),
    ("first_divergence.inputs_equal", _DELETE, "'inputs_equal' is a required property"),
    ("first_divergence.position", -1, "$.first_divergence"),
    ("causes.0.class", "bad_luck", "$.causes[0].class"),
    ("causes.0.share", _DELETE, "'share' is a required property"),
    ("causes.0.share", "most", "$.causes[0].share"),
    ("attribution.method", "guessed", "$.attribution.method"),
    ("attribution.closed", 1.2, "$.attribution.closed"),
    ("attribution.interaction", _DELETE, "'interaction' is a dependency of 'closed'"),
    ("attribution.levers.0.share", 0.5, "$.attribution.levers: the shares sum to 0.7"),
    ("causes.1.share", 0.1, "$.causes: the shares sum to 0.85"),
    ("causes.1.evidence", "one string", "$.causes[1].evidence"),
    ("introducing_ops.0.method", "guess", "$.introducing_ops[0].method"),
    ("divergence_table.max_abs_diff.3", [0.0], "max_abs_diff[3]: has 1 columns"),
    ("divergence_table.boundaries.1", "model.embed_tokens", "names must be unique"),
    ("contracts.weights.differs", "model.layers.0", "$.contracts.weights.differs"),
    ("sequences.prompt_lens", [16], "$.sequences.prompt_lens: has 1 entries"),
    ("complete", False, "$.warnings: must say why"),
]


@pytest.mark.parametrize("where,value,fragment", BROKEN, ids=[b[0] + "=" + repr(b[1])[:20] for b in BROKEN])
def test_broken_variants_are_rejected(sample_result, where, value, fragment):
    if where == "complete":
        sample_result["warnings"] = []
    _set(sample_result, where, value)
    errors = validate_result(sample_result)
    assert errors, f"{where}={value!r} was accepted"
    assert any(fragment in e for e in errors), errors


def test_moe_flip_rate_is_a_fraction(sample_result):
    sample_result["moe"]["router_flip_rate"]["model.layers.0.mlp.gate"] = 2.0
    assert any(e.startswith("$.moe") for e in validate_result(sample_result))


def test_logprobs_must_be_the_primary_pairs_metrics(sample_result):
    sample_result["logprobs"]["abs_diff_max"] = sample_result["pairs"][1]["metrics"]["abs_diff_max"]
    errors = validate_result(sample_result)
    assert any("primary pair" in e for e in errors), errors


def test_not_a_dict():
    assert validate_result([1, 2]) == ["$: expected a JSON object, found list"]


def test_missing_jsonschema_is_not_an_invalid_result(sample_result, monkeypatch):
    from logdiff.reports.schema import structure_checked

    assert structure_checked()
    monkeypatch.setitem(sys.modules, "jsonschema", None)      # makes `import jsonschema` fail
    assert not structure_checked()
    assert validate_result(sample_result) == []
    sample_result["sequences"]["count"] = 99                  # the cross-field rules still run
    assert any("count is 99" in e for e in validate_result(sample_result))


def test_report_and_explain_run_without_jsonschema(sample_result, monkeypatch, tmp_path):
    import json

    from typer.testing import CliRunner

    from logdiff.cli import app

    path = tmp_path / "result.json"
    path.write_text(json.dumps(sample_result), encoding="utf-8")
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    for args in (["explain", str(path)], ["report", str(path), "--quiet"]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        assert "not a valid logdiff result" not in res.output
    assert "jsonschema is not installed" in res.output and (tmp_path / "report.html").is_file()
    sample_result["sequences"]["count"] = 99                  # negative control: still rejects a broken one
    path.write_text(json.dumps(sample_result), encoding="utf-8")
    res = CliRunner().invoke(app, ["explain", str(path)])
    assert res.exit_code == 2 and "not a valid logdiff result" in res.output


def test_load_result_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_result(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_result(bad)
    bad.write_text("[1]", encoding="utf-8")
    with pytest.raises(ValueError, match="does not hold a JSON object"):
        load_result(bad)


def _doc_fields() -> tuple[set[str], set[str]]:
    """(all top-level fields, the ones marked always) from the doc's Top level table."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Top level", 1)[1].split("\n## ", 1)[0]
    fields, always = set(), set()
    for line in section.splitlines():
        m = re.match(r"\|\s*`([a-z_]+)`(\s*\*\(always\)\*)?\s*\|", line)
        if m:
            fields.add(m.group(1))
            if m.group(2):
                always.add(m.group(1))
    return fields, always


@pytest.mark.skipif(not DOC.exists(), reason="docs/result-schema.md is not in this checkout")
def test_schema_matches_the_doc():
    fields, always = _doc_fields()
    schema = load_schema()
    assert len(fields) >= 20 and len(always) >= 15, "the doc's Top level table was not parsed"
    assert set(schema["required"]) == always
    assert set(schema["properties"]) == fields
    metrics_section = DOC.read_text(encoding="utf-8").split("## Metrics", 1)[1].split("\n## ", 1)[0]
    documented = set()
    for line in metrics_section.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            names = re.findall(r"`([a-z0-9_.]+)`", first_cell)
            documented |= {names[0].rsplit("_", 1)[0] + n if n.startswith("_") else n for n in names}
    metric_props = set(schema["$defs"]["metrics"]["properties"])
    assert len(documented) >= 18, documented
    assert documented == metric_props, documented ^ metric_props


def test_sample_file_round_trips_through_json(sample_result):
    assert validate_result(json.loads(json.dumps(sample_result))) == []
