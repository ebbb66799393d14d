"""Batch-invariant linear layer: ``y = x @ W.T + b``.

Why stock GEMMs are not batch-invariant: a BLAS picks its kernel, blocking and
threading from the problem shape. On the CPUs we measured, fp32 ``torch.mm``
gives a row different bits at M = 1 than at M >= 2 (a GEMV path for one row);
oneDNN and cuBLAS pick kernels by shape too. A token's projection then depends
on how many other tokens share the call: prefill vs decode, batch 1 vs 8.

Design: **one GEMM shape per call site, whatever M and N are.**

* Rows (M): ``x`` is cut into tiles of exactly :data:`M_TILE` rows (the last
  one zero-padded) in a fresh contiguous buffer, so tiles also start at fixed
  alignments.
* Columns (N): the weight is cut into tiles of exactly :data:`N_TILE` output
  columns (the last one zero-padded). Each row tile is multiplied by all column
  tiles in one ``bmm`` of ``[M_TILE, K] @ [K, N_TILE]`` items.

So every (row, column) value comes from a GEMM of one shape, computed from that
row and that column only (a GEMM never mixes rows or columns). This makes a
packed weight (vLLM's ``qkv_proj`` = cat(q, k, v), ``gate_up_proj`` =
cat(gate, up)) give **bitwise** the columns of the unpacked HF projections
whenever each part's N is a multiple of ``N_TILE`` (128: true of every Qwen,
Llama and Mistral config we know). ``output_sizes=(n0, n1, ...)`` computes the
parts separately, for sizes that are not. Weights wider than
:data:`N_TILED_MAX` (the lm_head; never packed) are one ``[M_TILE, K] @ [K, N]``
GEMM per row tile: still one shape per weight, and cheaper than expanding a
row tile over thousands of column tiles.

Precision policy: products exact, accumulation in fp32 inside the BLAS in the
order it uses for the tile shape, bias added in fp32, one rounding to
``x.dtype``. The GEMM dtype is ``x.dtype`` where the device has native
low-precision GEMMs (CUDA; CPUs with AVX512-BF16/AMX for bf16, AVX512-FP16 for
fp16); elsewhere bf16/fp16 operands are widened (exactly) to fp32. A bf16 GEMM
rounds its output once inside the BLAS; with a bias that result is rounded a
second time after the fp32 bias add.

:func:`weight_cache` keeps the prepared (widened and/or column-padded) copies of
weights while it is open (consistent mode opens it) instead of preparing them
on every call; weights that need neither are used in place.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence

import torch

from .caches import active, kernel_caches
from .differentiable import needs_grad

M_TILE = 64
"""Rows per GEMM. Trades decode padding (a 1-row step computes 64 rows) against
prefill cost (the weight is streamed once per 64 rows)."""
N_TILE = 128
"""Output columns per GEMM (for weights up to N_TILED_MAX columns)."""
N_TILED_MAX = 16384

@functools.cache
def _gemm_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype the GEMM runs in: native low precision where the device has it, else fp32."""
    if dtype in (torch.float32, torch.float64) or device_type == "cuda":
        return dtype
    if device_type == "cpu":
        if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return dtype
        if dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported():
            return dtype
    return torch.float32


weight_cache = fp32_weight_cache = kernel_caches
"""Former names of :func:`kernel_caches` (prepared weights are cached inside it)."""


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter (and cannot be updated in place)
        return -1


