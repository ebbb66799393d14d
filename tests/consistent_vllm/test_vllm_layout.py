"""Layout discovery: known permutations are found, non-permutations are refused, and the
paged-KV reader reads back exactly what vLLM's own CPU write op stored (no engine needed)."""

from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from logdiff.sources.vllm.layout import discover_permutation, inverse_gather_index


def test_discovers_a_padded_transpose() -> None:
    def transform(src: torch.Tensor) -> torch.Tensor:  # [3, 5] -> transposed, one zero row of padding
        out = torch.zeros(6, 3, dtype=src.dtype)
        out[:5] = src.t()
        return out

    source_of = discover_permutation(transform, (3, 5), torch.bfloat16)
    expected = torch.full((6, 3), -1, dtype=torch.int64)
    expected[:5] = torch.arange(15).reshape(3, 5).t()
    assert torch.equal(source_of, expected)
    data = torch.randn(3, 5).to(torch.bfloat16)
    gather = inverse_gather_index(source_of, 15)
    assert torch.equal(transform(data).reshape(-1)[gather].reshape(3, 5), data)


def test_needs_several_digits_for_large_sources() -> None:
    n = 70_000  # > 256 ** 2: three base-256 passes
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    source_of = discover_permutation(lambda src: src.reshape(-1)[perm], (n,), torch.bfloat16)
    assert torch.equal(source_of, perm)


@pytest.mark.parametrize(
    "transform",
    [
        lambda src: torch.cat([src, src[:1]]),  # an element written twice
        lambda src: src[1:],  # an element dropped
        lambda src: src * 2,  # arithmetic, not data movement
    ],
)
def test_refuses_what_is_not_a_permutation(transform: object) -> None:
    with pytest.raises(RuntimeError, match="layout discovery"):
        discover_permutation(transform, (300,), torch.bfloat16)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_paged_kv_reader_reads_back_what_the_cpu_backend_wrote() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa

    from logdiff.sources.vllm.kv_cache import PagedKVReader

    blocks, heads, block_size, head = 6, 2, 32, 64
    impl = SimpleNamespace(attn_type="decoder", kv_cache_dtype="auto")
    impl.do_kv_cache_update = functools.partial(CPUAttentionBackendImpl.do_kv_cache_update, impl)
    layer = SimpleNamespace(
        isa=_get_attn_isa(torch.bfloat16, block_size, head), _k_scale_float=1.0, _v_scale_float=1.0
    )
    cache = torch.full((blocks, heads, block_size, 2 * head), float("nan"), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    seq_len, row = 70, torch.tensor([4, 1, 3])
    k = torch.randn(seq_len, heads, head, generator=gen).to(torch.bfloat16)
    v = torch.randn(seq_len, heads, head, generator=gen).to(torch.bfloat16)
    pos = torch.arange(seq_len)
    slots = row[pos // block_size] * block_size + pos % block_size
    impl.do_kv_cache_update(layer, k, v, cache, slots)
    k2 = torch.randn(5, heads, head, generator=gen).to(torch.bfloat16)  # a second request in block 0
    impl.do_kv_cache_update(layer, k2, -k2, cache, torch.arange(5))

    reader = PagedKVReader.discover(impl, layer, cache)
    k_read, v_read = reader.read(cache, row, seq_len)
    assert torch.equal(k_read, k) and torch.equal(v_read, v)
    strided = torch.zeros(2 * blocks, *cache.shape[1:], dtype=cache.dtype)[::2]  # not contiguous
    strided.copy_(cache)
    k_read, v_read = reader.read(strided, row, seq_len)
    assert torch.equal(k_read, k) and torch.equal(v_read, v)

    # A padded batch of both requests: exact zeros past each length, never the NaNs around them.
    table = torch.tensor([[4, 1, 3], [0, 0, 0]], dtype=torch.int32)
    k_batch, v_batch = reader.read_batch(cache, table, torch.tensor([seq_len, 5]))
    assert k_batch.shape == (2, seq_len, heads, head)
    assert torch.equal(k_batch[0], k) and torch.equal(v_batch[0], v)
    assert torch.equal(k_batch[1, :5], k2) and torch.equal(v_batch[1, :5], -k2)
    assert not k_batch[1, 5:].any() and not v_batch[1, 5:].isnan().any()

    # Why discovery is needed: reading K as a plain [block_size, head] slab gets it wrong.
    naive_k = cache[row].view(3, heads, 2, block_size, head)[:, :, 0].permute(0, 2, 1, 3).reshape(-1, heads, head)
    assert not torch.equal(naive_k[:seq_len], k)
