"""Bad numbers and bad paths never pass (issue 11): each case is one line and exit 2 before
any engine loads, or, for NaN/inf on a path, a localized ``non_finite`` finding that fails
``check``. Every detector also gets a valid input that must pass (the negative control).

The cheap checks run without loading an engine: most use a model path that does not
exist, so the error can only come from validation that runs before the model is read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from logdiff.reports import github
from logdiff.reports.format import safe_text
from typer.testing import CliRunner

from logdiff.cli import app
from logdiff.commands import baselines, outputs
from logdiff.commands import check as gating
from logdiff.commands.config import ScanConfig
from logdiff.errors import InputError
from logdiff.records.sequences import load_jsonl, load_text_prompts

runner = CliRunner()
FAST = ["--num-sequences", "2", "--prompt-len", "4", "--response-len", "4", "--depth", "logprobs"]  # scan defaults to modules
SAMPLE = Path(__file__).parent / "reports" / "data" / "sample_result.json"


def invoke(*args: object) -> tuple[int, str]:
    res = runner.invoke(app, [str(a) for a in args])
    out = res.output + (res.stderr if res.stderr_bytes is not None else "")
    assert "Traceback" not in out and "internal error" not in out, out
    return res.exit_code, out


def error(out: str) -> str:
    """The one error line (the last line), checked to be the only one."""
    lines = [line for line in out.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("logdiff: error:"), out
    return lines[-1]


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.fixture(scope="module")
def nan_ckpt(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's weights with one NaN in layer 1's down_proj."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(qwen3 / "model.safetensors"))
    sd["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    path = tmp_path_factory.mktemp("nan") / "nan.safetensors"
    save_file(sd, str(path))
    return path


def _no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make loading any engine fail the test: the error must come from validation before it."""
    from logdiff.commands import scan as pipeline

    monkeypatch.setattr(pipeline, "acquire", lambda *a: pytest.fail("an engine was loaded"))


@pytest.fixture(autouse=True)
def _no_github(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)


# --- 1. bad numbers: NaN/inf on a path is a finding ----------------------------------------------


def test_nan_weight_is_a_localized_finding_and_fails_check(qwen3: Path, nan_ckpt: Path, tmp_path: Path) -> None:
    # hf-decode samples the responses (the probe set): with a NaN weight that used to be exit 101.
    code, out = invoke("scan", qwen3, nan_ckpt, "--infer", "hf-decode", *FAST, "--depth", "modules",
                       "--out", tmp_path / "o")  # fmt: skip
    assert code == 0, out
    assert out.splitlines()[0].startswith("warning: non-finite values (NaN/inf) on a path:"), out
    r = json.loads((tmp_path / "o" / "result.json").read_text())
    found = r["non_finite"]
    assert found["first"]["boundary"] == "model.layers.1.mlp.down_proj"
    assert set(found["first"]["paths"]) == {"hf", "hf-decode"}
    assert found["weights"]["train"] == found["weights"]["infer"] == ["model.layers.1.mlp.down_proj.weight"]
    assert r["warnings"][0] == found["summary"] and r["verdict"] == "framework_difference"
    cause = r["causes"][0]
    assert (cause["class"], cause["kind"], cause["boundary"]) == (
        "framework_difference", "non_finite", "model.layers.1.mlp.down_proj")  # fmt: skip
    assert r["logprobs"]["abs_diff_max"] is None and r["logprobs"]["nonfinite_tokens"] == 8
    html = (tmp_path / "o" / "report.html").read_text()
    assert html.index('id="non-finite"') < html.index('id="verdict"')
    # the saved result is valid and re-renders; explain leads with the warning
    code, out = invoke("explain", tmp_path / "o" / "result.json")
    assert code == 0 and out.startswith("Warning: non-finite values"), out

    code, out = invoke("check", qwen3, nan_ckpt, "--infer", "hf-decode", *FAST, "--max-abs-diff", "100")
    assert code == 1, out
    assert any(line.startswith("FAIL finite values: NaN/inf found") for line in out.splitlines()), out
    assert "FAIL abs_diff_max (hf vs hf-decode): no finite value in the result" in out


