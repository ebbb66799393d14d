"""linear: a row's bits do not depend on M; packed weights give the unpacked columns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from logdiff.isa import cpu_isa
from logdiff.kernels import KERNELS, M_TILE, N_TILE, N_TILED_MAX, linear, linear_reference, weight_cache

DTYPES = [torch.float32, torch.bfloat16]
BOUND = {k.name: k.bound for k in KERNELS}["linear"]


def _xw(gen: torch.Generator, m: int = 70, k: int = 256, n: int = 192, dtype: torch.dtype = torch.float32):
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    return x.to(dtype), w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8, M_TILE + 1])
def test_rows_do_not_depend_on_batch_size(gen, dtype, m):
    x, w = _xw(gen, dtype=dtype)
    full = linear(x, w)
    assert torch.equal(linear(x[:m], w), full[:m])
    assert torch.equal(linear(x[-m:], w), full[-m:])  # rows at other offsets in the tile


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_length_batch_equals_each_sequence_alone(gen, dtype):
    x, w = _xw(gen, m=40, dtype=dtype)
    seqs = [x[:5], x[5:22], x[22:40]]
    padded = torch.zeros(3, 18, x.shape[1], dtype=dtype)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
    batched = linear(padded, w)  # [3, 18, N], leading dims kept
    for i, s in enumerate(seqs):
        assert torch.equal(batched[i, : len(s)], linear(s, w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_weight_with_output_sizes_equals_unpacked_layers(gen, dtype):
    x, _ = _xw(gen, dtype=dtype)
    q, k, v = (torch.randn(n, 256, generator=gen).to(dtype) / 16 for n in (128, 64, 64))
    bias = torch.randn(256, generator=gen).to(dtype)
    packed = linear(x, torch.cat([q, k, v]), bias, output_sizes=(128, 64, 64))
    unpacked = torch.cat([linear(x, q, bias[:128]), linear(x, k, bias[128:192]), linear(x, v, bias[192:])], -1)
    assert torch.equal(packed, unpacked)


@pytest.mark.isa_sensitive
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,parts", [(256, (256, 128, 128)), (896, (896, 128, 128)), (896, (4864, 4864))])
def test_packed_parts_that_are_whole_n_tiles_equal_unpacked_where_the_blas_ignores_the_batch_count(
    gen, dtype, k, parts
):
    """The same tiles in one batched GEMM or in several: equal where the BLAS computes a batch entry the
    same whatever the batch count (checked first). Measured otherwise on a 16-thread Intel Xeon (fp32,
    K=896), whose BLAS splits a lone GEMM across threads: packed weights need output_sizes there."""
    assert all(n % N_TILE == 0 for n in parts)
    x = torch.randn(37, k, generator=gen).to(dtype)
    ws = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for n in parts]
    rows = torch.randn(M_TILE, k, generator=gen).to(dtype)
    tiles = torch.randn(sum(parts) // N_TILE, k, N_TILE, generator=gen).to(dtype)
    batched, alone = torch.bmm(rows.expand(len(tiles), M_TILE, k), tiles), torch.bmm(rows[None], tiles[-1:])
    if not torch.equal(batched[-1], alone[0]):
        pytest.skip(f"this CPU's batched GEMM ({cpu_isa()}, {torch.get_num_threads()} threads) depends on the batch count")
    assert torch.equal(linear(x, torch.cat(ws)), torch.cat([linear(x, w) for w in ws], -1))


@pytest.mark.isa_sensitive
@pytest.mark.parametrize("dtype", DTYPES)
def test_parts_inside_one_n_tile_also_match_where_the_blas_computes_columns_alike(gen, dtype):
    """Parts smaller than N_TILE share a tile at different column offsets: equal wherever the
    BLAS computes each column alike (checked first: a property of the CPU's BLAS; output_sizes
    makes it certain everywhere)."""
    x = torch.randn(37, 64, generator=gen).to(dtype)
    ws = [(torch.randn(n, 64, generator=gen) / 8).to(dtype) for n in (64, 32, 32)]
    if not torch.equal(F.linear(x, torch.cat(ws)), torch.cat([F.linear(x, w) for w in ws], -1)):
        pytest.skip(f"this CPU's BLAS ({cpu_isa()}) computes a column differently at another offset")
    assert torch.equal(linear(x, torch.cat(ws)), torch.cat([linear(x, w) for w in ws], -1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_wider_than_the_tiled_limit_are_row_invariant(gen, dtype):
    x = torch.randn(70, 64, generator=gen).to(dtype)
    w = (torch.randn(N_TILED_MAX + 100, 64, generator=gen) / 8).to(dtype)
    full = linear(x, w)
    assert full.shape == (70, N_TILED_MAX + 100)
    assert torch.equal(linear(x[:1], w), full[:1]) and torch.equal(linear(x[-3:], w), full[-3:])


def test_weight_cache_gives_the_same_bits_and_follows_in_place_updates(gen):
    x, w = _xw(gen, n=100, dtype=torch.bfloat16)  # 100 columns: padded to one N tile
    plain = linear(x, w)
    with weight_cache():
        assert torch.equal(linear(x, w), plain) and torch.equal(linear(x, w), plain)
        w.mul_(2)
        assert torch.equal(linear(x, w), linear(x, w.clone()))


def test_bias_is_added_in_fp32_and_rounded_once(gen):
    x, w = _xw(gen, dtype=torch.float32)
    b = torch.randn(w.shape[0], generator=gen)
    assert torch.equal(linear(x, w, b), linear(x, w) + b)
    assert torch.equal(linear(x[:1], w, b), linear(x, w, b)[:1])


def test_error_against_fp64_is_within_the_stated_bound(gen):
    x, w = _xw(gen, k=1024)
    ref = linear_reference(x.double(), w.double())
    err = (linear(x, w).double() - ref).abs().max() / ref.abs().max()
    assert err <= BOUND


def test_bf16_output_is_one_rounding_of_an_fp32_accurate_result(gen):
    x, w = _xw(gen, dtype=torch.bfloat16)
    ref = linear_reference(x.double(), w.double())
    out = linear(x, w).double()
    # one bf16 rounding (<= 2^-8 relative) plus fp32 accumulation error
    assert ((out - ref).abs() <= ref.abs() * 2.0**-8 + 1e-4 * ref.abs().max()).all()


@pytest.mark.isa_sensitive
def test_negative_control_stock_fp32_linear_depends_on_batch_size(gen, stock_varies):
    x, w = _xw(gen)
    alone = F.linear(x[:1], w)
    in_batch = F.linear(x[:8], w)[:1]
    assert torch.equal(linear(x[:1], w), linear(x[:8], w)[:1])
    stock_varies(torch.equal(alone, in_batch), "stock fp32 F.linear is batch-invariant here")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [192, N_TILED_MAX + N_TILE])  # column-tiled, and one GEMM per row tile (lm_head)
def test_wide_row_tiles_give_the_narrow_tiles_bits(gen, dtype, n):
    """Inside kernel_caches() whole WIDE_TILE-row tiles go in one GEMM where the BLAS was checked to give
    each row the bits of M_TILE-row GEMMs; every M then equals the narrow-only result outside the block."""
    from logdiff.kernels import matmul

    x, w = _xw(gen, m=3 * matmul.WIDE_TILE + 5, k=64, n=n, dtype=dtype)
    with weight_cache() as caches:
        for m in (1, M_TILE + 1, matmul.WIDE_TILE, 2 * matmul.WIDE_TILE + 3, len(x)):
            assert torch.equal(linear(x[:m], w), full := linear(x, w)[:m]) and full.shape[0] == m
        checked = caches.wide_tiles
    assert len(checked) == 1  # one check per weight shape
    assert torch.equal(linear(x, w), linear(x, w)) and torch.equal(
        linear(x, w), _narrow_only(x, w)
    ), f"wide tiles {'used' if next(iter(checked.values())) else 'refused'} but the bits differ"


def _narrow_only(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.cat([linear(x[i : i + M_TILE], w) for i in range(0, len(x), M_TILE)])


def test_wide_tiles_are_refused_where_a_gemm_depends_on_the_row_count():
    """Negative control: a GEMM whose reduction order changes with the number of rows is caught by the check."""
    from logdiff.kernels import matmul

    w = torch.randn(N_TILE, 256, generator=torch.Generator().manual_seed(4))

    def other_kernel_when_narrow(wp: torch.Tensor):
        def gemm(rows: torch.Tensor, out: torch.Tensor) -> None:
            if len(rows) < matmul.WIDE_TILE:  # a "small-M kernel" that accumulates in another precision
                out.copy_((rows.double() @ wp.double().t()).float().unsqueeze(0))
            else:
                out.copy_((rows @ wp.t()).unsqueeze(0))

        return gemm

    with weight_cache():
        assert not matmul.wide_tiles_agree(w, other_kernel_when_narrow)
    with weight_cache():  # the control's control: each row alone, so the row count cannot matter
        assert matmul.wide_tiles_agree(
            w, lambda wp: lambda rows, out: out.copy_(torch.stack([r @ wp.t() for r in rows])[None])
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wide_tiles_are_refused_where_only_the_order_of_a_low_precision_gemm_changes(dtype):
    """Negative control: the same fp32 products added in another order for 64 rows than for 16, rounded to
    bf16/fp16. On random rows such kernels differ in a handful of outputs at most (oneDNN on AMX CPUs for
    K >= 512: the check once passed there by luck); the check's cancelling rows make it certain."""
    from logdiff.kernels import matmul

    w = torch.randn(N_TILE, 768, generator=torch.Generator().manual_seed(4)).to(dtype)

    def summed(order: str):
        def make(wp: torch.Tensor):
            def gemm(rows: torch.Tensor, out: torch.Tensor) -> None:
                products = rows.float()[:, None, :] * wp.float()[None]  # exact for bf16/fp16 operands
                if order == "reversed" and len(rows) >= matmul.WIDE_TILE:
                    products = products.flip(-1)
                out.copy_(products.sum(-1).to(dtype)[None])

            return gemm

        return make

    with weight_cache():
        assert not matmul.wide_tiles_agree(w, summed("reversed"))
    with weight_cache():  # the control's control: one order for every row count
        assert matmul.wide_tiles_agree(w, summed("same"))


