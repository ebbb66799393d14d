"""The INT8 W8A8 kernels (kernels/int8.py): the scheme's activation rounding, the exact integer GEMM and its
bound, batch invariance of the consistent quantized linear, its straight-through backward, and negative
controls that must fail (a batch-wide activation scale; one fp32 GEMM past the exact K bound)."""

from __future__ import annotations

import pytest
import torch

from logdiff.kernels import int8 as Q


def _x(m: int, k: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * (torch.rand(m, 1, generator=gen) * 8 + 0.1)).to(dtype)


def _w(n: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / 16


def test_activation_quantization_is_the_schemes_per_token_rounding():
    x = torch.tensor([[1.0, -0.5, 0.25, 2.0], [0.0, 0.0, 0.0, 0.0], [127.0, 0.5, 1.5, -2.5]])
    q, s = Q.quantize_activation(x)
    assert s.dtype == torch.float32 and s.shape == (3, 1)
    assert s[0, 0] == torch.tensor(2.0) / 127 and s[1, 0] == 0 and s[2, 0] == 1.0
    assert q[0].tolist() == [64, -32, 16, 127]  # 63.5 -> 64 (half to even), 31.75 -> 32
    assert q[1].tolist() == [0, 0, 0, 0]  # a zero row: scale 0, q 0
    assert q[2].tolist() == [127, 0, 2, -2]  # 0.5 -> 0, 1.5 -> 2, -2.5 -> -2: half to even
    # each token alone: its scale and values do not depend on the other rows
    for i in range(3):
        qi, si = Q.quantize_activation(x[i : i + 1])
        assert torch.equal(qi, q[i : i + 1]) and torch.equal(si, s[i : i + 1])


def test_integer_gemm_is_exact_up_to_and_past_one_fp32_chunk():
    # the worst case of the bound: every product is (-128) * (-128) = 2**14, K_CHUNK of them sum to 2**24
    for k in (Q.K_CHUNK, 3 * Q.K_CHUNK + 7):
        a = torch.full((3, k), -128, dtype=torch.int8)
        b = torch.full((5, k), -128, dtype=torch.int8)
        assert torch.equal(Q.int_dot(a, b), torch.full((3, 5), float(k * 2**14), dtype=torch.float64))
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(-128, 128, (9, 2500), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (7, 2500), generator=gen, dtype=torch.int8)
    assert torch.equal(Q.int_dot(a, b), (a.long() @ b.long().t()).double())


def test_one_fp32_gemm_past_the_bound_is_not_exact():
    """Negative control of ``K_CHUNK``: 16 * K_CHUNK products of about 2**14 with random low bits in ONE fp32 GEMM
    lose bits in whatever order the BLAS adds them (the sum is near 2**28), so the chunking is what makes the
    integer GEMM exact (a larger chunk would not be)."""
    k = 16 * Q.K_CHUNK
    gen = torch.Generator().manual_seed(4)
    a = torch.full((2, k), 127, dtype=torch.int8)
    b = torch.randint(100, 128, (3, k), generator=gen, dtype=torch.int8)
    exact = (a.long() @ b.long().t()).double()
    one_gemm = torch.mm(a.float(), b.float().t()).double()
    assert not torch.equal(one_gemm, exact)
    assert torch.equal(Q.int_dot(a, b), exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_linear_rows_are_bitwise_the_same_in_any_batch(dtype):
    x, w = _x(70, 1100, dtype=dtype), _w(96, 1100)
    b = torch.randn(96).to(dtype)
    q_w, s_w = Q.quantize_weight(w)
    full = Q.int8_linear(x, q_w, s_w, b)
    assert full.dtype == dtype and full.shape == (70, 96)
    for start, m in ((0, 1), (5, 3), (17, 16), (40, 30), (69, 1)):  # decode steps and prefill chunks
        assert torch.equal(Q.int8_linear(x[start : start + m], q_w, s_w, b), full[start : start + m])
    assert torch.equal(Q.int8_linear(x.reshape(7, 10, 1100), q_w, s_w, b).reshape(70, 96), full)  # [B, T, K]


def test_negative_control_a_batch_wide_activation_scale_is_not_batch_invariant():
    """The same invariance check on a per-tensor (batch-wide) activation scale must fail: row 0's bits depend on
    which rows share the call. So the check above can fail, and the per-token scale is what passes it."""
    x, w = _x(16, 256), _w(32, 256)
    q_w, s_w = Q.quantize_weight(w)

    def per_tensor(rows: torch.Tensor) -> torch.Tensor:
        q, s = Q.quantize_activation(rows.reshape(1, -1))  # one scale for the whole call
        return Q.scaled_mm(q.reshape(rows.shape), s.expand(rows.shape[0], 1), q_w, s_w, None, rows.dtype)

    assert not torch.equal(per_tensor(x[:1]), per_tensor(x)[:1])
    assert torch.equal(Q.int8_linear(x[:1], q_w, s_w), Q.int8_linear(x, q_w, s_w)[:1])


def test_int8_linear_is_within_its_exact_function():
    x, w, b = _x(33, 700), _w(40, 700), torch.randn(40)
    q_w, s_w = Q.quantize_weight(w)
    ref = Q.int8_linear_reference(x, q_w, s_w, b)
    out = Q.int8_linear(x, q_w, s_w, b)
    q, s = Q.quantize_activation(x)
    scale = (q.double().abs() @ q_w.double().abs().t()) * s.double() * s_w.double().t() + b.double().abs()
    # fp32 epilogue: acc exact here (|acc| < 2**24), the weight-scale product and the fused multiply-add
    assert ((out.double() - ref).abs() <= 2 * 2.0**-24 * scale * 1.0001).all()
    # bf16 output adds its one rounding
    out16 = Q.int8_linear(x.bfloat16(), q_w, s_w, b.bfloat16())
    ref16 = Q.int8_linear_reference(x.bfloat16(), q_w, s_w, b.bfloat16())
    assert ((out16.double() - ref16).abs() <= (2.0**-8 + 2 * 2.0**-24) * scale.clamp_min(ref16.abs()) * 1.01).all()


def test_fake_quant_linear_is_the_engines_linear_of_the_quantized_weight():
    x, w = _x(20, 128, dtype=torch.bfloat16), _w(64, 128).bfloat16()
    assert torch.equal(Q.fake_quant_linear(x, w), Q.int8_linear(x, *Q.quantize_weight(w)))
    from logdiff.kernels.caches import kernel_caches

    with kernel_caches() as caches:  # the quantized weight is kept while the weight is unchanged
        first = Q.fake_quant_linear(x, w)
        assert id(w) in caches.int8_weights
        w.mul_(2)  # an in-place update bumps the version: quantized again
        assert torch.equal(Q.fake_quant_linear(x, w), Q.int8_linear(x, *Q.quantize_weight(w)))
        assert not torch.equal(first, Q.fake_quant_linear(x, w))


def test_backward_is_a_straight_through_estimator_with_batch_invariant_dx():
    x, w, b = _x(40, 300), _w(48, 300), torch.randn(48)
    xr, wr, br = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    y = Q.fake_quant_linear(xr, wr, br)
    assert torch.equal(y.detach(), Q.fake_quant_linear(x, w, b))  # the forward is the inference one
    dy = torch.randn_like(y)
    y.backward(dy)
    # STE: the gradient of x_hat @ w_hat.T + b with the dequantized operands, rounding steps as identity
    q, s = Q.quantize_activation(x)
    x_hat = q.double() * s.double()
    w_hat = Q.dequantize_weight(*Q.quantize_weight(w)).double()
    for got, want in ((xr.grad, dy.double() @ w_hat), (wr.grad, dy.double().t() @ x_hat), (br.grad, dy.double().sum(0))):
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    # dx of a row does not depend on the batch
    x1 = x[7:8].clone().requires_grad_()
    Q.fake_quant_linear(x1, w, b).backward(dy[7:8])
    assert torch.equal(x1.grad, xr.grad[7:8])