def test_nan_in_replayed_sequences_at_logprobs_depth(qwen3: Path, nan_ckpt: Path, tmp_path: Path) -> None:
    seqs = tmp_path / "s.jsonl"
    seqs.write_text(json.dumps({"prompt_ids": [5, 6, 7], "response_ids": [8, 9]}) + "\n")
    code, out = invoke("scan", qwen3, nan_ckpt, "--infer", "hf-decode", "--sequences", seqs, "--depth", "logprobs",
                       "--json", tmp_path / "r.json")  # fmt: skip
    assert code == 0, out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["non_finite"]["first"] is None  # not probed at --depth logprobs, but still found
    assert r["causes"][0]["kind"] == "non_finite" and r["causes"][0]["boundary"] == "model.layers.1.mlp.down_proj"
    assert any("rerun with --depth modules" in e for e in r["causes"][0]["evidence"])


def test_computed_nan_names_its_side_and_finite_weights(qwen3: Path, tmp_path: Path) -> None:
    # rms_norm_eps = -1 on the inference side only: 1/sqrt(var - 1) is NaN there, the weights are fine.
    code, out = invoke("scan", qwen3, "--infer", "hf-decode", *FAST, "--set", "infer.rms_norm_eps=-1",
                       "--depth", "modules", "--json", tmp_path / "r.json")  # fmt: skip
    assert code == 0, out
    found = json.loads((tmp_path / "r.json").read_text())["non_finite"]
    assert found["first"]["boundary"] == "model.layers.0.input_layernorm" and found["first"]["paths"] == ["hf-decode"]
    assert found["weights"] == {"train": [], "infer": []} and "computed, not loaded" in found["summary"]


def test_finite_scan_has_no_finding_negative_control(qwen3: Path, tmp_path: Path) -> None:
    code, out = invoke("check", qwen3, "--infer", "hf-decode", *FAST, "--max-abs-diff", "100",
                       "--json", tmp_path / "r.json")  # fmt: skip
    assert code == 0, out
    assert "PASS finite values: every weight, logprob and probed value is finite" in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["non_finite"] is None and r["logprobs"]["nonfinite_tokens"] == 0 and "warning" not in out


@pytest.mark.vllm
def test_nan_weight_with_vllm_is_a_finding(qwen3: Path, nan_ckpt: Path, tmp_path: Path) -> None:
    code, out = invoke("scan", qwen3, nan_ckpt, "--infer", "vllm", *FAST, "--json", tmp_path / "r.json")
    assert code == 0, out
    r = json.loads((tmp_path / "r.json").read_text())
    assert {"hf", "vllm", "vllm-prefill"} <= set(r["non_finite"]["paths"]) and r["verdict"] == "framework_difference"


@pytest.mark.parametrize("value,problem", [
    (0.5, "is 0.5, but a logprob is <= 0"), (3.0, "is 3.0, but a logprob is <= 0"),
    ("NaN", "is nan, not a finite number"), ("Infinity", "is inf, not a finite number"),
    ('"nan"', "is str 'nan', not a number"),
    ('"-inf"', "is str '-inf', not a number"), ("true", "is bool True, not a number"),
])  # fmt: skip
def test_bad_rollout_logprobs_name_sequence_and_position(tmp_path: Path, value: object, problem: str) -> None:
    f = tmp_path / "s.jsonl"
    good = json.dumps({"prompt_ids": [1, 2], "response_ids": [3], "rollout_logprobs": [-0.1]})
    bad = f'{{"prompt_ids": [1, 2], "response_ids": [3, 4], "rollout_logprobs": [-0.2, {value}]}}'
    f.write_text(good + "\n" + bad + "\n")
    with pytest.raises(InputError) as e:
        load_jsonl(f)
    assert f"{f}:2 (sequence 1): rollout_logprobs at response position 1 {problem}" in str(e.value)


