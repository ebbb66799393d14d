"""Bad input gives one clear line and a documented exit code, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from logdiff.cli import app

runner = CliRunner()
FAST = ["--num-sequences", "2", "--prompt-len", "4", "--response-len", "4", "--depth", "logprobs"]  # scan defaults to modules


def invoke(*args: str) -> tuple[int, str]:
    res = runner.invoke(app, [str(a) for a in args])
    out = res.output + (res.stderr if res.stderr_bytes is not None else "")
    assert "Traceback" not in out
    return res.exit_code, out


def one_line_error(out: str) -> str:
    lines = [line for line in out.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("logdiff: error:"), out
    return lines[-1]


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_help_is_instant_and_imports_no_torch() -> None:
    code = "import sys, logdiff.cli; assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert invoke("--help")[0] == 0


def test_missing_model_path(tmp_path: Path) -> None:
    code, out = invoke("scan", tmp_path / "nope", "--infer", "hf", *FAST)
    assert code == 2 and "not found" in one_line_error(out)


def test_not_a_model_dir(tmp_path: Path) -> None:
    code, out = invoke("scan", tmp_path, "--infer", "hf", *FAST)
    assert code == 2 and "config.json" in one_line_error(out)


def test_unsupported_architecture_lists_supported(qwen3: Path, tmp_path: Path) -> None:
    model = _copy_model(qwen3, tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(cfg))
    code, out = invoke("scan", model, "--infer", "hf", *FAST)
    line = one_line_error(out)
    assert code == 2 and "GPT2LMHeadModel" in line and "Qwen3ForCausalLM" in line


def test_config_weights_mismatch(qwen3: Path, tmp_path: Path) -> None:
    model = _copy_model(qwen3, tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2
    (model / "config.json").write_text(json.dumps(cfg))
    code, out = invoke("scan", model, "--infer", "hf", *FAST)
    assert code == 2 and "config/weights mismatch" in one_line_error(out)


def test_corrupted_safetensors(qwen3: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((qwen3 / "model.safetensors").read_bytes()[:5000])
    code, out = invoke("scan", qwen3, bad, "--infer", "hf", *FAST)
    assert code == 2 and "corrupt safetensors" in one_line_error(out)


def test_token_ids_outside_vocabulary(qwen3: Path, tmp_path: Path) -> None:
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps({"prompt_ids": [1, 2, 10**7], "response_ids": [3]}) + "\n")
    code, out = invoke("scan", qwen3, "--infer", "hf", "--sequences", f)
    assert code == 2 and "outside the model's vocabulary" in one_line_error(out)


def test_sequence_longer_than_context(qwen3: Path, tmp_path: Path) -> None:
    n = json.loads((qwen3 / "config.json").read_text())["max_position_embeddings"]
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps({"prompt_ids": [1] * n, "response_ids": [3]}) + "\n")
    code, out = invoke("scan", qwen3, "--infer", "hf", "--sequences", f)
    assert code == 2 and "exceed the model's context" in one_line_error(out)


def test_malformed_jsonl(qwen3: Path, tmp_path: Path) -> None:
    f = tmp_path / "s.jsonl"
    f.write_text('{"prompt_ids": [1, 2]}\n')
    code, out = invoke("scan", qwen3, "--infer", "hf", "--sequences", f)
    assert code == 2 and "response_ids" in one_line_error(out)


def test_bad_set_and_bad_options(qwen3: Path) -> None:
    code, out = invoke("scan", qwen3, "--infer", "hf", "--set", "rms_norm_eps=1", *FAST)
    assert code == 2 and "train.KEY=VALUE" in one_line_error(out)
    code, out = invoke("scan", qwen3, "--infer", "hf", "--set", "infer.no_such_key=1", *FAST)
    assert code == 2 and "no_such_key" in one_line_error(out)
    code, out = invoke("scan", qwen3, "--infer", "nope", *FAST)
    assert code == 2 and "unknown engine" in one_line_error(out)
    code, out = invoke("scan", qwen3, "--infer", "hf", "--dtype", "int8", *FAST)
    assert code == 2 and "--dtype" in one_line_error(out)


def test_missing_vllm_exits_3_and_says_how_to_install(qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    code, out = invoke("scan", qwen3, "--infer", "vllm", "--seed", "12345", *FAST)
    line = one_line_error(out)
    assert code == 3 and "vLLM is not installed" in line and "pip install" in line


def test_scan_writes_json(qwen3: Path, tmp_path: Path) -> None:
    code, out = invoke("scan", qwen3, "--infer", "hf", "--json", tmp_path / "r.json", *FAST)
    assert code == 0, out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["schema_version"] == 2 and result["verdict"] == "consistent"


def test_explain_and_report_refuse_a_missing_or_invalid_result(tmp_path: Path) -> None:
    for command in ("explain", "report"):
        code, out = invoke(command, tmp_path / "nope.json")
        assert code == 2 and ("cannot read" in one_line_error(out) or "not found" in one_line_error(out))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema_version": 1}))
    code, out = invoke("explain", bad)
    assert code == 2 and "not a valid logdiff result" in one_line_error(out)


@pytest.mark.parametrize("extra", [["--depth", "modules"], ["--depth", "logprobs", "--consistent"]])
def test_a_tensor_parallel_vllm_cannot_be_hooked_or_patched_and_says_where_to_go(qwen3: Path, extra: list[str]) -> None:
    """vLLM's own tensor_parallel_size puts the model in worker processes: refused before anything loads, naming
    the capture and logdiff compare (tests/test_rl_step_capture.py runs those)."""
    code, out = invoke("scan", qwen3, "--set", "infer.tensor_parallel_size=2", *extra)
    line = one_line_error(out)
    assert code == 2 and "worker processes" in line and "logdiff compare" in line


def test_a_training_tensor_parallel_size_that_does_not_divide_the_heads_is_one_line(qwen3: Path) -> None:
    code, out = invoke("scan", qwen3, "--infer", "hf", "--set", "train.tensor_parallel_size=3", *FAST)
    assert code == 2 and "tensor_parallel_size" in one_line_error(out)


def test_consistent_vllm_against_a_tensor_parallel_training_path_is_refused_before_loading(qwen3: Path) -> None:
    code, out = invoke("scan", qwen3, "--consistent", "--set", "train.tensor_parallel_size=2", *FAST)
    assert code == 2 and "fixed-order row-parallel" in one_line_error(out)


@pytest.mark.vllm
def test_a_scan_refuses_to_run_its_vllm_under_the_capture_plugin(qwen3: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("LOGDIFF_CAPTURE", str(tmp_path / "bundle"))
    code, out = invoke("scan", qwen3, *FAST)
    assert code == 2 and "LOGDIFF_CAPTURE" in one_line_error(out)
    assert not (tmp_path / "bundle").exists()
