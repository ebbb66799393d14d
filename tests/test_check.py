"""``logdiff check``: gates, baselines, CI outputs and exit codes, on real scans.

Every gate is shown to fail as well as pass: thresholds against the HF decode
path (which differs from the full forward; see ../shared/notes/cpu-numerics.md),
a planted config regression against a clean baseline, and the built-in negative
control, where consistent mode silently switched off must turn a check against
a baseline of 0 red. The project's self-check (HF against vLLM on the demo
model, against the committed baseline) runs here too, so an upgrade that moves
the numerics fails this suite with an explanation.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from logdiff.reports import github
from logdiff.reports.junit import junit_xml
from typer.testing import CliRunner

from logdiff.cli import app
from logdiff.commands import baselines
from logdiff.commands import check as gating
from logdiff.errors import InputError

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
# The same sizes test_scan.py shows to diverge between the full forward and KV-cache decode.
DECODE = ["--infer", "hf-decode", "--num-sequences", "4", "--prompt-len", "12", "--response-len", "12"]
IDENTITY = ["--infer", "hf", "--num-sequences", "2", "--prompt-len", "4", "--response-len", "4"]
# The project's self-check: the committed baseline was recorded with exactly these options on the
# conftest demo model (build_demo_model(..., "qwen3", seed=0, max_steps=BASELINE_TRAIN_STEPS)).
SELF_CHECK_ARGS = ["--infer", "vllm", "--num-sequences", "4", "--prompt-len", "8", "--response-len", "8"]
SELF_CHECK_BASELINE = REPO / ".logdiff" / "baselines" / "{hw}" / "demo-qwen3-hf-vs-vllm.json"
BASELINE_TRAIN_STEPS = 60
# This machine's own baselines for hardware with none committed (see self_check_baseline).
LOCAL_BASELINES = Path(os.environ.get("LOGDIFF_TEST_MODELS", Path.home() / ".cache" / "logdiff" / "test-models")).parent / "baselines"


def record_self_check(model: Path) -> str:
    """The command that (re)records the self-check baseline from the fixture's demo model."""
    args = " ".join(SELF_CHECK_ARGS)
    baseline = f"'.logdiff/baselines/{{hw}}/{SELF_CHECK_BASELINE.name}'"
    return f"logdiff check {model} {args} --baseline {baseline} --update-baseline"