def test_bad_rollout_logprobs_exit_2_from_the_cli(qwen3: Path, tmp_path: Path, monkeypatch) -> None:
    _no_engine(monkeypatch)
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps({"prompt_ids": [1], "response_ids": [3], "rollout_logprobs": [3.0]}) + "\n")
    code, out = invoke("check", qwen3, "--infer", "hf", "--sequences", f, "--max-abs-diff", "1")
    assert code == 2 and "rollout_logprobs at response position 0 is 3.0, but a logprob is <= 0" in error(out)


def test_valid_rollout_logprobs_pass_negative_control(tmp_path: Path) -> None:
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps({"prompt_ids": [1], "response_ids": [3, 4, 5], "rollout_logprobs": [-2, 0.0, 5e-5]}) + "\n")
    assert load_jsonl(f)[0].rollout_logprobs == [-2.0, 0.0, 5e-5]


@pytest.mark.parametrize("sets,fragment", [
    (["infer.temperature=-1"], "infer.temperature=-1: must be a finite number > 0"),
    (["infer.temperature=0"], "must be a finite number > 0"),
    (["train.batch_size=x"], "train.batch_size='x': must be an integer >= 1"),
    (["train.batch_size=0"], "must be an integer >= 1"),
    (["infer.attn_implementation=flash_attention_9"], "must be one of sdpa, eager"),
    (["infer.max_model_len=4"], "max_model_len is an option of vllm, vllm-ascend, not used by hf-decode"),
    (["infer.rms_norm_eps=NaN"], "not a finite number"),
])  # fmt: skip
def test_bad_engine_options_exit_2_before_loading(tmp_path: Path, sets: list[str], fragment: str) -> None:
    args = [a for s in sets for a in ("--set", s)]
    code, out = invoke("scan", tmp_path / "not-loaded", "--infer", "hf-decode", *FAST, *args)
    assert code == 2 and fragment in error(out), out


def test_valid_engine_options_pass_negative_control(tmp_path: Path) -> None:
    ScanConfig(model=tmp_path, infer=["hf-decode"], infer_set={"temperature": 0.7, "batch_size": 2,
               "attn_implementation": "eager"})  # fmt: skip
    # an option of one engine on the side is never a config override for another
    from logdiff.commands.scan import split_settings

    cfg = ScanConfig(model=tmp_path, infer=["vllm", "hf-decode"], infer_set={"max_model_len": 64, "rms_norm_eps": 1e-5})
    assert split_settings("hf-decode", cfg.infer_set) == ((("rms_norm_eps", 1e-5),), ())
    assert split_settings("vllm", cfg.infer_set) == ((("rms_norm_eps", 1e-5),), (("max_model_len", 64),))


# --- 4. config overrides: typed against the config class, fitted to the weights -----------------


@pytest.mark.parametrize("item,fragment", [
    ("infer.rms_norm_eps=abc", "--set infer.rms_norm_eps='abc': rms_norm_eps must be float in Qwen3Config"),
    ("infer.hidden_size=128", "config/weights mismatch"),
    ("infer.vocab_size=100", "config/weights mismatch"),
    ("infer.tie_word_embeddings=1", "tie_word_embeddings must be bool"),
    ("infer.no_such_key=1", "the model config has no key 'no_such_key'"),
])  # fmt: skip
def test_bad_config_overrides_exit_2_before_loading(qwen3: Path, item: str, fragment: str, monkeypatch) -> None:
    _no_engine(monkeypatch)
    code, out = invoke("scan", qwen3, "--infer", "hf-decode", *FAST, "--set", item)
    assert code == 2 and fragment in error(out), out


def test_valid_config_overrides_pass_negative_control(qwen3: Path, tmp_path: Path) -> None:
    code, out = invoke("scan", qwen3, "--infer", "hf-decode", *FAST, "--set", "infer.rms_norm_eps=1",
                       "--set", "infer.rope_theta=10000", "--json", tmp_path / "r.json")  # fmt: skip
    assert code == 0, out
    assert json.loads((tmp_path / "r.json").read_text())["settings"]["overrides"]["infer"] == {
        "rms_norm_eps": 1.0, "rope_theta": 10000.0}  # fmt: skip