def _prepare(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype``, its rows zero-padded to a multiple of N_TILE when it is column-tiled."""
    n = weight.shape[0]
    pad = -n % N_TILE if n <= N_TILED_MAX else 0
    if weight.dtype == dtype and not pad:
        return weight
    key = (_version(weight), dtype)
    caches = active()
    if caches is not None:
        hit = caches.weights.get(id(weight))
        if hit is not None and hit[0]() is weight and hit[1] == key:
            return hit[2]
    prepared = torch.zeros(n + pad, weight.shape[1], dtype=dtype, device=weight.device)
    prepared[:n] = weight
    if caches is not None:
        caches.weights[id(weight)] = (weakref.ref(weight, _forget(caches.weights, id(weight))), key, prepared)
    return prepared


def _forget(cache: dict, weight_id: int) -> Callable[[weakref.ref], None]:
    """Weakref callback: drop a dead weight's prepared copy from the cache that held it."""

    def callback(_: weakref.ref) -> None:
        cache.pop(weight_id, None)

    return callback


def _row_tiles(x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x2`` ``[M, K]`` copied into a fresh zero buffer of whole M_TILE-row tiles, in ``dtype``."""
    rows = torch.zeros(-(-x2.shape[0] // M_TILE) * M_TILE, x2.shape[1], dtype=dtype, device=x2.device)
    rows[: x2.shape[0]] = x2
    return rows


def _tiled_mm(x2: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[M, K] @ weight.T`` from fixed-shape GEMMs; returns ``[M, N]`` in ``dtype``."""
    m, k = x2.shape
    n = weight.shape[0]
    rows = _row_tiles(x2, dtype)
    w = _prepare(weight, dtype)
    if n > N_TILED_MAX:
        out = torch.empty(rows.shape[0], n, dtype=dtype, device=x2.device)
        for start in range(0, rows.shape[0], M_TILE):
            torch.mm(rows[start : start + M_TILE], w.t(), out=out[start : start + M_TILE])
        return out[:m]
    m_tiles, n_tiles = rows.shape[0] // M_TILE, w.shape[0] // N_TILE
    w_tiles = w.view(n_tiles, N_TILE, k).transpose(1, 2)  # [Bn, K, N_TILE]
    out = torch.empty(m_tiles, n_tiles, M_TILE, N_TILE, dtype=dtype, device=x2.device)
    for i in range(m_tiles):
        torch.bmm(rows[i * M_TILE : (i + 1) * M_TILE].expand(n_tiles, M_TILE, k), w_tiles, out=out[i])
    return out.transpose(1, 2).reshape(rows.shape[0], n_tiles * N_TILE)[:m, :n]


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    output_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Batch-invariant ``x @ weight.T + bias``: x ``[..., K]``, weight ``[N, K]`` -> ``[..., N]``.

    ``output_sizes`` splits a packed weight into parts computed by separate
    GEMMs (bitwise the columns of the unpacked layers).
    """
    if output_sizes is not None:
        if sum(output_sizes) != weight.shape[0]:
            raise ValueError(f"output_sizes {tuple(output_sizes)} do not add up to N={weight.shape[0]}")
        weights = weight.split(list(output_sizes))
        biases = bias.split(list(output_sizes)) if bias is not None else [None] * len(weights)
        return torch.cat([linear(x, w, b) for w, b in zip(weights, biases, strict=True)], dim=-1)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear: x has K={x.shape[-1]} but weight is {tuple(weight.shape)}")
    if needs_grad(x, weight, bias):
        return _Linear.apply(x, weight, bias)
    return _linear(x, weight, bias)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    dtype = _gemm_dtype(x.dtype, x.device.type)
    out = _tiled_mm(x.reshape(-1, k), weight, dtype)
    if bias is not None:
        out = out.float() + bias.float()
    return out.to(x.dtype).reshape(*lead, weight.shape[0])


def _weight_grad(dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``[sum_m dy[m]^T x[m] | sum_m dy[m]]`` (``[N, K+1]``) in fp32 (fp64 for fp64), one fixed order.

    Rows are cut into the forward's zero-padded M_TILE tiles; each tile is one
    ``[N, M_TILE] @ [M_TILE, K+1]`` GEMM (the ones column gives the bias gradient in
    the same GEMM), and the tile results are added left to right. The order
    depends only on the number of tiles; zero rows (padding) add exact zeros.
    """
    acc = torch.float64 if dy2.dtype == torch.float64 else torch.float32
    dy = _row_tiles(dy2, acc)
    xs = _row_tiles(torch.cat([x2.to(acc), x2.new_ones(x2.shape[0], 1, dtype=acc)], dim=1), acc)
    total = torch.zeros(dy.shape[1], xs.shape[1], dtype=acc, device=dy.device)
    for start in range(0, dy.shape[0], M_TILE):
        total.add_(torch.mm(dy[start : start + M_TILE].t(), xs[start : start + M_TILE]))
    return total


class _Linear(torch.autograd.Function):
    """``linear`` with a fixed-tile backward: dx row-invariant, dW/db in one fixed order over row tiles."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, weight.shape[0])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dtype = _gemm_dtype(x.dtype, x.device.type)
            dx = _tiled_mm(dy2, weight.t().contiguous(), dtype).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grads = _weight_grad(dy2, x.reshape(-1, x.shape[-1]))
            dw = grads[:, :-1].to(weight.dtype)
            db = None if ctx.bias_dtype is None else grads[:, -1].to(ctx.bias_dtype)
        return dx, dw, db


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain ``F.linear`` in fp32 (fp64 for fp64 input), rounded once to ``x.dtype``."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.nn.functional.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    return y.to(x.dtype)
