"""The ``cpu`` backend of consistent mode: vLLM's CPU build (0.32), as it has always run.

* Linear layers and the lm_head: their GEMM is ``layer.cpu_linear``
  (``layers/utils.py``, ``dispatch_cpu_unquantized_gemm``), which holds the weight
  in a oneDNN/sgl/zentorch handle; the plain weight is recovered bit-exactly
  through an identity GEMM (``weights.dense_weight``) and ``cpu_linear`` is
  replaced by ``kernels.linear`` on it (packed weights part by part).
* Attention: ``CPUAttentionBackendImpl.forward``, reading every request's context
  back from the paged cache whose private layout ``kv_cache.PagedKVReader`` learns
  from the backend's own write method.
* MLA: ``forward_impl`` of ``CPUMLAImpl`` and ``AMXMLAImpl`` layers (AMX hosts) on the
  paged latent cache. The whole step, decode and prefill, is the latent kernel,
  so nothing of the AMX path runs (its ``bmm_cpu`` absorb/de-absorb on packed
  ``W_UK``/``W_UV``, its decode/extend kernels), only its cache writer (read
  back through the layout learnt from it); ``kv_b_proj``'s plain weight, which
  the AMX path releases, is recovered from the packed copies
  (``weights.latent_up_weight``).
* MoE: the runner's forward on the experts' weights recovered from their
  prepacked tiling (``weights.moe_runner_weights``); not on zentorch.

Refuses any world size above 1 (tensor or pipeline parallel): the kernels'
collectives are not wired into vLLM's CPU communicator.
"""

from __future__ import annotations

from typing import Any

from logdiff.sources.vllm.consistent.plan import Patch, attention_problem


class CPUBackend:
    """``plan.Backend`` for ``current_platform.device_type == "cpu"``."""

    name = "cpu"
    #: the engine's attention layers (``check``): where a ``kv_b_proj`` released by AMX MLA is recovered from
    layers: tuple[Any, ...] = ()

    def check(self, config: Any) -> None:
        if config.parallel_config.world_size > 1:
            raise NotImplementedError("consistent mode covers a single-process (TP=1, PP=1) engine only")
        self.layers = tuple(config.compilation_config.static_forward_context.values())

    def linear(self, module: Any, shared_expert: bool = False) -> Patch | str:
        from logdiff.sources.vllm import consistent_ops as ops
        from logdiff.sources.vllm.weights import dense_weight

        if not shared_expert and "cpu_linear" not in vars(module):
            return f"{type(module).__name__} without a CPU GEMM"
        sizes = getattr(module, "output_partition_sizes", None)
        return module, "cpu_linear", ops.linear_gemm(dense_weight(module, self.layers), sizes)

    def attention(self, layer: Any) -> Patch | str:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        from logdiff.sources.vllm import consistent_ops as ops

        impl = layer.impl
        if not isinstance(impl, CPUAttentionBackendImpl):
            return f"attention backend {type(impl).__name__}; only the CPU backend is covered"
        return attention_problem(impl) or (impl, "forward", ops.attention_forward(impl))

    def mla(self, layer: Any) -> Patch | str:
        from logdiff.sources.vllm import consistent_ops as ops
        from logdiff.sources.vllm.weights import latent_up_weight

        problem = _mla_problem(layer)
        if problem:
            return problem
        return layer, "forward_impl", ops.mla_forward_impl(layer, latent_up_weight(layer))

    def moe(self, runner: Any) -> Patch | str:
        experts = runner.routed_experts
        if getattr(experts.quant_method.moe_kernel.fused_experts, "_use_zentorch", False):
            return "MoE experts on zentorch"
        if runner.gate is not None and "cpu_linear" not in vars(runner.gate):
            return "MoE gate without a CPU GEMM"
        return runner, "forward", _moe_replacement(runner)


def _mla_problem(layer: Any) -> str | None:
    """Why the consistent latent attention cannot stand in for ``layer`` (an ``MLAAttention``), or None."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    impl = layer.impl
    if not isinstance(impl, (CPUMLAImpl, AMXMLAImpl)):
        return f"MLA backend {type(impl).__name__}; only the CPU and AMX MLA backends are covered"
    if layer.kv_cache_dtype != "auto" or getattr(layer, "use_sparse", False):
        return f"MLA KV cache dtype {layer.kv_cache_dtype} or sparse MLA"
    if layer.sliding_window is not None or layer.non_causal_multi_token_decode:
        return "MLA with a sliding window or non-causal decode"
    if impl.dcp_world_size > 1 or getattr(layer, "use_pcp", False):
        return "MLA with context parallelism"
    if not isinstance(getattr(layer.kv_b_proj, "quant_method", None), UnquantizedLinearMethod):
        return "MLA with a quantized kv_b_proj"
    return None


def _moe_replacement(runner: Any) -> Any:
    from logdiff.sources.vllm import consistent_ops as ops
    from logdiff.sources.vllm.weights import dense_weight, moe_runner_weights

    w13, w2 = moe_runner_weights(runner)
    gate_weight = dense_weight(runner.gate) if runner.gate is not None else None
    experts = runner.routed_experts
    if str(getattr(experts.activation, "value", experts.activation)) == "swigluoai":  # gpt-oss: biased experts
        return ops.moe_forward(runner, gate_weight, w13, w2, (experts.w13_bias.data, experts.w2_bias.data))
    return ops.moe_forward(runner, gate_weight, w13, w2)