def test_context_length_of_vllm_exit_2_before_loading(qwen3: Path, monkeypatch) -> None:
    _no_engine(monkeypatch)
    code, out = invoke("scan", qwen3, "--infer", "vllm", *FAST, "--set", "infer.max_model_len=6")
    assert code == 2 and "8 tokens exceed the model's context of 6 (--set infer.max_model_len)" in error(out)
    code, out = invoke("scan", qwen3, "--infer", "vllm", *FAST, "--set", "infer.max_model_len=4096")
    assert code == 2 and "exceeds the model's context of 2048" in error(out)


@pytest.mark.vllm
def test_vllm_request_errors_are_input_errors() -> None:
    from vllm.exceptions import VLLMValidationError

    from logdiff.sources.vllm import VLLMEngine

    class FakeLLM:
        class request_counter:  # noqa: N801 - mirrors vLLM's attribute
            counter = 0

        def __init__(self, exc: Exception) -> None:
            self.exc = exc

        def generate(self, *_a: object, **_k: object) -> None:
            raise self.exc

    engine = object.__new__(VLLMEngine)
    engine.llm = FakeLLM(VLLMValidationError("This model's maximum context length is 6 tokens."))
    with pytest.raises(InputError, match="maximum context length"):
        engine.generate([[1, 2]], [None])
    engine.llm = FakeLLM(RuntimeError("kernel crashed"))  # negative control: not the input's fault
    with pytest.raises(RuntimeError):
        engine.generate([[1, 2]], [None])


# --- chat messages -------------------------------------------------------------------------------


@pytest.mark.parametrize("messages,fragment", [
    ("hello", "'messages' must be a non-empty list"),
    ([], "'messages' must be a non-empty list"),
    ([{"content": "x"}], "messages[0] needs a string 'role'"),
    ([{"role": "user", "content": {"x": 1}}], "messages[0].content must be a string or a list"),
])  # fmt: skip
def test_malformed_chat_messages(qwen3: Path, tmp_path: Path, messages: object, fragment: str) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": messages}) + "\n")
    with pytest.raises(InputError) as e:
        load_text_prompts(f, qwen3)
    assert f"{f}:1: {fragment}" in str(e.value)


def test_valid_chat_messages_negative_control(qwen3: Path, tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "import os"}]}) + "\n")
    assert len(load_text_prompts(f, qwen3)[0].prompt_ids) > 3


# --- 2. baselines never weaken the gate ----------------------------------------------------------


def _baseline(tmp_path: Path) -> tuple[Path, dict]:
    data = baselines.make_baseline(json.loads(SAMPLE.read_text()), gating.Tolerance())
    path = tmp_path / "b.json"
    path.write_text(json.dumps(data))
    return path, data


@pytest.mark.parametrize("where,value,fragment", [
    (("pairs", "hf vs vllm", "abs_diff_max"), "abc", "abs_diff_max is 'abc', not a finite number"),
    (("pairs", "hf vs vllm", "kl_k3"), None, "kl_k3 is None, not a finite number"),
    (("pairs", "hf vs vllm", "bitwise_equal_fraction"), 1.5, "out of range"),
    (("tolerance", "rel"), "x", "tolerance.rel is 'x'"),
    (("tolerance", "abs"), -1, "tolerance.abs is -1"),
    (("verdict",), "fine", "verdict is 'fine'"),
])  # fmt: skip
def test_malformed_baseline_exit_2_before_the_scan(tmp_path: Path, where: tuple, value: object, fragment: str) -> None:
    path, data = _baseline(tmp_path)
    node = data
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    path.write_text(json.dumps(data))
    code, out = invoke("check", tmp_path / "not-scanned", "--infer", "hf", *FAST, "--baseline", path)
    assert code == 2 and fragment in error(out), out


def test_valid_baseline_loads_negative_control(tmp_path: Path) -> None:
    path, data = _baseline(tmp_path)
    assert baselines.load_baseline(path) == data


