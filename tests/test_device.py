"""The HF paths compute on the device they are given, with the same verdicts as on the CPU.

On a machine without an accelerator only the input checks run; with CUDA (or
an Ascend NPU) the real scans run there: HF's full forward against its own
KV-cache decode is localized and classified, and consistent mode makes the two
bitwise equal on the device too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from plants import split_k
from typer.testing import CliRunner

import logdiff
from logdiff.cli import app
from logdiff.sources import base, checkpoint, pool
from logdiff.sources.base import resolve_device

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "attribute": False}


def _exit(*args: object) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["scan", *(str(a) for a in args)])
    out = res.output + (res.stderr if res.stderr_bytes is not None else "")
    assert "Traceback" not in out, out
    return res.exit_code, out


def test_an_unknown_device_is_an_input_error(qwen3: Path) -> None:
    code, out = _exit(qwen3, "--infer", "hf", "--device", "gpu", "--depth", "logprobs")
    assert code == 2 and "--device must be" in out


def test_a_device_torch_does_not_see_is_an_unavailable_engine(qwen3: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, out = _exit(qwen3, "--infer", "hf", "--device", "cuda", "--depth", "logprobs")
    assert code == 3 and "torch sees no such device" in out


def test_auto_picks_the_accelerator_or_the_cpu() -> None:
    import torch

    picked = resolve_device("auto")
    assert picked == "cuda" if torch.cuda.is_available() else picked in ("cpu", "npu", "xpu")
    assert resolve_device("cpu") == "cpu"


def _accelerator() -> str:
    device = resolve_device("auto")
    if device == "cpu":
        pytest.skip("no accelerator on this machine (the CUDA/NPU path runs where one is)")
    return device


def test_scan_on_the_accelerator_localizes_and_classifies(qwen3: Path, stock_varies: Callable) -> None:
    device = _accelerator()
    r = logdiff.scan(qwen3, infer=["hf-decode"], device=device, depth="modules", **SMALL)
    stock_varies(r["verdict"] == "consistent", f"HF forward and KV-cache decode agree bitwise on {device}")
    assert r["first_divergence"] is not None and r["causes"], r["warnings"]
    assert all(c["class"] == "operator_path" for c in r["causes"]), [(c["boundary"], c["kind"]) for c in r["causes"]]


def test_a_planted_fault_on_the_accelerator_is_localized(qwen3: Path) -> None:
    """Planted on the device itself, so it does not depend on what the stock kernels do there."""
    device = _accelerator()
    engine = pool.acquire("hf-decode", base.EngineSpec(str(checkpoint.stage(qwen3).path), device=device))
    target = "model.layers.2.self_attn.o_proj"
    with split_k(engine.model.get_submodule(target)):
        r = logdiff.scan(qwen3, infer=["hf-decode"], device=device, depth="modules", **SMALL)
    cause = next((c for c in r["causes"] if c["boundary"] == target), None)
    assert cause is not None, [(c["boundary"], c["kind"]) for c in r["causes"]]
    assert (cause["class"], cause["kind"]) == ("operator_path", "reduction_order")
    conf = cause["conformance"]
    assert all(conf[s]["error"] <= conf[s]["bound"] for s in ("train", "infer")), conf


def test_consistent_mode_is_bitwise_on_the_accelerator(qwen3: Path) -> None:
    device = _accelerator()
    for dtype in ("bfloat16", "float32"):
        r = logdiff.scan(qwen3, infer=["hf-decode"], device=device, dtype=dtype, consistent=True, depth="logprobs",
                         **SMALL)  # fmt: skip
        assert r["logprobs"]["abs_diff_max"] == 0.0 and r["verdict"] == "consistent", (dtype, r["logprobs"])
