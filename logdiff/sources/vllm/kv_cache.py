"""Read requests' keys and values (or MLA's latents) back out of vLLM's paged KV cache.

vLLM writes K and V into the paged cache (``impl.do_kv_cache_update``) before it
calls the attention implementation, so a replacement ``impl.forward`` finds the
whole context, old and new tokens, in the cache. The cache tensor is
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, but the CPU backend
stores each (block, kv-head) slab in its own private order (K transposed, and
ISA-dependent). ``PagedKVReader.discover`` therefore runs the backend's own
write method on a two-block scratch cache filled from a known pattern
(``layout.discover_permutation``), checks that the layout repeats block
by block, and keeps, for one block, the flat in-block position of every
(slot, head, dim) element of K and of V. Reading all requests of a step is
then one gather over the flat cache, at exactly the positions they need.

MLA layers (DeepSeek) cache one latent row per token instead;
``LatentCacheReader`` learns and reads that layout the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from logdiff.sources.vllm.layout import discover_permutation, inverse_gather_index

_READERS: dict[tuple[Any, ...], PagedKVReader] = {}


@dataclass(frozen=True)
class PagedKVReader:
    """Gathers K and V ``[seq_len, num_kv_heads, head_size]`` of requests from the paged cache."""

    block_size: int
    num_kv_heads: int
    head_size: int
    k_index: Any  # int64 [block_size * num_kv_heads * head_size], by (slot, head, dim): in-block flat position
    v_index: Any
    kv_index: Any  # k_index then v_index, for one gather of both

    def read(self, kv_cache: Any, block_row: Any, seq_len: int) -> tuple[Any, Any]:
        """K and V ``[seq_len, num_kv_heads, head_size]`` of the request whose block table row is given."""
        import torch

        k, v = self.read_batch(kv_cache, block_row[None], torch.tensor([seq_len]))
        return k[0], v[0]

    def read_batch(self, kv_cache: Any, block_rows: Any, seq_lens: Any) -> tuple[Any, Any]:
        """Zero-padded K and V ``[B, max(seq_lens), num_kv_heads, head_size]`` for B requests.

        ``block_rows`` is ``[B, >= blocks needed]`` (block table rows), ``seq_lens`` ``[B]``.
        One gather reads K and V of every request; positions past a request's
        length are exact zeros, whatever the cache holds there.
        """
        import torch

        longest = int(seq_lens.max())
        pos = torch.arange(longest)
        blocks = block_rows[:, : -(-longest // self.block_size)].long().clamp(0, kv_cache.shape[0] - 1)
        slot_blocks = blocks[:, pos // self.block_size]  # [B, longest]
        in_block = self.kv_index.view(2, self.block_size, -1)[:, pos % self.block_size].transpose(0, 1)  # [S, 2, H*D]
        if kv_cache.is_contiguous():
            index = slot_blocks[..., None, None] * kv_cache[0].numel() + in_block  # [B, S, 2, H*D]
            both = kv_cache.view(-1)[index]
        else:
            both = kv_cache.flatten(1)[slot_blocks[..., None, None], in_block]
        both = both.view(blocks.shape[0], longest, 2, self.num_kv_heads, self.head_size)
        valid = (pos < seq_lens.long()[:, None])[..., None, None]
        return torch.where(valid, both[:, :, 0], 0), torch.where(valid, both[:, :, 1], 0)

    @classmethod
    def discover(cls, impl: Any, layer: Any, kv_cache: Any) -> PagedKVReader:
        """Learn the cache layout of ``impl`` (a CPU attention impl) from its own write method."""
        import torch

        _, num_kv_heads, block_size, last = kv_cache.shape
        key = (type(impl), getattr(layer, "isa", None), tuple(kv_cache.shape[1:]), kv_cache.dtype, impl.kv_cache_dtype)
        if key in _READERS:
            return _READERS[key]
        if last % 2:
            raise NotImplementedError(f"KV cache last dim {last} is not 2 * head_size")
        head_size = last // 2
        tokens = 2 * block_size  # two blocks, to check that the layout repeats per block
        slots = torch.arange(tokens, dtype=torch.int64)
        source_shape = (tokens, num_kv_heads, head_size)

        def writer(which: str) -> Any:
            def transform(src: Any) -> Any:
                cache = torch.zeros((2, num_kv_heads, block_size, last), dtype=kv_cache.dtype)
                zeros = torch.zeros_like(src)
                k, v = (src, zeros) if which == "k" else (zeros, src)
                impl.do_kv_cache_update(layer, k, v, cache, slots)
                return cache

            return transform

        per_token = num_kv_heads * head_size
        indices = []
        for which in ("k", "v"):
            source_of = discover_permutation(writer(which), source_shape, kv_cache.dtype).reshape(2, -1)
            first, second = source_of[0], source_of[1]
            shifted = torch.where(first >= 0, first + block_size * per_token, first)
            if not torch.equal(second, shifted):
                raise NotImplementedError("the KV cache layout does not repeat block by block")
            indices.append(inverse_gather_index(first, block_size * per_token))
        reader = cls(block_size, num_kv_heads, head_size, indices[0], indices[1], torch.cat(indices))
        _READERS[key] = reader
        return reader


_LATENT_READERS: dict[tuple[Any, ...], LatentCacheReader] = {}


@dataclass(frozen=True)
class LatentCacheReader:
    """Gathers MLA's cached latent ``[seq_len, kv_lora_rank]`` and RoPE key ``[seq_len, qk_rope_head_dim]``.

    vLLM's MLA caches no K and V: per token one row of the normed latent and
    the RoPE'd ``k_pe`` (``MLAAttention.update_kv_cache`` -> ``impl.do_kv_cache_update``),
    in a paged cache the layer holds as ``[num_blocks, block_size, row]``. As for
    :class:`PagedKVReader`, the layout is learnt from the backend's own write
    method on a two-block scratch cache (checked to repeat block by block), not
    assumed: ``index`` holds, for one block, the flat in-block position of every
    (slot, latent dim | rope dim) element.
    """

    block_size: int
    kv_lora_rank: int
    rope_dim: int
    index: Any  # int64 [block_size * (kv_lora_rank + rope_dim)], by (slot, dim): in-block flat position

    def read_batch(self, kv_cache: Any, block_rows: Any, seq_lens: Any) -> tuple[Any, Any]:
        """Zero-padded latent ``[B, S, kv_lora_rank]`` and k_pe ``[B, S, rope_dim]``, ``S = max(seq_lens)``.

        Positions past a request's length are exact zeros, whatever the cache holds there.
        """
        import torch

        longest = int(seq_lens.max())
        pos = torch.arange(longest)
        blocks = block_rows[:, : -(-longest // self.block_size)].long().clamp(0, kv_cache.shape[0] - 1)
        slot_blocks = blocks[:, pos // self.block_size]  # [B, S]
        in_block = self.index.view(self.block_size, -1)[pos % self.block_size]  # [S, R + P]
        if kv_cache.is_contiguous():
            rows = kv_cache.reshape(-1)[slot_blocks[..., None] * kv_cache[0].numel() + in_block]
        else:
            rows = kv_cache.flatten(1)[slot_blocks[..., None], in_block]
        rows = torch.where((pos < seq_lens.long()[:, None])[..., None], rows, 0)  # [B, S, R + P]
        return rows[..., : self.kv_lora_rank], rows[..., self.kv_lora_rank :]

    @classmethod
    def discover(cls, impl: Any, kv_cache: Any, kv_lora_rank: int, rope_dim: int) -> LatentCacheReader:
        """Learn the latent cache layout of ``impl`` (an MLA impl) from its own ``do_kv_cache_update``."""
        import torch

        row = kv_lora_rank + rope_dim
        key = (type(impl), tuple(kv_cache.shape[1:]), kv_cache.dtype, impl.kv_cache_dtype, kv_lora_rank, rope_dim)
        if key in _LATENT_READERS:
            return _LATENT_READERS[key]
        if kv_cache[0].numel() % row:
            raise NotImplementedError(f"MLA cache blocks of {kv_cache[0].numel()} elements are not whole {row}-rows")
        block_size = kv_cache[0].numel() // row
        tokens = 2 * block_size  # two blocks, to check that the layout repeats per block
        slots = torch.arange(tokens, dtype=torch.int64)
        scale = torch.ones((), dtype=torch.float32)

        def transform(src: Any) -> Any:
            cache = torch.zeros((2, *kv_cache.shape[1:]), dtype=kv_cache.dtype)
            latent, k_pe = src[:, :kv_lora_rank].contiguous(), src[:, kv_lora_rank:].unsqueeze(1).contiguous()
            impl.do_kv_cache_update(latent, k_pe, cache, slots, impl.kv_cache_dtype, scale)
            return cache

        per_block = block_size * row
        source_of = discover_permutation(transform, (tokens, row), kv_cache.dtype).reshape(2, -1)
        first, second = source_of[0], source_of[1]
        if not torch.equal(second, torch.where(first >= 0, first + per_block, first)):
            raise NotImplementedError("the MLA latent cache layout does not repeat block by block")
        reader = cls(block_size, kv_lora_rank, rope_dim, inverse_gather_index(first, per_block))
        _LATENT_READERS[key] = reader
        return reader