def test_a_gate_never_silently_drops_out() -> None:
    result = json.loads(SAMPLE.read_text())
    base = baselines.make_baseline(result, gating.Tolerance())
    base["pairs"]["hf vs vllm"]["kl_k3"] = None  # (load_baseline refuses this; the gate must too)
    gates = baselines.baseline_gates(result, base, gating.Tolerance())
    assert any(g.name == "baseline kl_k3 (hf vs vllm)" and not g.passed for g in gates)
    asked = gating.asked_gates(result, {"max_kl": 0.1}, ["operator_path"], None)
    assert asked == {"--max-kl": len(result["pairs"]), "--fail-on": 1}
    short = gating.threshold_gates(result, {"max_kl": 0.1})[:1]  # one pair's gate went missing
    (missing,) = gating.coverage_gates(short, {"--max-kl": len(result["pairs"])})
    assert not missing.passed and "1 of the" in missing.message
    # negative control: every gate asked for was evaluated
    gates = gating.threshold_gates(result, {"max_kl": 0.1}) + gating.fail_on_gates(result, ["operator_path"])
    assert gating.coverage_gates(gates, asked) == []


# --- 3. output paths: probed first, stale files cleared, atomic writes --------------------------
# (an output that cannot be written is exit 4, not 2; write-time failures: tests/test_output_errors.py)


@pytest.mark.parametrize("opt,target,fragment", [
    ("--out", "/proc/logdiff-x", "cannot create the directory (No such file or directory)"),
    ("--out", "FILE", "exists and is not a directory"),
    ("--json", "/dev/full", "exists and is not a regular file"),
    ("--json", "DIR", "is a directory"),
    ("--junit", "DIR", "is a directory"),
])  # fmt: skip
def test_bad_output_paths_exit_4_before_the_scan(tmp_path: Path, opt: str, target: str, fragment: str) -> None:
    if target == "FILE":
        target = tmp_path / "a-file"
        target.write_text("x")
    elif target == "DIR":
        target = tmp_path
    command = "check" if opt == "--junit" else "scan"
    gate = ["--max-abs-diff", "1"] if command == "check" else []
    code, out = invoke(command, tmp_path / "not-scanned", "--infer", "hf", *FAST, *gate, opt, target)
    assert code == 4 and fragment in error(out) and opt in error(out), out
    assert f"cannot write {target} ({opt})" in error(out), out


def test_update_baseline_target_is_probed(tmp_path: Path) -> None:
    code, out = invoke("check", tmp_path / "not-scanned", "--infer", "hf", *FAST, "--baseline", "/proc/x/b.json",
                       "--update-baseline")  # fmt: skip
    assert code == 4 and "cannot write /proc/x/b.json (--baseline)" in error(out), out


def test_a_failed_run_keeps_the_earlier_outputs_and_a_good_one_replaces_them(tmp_path: Path) -> None:
    out, junit, js = tmp_path / "out", tmp_path / "junit.xml", tmp_path / "r.json"
    out.mkdir()
    earlier = [out / "result.json", out / "report.html", out / "divergence_table.parquet", junit, js]
    for f in [*earlier, out / "notes.txt"]:
        f.write_text(f"{f.name} from an earlier run")
    code, res = invoke("check", tmp_path / "missing-model", "--infer", "hf", *FAST, "--max-abs-diff", "1",
                       "--out", out, "--junit", junit, "--json", js)  # fmt: skip
    assert code == 2 and "model directory not found" in error(res)
    assert all(f.read_text() == f"{f.name} from an earlier run" for f in [*earlier, out / "notes.txt"])
    assert sorted(p.name for p in out.iterdir()) == ["divergence_table.parquet", "notes.txt", "report.html",
                                                     "result.json"]  # nothing half-written beside them
    outputs.write_result(json.loads(SAMPLE.read_text()), out, js)  # a run that succeeds, with no table
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "report.html", "result.json"]  # the old table went
    assert json.loads((out / "result.json").read_text()) == json.loads(js.read_text())


