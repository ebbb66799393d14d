"""Route aten's GEMMs and reductions through the fixed-order kernels, for one dispatch key.

``with aten_overrides("CUDA"): ...`` registers Python kernels for

=====================  =========================================================
aten op                implementation
=====================  =========================================================
``aten::mm``           :func:`kernels.linear` (``a @ b`` = ``linear(a, b.T)``)
``aten::addmm``        the same with the bias added in fp32 (``beta``/``alpha``
                       applied elementwise after the GEMM otherwise)
``aten::bmm``          one ``linear`` per batch item
``aten::_log_softmax`` :func:`kernels.log_softmax` (fixed-order ``exp``/``log``
                       and halving sum), over any ``dim``
``aten::mean.dim``     :func:`kernels.pairwise_sum` in fp32 (fp64 for fp64)
=====================  =========================================================

through ``torch.library.Library("aten", "IMPL")``, the mechanism of vLLM's
batch-invariant mode (``vllm/model_executor/determinism/batch_invariant.py``,
``VLLM_BATCH_INVARIANT=1``), and removes them on exit, exceptions included.
Every module that reaches these ops through ``F.linear``, ``torch.matmul``,
``log_softmax`` or ``mean`` (an HF model, layer by layer) then computes each
row's bits independently of the other rows in the call. The dispatcher keeps
a list of kernels per (op, key): the newest registration wins and removing it
brings back the one before, so this context stacks over vLLM's own overrides
(and over another ``aten_overrides``) and unwinds cleanly.

Only the default overloads are overridden; the ``out=`` overloads keep the
stock kernels. The fixed-order kernels call only ``out=`` GEMMs and
elementwise ops, and a call that re-enters an overridden op from inside an
override goes to the stock ``out=`` kernel (a per-context, per-thread guard),
so nothing recurses. Inputs the kernels do not cover (integer or complex
dtypes, empty tensors, mixed dtypes, fp64 log-softmax) go to the stock kernel.

The ``CPU`` key is what the tests exercise (tests/kernels/test_aten_overrides.py).
The ``CUDA`` key runs the same torch code on CUDA tensors; it **has not run on
GPU hardware yet**. Cost: padded tiles and copies; a consistency mode, not a fast path. Imports nothing of logdiff beyond ``kernels``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .fixed_order import pairwise_sum
from .logsoftmax import _log_softmax as _fixed_log_softmax
from .matmul import M_TILE, _gemm_dtype, _linear

OPS = ("mm", "addmm", "bmm", "_log_softmax", "mean.dim")
"""The aten ops overridden by default (vLLM's batch-invariant list, less ``matmul``/``linear``,
which decompose into these)."""

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _gemm_ok(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return all(
        t.dtype == first.dtype and t.dtype in _FLOATS and t.device == first.device and t.numel() > 0
        for t in tensors
    )


def _empty_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A 0-element ``out=`` buffer: ``out=`` ops resize it to the result's shape."""
    return x.new_empty(0, dtype=dtype or x.dtype)


# ----------------------------------------------------------------------------- stock (``out=``) kernels


def _stock_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b, out=_empty_like(a, torch.promote_types(a.dtype, b.dtype)))


def _stock_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    return torch.addmm(bias, a, b, beta=beta, alpha=alpha, out=_empty_like(a))


def _stock_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a, b, out=_empty_like(a))


def _stock_log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    out = _empty_like(x, torch.float32 if half_to_float else x.dtype)
    return torch.ops.aten._log_softmax.out(x, dim, half_to_float, out=out)


