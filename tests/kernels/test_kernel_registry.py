"""The catalogue and ``self_test``, as ``logdiff kernels --self-test`` uses them."""

from __future__ import annotations

import subprocess
import sys

from logdiff import kernels


def test_catalogue_names_the_api_and_resolves_references():
    names = [k.name for k in kernels.KERNELS]
    assert names == [
        "linear",
        "rms_norm",
        "rope",
        "attention",
        "silu_and_mul",
        "log_softmax",
        "moe_route",
        "moe_route_grouped",
        "moe_combine",
        "gemma_rms_norm",
        "gelu_tanh_and_mul",
        "swiglu_oai_and_mul",
        "softcap",
        "int8_linear",
    ]
    for info in kernels.consistent_kernels():
        assert callable(info.kernel) and callable(info.reference)
        assert info.reference.__name__ == info.kernel.__name__ + "_reference"
        assert info.description and info.precision and info.bound > 0


def test_self_test_passes_every_kernel():
    results = kernels.self_test()
    assert [r.name for r in results] == [k.name for k in kernels.KERNELS]
    failed = [(r.name, r.invariant, r.max_error, r.bound) for r in results if not r.ok]
    assert not failed


def test_self_test_reports_a_broken_kernel(monkeypatch):
    import torch

    from logdiff.kernels import registry

    def batch_dependent(x, weight, bias=None, **_):
        return torch.nn.functional.linear(x, weight, bias)  # stock fp32: M=1 differs from M>1

    monkeypatch.setattr("logdiff.kernels.matmul.linear", batch_dependent)
    result = next(r for r in registry.self_test() if r.name == "linear")
    assert not result.invariant and not result.ok


def test_public_functions_survive_submodule_imports():
    code = (
        "import importlib, logdiff.kernels.attention, logdiff.kernels.rope; "
        "from logdiff import kernels; assert callable(kernels.attention) and callable(kernels.rope)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
