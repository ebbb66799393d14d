"""The sinks' backward (gpt-oss): gradcheck in float64, agreement with fp64 autograd of the reference, batch
invariance of a query's gradients; the sink's own gradient ``-sum_i P_i,sink * delta_i``."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from logdiff import kernels as K

LOOSE = dict(eps=1e-3, atol=1e-3, rtol=1e-3)  # the kernel computes in fp32 even for fp64 input
GRAD_BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
HQ, HKV, D = 4, 2, 8


def _case(s: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV))
    return q, k, v, (torch.randn(HQ, generator=gen) * 2).to(dtype)


def test_gradcheck_with_padding_gqa_window_and_sinks():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, h, 4, generator=gen, dtype=torch.float64).requires_grad_() for h in (HQ, HKV, HKV))
    sinks = torch.randn(HQ, generator=gen, dtype=torch.float64).requires_grad_()
    q_positions, kv_lens = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]]), torch.tensor([5, 3])

    def f(q, k, v, sinks):  # noqa: ANN001, ANN202
        return K.attention_batched(q, k, v, q_positions, 0.5, kv_lens, window=3, sinks=sinks)

    assert gradcheck(f, (q, k, v, sinks), fast_mode=True, **LOOSE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_agree_with_fp64_autograd_of_the_reference(dtype):
    q, k, v, sinks = _case(37, dtype)
    positions = torch.arange(37)
    dy = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ours = torch.autograd.grad(K.attention(*leaves[:3], positions, 0.3, window=9, sinks=leaves[3]), leaves, dy.to(dtype))
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    out = K.attention_reference(*ref_leaves[:3], positions, 0.3, window=9, sinks=ref_leaves[3])
    ref = torch.autograd.grad(out, ref_leaves, dy.double())
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == dtype
        assert (a.double() - b).abs().max() <= GRAD_BOUND[dtype] * b.abs().max()
    assert ref[3].abs().max() > 0  # control: the sinks do receive a gradient


def test_a_querys_gradients_do_not_depend_on_the_batch():
    """Sequence 0 alone vs right-padded beside a longer one: its q grads bitwise; the sink grad is their sum."""
    (q0, k0, v0, sinks), (q1, k1, v1, _) = _case(11, torch.float32), _case(37, torch.float32, seed=1)
    dy = torch.randn(2, 37, HQ, D, generator=torch.Generator().manual_seed(2))

    def grads(q, k, v, positions, kv_lens, d):  # noqa: ANN001, ANN202
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = K.attention_batched(*leaves[:3], positions, 0.3, kv_lens, sinks=leaves[3])
        return torch.autograd.grad(out, leaves, d)

    batch = [torch.zeros(2, 37, *t.shape[1:]) for t in (q0, k0, v0)]
    for padded, a, b in zip(batch, (q0, k0, v0), (q1, k1, v1), strict=True):
        padded[0, :11], padded[1] = a, b
    positions = torch.stack([torch.where(torch.arange(37) < 11, torch.arange(37), -1), torch.arange(37)])
    together = grads(*batch, positions, torch.tensor([11, 37]), dy)
    alone = grads(q0[None], k0[None], v0[None], torch.arange(11)[None], torch.tensor([11]), dy[:1, :11])
    assert torch.equal(alone[0][0], together[0][0, :11])
    assert torch.equal(together[0], grads(*batch, positions, torch.tensor([11, 37]), dy)[0])  # deterministic
    second = grads(q1[None], k1[None], v1[None], torch.arange(37)[None], torch.tensor([37]), dy[1:])
    assert torch.allclose(together[3], alone[3] + second[3], atol=1e-6)  # a parameter: summed over the batch