def _stock_mean(x: torch.Tensor, dim: Any, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.ops.aten.mean.out(x, dim, keepdim, dtype=dtype, out=_empty_like(x, dtype))


STOCK: dict[str, Callable[..., torch.Tensor]] = {
    "mm": _stock_mm,
    "addmm": _stock_addmm,
    "bmm": _stock_bmm,
    "_log_softmax": _stock_log_softmax,
    "mean.dim": _stock_mean,
}
"""The stock kernel of each op, reached through its ``out=`` overload (never overridden here)."""


# ----------------------------------------------------------------------------- fixed-order kernels


def fixed_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with every row from the fixed-shape tiles of :func:`kernels.linear`."""
    if a.dim() != 2 or not _gemm_ok(a, b):
        return _stock_mm(a, b)
    return _linear(a, b.t(), None)


def fixed_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    """``beta * bias + alpha * (a @ b)``; a row bias with unit scales is added in fp32 (``linear``'s policy)."""
    if a.dim() != 2 or not _gemm_ok(bias, a, b):
        return _stock_addmm(bias, a, b, beta=beta, alpha=alpha)
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == b.shape[1]:
        return _linear(a, b.t(), bias)
    product = _linear(a, b.t(), None).float()
    return (product * alpha + bias.float() * beta).to(a.dtype)  # elementwise: no row mixes with another


def fixed_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` per batch item, every item's rows cut into zero-padded ``M_TILE``-row tiles.

    One batched GEMM of ``[M_TILE, K] @ [K, N]`` items (the item's ``b`` repeated per
    tile): a row's bits come from a tile GEMM of one shape, whatever ``M`` is. That a
    batched GEMM computes each item alone, whatever the batch count, is a property of
    the BLAS (checked on CPU by the tests, not assumed elsewhere).
    """
    if a.dim() != 3 or not _gemm_ok(a, b):
        return _stock_bmm(a, b)
    items, m, k = a.shape
    n, tiles = b.shape[2], -(-m // M_TILE)
    dtype = _gemm_dtype(a.dtype, a.device.type)
    rows = torch.zeros(items, tiles * M_TILE, k, dtype=dtype, device=a.device)
    rows[:, :m] = a
    w = b.to(dtype).unsqueeze(1).expand(items, tiles, k, n).reshape(items * tiles, k, n)
    out = torch.empty(items * tiles, M_TILE, n, dtype=dtype, device=a.device)
    torch.bmm(rows.view(items * tiles, M_TILE, k), w, out=out)
    return out.view(items, tiles * M_TILE, n)[:, :m].to(a.dtype)


def fixed_log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """``log_softmax`` over ``dim`` from :func:`kernels.log_softmax` (fp32 inside; fp64 stays stock)."""
    if x.dtype not in _FLOATS[:3] or x.numel() == 0 or x.dim() == 0:
        return _stock_log_softmax(x, dim, half_to_float)
    out = _fixed_log_softmax(x.movedim(dim, -1))
    return out.to(torch.float32 if half_to_float else x.dtype).movedim(-1, dim).contiguous()


def fixed_mean(x: torch.Tensor, dim: Any, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``mean`` over ``dim`` as a :func:`kernels.pairwise_sum` (order fixed by the reduced length) / count."""
    out_dtype = dtype or x.dtype
    if x.dtype not in _FLOATS or out_dtype not in _FLOATS or x.dim() == 0 or x.numel() == 0:
        return _stock_mean(x, dim, keepdim, dtype=dtype)
    dims = sorted({d % x.dim() for d in dim}) if dim else list(range(x.dim()))
    acc = torch.float64 if torch.float64 in (x.dtype, out_dtype) else torch.float32
    tail = list(range(x.dim() - len(dims), x.dim()))
    rows = x.to(acc).movedim(dims, tail).flatten(start_dim=x.dim() - len(dims))
    out = (pairwise_sum(rows, -1) / rows.shape[-1]).to(out_dtype)
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


FIXED_ORDER: dict[str, Callable[..., torch.Tensor]] = {
    "mm": fixed_mm,
    "addmm": fixed_addmm,
    "bmm": fixed_bmm,
    "_log_softmax": fixed_log_softmax,
    "mean.dim": fixed_mean,
}


# ----------------------------------------------------------------------------- the context


def _guarded(impl: Callable[..., Any], stock: Callable[..., Any], state: threading.local) -> Callable[..., Any]:
    """``impl``, except that a call re-entering an overridden op from inside an override runs ``stock``."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if getattr(state, "inside", False):
            return stock(*args, **kwargs)
        state.inside = True
        try:
            return impl(*args, **kwargs)
        finally:
            state.inside = False

    return kernel


@contextlib.contextmanager
def aten_overrides(
    dispatch_key: str = "CUDA",
    implementations: Mapping[str, Callable[..., torch.Tensor]] | None = None,
) -> Iterator[list[str]]:
    """Override :data:`OPS` for ``dispatch_key`` inside the block; yields the op names overridden.

    ``implementations`` replaces some (or all) of the fixed-order kernels, by op name
    (the tests plant an order-dependent ``mm`` this way: the check must catch it).
    """
    impls = dict(FIXED_ORDER)
    if implementations:
        unknown = set(implementations) - set(OPS)
        if unknown:
            raise ValueError(f"aten_overrides: no override for {sorted(unknown)}; known: {', '.join(OPS)}")
        impls.update(implementations)
    state = threading.local()
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": the point here
            warnings.simplefilter("ignore")
            for op in OPS:
                lib.impl(op, _guarded(impls[op], STOCK[op], state), dispatch_key)
        yield list(OPS)
    finally:
        lib._destroy()
