"""One reduction order for a row-parallel product, whatever the world size (issue 22, collective order).

``chunked_linear`` on one rank and ``row_parallel_linear`` on 2 and 4 gloo ranks must give the same
bits; the stock path (a local GEMM, then ``all_reduce``) is the control that shows the problem where
this machine's BLAS exhibits it, and summing the gathered partials in another order is the negative
control that must differ.
"""

from __future__ import annotations

import os

import pytest
import torch

from logdiff.kernels.collective import chunked_linear, k_chunk_partials
from logdiff.kernels.fixed_order import pairwise_sum

M, K, N, CHUNK = 24, 256, 48, 32


def _case(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(N, K, generator=gen) / 16).to(dtype)
    return x, w, torch.randn(N, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_linear_is_the_product_within_the_fp32_bound(dtype: torch.dtype) -> None:
    x, w, b = _case(dtype)
    exact = x.double() @ w.double().T + b.double()
    got = chunked_linear(x, w, b, chunk=CHUNK).double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((got - exact).abs().max() / exact.abs().max()) <= tol


def test_any_split_of_the_chunks_sums_to_the_same_bits() -> None:
    """The collective's arithmetic without a process group: each 'rank' computes its slice's partials."""
    x, w, b = _case()
    whole = chunked_linear(x, w, b, chunk=CHUNK)
    for world in (2, 4, 8):
        step = K // world
        parts = [k_chunk_partials(x[:, r * step:(r + 1) * step], w[:, r * step:(r + 1) * step], CHUNK)
                 for r in range(world)]  # fmt: skip
        assert torch.equal((pairwise_sum(torch.cat(parts), 0) + b).to(x.dtype), whole), world
    # negative control: the ranks' partials in another order (rotated by one: a reversal of a pairwise tree
    # only swaps the operands of each addition, which IEEE addition does not notice)
    reordered = pairwise_sum(torch.cat(parts[1:] + parts[:1]), 0) + b
    assert not torch.equal(reordered, whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 4])
def test_column_parallel_slices_are_the_whole_products_columns_bitwise(dtype: torch.dtype, world: int) -> None:
    """A column-parallel rank's ``linear`` on its rows of the weight: the unsharded product's columns, bitwise,
    also where a slice is narrower than a column tile (N / world = 64, 32 here: padded into a tile at other
    positions than in the whole weight's), with a bias. What consistent TP's column-parallel GEMMs rely on."""
    from logdiff.kernels import linear

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, K, generator=gen).to(dtype)
    for n in (128, 384):  # a slice narrower than N_TILE, and one of whole tiles (at 2 ranks)
        w = (torch.randn(n, K, generator=gen) / 16).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype)
        whole, step = linear(x, w, b), n // world
        for r in range(world):
            cols = slice(r * step, (r + 1) * step)
            assert torch.equal(linear(x, w[cols], b[cols]), whole[:, cols]), (n, r)


def test_a_slice_that_is_not_whole_chunks_is_refused() -> None:
    x, w, _ = _case()
    with pytest.raises(ValueError, match="not a whole number of chunks"):
        k_chunk_partials(x[:, :40], w[:, :40], CHUNK)


def _rank(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from logdiff.kernels.collective import row_parallel_linear

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        x, w, b = _case()
        step = K // world
        xs, ws = x[:, rank * step:(rank + 1) * step], w[:, rank * step:(rank + 1) * step]
        fixed = row_parallel_linear(xs, ws, b, chunk=CHUNK)
        stock = xs @ ws.T
        dist.all_reduce(stock)
        torch.save({"fixed": fixed, "stock": stock + b}, f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4])
def gloo_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each rank's fixed-order and stock row-parallel products, from ``world`` gloo processes."""
    import torch.multiprocessing as mp

    world, tmp = request.param, tmp_path_factory.mktemp("gloo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_rank, args=(world, str(tmp / "store"), str(tmp / "out")), nprocs=world, join=True,
                       start_method="spawn")  # fmt: skip
    return [torch.load(tmp / f"out-{r}.pt") for r in range(world)]


def test_row_parallel_on_gloo_ranks_equals_one_rank_bitwise(gloo_results: list[dict]) -> None:
    x, w, b = _case()
    one_rank = chunked_linear(x, w, b, chunk=CHUNK)
    for r, got in enumerate(gloo_results):
        assert torch.equal(got["fixed"], one_rank), f"rank {r}"


def test_control_stock_row_parallel_differs_from_one_rank(gloo_results: list[dict]) -> None:
    """What the fixed order repairs: a local GEMM then all_reduce, against one rank's GEMM (where this BLAS shows it)."""
    x, w, b = _case()
    if all(torch.equal(got["stock"], x @ w.T + b) for got in gloo_results):
        pytest.skip("this machine's stock row-parallel product equals one rank's bitwise: nothing to repair here")
    assert not torch.equal(gloo_results[0]["stock"], x @ w.T + b)
