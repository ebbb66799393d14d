"""Batch-invariant linear layer: ``y = x @ W.T + b``.

Why stock GEMMs are not batch-invariant: a BLAS picks its kernel, blocking and
threading from the problem shape. On the CPUs we measured, fp32 ``torch.mm``
gives a row different bits at M = 1 than at M >= 2 (a GEMV path for one row);
oneDNN and cuBLAS pick kernels by shape too. A token's projection then depends
on how many other tokens share the call: prefill vs decode, batch 1 vs 8.

Design: **one GEMM shape per call site, whatever M and N are.**

* Rows (M): ``x`` is cut into tiles of exactly :data:`M_TILE` rows (the last
  one zero-padded) in a fresh contiguous buffer, so tiles also start at fixed
  alignments. A decode step of a few rows pads to 16, not to a prefill-sized
  tile. Prefill would then stream the weight once per 16 rows; so where
  :data:`WIDE_TILE` rows in one GEMM give every row **bitwise** the result of
  16-row GEMMs (checked on this device, for this weight shape, thread count and
  dtype, inside ``kernel_caches()``, on rows that expose any change of the
  reduction order even through a bf16 rounding: a property of the BLAS, never
  assumed; oneDNN's bf16 GEMMs on AMX CPUs fail it for K >= 512),
  whole wide tiles go in one call. The result is the 16-row tiles' either way.
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

M_TILE = 16
"""Rows per GEMM: what a row's bits are defined by (a decode step pads to this many rows)."""
WIDE_TILE = 64
"""Rows per GEMM where the BLAS gives each of them the bits of M_TILE-row GEMMs (checked per shape)."""
W_GRAD_TILE = 256
"""Rows per weight-gradient GEMM in the backward (tile results added in one fixed order)."""
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


