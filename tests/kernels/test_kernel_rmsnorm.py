"""rms_norm: rows invariant across batch sizes, residual semantics, precision."""

from __future__ import annotations

import pytest
import torch

from logdiff.kernels import KERNELS, rms_norm, rms_norm_reference

DTYPES = [torch.float32, torch.bfloat16]
BOUND = {k.name: k.bound for k in KERNELS}["rms_norm"]


def _inputs(gen, m=8, h=384, dtype=torch.float32):
    x = torch.randn(m, h, generator=gen) * 3
    r = torch.randn(m, h, generator=gen)
    w = torch.rand(h, generator=gen) + 0.5
    return x.to(dtype), r.to(dtype), w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_rows_do_not_depend_on_batch_size(gen, dtype, m):
    x, r, w = _inputs(gen, dtype=dtype)
    assert torch.equal(rms_norm(x[-m:], w, 1e-6), rms_norm(x, w, 1e-6)[-m:])
    normed, summed = rms_norm(x[-m:], w, 1e-6, residual=r[-m:])
    full_normed, full_summed = rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(normed, full_normed[-m:]) and torch.equal(summed, full_summed[-m:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_length_batch_equals_each_sequence_alone(gen, dtype):
    x, _, w = _inputs(gen, m=20, dtype=dtype)
    padded = torch.zeros(2, 13, x.shape[1], dtype=dtype)
    padded[0, :7], padded[1, :13] = x[:7], x[7:]
    out = rms_norm(padded, w, 1e-5)
    assert torch.equal(out[0, :7], rms_norm(x[:7], w, 1e-5))
    assert torch.equal(out[1], rms_norm(x[7:], w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_is_the_rounded_sum_and_the_norm_is_of_that_sum(gen, dtype):
    x, r, w = _inputs(gen, dtype=dtype)
    normed, summed = rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(summed, x + r)
    assert torch.equal(normed, rms_norm(x + r, w, 1e-6))


def test_long_rows_are_invariant_where_a_thread_split_reduction_could_differ(gen):
    x = torch.randn(4, 1 << 18, generator=gen)
    w = torch.ones(1 << 18)
    assert torch.equal(rms_norm(x[:1], w, 1e-6), rms_norm(x, w, 1e-6)[:1])


def test_error_against_fp64_is_within_the_stated_bound(gen):
    x, _, w = _inputs(gen, h=4096)
    ref = rms_norm_reference(x.double(), w.double(), 1e-6)
    assert (rms_norm(x, w, 1e-6).double() - ref).abs().max() / ref.abs().max() <= BOUND


def test_bf16_matches_the_hf_module_within_one_rounding(gen):
    x, _, w = _inputs(gen, dtype=torch.bfloat16)
    ref = rms_norm_reference(x, w, 1e-6).float()  # HF's formula on the same bf16 input
    ours = rms_norm(x, w, 1e-6).float()
    assert ((ours - ref).abs() <= ref.abs() * 2.0**-7).all()