@pytest.fixture(autouse=True)
def _not_in_github_actions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our own CI may run under GitHub Actions: keep these runs out of its step summary."""
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)


def invoke(*args: object, env: dict[str, str] | None = None) -> tuple[int, str]:
    res = runner.invoke(app, ["check", *(str(a) for a in args)], env=env)
    out = res.output + (res.stderr if res.stderr_bytes is not None else "")
    assert "Traceback" not in out, out
    return res.exit_code, out


def last_error(out: str) -> str:
    lines = [line for line in out.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("logdiff: error:"), out
    return lines[-1]


def fail_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("FAIL ")]


# --- the pieces, without an engine -------------------------------------------------------------


def test_tolerance_is_relative_plus_absolute_and_exact_at_zero() -> None:
    tol = gating.Tolerance.parse("0.1,1e-6")
    assert (tol.rel, tol.abs) == (0.1, 1e-6)
    assert gating.Tolerance.parse("0.25") == gating.Tolerance(0.25, gating.Tolerance.abs)
    assert tol.allows(1.1, 1.0, exact=0.0) and not tol.allows(1.11, 1.0, exact=0.0)
    assert tol.allows(0.9, 1.0, exact=0.0) and not tol.allows(0.89, 1.0, exact=0.0)  # two-sided
    assert tol.allows(0.0, 0.0, exact=0.0) and not tol.allows(1e-12, 0.0, exact=0.0)  # 0 means exactly 0
    assert not tol.allows(0.999, 1.0, exact=1.0)  # every token bitwise equal means exactly that
    for bad in ("", "x", "-1", "0.1,2,3", "nan"):
        with pytest.raises(InputError):
            gating.Tolerance.parse(bad)


def test_hardware_key() -> None:
    assert baselines.hardware_key({"device": "cpu", "machine": "x86_64"}) == "cpu-x86_64"
    assert baselines.hardware_key({"device": "cpu", "machine": "x86_64", "cpu_isa": "avx2"}) == "cpu-x86_64-avx2"
    assert baselines.hardware_key({"device": "cuda:NVIDIA H200", "machine": "x86_64"}) == "cuda-nvidia-h200"
    assert baselines.resolve_baseline_path(Path("b/{hw}/m.json"), "cpu-aarch64") == Path("b/cpu-aarch64/m.json")


def test_fail_on_matches_the_verdict_and_cause_classes() -> None:
    cause = {"class": "framework_difference", "kind": "rms_norm_eps", "boundary": "model.norm", "share": 0.9}
    mixed = {"verdict": "mixed", "causes": [cause, {**cause, "class": "operator_path", "kind": "x"}]}
    failed = {g.name for g in gating.fail_on_gates(mixed, ["framework_difference", "operator_path", "divergent"])
              if not g.passed}  # fmt: skip
    assert failed == {"fail-on framework_difference", "fail-on operator_path"}
    assert not gating.fail_on_gates({"verdict": "divergent", "causes": []}, ["divergent"])[0].passed
    assert gating.fail_on_gates({"verdict": "consistent", "causes": []}, ["divergent"])[0].passed
    assert gating.parse_fail_on(["operator_path,divergent", "divergent"]) == ["operator_path", "divergent"]
    with pytest.raises(InputError, match="unknown class"):
        gating.parse_fail_on(["frameworkdifference"])
    assert "top cause: framework_difference/rms_norm_eps at model.norm, share 90%" in gating.explain(
        {"verdict": "framework_difference", "causes": [cause], "pairs": [], "logprobs": {}}
    )


def _gates(n_failed: int, n_passed: int = 0, message: str = "m") -> list[dict]:
    return [{"name": f"g{i}", "passed": False, "value": 0.5, "threshold": 0.1, "message": message}
            for i in range(n_failed)] + [
            {"name": f"p{i}", "passed": True, "value": 0.0, "threshold": 0.1, "message": "ok"}
            for i in range(n_passed)]  # fmt: skip


def test_github_output_is_escaped_capped_and_small() -> None:
    nasty = "50% worse\r\nline two: a,b ::error::injected"
    lines = github.annotations(_gates(1, 1, nasty), ["verdict: divergent"])
    assert lines == [
        "::error title=logdiff check%3A g0::50%25 worse%0D%0Aline two: a,b ::error::injected%0Averdict: divergent"
    ]
    assert all("\n" not in line for line in lines)
    many = github.annotations(_gates(25))
    assert len(many) == github.MAX_ANNOTATIONS and "16 more gates failed" in many[-1]
    summary = github.step_summary(_gates(5000, 5000, "x" * 5000), ["a|b <script>"])
    assert len(summary.encode()) <= github.MAX_SUMMARY_BYTES < 1024 * 1024
    assert "a\\|b &lt;script&gt;" in summary and "<script>" not in summary
    assert "more gates" in summary and summary.index("| g0 |") < summary.index("| **FAIL** |") + 200


def test_junit_xml_escapes_and_counts() -> None:
    gates = _gates(1, 2, 'value 3 > 1 <&> "q" \x00\x1b')
    root = ET.fromstring(junit_xml(gates, properties={"verdict": "divergent"}))
    suite = root.find("testsuite")
    assert suite is not None and suite.get("tests") == "3" and suite.get("failures") == "1"
    failure = suite.find("testcase[@name='g0']/failure")
    assert failure is not None and failure.get("message") == 'value 3 > 1 <&> "q" '
    assert "value: 0.5" in (failure.text or "") and "threshold: 0.1" in (failure.text or "")
    assert suite.find("properties/property[@name='verdict']").get("value") == "divergent"


def test_usage_errors_exit_2_before_any_scan(tmp_path: Path) -> None:
    model = tmp_path / "not-scanned"  # never loaded: each error is found before the scan
    code, out = invoke(model, *IDENTITY)
    assert code == 2 and "check needs a gate" in last_error(out)
    code, out = invoke(model, *IDENTITY, "--update-baseline")
    assert code == 2 and "--update-baseline needs --baseline" in last_error(out)
    code, out = invoke(model, *IDENTITY, "--max-kl", "1", "--tolerance", "ten")
    assert code == 2 and "--tolerance" in last_error(out)
    code, out = invoke(model, *IDENTITY, "--fail-on", "nonsense")
    assert code == 2 and "unknown class 'nonsense'" in last_error(out)
    code, out = invoke(model, *IDENTITY, "--max-abs-diff", "-1")
    assert code == 2
    missing = tmp_path / "none.json"
    code, out = invoke(model, *IDENTITY, "--baseline", missing)
    assert code == 2 and "no baseline at" in last_error(out) and "--update-baseline" in last_error(out)
    (tmp_path / "bad.json").write_text("{not json")
    code, out = invoke(model, *IDENTITY, "--baseline", tmp_path / "bad.json")
    assert code == 2 and "not valid JSON" in last_error(out)


# --- real scans: HF full forward against HF KV-cache decode --------------------------------------


def test_thresholds_pass_and_fail_with_the_numbers(qwen3: Path, tmp_path: Path) -> None:
    code, out = invoke(qwen3, *IDENTITY, "--max-abs-diff", "0", "--fail-on", "divergent")
    assert code == 0, out
    assert "PASS abs_diff_max (hf vs hf) = 0 <= 0 (--max-abs-diff)" in out and "all 4 gates passed" in out

    loose = ["--max-abs-diff", "5", "--max-mean-diff", "5", "--max-kl", "5", "--max-clip-fraction", "1"]
    code, out = invoke(qwen3, *DECODE, *loose, "--json", tmp_path / "pass.json")
    assert code == 0 and not fail_lines(out), out
    result = json.loads((tmp_path / "pass.json").read_text())
    m = result["logprobs"]
    assert m["abs_diff_max"] > 0, "precondition: hf-decode differs from the full forward here"

    junit = tmp_path / "ci" / "junit.xml"
    tight = ["--max-abs-diff", "1e-9", "--max-mean-diff", "5", "--max-kl", "0", "--max-clip-fraction", "1"]
    code, out = invoke(qwen3, *DECODE, *tight, "--junit", junit, "--out", tmp_path / "art")
    assert code == 1, out
    assert fail_lines(out) == [
        f"FAIL abs_diff_max (hf vs hf-decode) = {gating.fmt(m['abs_diff_max'])} > 1e-09 (--max-abs-diff)",
        f"FAIL k3_kl (hf vs hf-decode) = {gating.fmt(m['k3_kl'])} > 0 (--max-kl)",
    ]
    assert "logdiff check: 2 of 6 gates failed" in out
    assert f"verdict: {result['verdict']} (max |Δ logprob| {gating.fmt(m['abs_diff_max'])}" in out
    assert "top cause: " in out
    assert (tmp_path / "art" / "result.json").is_file() and (tmp_path / "art" / "report.html").is_file()

    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and (suite.get("tests"), suite.get("failures")) == ("6", "2")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert set(cases) == {"scan complete", "finite values", "abs_diff_max (hf vs hf-decode)",
                          "abs_diff_mean (hf vs hf-decode)", "k3_kl (hf vs hf-decode)",
                          "ratio_outside_band_0.2 (hf vs hf-decode)"}  # fmt: skip
    failure = cases["abs_diff_max (hf vs hf-decode)"].find("failure")
    assert failure is not None and "> 1e-09" in failure.get("message", "")
    assert f"value: {gating.fmt(m['abs_diff_max'])}" in (failure.text or "") and "threshold: 1e-09" in failure.text
    assert cases["abs_diff_mean (hf vs hf-decode)"].find("failure") is None
    assert suite.find("properties/property[@name='hardware']").get("value") == baselines.current_hardware()


def test_fail_on_any_divergence_class(qwen3: Path) -> None:
    every = ["--fail-on", "framework_difference,operator_path", "--fail-on", "divergent"]
    code, out = invoke(qwen3, *DECODE, *every)
    assert code == 1 and any(line.startswith("FAIL fail-on ") for line in fail_lines(out)), out
    code, out = invoke(qwen3, *IDENTITY, *every)
    assert code == 0 and not fail_lines(out), out


def test_baseline_create_compare_refresh_and_planted_regression(qwen3: Path, tmp_path: Path) -> None:
    template = tmp_path / "baselines" / "{hw}" / "decode.json"
    path = baselines.resolve_baseline_path(template)
    code, out = invoke(qwen3, *DECODE, "--baseline", template)
    # A {hw} baseline names the hardware key it looked up, before the scan and in the error.
    assert code == 2 and f"no baseline for hardware key {path.parent.name} at" in last_error(out) and not path.exists()
    assert f"baseline for hardware key {path.parent.name}: {path}" in out

    code, out = invoke(qwen3, *DECODE, "--baseline", template, "--update-baseline")
    assert code == 0 and f"wrote baseline {path}" in out, out
    base = json.loads(path.read_text())
    assert base["format"] == baselines.BASELINE_FORMAT and base["key"]["hardware"] == baselines.current_hardware()
    assert base["key"]["paths"] == {"train": "hf", "infer": ["hf-decode"]} and base["key"]["dtype"] == "bfloat16"
    recorded = base["pairs"]["hf vs hf-decode"]
    assert set(recorded) == set(gating.BASELINE_METRICS) and recorded["abs_diff_max"] > 0
    assert base["tolerance"] == {"rel": 0.1, "abs": 1e-6}
    assert "tensor" not in path.read_text() and len(path.read_text()) < 4096

    code, out = invoke(qwen3, *DECODE, "--baseline", template, "--json", tmp_path / "r.json")
    assert code == 0 and not fail_lines(out), out
    assert "PASS baseline abs_diff_max (hf vs hf-decode)" in out and "PASS baseline verdict and causes" in out
    result = json.loads((tmp_path / "r.json").read_text())

    # A planted regression: the inference side's RMSNorm epsilon changed.
    code, out = invoke(qwen3, *DECODE, "--baseline", template, "--set", "infer.rms_norm_eps=0.01")
    assert code == 1, out
    assert any(line.startswith("FAIL baseline abs_diff_max (hf vs hf-decode)") and ": worse by" in line
               for line in fail_lines(out)), out  # fmt: skip
    assert "note: --set overrides differ from the baseline's" in out

    # The tolerance is stated and applied: 5% off passes the baseline's 10%, fails --tolerance 0.01.
    stale = json.loads(path.read_text())
    stale["pairs"]["hf vs hf-decode"]["abs_diff_max"] = recorded["abs_diff_max"] * 1.05
    path.write_text(json.dumps(stale))
    assert all(g.passed for g in baselines.baseline_gates(result, stale, baselines.baseline_tolerance(stale)))
    code, out = invoke(qwen3, *DECODE, "--baseline", template, "--tolerance", "0.01,0")
    assert code == 1 and "better by" in out and "--update-baseline" in out, out

    # Refresh brings the file back to this run's numbers and says what changed.
    code, out = invoke(qwen3, *DECODE, "--baseline", template, "--update-baseline")
    assert code == 0 and f"refreshed baseline {path}" in out, out
    stale_max = gating.fmt(stale["pairs"]["hf vs hf-decode"]["abs_diff_max"])
    real_max = gating.fmt(recorded["abs_diff_max"])
    assert f"baseline change: abs_diff_max (hf vs hf-decode): {stale_max} -> {real_max}" in out
    assert json.loads(path.read_text())["pairs"]["hf vs hf-decode"] == recorded

    # A baseline for another setup is a usage error, not a gate failure.
    code, out = invoke(qwen3, *DECODE[:-6], "--num-sequences", "2", "--prompt-len", "12", "--response-len", "12",
                       "--baseline", template)  # fmt: skip
    assert code == 2 and "sequences count=4" in last_error(out)


def test_github_actions_annotations_and_step_summary(qwen3: Path, tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    env = {"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(summary)}
    code, out = invoke(qwen3, *DECODE, "--max-abs-diff", "1e-9", "--max-mean-diff", "5", env=env)
    assert code == 1, out
    errors = [line for line in out.splitlines() if line.startswith("::error ")]
    assert len(errors) == 1 and errors[0].startswith("::error title=logdiff check%3A abs_diff_max (hf vs hf-decode)::")
    assert "> 1e-09 (--max-abs-diff)%0Averdict: " in errors[0] and "%0Atop cause: " in errors[0]
    text = summary.read_text()
    assert text.startswith("earlier step\n### logdiff check: ❌ 1 of 4 gates failed")
    assert "| abs_diff_max (hf vs hf-decode) |" in text and "| **FAIL** |" in text and "| pass |" in text
    assert len(text.encode()) < 64 * 1024

    summary.write_text("")
    code, out = invoke(qwen3, *DECODE, "--max-abs-diff", "1e-9", env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert code == 1 and "::error" not in out and summary.read_text() == ""


def test_internal_error_exits_101(qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object, **_kwargs: object) -> list:
        raise RuntimeError("gate machinery broke")

    monkeypatch.setattr(gating, "threshold_gates", broken)
    code, out = invoke(qwen3, *IDENTITY, "--max-abs-diff", "1")
    assert code == 101 and "logdiff: internal error: RuntimeError: gate machinery broke" in out


# --- the built-in negative control: consistent mode ----------------------------------------------


def _switch_off_consistent_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every engine's consistent() a silent no-op, as a broken kernel install would."""
    from logdiff.sources import hf, vllm

    for cls in (hf.HFEngine, vllm.VLLMEngine):
        monkeypatch.setattr(cls, "consistent", lambda self, only=None, fixed_order_rows=False: contextlib.nullcontext())


