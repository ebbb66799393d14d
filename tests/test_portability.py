"""The suite's verdicts may not depend on the CPU: run the ISA-sensitive tests as an AVX2 machine.

Tests marked ``isa_sensitive`` touch what torch, oneDNN and vLLM's CPU build
choose per instruction set (which GEMM runs, whether vLLM keeps a plain weight,
whether a stock op varies with the batch). Each checks the property it needs
before relying on it. Here they run a second time in a child pytest under
``LOGDIFF_EMULATE_ISA=avx2`` (logdiff/isa.py), so a developer on an AVX-512
machine sees what a developer on an AVX2-only one would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from logdiff import isa
from logdiff.commands.baselines import hardware_key
from logdiff.errors import InputError

REPO = Path(__file__).resolve().parents[1]


def test_emulated_runs_get_their_own_hardware_key() -> None:
    env = {"device": "cpu", "machine": "x86_64", "cpu_isa": "avx2"}
    assert hardware_key(env) == "cpu-x86_64-avx2"
    assert hardware_key({**env, "cpu_isa_emulated": True}) == "cpu-x86_64-avx2-emulated"  # a host unknown
    emulated = {**env, "cpu_isa_emulated": True, "cpu_isa_host": "amx_bf16"}
    assert hardware_key(emulated) == "cpu-x86_64-avx2-emulated-on-amx_bf16"  # never another host's baseline


def test_an_unknown_emulation_is_an_input_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(isa.ENV, "sparc")
    with pytest.raises(InputError, match="can emulate avx2 only"):
        isa.apply_emulation()


def test_only_a_smaller_isa_can_be_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    for host, ok in (("avx512_bf16", True), ("amx_bf16", True), ("avx2", True), ("asimd", False), ("unknown", False)):
        monkeypatch.setattr(isa, "host_isa", lambda host=host: host)
        assert isa.can_emulate("avx2") is ok, host
    assert isa.emulation_env("avx2") == {isa.ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_gemm_kind_names_the_kernel_behind_cpu_linear() -> None:
    from logdiff.sources.vllm.doctor import gemm_kind

    class ops:  # stand-ins with the names vLLM's dispatch closures call
        onednn_mm = weight_packed_linear_cpu = staticmethod(lambda *a: None)

    handler = packed = None
    assert gemm_kind(lambda x, w, b: ops.onednn_mm(handler, x, b)) == "onednn"
    assert gemm_kind(lambda x, w, b: ops.weight_packed_linear_cpu(x, packed, 4, b)) == "sgl_packed"
    assert gemm_kind(lambda x, w, b: __import__("torch").nn.functional.linear(x, w, b)) == "torch_linear"


def isa_sensitive_files() -> list[str]:
    """The test files that name the ``isa_sensitive`` marker: the child collects these, not the whole suite
    (collecting its ~2,000 tests imports every test module). Where a module that is not a test file names the
    marker (a conftest.py could mark tests of other files), the whole folder."""
    named = [p for p in (REPO / "tests").rglob("*.py")
             if p.name != Path(__file__).name and "isa_sensitive" in p.read_text(encoding="utf-8")]
    if any(not p.name.startswith("test_") for p in named):
        return [str(REPO / "tests")]
    return sorted(str(p) for p in named)


def test_the_avx2_rerun_collects_every_isa_sensitive_test() -> None:
    files = isa_sensitive_files()
    assert str(REPO / "tests" / "test_batch_probe.py") in files  # marks its tests
    assert str(REPO / "tests" / "test_scan_sharded.py") not in files  # marks none
    assert not any(f.endswith(Path(__file__).name) for f in files)  # the child never reruns this file


@pytest.mark.vllm
def test_isa_sensitive_tests_pass_as_avx2(demo_model: Callable[[str], Path]) -> None:
    if isa.emulated_isa() is not None:
        pytest.skip("already running under ISA emulation")
    if not isa.can_emulate("avx2") or isa.host_isa() == "avx2":
        pytest.skip(f"this {isa.host_isa()} CPU runs AVX2 kernels natively or cannot emulate them")
    demo_model("qwen3")  # built natively first; the child reuses it (LOGDIFF_TEST_MODELS_NATIVE)
    env = {**os.environ, **isa.emulation_env("avx2"), "LOGDIFF_TEST_MODELS_NATIVE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "isa_sensitive", "-p", "no:cacheprovider", "-p", "no:randomly",
           *isa_sensitive_files()]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=2400)
    tail = "\n".join((run.stdout + run.stderr).splitlines()[-40:])
    assert run.returncode == 0, f"ISA-sensitive tests failed as AVX2 ({' '.join(cmd)}):\n{tail}"
    assert " passed" in tail, tail
