"""kernels/int8.py against the installed vLLM's own CPU ops, bitwise: the dynamic per-token activation
quantization (``dynamic_scaled_int8_quant``) and the int8 GEMM with its epilogue (``onednn_scaled_mm``), as
the compressed-tensors W8A8 int8 scheme calls them on x86 without AMX (``CPUInt8ScaledMMLinearKernel``'s
oneDNN path). Skipped where vLLM or its AVX-512 int8 ops are absent."""

from __future__ import annotations

import pytest
import torch

from logdiff.kernels import int8 as Q

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


def _engine(ops, x, q_w, s_w, bias):
    xq, xs, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
    handler = ops.create_onednn_scaled_mm(q_w.t(), s_w, x.dtype, True, False, 32)
    out = torch.empty(x.shape[0], q_w.shape[0], dtype=x.dtype)
    ops.onednn_scaled_mm(handler, xq, out, xs, None, None, bias)
    return xq, xs, out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_is_bitwise_the_engines_quantization_gemm_and_epilogue(ops, dtype):
    gen = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10).to(dtype)
        x[0, : k // 2] = 0  # a half-zero row
        if m > 2:
            x[1] = 0  # a zero row: scale 0
        q_w, s_w = Q.quantize_weight(torch.randn(n, k, generator=gen) / 50)
        for bias in (None, torch.randn(n, generator=gen).to(dtype)):
            xq, xs, out = _engine(ops, x, q_w, s_w, bias)
            q, s = Q.quantize_activation(x)
            assert torch.equal(s, xs) and torch.equal(q, xq), (m, k, n)
            assert torch.equal(Q.scaled_mm(q, s, q_w, s_w, bias, dtype), out), (m, k, n, bias is not None)
            assert torch.equal(Q.int8_linear(x, q_w, s_w, bias), out)


def test_accumulators_past_fp32s_exact_range_round_as_the_engines(ops):
    """|acc| above 2**24 (every product near the int8 maximum, K = 4096): the int32 -> fp32 conversion rounds,
    and the kernel rounds it the same way."""
    k = 4096
    gen = torch.Generator().manual_seed(1)
    x = (torch.rand(4, k, generator=gen) + 3).to(torch.bfloat16)
    w = torch.rand(16, k, generator=gen) + 2
    q_w, s_w = Q.quantize_weight(w)
    xq, xs, out = _engine(ops, x, q_w, s_w, None)
    acc = Q.int_dot(xq, q_w)
    assert float(acc.abs().min()) > 2**24 and not torch.equal(acc.float().double(), acc)  # fp32 rounds them
    assert torch.equal(Q.int8_linear(x, q_w, s_w), out)
