"""Gemma's kernels: (1 + w) RMSNorm, gelu-tanh-and-mul, soft-capping, soft-capped attention.

Each is checked like its neighbours: a row's bits do not depend on how many
rows share the call (bitwise), the kernel agrees with its plain-torch reference
within its stated bound, and (negative controls) the kernel is not the Llama
formula it extends, and soft-capping really changes attention.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from logdiff.kernels import (
    KERNELS,
    attention,
    attention_reference,
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_reference,
    gemma_rms_norm,
    gemma_rms_norm_reference,
    rms_norm,
    softcap,
    softcap_reference,
    tanh,
)

DTYPES = [torch.float32, torch.bfloat16]
BOUND = {k.name: k.bound for k in KERNELS}


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_rows_do_not_depend_on_the_batch(gen, dtype):
    x, w = (torch.randn(37, 256, generator=gen) * 3).to(dtype), (torch.randn(256, generator=gen) * 0.1).to(dtype)
    full = gemma_rms_norm(x, w, 1e-6)
    alone = torch.cat([gemma_rms_norm(x[i : i + 1], w, 1e-6) for i in range(len(x))])
    assert torch.equal(alone, full)
    r = (torch.randn(37, 256, generator=gen)).to(dtype)
    normed, summed = gemma_rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(summed, x + r) and torch.equal(normed, gemma_rms_norm(x + r, w, 1e-6))


def test_gemma_rms_norm_matches_hf_within_bound_and_is_not_llamas(gen):
    x, w = torch.randn(64, 256, generator=gen) * 3, torch.randn(256, generator=gen) * 0.1
    ref = gemma_rms_norm_reference(x.double(), w.double(), 1e-6)
    assert (gemma_rms_norm(x, w, 1e-6).double() - ref).abs().max() / ref.abs().max() <= BOUND["gemma_rms_norm"]
    # control: the (1 + w) offset matters (Llama's w * x / rms is a different function)
    assert not torch.allclose(rms_norm(x, w, 1e-6), gemma_rms_norm(x, w, 1e-6))
    # HF's module, on bf16: one rounding after (1 + w), so equal to the reference formula in bf16
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    hf = Gemma2RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(w)
    xb = x.bfloat16()
    assert torch.equal(hf.bfloat16()(xb), gemma_rms_norm_reference(xb, hf.weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_rows_do_not_depend_on_the_batch(gen, dtype):
    gate, up = (torch.randn(64, 31, generator=gen) * 4).to(dtype), torch.randn(64, 31, generator=gen).to(dtype)
    full = gelu_tanh_and_mul(gate, up)
    alone = torch.cat([gelu_tanh_and_mul(gate[i : i + 1], up[i : i + 1]) for i in range(len(gate))])
    assert torch.equal(alone, full)
    packed = torch.cat([gate, up], -1)  # vLLM's GeluAndMul input: non-contiguous halves
    assert torch.equal(gelu_tanh_and_mul(*packed.chunk(2, -1)), full)


def test_gelu_tanh_and_mul_within_bound_and_not_silu(gen):
    gate, up = torch.randn(256, 300, generator=gen) * 4, torch.randn(256, 300, generator=gen)
    ref = gelu_tanh_and_mul_reference(gate.double(), up.double())
    assert (gelu_tanh_and_mul(gate, up).double() - ref).abs().max() / ref.abs().max() <= BOUND["gelu_tanh_and_mul"]
    assert not torch.allclose(gelu_tanh_and_mul(gate, up), F.silu(gate) * up)  # control


def test_fixed_order_tanh_depends_on_the_value_alone(gen):
    x = torch.randn(1000, generator=gen) * 5
    alone = torch.cat([tanh(x[i : i + 1]) for i in range(0, 1000, 7)])
    assert torch.equal(alone, tanh(x)[::7])
    assert (tanh(x).double() - torch.tanh(x.double())).abs().max() < 1e-6
    big = torch.tensor([-1e30, -50.0, 0.0, 50.0, 1e30])
    assert torch.equal(tanh(big), torch.tensor([-1.0, -1.0, 0.0, 1.0, 1.0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_rows_do_not_depend_on_the_batch_and_cap(gen, dtype):
    x = (torch.randn(9, 4096, generator=gen) * 40).to(dtype)
    full = softcap(x, 30.0)
    assert torch.equal(torch.cat([softcap(x[i : i + 1], 30.0) for i in range(9)]), full)
    assert full.abs().max() <= 30.0
    ref = softcap_reference(x.float().double(), 30.0)
    assert (softcap(x.float(), 30.0).double() - ref).abs().max() / ref.abs().max() <= BOUND["softcap"]


def _qkv(gen, t=37, hq=4, hkv=2, d=16, scale=3.0):
    q = torch.randn(t, hq, d, generator=gen) * scale
    k = torch.randn(t, hkv, d, generator=gen) * scale
    v = torch.randn(t, hkv, d, generator=gen)
    return q, k, v


def test_softcapped_attention_prefill_equals_decode_and_its_reference(gen):
    q, k, v = _qkv(gen)
    t = q.shape[0]
    pos = torch.arange(t)
    full = attention(q, k, v, pos, 0.25, softcap=5.0)
    for i in (0, 15, 16, t - 1):  # one-query decode steps against the whole cache, padded past the query
        assert torch.equal(attention(q[i : i + 1], k, v, pos[i : i + 1], 0.25, kv_len=i + 1, softcap=5.0), full[i : i + 1])
    ref = attention_reference(q.double(), k.double(), v.double(), pos, 0.25, softcap=5.0)
    assert (full.double() - ref).abs().max() / ref.abs().max() <= BOUND["attention"]
    # control: the cap changes the result (scores here reach far past 5)
    assert not torch.allclose(full, attention(q, k, v, pos, 0.25), atol=1e-3)
