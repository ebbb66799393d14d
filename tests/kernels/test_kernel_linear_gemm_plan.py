"""linear's GEMM plan: inside kernel_caches() rows go through the largest GEMMs (256 and 64 rows, one ``mm``
over all columns) that were checked to give every row the bits of the M_TILE-row tile GEMMs; the result is
bitwise the narrow tiles' for every M, and the check refuses GEMMs that differ."""

from __future__ import annotations

import pytest
import torch
from logdiff.kernels import M_TILE, N_TILE, N_TILED_MAX, linear, weight_cache


def _order_revealing(gen: torch.Generator, m: int, k: int, n: int, dtype: torch.dtype):
    """Rows whose even outputs are pure fp32 rounding error (``a`` and ``-a`` on repeated weight columns), so a
    change of the reduction order shows through a bf16 rounding; odd rows random."""
    half = k // 2
    b = torch.randn(n, half, generator=gen)
    w = torch.cat([b, b], dim=1).to(dtype)
    x = torch.randn(m, k, generator=gen)
    x[0::2, half:] = -x[0::2, :half]
    return x.to(dtype), w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [3 * N_TILE, N_TILED_MAX + N_TILE])  # column-tiled, and one GEMM per row tile
def test_every_m_gives_the_narrow_tiles_bits(dtype, n):
    from logdiff.kernels import matmul

    x, w = _order_revealing(torch.Generator().manual_seed(5), 2 * 256 + 37, 512, n, dtype)
    narrow = linear(x, w)  # outside kernel_caches(): M_TILE-row tile GEMMs only, nothing checked
    with weight_cache():
        plan = matmul._gemm_plan(matmul._prepare(w, matmul._gemm_dtype(dtype, "cpu")))
        for m in (1, M_TILE + 1, 64, 255, 256, 300, len(x)):
            assert torch.equal(linear(x[:m], w), narrow[:m]), f"M={m}, plan {plan}"
    assert plan[-1][0] == M_TILE and [size for size, _ in plan] == sorted((size for size, _ in plan), reverse=True)


def test_outside_a_block_only_the_tile_gemms_run():
    from logdiff.kernels import matmul

    assert matmul._gemm_plan(torch.zeros(N_TILE, 64)) == ((M_TILE, "tiles"),)


def test_a_strided_weight_keeps_the_tile_gemms():
    """The check runs on contiguous weights; a column slice (chunked_linear) never takes the unchecked mm form."""
    from logdiff.kernels import matmul

    w = torch.randn(N_TILE, 128)[:, :64]
    with weight_cache():
        assert all(form == "tiles" for _, form in matmul._gemm_plan(w))


def test_the_mm_form_is_refused_where_it_differs_from_the_tile_gemms():
    """Negative control: a tile GEMM that accumulates in fp64 (unlike the fp32 mm) makes the mm form fail the
    check, at every size; the control's control: tile GEMMs that run the wide mm's own shape (their rows
    zero-padded to ``size``), so the row count cannot matter, pass."""
    from logdiff.kernels import matmul

    w = torch.zeros(N_TILE, 256)

    def fp64_tiles(wp: torch.Tensor):
        return lambda rows, out: out.copy_((rows.double() @ wp.double().t()).float().view(len(rows), 1, N_TILE).transpose(0, 1))

    def mm_tiles(size: int):
        def make(wp: torch.Tensor):
            def gemm(rows: torch.Tensor, out: torch.Tensor) -> None:
                padded = torch.zeros(size, rows.shape[1])
                padded[: len(rows)] = rows
                full = torch.empty(size, wp.shape[0])
                torch.mm(padded, wp.t(), out=full)
                out.copy_(full[: len(rows)].view(len(rows), 1, N_TILE).transpose(0, 1))

            return gemm

        return make

    for size in (64, 256):
        assert not matmul._agree(w, size, fp64_tiles, "mm")
        assert matmul._agree(w, size, mm_tiles(size), "mm")