@pytest.mark.parametrize("k", [256, 512, 768, 1024])
def test_rows_keep_their_bits_in_a_prefill_sized_bf16_batch_on_order_revealing_rows(k):
    """A row's bits in a 197-row batch (wide tiles, where the check allows them) are its bits alone, on rows
    whose outputs are pure fp32 rounding error (exact dot products of 0: columns repeated, ``a`` and ``-a``),
    so any change of the GEMM's reduction order with M shows through the bf16 rounding. Failed on an AMX
    CPU (oneDNN's bf16 GEMM adds in another order for 64 rows than for 16 once K >= 512) while the
    wide-tile check used random rows only."""
    gen = torch.Generator().manual_seed(11)
    half = k // 2
    b = torch.randn(192, half, generator=gen).to(torch.bfloat16)
    a = torch.randn(197, half, generator=gen).to(torch.bfloat16)
    w, x = torch.cat([b, b], 1), torch.cat([a, -a], 1)
    perm = torch.randperm(k, generator=gen)
    w, x = w[:, perm].contiguous(), x[:, perm].contiguous()
    with weight_cache():
        batch = linear(x, w)
        alone = torch.cat([linear(x[i : i + 1], w) for i in range(len(x))])
    assert batch.abs().max() > 0  # the outputs do carry the accumulation's rounding error
    assert torch.equal(batch, alone), f"{int((batch != alone).sum())} of {batch.numel()} outputs differ"


