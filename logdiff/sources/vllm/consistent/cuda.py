"""The ``cuda`` backend of consistent mode, on top of vLLM's batch-invariant mode.

**Coded against vLLM's published sources (0.32: ``model_executor/determinism/
batch_invariant.py``, ``v1/attention/backends/flash_attn.py``); not yet run on GPU
hardware** (``scripts/gpu-check.sh`` is the prepared check).

vLLM's part. ``VLLM_BATCH_INVARIANT=1`` must be in the environment when the engine
starts (vLLM reads it at import and in ``init_batch_invariance``, when the worker
starts): it selects a batch-invariant attention backend (FlashAttention with one
split, FlashInfer, Triton), registers its ``torch.library`` overrides of
``aten::mm/addmm/matmul/linear/bmm/_log_softmax/mean`` (on SM80/ROCm; cuBLASLt
without split-K on SM90+), pins NCCL and cuBLAS settings, and routes unquantized
linear layers to ``linear_batch_invariant``. Consistent mode refuses, in one line,
an engine started without it, with CUDA graphs, or over more than one GPU.

Ours, aligned with what HF runs under ``consistent_hf`` in the same process:

* linear layers and the lm_head: the layer's ``quant_method.apply`` (where vLLM
  calls ``linear_batch_invariant``) becomes ``kernels.linear`` on the layer's
  plain ``[N, K]`` weight, packed weights part by part;
* RMSNorm, RoPE, SiLU-and-mul, the soft cap and the sampler's log-softmax: the
  same replacements as on CPU (``consistent_ops``, platform neutral);
* attention on ``FlashAttentionImpl``: the reference kernel over FlashAttention's
  paged cache (``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, read
  back exactly as vLLM's own ``do_kv_cache_update`` writes it);
* and the whole block runs under ``kernels.aten_overrides("CUDA")``, as HF's does:
  every aten GEMM, log-softmax and mean that no module patch reaches is
  fixed-order on both sides.

Left to vLLM (listed in ``ConsistentVLLM.left``; no bitwise claim): attention on
any other backend (FlashInfer, Triton, FlashMLA, ...), MLA cores and MoE experts.
Their batch invariance is vLLM's; their equality with HF's reference kernels is
not known, and the scan reports which op is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from logdiff.sources.vllm.consistent.plan import Left, Patch, attention_problem


class CUDABackend:
    """``plan.Backend`` for ``current_platform.device_type == "cuda"``."""

    name = "cuda"

    def __init__(self) -> None:
        self._methods: set[int] = set()  # quant_method objects already planned (one per layer expected)

    def check(self, config: Any) -> None:
        import vllm.envs as envs

        if not envs.VLLM_BATCH_INVARIANT:
            raise NotImplementedError(
                "consistent mode on CUDA needs VLLM_BATCH_INVARIANT=1 in the environment before the engine starts"
            )
        if config.parallel_config.world_size > 1:
            raise NotImplementedError("consistent mode on CUDA covers a single-GPU (TP=1, PP=1) engine only")
        if not config.model_config.enforce_eager:
            raise NotImplementedError("consistent mode on CUDA needs enforce_eager=True (CUDA graphs replay stock kernels)")

    def context(self) -> Any:
        from logdiff.kernels.aten_overrides import aten_overrides

        return aten_overrides("CUDA")

    def linear(self, module: Any, shared_expert: bool = False) -> Patch | str:
        from logdiff.sources.vllm import consistent_ops as ops

        method = module.quant_method
        weight = getattr(module, "weight", None)
        sizes = getattr(module, "output_partition_sizes", None)
        if id(method) in self._methods:
            return "a quant_method shared between layers"
        if weight is None or weight.dim() != 2 or (sizes and sum(sizes) != weight.shape[0]):
            return f"{type(module).__name__} without a plain [N, K] weight"
        self._methods.add(id(method))
        gemm = ops.linear_gemm(weight.data, sizes)

        def apply(layer: Any, x: Any, bias: Any = None) -> Any:
            return gemm(x, None, bias)

        return method, "apply", apply

    def attention(self, layer: Any) -> Patch | Left | str:
        from logdiff.sources.vllm import consistent_ops as ops

        impl = layer.impl
        if type(impl).__name__ != "FlashAttentionImpl":
            return Left(f"{type(impl).__name__} (vLLM's batch-invariant backend, not the reference kernel)")
        problem = attention_problem(impl)
        if problem:
            return problem
        left, right = impl.sliding_window
        if right not in (0, -1):
            return f"FlashAttention window {impl.sliding_window} is not causal"
        window = left + 1 if left >= 0 else None
        return impl, "forward", ops.attention_forward(impl, reader=FlashKVReader.of, window=window)

    def mla(self, layer: Any) -> Left:
        return Left(f"MLA core {type(layer.impl).__name__} (vLLM's batch-invariant MLA backend)")

    def moe(self, runner: Any) -> Left:
        return Left("fused MoE experts (vLLM's kernel; its batch invariance is not checked here)")


@dataclass(frozen=True)
class FlashKVReader:
    """K and V of requests from FlashAttention's paged cache ``[blocks, kv_heads, block_size, 2 * head_size]``.

    vLLM's ``FlashAttentionImpl.do_kv_cache_update`` writes through
    ``kv_cache.transpose(1, 2).split(head_size, -1)``: K and V as ``[blocks, block_size,
    kv_heads, head_size]`` views. Reading uses the same views.
    """

    head_size: int

    @classmethod
    def of(cls, impl: Any, layer: Any, kv_cache: Any) -> FlashKVReader:
        if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * impl.head_size:
            raise NotImplementedError(f"FlashAttention KV cache of shape {tuple(kv_cache.shape)}")
        return cls(impl.head_size)

    def read_batch(self, kv_cache: Any, block_rows: Any, seq_lens: Any) -> tuple[Any, Any]:
        """Zero-padded K and V ``[B, max(seq_lens), kv_heads, head_size]`` (see ``kv_cache.PagedKVReader``)."""
        import torch

        k_cache, v_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        block_size = k_cache.shape[1]
        longest = int(seq_lens.max())
        pos = torch.arange(longest, device=kv_cache.device)
        blocks = block_rows.to(kv_cache.device)[:, : -(-longest // block_size)].long()
        slot_blocks = blocks[:, pos // block_size]  # [B, longest]
        valid = (pos < seq_lens.to(kv_cache.device).long()[:, None])[..., None, None]
        k = k_cache[slot_blocks, pos % block_size]  # [B, longest, kv_heads, head_size]
        v = v_cache[slot_blocks, pos % block_size]
        return torch.where(valid, k, 0), torch.where(valid, v, 0)