def _row_tiles(x2: torch.Tensor, dtype: torch.dtype, tile: int) -> torch.Tensor:
    """``x2`` ``[M, K]`` copied into a fresh zero buffer of whole ``tile``-row tiles, in ``dtype``."""
    rows = torch.zeros(-(-x2.shape[0] // tile) * tile, x2.shape[1], dtype=dtype, device=x2.device)
    rows[: x2.shape[0]] = x2
    return rows


def tile_gemm(w: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``gemm(rows, out)``: ``rows [R, K] @ w.T`` into ``out`` (``[R, N]`` or ``[n_tiles, R, N_TILE]``)."""
    n, k = w.shape
    if n > N_TILED_MAX:
        return lambda rows, out: torch.mm(rows, w.t(), out=out)
    n_tiles = n // N_TILE
    w_tiles = w.view(n_tiles, N_TILE, k).transpose(1, 2)  # [Bn, K, N_TILE]
    return lambda rows, out: torch.bmm(rows.expand(n_tiles, *rows.shape), w_tiles, out=out)


def _probe_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [WIDE_TILE, K], weight [N, K])`` on which a change of the GEMM's reduction order shows in its output.

    A low-precision GEMM rounds its fp32 accumulator once (bf16: 8 significant bits), so on random rows two
    kernels that add the K products in different orders give different bf16 bits in only a few of the
    outputs (measured: 0 to 5 of 16384 for K = 512..1024 on an AMX CPU, whose oneDNN picks another kernel
    for 64 rows than for 16): a random-rows check passes by luck. So the even rows cancel exactly: the probe
    weight repeats its columns ``P`` at columns ``Q`` (a fixed random split of K), the row holds ``a`` on
    ``P`` and ``-a`` on ``Q``; every exact dot product is 0 and the output is the accumulator's rounding
    error alone, a fingerprint of the order the kernel adds the products in, kept to 8 bits by the
    rounding. The odd rows are random (a kernel may differ in other ways, e.g. its final rounding).
    """
    n, k = w.shape
    gen = torch.Generator(device=w.device).manual_seed(0)
    perm = torch.randperm(k, generator=gen, device=w.device)
    half = k // 2
    p, q = perm[:half], perm[half : 2 * half]
    b = torch.randn(n, half, generator=gen, device=w.device).to(w.dtype)
    weight = torch.zeros(n, k, dtype=w.dtype, device=w.device)
    weight[:, p] = b
    weight[:, q] = b
    rows = torch.randn(WIDE_TILE, k, generator=gen, device=w.device).to(w.dtype)
    a = rows[0::2, p].clone()
    rows[0::2] = 0
    rows[0::2, p] = a
    rows[0::2, q] = -a
    return rows, weight


def wide_tiles_agree(
    w: torch.Tensor, make_gemm: Callable[[torch.Tensor], Callable[[torch.Tensor, torch.Tensor], None]] = tile_gemm
) -> bool:
    """Whether one WIDE_TILE-row GEMM gives every row the bits of M_TILE-row GEMMs, for weights shaped as ``w``.

    A property of the BLAS (its kernel choice and reduction order per shape), checked once per
    (shape, dtype, device, threads) inside ``kernel_caches()`` on the rows and probe weight of
    :func:`_probe_rows` (``make_gemm(weight)`` is the GEMM under test); outside one the narrow tiles
    are used and nothing is checked.
    """
    caches = active()
    if caches is None:
        return False
    key = (tuple(w.shape), w.dtype, str(w.device), torch.get_num_threads())
    agree = caches.wide_tiles.get(key)
    if agree is None:
        rows, probe = _probe_rows(w)
        gemm = make_gemm(probe)
        tiled = w.shape[0] <= N_TILED_MAX

        def run(r: torch.Tensor) -> torch.Tensor:
            out = torch.empty((w.shape[0] // N_TILE, len(r), N_TILE) if tiled else (len(r), w.shape[0]),
                              dtype=w.dtype, device=w.device)  # fmt: skip
            gemm(r, out)
            return out

        narrow = [run(rows[start : start + M_TILE]) for start in range(0, WIDE_TILE, M_TILE)]
        agree = caches.wide_tiles[key] = torch.equal(run(rows), torch.cat(narrow, dim=1 if tiled else 0))
    return agree


def _tiled_mm(x2: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[M, K] @ weight.T`` from fixed-shape GEMMs; returns ``[M, N]`` in ``dtype``."""
    m, k = x2.shape
    n = weight.shape[0]
    rows = _row_tiles(x2, dtype, M_TILE)
    w = _prepare(weight, dtype)
    gemm = tile_gemm(w)
    total = rows.shape[0]
    wide_end = total - total % WIDE_TILE if total >= WIDE_TILE and wide_tiles_agree(w) else 0
    starts = [(s, WIDE_TILE) for s in range(0, wide_end, WIDE_TILE)] + [(s, M_TILE) for s in range(wide_end, total, M_TILE)]
    if n > N_TILED_MAX:
        out = torch.empty(total, n, dtype=dtype, device=x2.device)
        for start, size in starts:
            gemm(rows[start : start + size], out[start : start + size])
        return out[:m]
    n_tiles = w.shape[0] // N_TILE
    parts = []
    for start, size in starts:
        parts.append(torch.empty(n_tiles, size, N_TILE, dtype=dtype, device=x2.device))
        gemm(rows[start : start + size], parts[-1])
    return torch.cat(parts, dim=1).transpose(0, 1).reshape(total, n_tiles * N_TILE)[:m, :n]


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

    Rows are cut into zero-padded W_GRAD_TILE tiles; each tile is one
    ``[N, W_GRAD_TILE] @ [W_GRAD_TILE, K+1]`` GEMM (the ones column gives the bias gradient in
    the same GEMM), and the tile results are added left to right. The order
    depends only on the number of tiles; zero rows (padding) add exact zeros.
    """
    acc = torch.float64 if dy2.dtype == torch.float64 else torch.float32
    dy = _row_tiles(dy2, acc, W_GRAD_TILE)
    xs = _row_tiles(torch.cat([x2.to(acc), x2.new_ones(x2.shape[0], 1, dtype=acc)], dim=1), acc, W_GRAD_TILE)
    total = torch.zeros(dy.shape[1], xs.shape[1], dtype=acc, device=dy.device)
    for start in range(0, dy.shape[0], W_GRAD_TILE):
        total.add_(torch.mm(dy[start : start + W_GRAD_TILE].t(), xs[start : start + W_GRAD_TILE]))
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
