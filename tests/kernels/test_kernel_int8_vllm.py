"""kernels/int8.py against the installed vLLM's own CPU ops, bitwise: the dynamic per-token activation
quantization (``dynamic_scaled_int8_quant``) and the int8 GEMM with its epilogue (``onednn_scaled_mm``), as
the compressed-tensors W8A8 int8 scheme calls them on x86 without AMX (``CPUInt8ScaledMMLinearKernel``'s
oneDNN path). Skipped where vLLM or its int8 ops are absent, and where its GEMM is not the exact one this kernel
models (a host without VNNI, whose oneDNN GEMM saturates int16 pair sums: ``sources/vllm/int8_host.py``; there the
last test checks that this is what the engine computes)."""

from __future__ import annotations

import pytest
import torch

from logdiff.kernels import int8 as Q
from logdiff.sources.vllm.int8_host import EXACT, SATURATING, int8_gemm, onednn_linear, saturating_int_dot

pytestmark = pytest.mark.vllm

SHAPES = [(1, 4096, 64), (2, 17, 5), (3, 1000, 33), (64, 256, 80), (130, 64, 48)]


@pytest.fixture(scope="module")
def ops():
    from vllm import _custom_ops as ops

    try:
        ops.onednn_scaled_int8_quant(torch.ones(1, 16, dtype=torch.bfloat16), None, None, True)
    except (RuntimeError, AttributeError) as e:  # AVX2-only builds: "requires AVX512 support"
        pytest.skip(f"vLLM's CPU int8 ops are unavailable here: {e}")
    return ops


@pytest.fixture(scope="module")
def exact_ops(ops):
    if int8_gemm() != EXACT:
        pytest.skip(f"vLLM's oneDNN int8 GEMM on this host is {int8_gemm() or 'unknown'}, not the exact GEMM of "
                    "kernels/int8.py (a host without VNNI: sources/vllm/int8_host.py)")
    return ops



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_is_bitwise_the_engines_quantization_gemm_and_epilogue(exact_ops, dtype):
    gen = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10).to(dtype)
        x[0, : k // 2] = 0  # a half-zero row
        if m > 2:
            x[1] = 0  # a zero row: scale 0
        q_w, s_w = Q.quantize_weight(torch.randn(n, k, generator=gen) / 50)
        for bias in (None, torch.randn(n, generator=gen).to(dtype)):
            xq, xs, out = onednn_linear(x, q_w, s_w, bias)
            q, s = Q.quantize_activation(x)
            assert torch.equal(s, xs) and torch.equal(q, xq), (m, k, n)
            assert torch.equal(Q.scaled_mm(q, s, q_w, s_w, bias, dtype), out), (m, k, n, bias is not None)
            assert torch.equal(Q.int8_linear(x, q_w, s_w, bias), out)


def test_accumulators_past_fp32s_exact_range_round_as_the_engines(exact_ops):
    """|acc| above 2**24 (every product near the int8 maximum, K = 4096): the int32 -> fp32 conversion rounds,
    and the kernel rounds it the same way."""
    k = 4096
    gen = torch.Generator().manual_seed(1)
    x = (torch.rand(4, k, generator=gen) + 3).to(torch.bfloat16)
    w = torch.rand(16, k, generator=gen) + 2
    q_w, s_w = Q.quantize_weight(w)
    xq, xs, out = onednn_linear(x, q_w, s_w)
    acc = Q.int_dot(xq, q_w)
    assert float(acc.abs().min()) > 2**24 and not torch.equal(acc.float().double(), acc)  # fp32 rounds them
    assert torch.equal(Q.int8_linear(x, q_w, s_w), out)


def test_the_hosts_gemm_is_named_and_a_saturating_one_is_another_function(ops):
    """``int8_host.int8_gemm`` names what the engine's GEMM computes here. Where it saturates, rows of large
    same-sign products (every pair past int16) give the saturating GEMM's values, far from the scheme's exact
    ones; where it is exact, the same rows are the exact kernel's bit for bit (the control)."""
    gemm = int8_gemm()
    assert gemm in (EXACT, SATURATING)
    gen = torch.Generator().manual_seed(1)
    x = (torch.rand(4, 256, generator=gen) + 3).to(torch.float32)
    q_w, s_w = Q.quantize_weight(torch.rand(16, 256, generator=gen) + 2)
    xq, xs, out = onednn_linear(x, q_w, s_w)
    exact = Q.scaled_mm(xq, xs, q_w, s_w, None, torch.float32)
    if gemm == EXACT:
        assert torch.equal(exact, out)
        return
    model = Q.scaled_mm(xq, xs, q_w, s_w, None, torch.float32, dot=saturating_int_dot)
    assert bool(((out - model).abs() <= 2**-6 * model.abs()).all()), (out, model)  # up to its epilogue's roundings
    assert bool((out.abs() < exact.abs() / 2).all()), (out, exact)