def test_outputs_are_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = json.loads(SAMPLE.read_text())
    out = tmp_path / "out"
    from logdiff.reports import html

    for exc in (OSError("disk full"), KeyboardInterrupt()):
        def broken(*_a: object, exc: BaseException = exc) -> None:
            raise exc

        monkeypatch.setattr(html, "render_html", broken)
        with pytest.raises(type(exc)):
            outputs.write_result(result, out, tmp_path / "r.json")
        assert (not out.exists() or list(out.iterdir()) == []) and not (tmp_path / "r.json").exists()
    monkeypatch.undo()
    outputs.write_result(result, out, tmp_path / "r.json")  # negative control
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "result.json"]
    assert json.loads((tmp_path / "r.json").read_text())["verdict"] == result["verdict"]


def test_valid_output_paths_pass_negative_control(tmp_path: Path) -> None:
    outputs.prepare(tmp_path / "new" / "dir", tmp_path / "sub" / "r.json", tmp_path / "j" / "junit.xml")
    assert (tmp_path / "new" / "dir").is_dir() and list((tmp_path / "new" / "dir").iterdir()) == []


# --- 4. more input errors that used to be internal errors ----------------------------------------


def test_deeply_nested_result_json(tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text('{"a": ' + "[" * 200_000 + "]" * 200_000 + "}")
    for command in ("report", "explain"):
        code, out = invoke(command, deep)
        assert code == 2 and "nested" in error(out), out


def test_drill_and_consistent_kernels_are_not_silently_ignored(tmp_path: Path) -> None:
    code, out = invoke("scan", tmp_path / "x", "--infer", "hf", *FAST, "--drill", "model.norm")
    assert code == 2 and "--drill needs --depth ops" in error(out)
    code, out = invoke("scan", tmp_path / "x", "--infer", "hf", *FAST, "--consistent-kernels", "rope")
    assert code == 2 and "--consistent-kernels needs --consistent" in error(out)
    # negative control: both with what they need
    ScanConfig(model=tmp_path, depth="ops", drill="model.norm", consistent=True, consistent_kernels=("rope",))


# --- 5. terminal output is inert ---------------------------------------------------------------


HOSTILE = "\x1b[31mred\x1b]8;;http://evil\x07link\x1b]8;;\x07\r\n::error::injected\u202e"


def test_report_and_explain_escape_control_characters(tmp_path: Path) -> None:
    result = json.loads(SAMPLE.read_text())
    result["model"] = HOSTILE
    result["warnings"].append(HOSTILE)
    result["causes"][0]["fix"] = HOSTILE
    result["causes"][0]["evidence"].append(HOSTILE)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    for command in ("report", "explain"):
        code, out = invoke(command, path)
        assert code == 0, out
        assert "\x1b" not in out and "\r" not in out and "\x07" not in out and "\u202e" not in out
        assert not any(line.strip().startswith("::") for line in out.splitlines()), out
        assert "\\x1b[31mred" in out  # shown, escaped
    # negative control: plain strings print unchanged
    assert safe_text("model.layers.0.mlp: ok") == "model.layers.0.mlp: ok"


def test_error_lines_are_one_inert_line(tmp_path: Path) -> None:
    res = runner.invoke(app, ["scan", str(tmp_path / "evil\n::error::x\x1b[2J"), "--infer", "hf", *FAST])
    assert res.exit_code == 2 and "\x1b" not in res.output and len(res.stderr.strip().splitlines()) == 1
    assert "evil\\n::error::x\\x1b[2J" in error(res.stderr)


def test_only_the_github_path_emits_workflow_commands() -> None:
    gate = {"name": "g\n::error::x", "passed": False, "value": 1, "threshold": 0, "message": HOSTILE}
    (line,) = github.annotations([gate])
    assert line.startswith("::error title=logdiff check%3A g%0A%3A%3Aerror%3A%3Ax::")
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "%1B[31m" in line


# --- 6. remote code ------------------------------------------------------------------------------


def test_model_that_needs_custom_code_is_refused(qwen3: Path, tmp_path: Path) -> None:
    model = _copy(qwen3, tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    (model / "evil.py").write_text("raise SystemExit('custom code ran')\n")
    for change in ({"auto_map": {"AutoConfig": "evil.EvilConfig"}}, {"model_type": "evil"}):
        (model / "config.json").write_text(json.dumps({**cfg, **change}))
        code, out = invoke("scan", model, "--infer", "hf", *FAST)
        assert code == 2 and "needs custom code" in error(out) and "--trust-remote-code" in error(out), out


def test_trust_remote_code_is_false_unless_asked(qwen3: Path, tmp_path: Path, monkeypatch) -> None:
    import transformers

    seen: list[object] = []
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        original = cls.from_pretrained.__func__

        def spy(klass: type, *a: object, _orig: object = original, **k: object) -> object:
            seen.append(k.get("trust_remote_code", "unset"))
            return _orig(klass, *a, **k)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    code, out = invoke("scan", qwen3, "--infer", "hf", *FAST, "--seed", "11", "--json", tmp_path / "r.json")
    assert code == 0, out
    assert seen and set(seen) == {False}, seen
    assert json.loads((tmp_path / "r.json").read_text())["settings"]["trust_remote_code"] is False
    seen.clear()  # negative control: the flag reaches every load
    code, out = invoke("scan", qwen3, "--infer", "hf", *FAST, "--seed", "11", "--trust-remote-code",
                       "--json", tmp_path / "t.json")  # fmt: skip
    assert code == 0 and set(seen) == {True}, (out, seen)
    assert json.loads((tmp_path / "t.json").read_text())["settings"]["trust_remote_code"] is True


# --- 8. every override is read back ------------------------------------------------------------


def test_override_without_effect_on_hf_decode(qwen3: Path) -> None:
    code, out = invoke("scan", qwen3, "--infer", "hf-decode", *FAST, "--set", "infer.padding_side=right")
    assert code == 2 and "infer.padding_side='right' did not take effect on hf-decode" in error(out), out


def test_read_back_compares_with_the_loaded_engine() -> None:
    from logdiff.commands.overrides import check_applied

    class Config:
        rope_parameters = {"rope_theta": 1e6}
        hidden_act = "silu"

    class Engine:
        name, options = "fake", frozenset({"temperature"})

        def effective_options(self) -> dict:
            return {"temperature": 0.7}

        def contract(self) -> dict:
            return {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 1e6}

        def loaded_config(self) -> Config:
            return Config()

    ok = {"temperature": 0.7, "rms_norm_eps": 1e-5, "rope_theta": 1000000, "hidden_act": "silu"}
    check_applied(Engine(), "infer", ok)  # negative control
    for key, value in (("tie_word_embeddings", True), ("rms_norm_eps", 1e-2), ("temperature", 1.0)):
        with pytest.raises(InputError, match=f"infer.{key}=.* did not take effect on fake"):
            check_applied(Engine(), "infer", {key: value})


@pytest.mark.vllm
def test_vllm_override_without_effect_exit_2_and_working_ones_pass(qwen3: Path) -> None:
    code, out = invoke("scan", qwen3, "--infer", "vllm", *FAST, "--set", "infer.tie_word_embeddings=true")
    line = error(out)
    assert code == 2 and "infer.tie_word_embeddings=True did not take effect on vllm" in line, out
    # negative control: overrides vLLM does apply, read back at --depth logprobs
    code, out = invoke("scan", qwen3, "--infer", "vllm", *FAST, "--set", "infer.rms_norm_eps=1e-5",
                       "--set", "infer.rope_theta=10000", "--set", "infer.temperature=0.7",
                       "--set", "infer.max_model_len=64")  # fmt: skip
    assert code == 0, out


def test_nan_summary_math_is_not_nan() -> None:
    """The finding's counts are integers that JSON keeps (not NaN that would become null)."""
    import numpy as np

    from logdiff.diagnosis import nonfinite
    from logdiff.sources.base import PathScores

    counts = nonfinite.path_counts([PathScores("a", "forward", [np.array([0.0, math.nan])]),
                                    PathScores("b", "forward", [np.array([0.0, -1.0])])])  # fmt: skip
    assert counts == {"a": [1, 2]}
    assert nonfinite.finding({}, {"train": [], "infer": []}, None, "bfloat16") is None  # negative control
