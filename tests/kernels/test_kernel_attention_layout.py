"""attention's layout cache: inside kernel_caches() the last layout (tiles, groups, masks) is reused for fresh
position tensors with the same values (vLLM builds them per layer), never for other values."""

from __future__ import annotations

import torch
from logdiff.kernels import attention_batched, kernel_caches


def _qkv(gen: torch.Generator, b: int = 3, t: int = 5, s: int = 40):
    q = torch.randn(b, t, 4, 32, generator=gen)
    k = torch.randn(b, s, 2, 32, generator=gen)
    v = torch.randn(b, s, 2, 32, generator=gen)
    return q, k, v


def _positions(lens: list[int], t: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.stack([torch.arange(n - t, n) for n in lens])
    return pos, torch.tensor(lens)


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Attention with freshly built position and length tensors (as vLLM's attention builds them per layer)."""
    pos, kv_lens = _positions(lens, q.shape[1])
    return attention_batched(q, k, v, pos, 0.2, kv_lens)


def test_fresh_tensors_with_the_same_values_reuse_the_layout():
    q, k, v = _qkv(torch.Generator().manual_seed(0))
    alone = _run(q, k, v, [40, 33, 21])
    with kernel_caches() as caches:
        first = _run(q, k, v, [40, 33, 21])
        layout = caches.attention_layout[1]
        again = _run(q, k, v, [40, 33, 21])  # new tensors, same values
        assert caches.attention_layout[1] is layout
    assert torch.equal(first, alone) and torch.equal(again, alone)


def test_other_values_get_their_own_layout():
    """Negative control: positions one step later (a decode step's) must not reuse the previous masks."""
    q, k, v = _qkv(torch.Generator().manual_seed(1))
    later = _run(q, k, v, [39, 32, 20])
    with kernel_caches() as caches:
        earlier = _run(q, k, v, [40, 33, 21])
        layout = caches.attention_layout[1]
        got = _run(q, k, v, [39, 32, 20])
        assert caches.attention_layout[1] is not layout
    assert torch.equal(got, later) and not torch.equal(got, earlier)


def test_a_tensor_changed_in_place_is_not_matched_to_its_old_values():
    q, k, v = _qkv(torch.Generator().manual_seed(2))
    pos, lens = _positions([40, 33, 21], 5)
    with kernel_caches():
        attention_batched(q, k, v, pos, 0.2, lens)
        pos -= 1
        lens -= 1
        got = attention_batched(q, k, v, pos.clone(), 0.2, lens.clone())
    assert torch.equal(got, attention_batched(q, k, v, pos, 0.2, lens))


def test_an_inference_buffer_refilled_in_place_is_not_matched_to_its_old_values():
    """An inference tensor has no version counter: the same persistent buffer, refilled in place inside
    inference_mode between forwards (as a graph-captured engine's are), must be judged by its values."""
    q, k, v = _qkv(torch.Generator().manual_seed(3))
    with torch.inference_mode():
        pos, lens = _positions([40, 33, 21], 5)
        with kernel_caches() as caches:
            attention_batched(q, k, v, pos, 0.2, lens)
            layout = caches.attention_layout[1]
            attention_batched(q, k, v, pos, 0.2, lens)  # the same values: the layout is reused
            assert caches.attention_layout[1] is layout
            pos -= 1
            lens -= 1
            got = attention_batched(q, k, v, pos, 0.2, lens)
            assert caches.attention_layout[1] is not layout
        want = attention_batched(q, k, v, pos.clone(), 0.2, lens.clone())
    assert torch.equal(got, want)