def _negative_control(qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]) -> None:
    path = tmp_path / "zero.json"
    gate = ["--consistent", "--max-abs-diff", "0", "--baseline", path]
    code, out = invoke(qwen3, *args, *gate, "--update-baseline")
    assert code == 0, out
    for pair, metrics in json.loads(path.read_text())["pairs"].items():
        assert metrics["abs_diff_max"] == 0.0 and metrics["bitwise_equal_fraction"] == 1.0, pair
    code, out = invoke(qwen3, *args, *gate)
    assert code == 0 and "all " in out and not fail_lines(out), out

    _switch_off_consistent_mode(monkeypatch)
    code, out = invoke(qwen3, *args, *gate)
    assert code == 1, "a check against a baseline of 0 must fail when consistent mode is off"
    assert any("baseline allows no change" in line for line in fail_lines(out)), out


def test_negative_control_consistent_decode(qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _negative_control(qwen3, tmp_path, monkeypatch, DECODE)


@pytest.mark.vllm
def test_self_check_hf_vs_vllm_consistent_stays_at_zero(
    qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _negative_control(qwen3, tmp_path, monkeypatch, SELF_CHECK_ARGS)


# --- the project's self-check: HF against vLLM on the demo model ----------------------------------


def self_check_baseline(model: Path) -> Path:
    """The committed baseline for this hardware, else this machine's own first record.

    Baselines are per hardware key (the CPU ISA is part of it). On hardware with
    no committed baseline, the first run records one under the test-model cache
    and skips, saying so; every later run on this machine compares against it,
    so a new machine is never skipped forever. Commit the record to share it.
    """
    committed = baselines.resolve_baseline_path(SELF_CHECK_BASELINE)
    if committed.is_file():
        return committed
    hw = committed.parent.name
    local = LOCAL_BASELINES / hw / SELF_CHECK_BASELINE.name
    if not local.is_file():
        code, out = invoke(model, *SELF_CHECK_ARGS, "--baseline", local, "--update-baseline")
        assert code == 0, out
        pytest.skip(f"no committed baseline for this hardware ({hw}): recorded this machine's first at {local}; "
                    f"later runs compare against it (commit it as {committed.relative_to(REPO)} to share it)")
    return local


@pytest.mark.vllm
@pytest.mark.isa_sensitive
def test_self_check_hf_vs_vllm_matches_committed_baseline(qwen3: Path) -> None:
    demo = json.loads((qwen3 / "logdiff_demo.json").read_text())
    if (demo["seed"], demo["steps"]) != (0, BASELINE_TRAIN_STEPS):
        pytest.skip(f"the baseline is for the demo model trained {BASELINE_TRAIN_STEPS} steps from seed 0 "
                    f"(LOGDIFF_TEST_TRAIN_STEPS), this one ran {demo['steps']} from seed {demo['seed']}")
    baseline = self_check_baseline(qwen3)
    code, out = invoke(qwen3, *SELF_CHECK_ARGS, "--baseline", baseline, "--max-abs-diff", "1")
    assert code == 0, f"HF vs vLLM moved away from the baseline {baseline} (refresh: {record_self_check(qwen3)})\n{out}"
    assert "PASS baseline abs_diff_max (hf vs vllm)" in out and "PASS baseline abs_diff_max (hf vs vllm-prefill)" in out

    code, out = invoke(qwen3, *SELF_CHECK_ARGS, "--baseline", baseline, "--set", "infer.rms_norm_eps=0.01")
    assert code == 1, out
    assert any(line.startswith("FAIL baseline abs_diff_max (hf vs vllm)") for line in fail_lines(out)), out


def test_missing_vllm_exits_3(qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that cannot load evicts nothing: availability is checked before an exclusive eviction."""
    from logdiff.sources.pool import current_pool

    loaded = len(current_pool())
    monkeypatch.setitem(sys.modules, "vllm", None)
    code, out = invoke(qwen3, "--infer", "vllm", "--seed", "12345", *IDENTITY[2:], "--max-abs-diff", "1")
    assert code == 3 and "vLLM is not installed" in last_error(out)
    assert len(current_pool()) >= loaded  # the hf engine may load first; no pooled engine was closed
