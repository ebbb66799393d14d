"""``kernels.aten_overrides`` on the CPU dispatch key: the property, its removal, and a negative control.

The property: inside the context, a row's ``torch.mm`` (and ``F.linear``, ``log_softmax``,
``mean``) bits do not depend on the other rows in the call. The same check run on a
deliberately order-dependent ``mm`` must fail, or the check proves nothing. Nothing here
assumes the stock CPU kernels are (or are not) batch-invariant: that depends on the ISA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import linear
from kernels.aten_overrides import STOCK, aten_overrides

SHAPES = [(64, 40), (96, 128), (256, 300)]  # (K, N): tiled, exactly one tile, several and padded
BATCHES = (1, 3, 17, 40)


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rows_batch_invariant(op, k: int, dtype: torch.dtype) -> bool:
    """Whether ``op(x)[i]`` is bitwise ``op(x[i:i+1])[0]`` for a needle row among batches of other rows."""
    needle = _rows(1, k, dtype, seed=1)
    alone = op(needle)[0]
    for m in BATCHES:
        batch = torch.cat([_rows(m, k, dtype, seed=100 + m), needle, _rows(m // 2, k, dtype, seed=200 + m)])
        if not torch.equal(op(batch)[m], alone):
            return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", SHAPES)
def test_mm_and_linear_rows_are_batch_invariant_inside(k, n, dtype):
    w = _rows(k, n, dtype, seed=7)
    bias = _rows(1, n, dtype, seed=8)[0]
    with aten_overrides("CPU"):
        assert rows_batch_invariant(lambda x: torch.mm(x, w), k, dtype)
        assert rows_batch_invariant(lambda x: F.linear(x, w.t(), bias), k, dtype)  # aten::addmm
        assert rows_batch_invariant(lambda x: F.linear(x.unsqueeze(0), w.t()).squeeze(0), k, dtype)  # 3-D: mm
        x = _rows(5, k, dtype, seed=9)
        assert torch.equal(torch.mm(x, w), linear(x, w.t()))  # the override is the fixed-order kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_log_softmax_and_mean_are_batch_invariant_inside(dtype):
    w = _rows(64, 48, dtype, seed=3)
    with aten_overrides("CPU"):
        assert rows_batch_invariant(lambda x: torch.bmm(x.unsqueeze(1), w.expand(len(x), 64, 48)).squeeze(1), 64, dtype)
        assert rows_batch_invariant(lambda x: torch.bmm(x.expand(3, *x.shape), w.expand(3, 64, 48))[1], 64, dtype)
        a, b = _rows(6, 64, torch.float32, seed=5).view(2, 3, 64), _rows(2 * 64, 48, torch.float32, seed=6)
        assert torch.allclose(torch.bmm(a, b.view(2, 64, 48)), (a.double() @ b.view(2, 64, 48).double()).float(), atol=1e-4)
        assert rows_batch_invariant(lambda x: torch.log_softmax(x, dim=-1), 300, dtype)
        assert rows_batch_invariant(lambda x: torch.log_softmax(x.t(), dim=0).t(), 300, dtype)
        assert rows_batch_invariant(lambda x: x.mean(dim=-1, keepdim=True), 300, dtype)
        x = _rows(6, 300, torch.float32, seed=4)
        assert torch.allclose(torch.log_softmax(x, -1), torch.log_softmax(x.double(), -1).float(), atol=1e-5)
        assert torch.allclose(x.mean(dim=(0, 1)), x.double().mean().float(), atol=1e-6)


def _order_dependent_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Split-K whose split count grows with the row count (what a shape-picked BLAS kernel does)."""
    splits = min(len(a), 8)
    chunks = torch.arange(a.shape[1]).chunk(splits)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype)
    for idx in chunks:
        out = out + STOCK["mm"](a[:, idx], b[idx])  # rounded to a.dtype after every chunk
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_negative_control_order_dependent_mm_fails_the_check(dtype):
    w = _rows(256, 128, dtype, seed=7)
    with aten_overrides("CPU", {"mm": _order_dependent_mm}):
        assert not rows_batch_invariant(lambda x: torch.mm(x, w), 256, dtype)


def _sentinel_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.full((a.shape[0], b.shape[1]), 7.0, dtype=a.dtype)


def test_stock_op_is_back_after_exit_even_on_exception():
    a, b = _rows(4, 32, torch.float32, seed=1), _rows(32, 16, torch.float32, seed=2)
    stock = STOCK["mm"](a, b)
    with aten_overrides("CPU", {"mm": _sentinel_mm}):
        assert torch.equal(torch.mm(a, b), torch.full_like(stock, 7.0))  # really registered
    assert torch.equal(torch.mm(a, b), stock)
    with pytest.raises(KeyError):
        with aten_overrides("CPU", {"mm": _sentinel_mm}):
            raise KeyError("boom")
    assert torch.equal(torch.mm(a, b), stock)
    assert torch.equal(torch.log_softmax(a, -1), STOCK["_log_softmax"](a, -1, False))


def test_contexts_stack_and_unwind_in_order():
    a, b = _rows(4, 32, torch.float32, seed=1), _rows(32, 16, torch.float32, seed=2)
    with aten_overrides("CPU"):
        with aten_overrides("CPU", {"mm": _sentinel_mm}):
            assert torch.equal(torch.mm(a, b), torch.full((4, 16), 7.0))
        assert torch.equal(torch.mm(a, b), linear(a, b.t()))  # the outer registration is back


def test_other_dispatch_keys_and_dtypes_are_untouched():
    a, b = torch.arange(12).view(3, 4), torch.arange(8).view(4, 2)
    with aten_overrides("CPU", {"mm": _sentinel_mm}):
        with aten_overrides("Meta", {"bmm": _sentinel_mm}):
            pass
    with aten_overrides("CPU"):
        assert torch.equal(torch.mm(a, b), STOCK["mm"](a, b))  # integers: the stock kernel
    with pytest.raises(ValueError, match="no override"):
        with aten_overrides("CPU", {"matmul": _sentinel_mm}):
            pass
