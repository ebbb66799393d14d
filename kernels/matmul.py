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
  The same check decides the GEMM plan (:func:`_gemm_plan`): 256-row tiles, and one
  ``mm`` over all columns instead of the column-tile ``bmm``, each used only where
  its GEMM gives every row the bits of the 16-row tile GEMMs; the verdict is a
  property of the process's BLAS, memoised per process (:func:`_blas_plan`).
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
    if t.is_inference():  # no version counter (and cannot be updated in place); asked first: a raised error costs ~70 us
        return -1
    return t._version


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
    m = x2.shape[0]
    rows = torch.empty(-(-m // tile) * tile, x2.shape[1], dtype=dtype, device=x2.device)
    rows[:m] = x2
    rows[m:] = 0  # only the padding rows are zeroed: the rows above are written once
    return rows


def tile_gemm(w: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``gemm(rows, out)``: ``rows [R, K] @ w.T`` into ``out`` (``[R, N]`` or ``[n_tiles, R, N_TILE]``)."""
    n, k = w.shape
    if n > N_TILED_MAX:
        return lambda rows, out: torch.mm(rows, w.t(), out=out)
    n_tiles = n // N_TILE
    w_tiles = w.view(n_tiles, N_TILE, k).transpose(1, 2)  # [Bn, K, N_TILE]
    return lambda rows, out: torch.bmm(rows.expand(n_tiles, *rows.shape), w_tiles, out=out)


def _probe_rows(w: torch.Tensor, count: int = WIDE_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [count, K], weight [N, K])`` on which a change of the GEMM's reduction order shows in its output.

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
    rows = torch.randn(count, k, generator=gen, device=w.device).to(w.dtype)
    a = rows[0::2, p].clone()
    rows[0::2] = 0
    rows[0::2, p] = a
    rows[0::2, q] = -a
    return rows, weight


def _gemm_out(rows: int, w: torch.Tensor) -> torch.Tensor:
    """An output buffer of :func:`tile_gemm` for ``rows`` rows."""
    tiled = w.shape[0] <= N_TILED_MAX
    shape = (w.shape[0] // N_TILE, rows, N_TILE) if tiled else (rows, w.shape[0])
    return torch.empty(shape, dtype=w.dtype, device=w.device)


def _agree(
    w: torch.Tensor, size: int, make_gemm: Callable[[torch.Tensor], Callable[[torch.Tensor, torch.Tensor], None]], form: str
) -> bool:
    """Whether ``size`` rows in one GEMM of ``form`` (``"tiles"``: :func:`tile_gemm`'s own; ``"mm"``: one ``mm``
    over all of ``w``'s columns) give every row the bits of ``make_gemm``'s M_TILE-row GEMMs, on the rows of
    :func:`_probe_rows`."""
    rows, probe = _probe_rows(w, size)
    gemm = make_gemm(probe)
    tiled = w.shape[0] <= N_TILED_MAX

    def run(r: torch.Tensor) -> torch.Tensor:
        out = _gemm_out(len(r), probe)
        gemm(r, out)
        return out.transpose(0, 1).reshape(len(r), -1) if tiled else out

    narrow = torch.cat([run(rows[start : start + M_TILE]) for start in range(0, size, M_TILE)])
    if form == "tiles":
        return torch.equal(run(rows), narrow)
    wide = torch.empty(size, probe.shape[0], dtype=probe.dtype, device=probe.device)
    torch.mm(rows, probe.t(), out=wide)  # the call _tiled_mm makes
    return torch.equal(wide, narrow)


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
    key = ("agree", tuple(w.shape), w.dtype, str(w.device), torch.get_num_threads())
    agree = caches.wide_tiles.get(key)
    if agree is None:
        agree = caches.wide_tiles[key] = _agree(w, WIDE_TILE, make_gemm, "tiles")
    return agree


GEMM_SIZES = (256, WIDE_TILE, M_TILE)
"""Row counts one GEMM may take, largest first: each is used only where checked to give the M_TILE bits."""


@functools.lru_cache(maxsize=1024)
def _blas_plan(shape: tuple[int, int], dtype: torch.dtype, device: str, threads: int) -> tuple[tuple[int, str], ...]:
    """The GEMMs that give a ``shape`` weight's rows exactly the bits of its M_TILE-row tiles on this BLAS.

    ``((rows, form), ...)`` largest first, ``form`` ``"mm"`` (one ``mm`` over all columns: fewer, larger
    calls, no re-layout of the output) where the check passes, else ``"tiles"`` (:func:`tile_gemm`, the
    definition for M_TILE rows); row counts that pass neither are left out. The check
    (:func:`_agree`, on order-revealing rows) is a property of the process's BLAS for a shape, dtype,
    device and thread count, like :func:`_gemm_dtype`, so it runs once per process, not once per block.
    """
    w = torch.zeros(shape, dtype=dtype, device=device)
    plan = []
    for size in GEMM_SIZES:
        if _agree(w, size, tile_gemm, "mm"):
            plan.append((size, "mm"))
        elif size == M_TILE or _agree(w, size, tile_gemm, "tiles"):
            plan.append((size, "tiles"))
    return tuple(plan)


def _gemm_plan(w: torch.Tensor) -> tuple[tuple[int, str], ...]:
    """Inside ``kernel_caches()``: :func:`_blas_plan` for ``w``; outside: M_TILE-row tiles only (nothing checked).

    The check runs on contiguous weights; a strided one (a column slice, ``collective.chunked_linear``) keeps
    the tile GEMMs, the form it was checked in before ``"mm"`` existed.
    """
    caches = active()
    if caches is None:
        return ((M_TILE, "tiles"),)
    key = (tuple(w.shape), w.dtype, str(w.device), torch.get_num_threads())
    plan = caches.wide_tiles.get(key)
    if plan is None:
        plan = caches.wide_tiles[key] = _blas_plan(*key)
    if not w.is_contiguous():
        plan = tuple(p for p in plan if p[1] == "tiles") or ((M_TILE, "tiles"),)
    return plan


def _tiled_mm(x2: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[M, K] @ weight.T`` with every row's bits those of M_TILE-row tile GEMMs; returns ``[M, N]`` in ``dtype``.

    Rows go through the largest GEMMs of :func:`_gemm_plan` that fit (rows are independent, so the
    split never changes a bit), each writing its rows of one ``[rows, N]`` output in place.
    """
    m = x2.shape[0]
    n = weight.shape[0]
    rows = _row_tiles(x2, dtype, M_TILE)
    w = _prepare(weight, dtype)
    total, width = rows.shape[0], w.shape[0]
    out = torch.empty(total, width, dtype=dtype, device=x2.device)
    gemm = None
    start = 0
    for size, form in _gemm_plan(w):
        while total - start >= size:
            if form == "mm":
                torch.mm(rows[start : start + size], w.t(), out=out[start : start + size])
            elif width > N_TILED_MAX:
                gemm = gemm or tile_gemm(w)
                gemm(rows[start : start + size], out[start : start + size])
            else:
                gemm = gemm or tile_gemm(w)
                part = _gemm_out(size, w)
                gemm(rows[start : start + size], part)
                out[start : start + size].view(size, -1, N_TILE).copy_(part.transpose(0, 1))
            start += size
    return out[:m, :n]


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
