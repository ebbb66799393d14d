"""Consistent mode for a real, in-process vLLM engine (vLLM 0.32, CPU build).

``with consistent_vllm(llm): ...`` swaps every operator on the numerical path
of ``llm``'s model for the reference kernels in ``logdiff.kernels`` and puts
every original back on exit, exceptions included. The same kernels installed
into HF by ``consistent_hf`` then give bitwise-equal logprobs on both sides.

What is replaced (all as *instance* attributes: classes are never touched):

==========================  ==========================================  ==================
vLLM object                 attribute                                   kernel
==========================  ==========================================  ==================
linear layers, lm_head      ``layer.cpu_linear`` (layers/utils.py,      ``linear``
(anything with a CPU GEMM)  ``dispatch_cpu_unquantized_gemm``)
``RMSNorm``                 ``forward`` (with/without fused residual)   ``rms_norm``
``RotaryEmbedding``, its    ``forward`` (the module's ``RopeParams``,   ``rope``
llama3, linear and yarn     checked against its ``_compute_inv_freq``)
subclasses, DeepSeek's
``DeepseekScaling...``
``GemmaRMSNorm``            ``forward`` (``(1 + w)``, same fusions)      ``gemma_rms_norm``
``SiluAndMul``              ``forward``                                 ``silu_and_mul``
``GeluAndMul`` (tanh)       ``forward``                                 ``gelu_tanh_and_mul``
``LogitsProcessor`` with    ``forward`` (its ``_get_logits``, then the  ``softcap``
a ``soft_cap`` (Gemma 2)    kernel's cap)
``Attention.impl``          ``forward`` (v1/attention/backends/         ``attention``
(CPUAttentionBackendImpl)   cpu_attn.py); the cache write is kept;
                            its ``sinks`` (gpt-oss) go to the kernel
``MLAAttention``            ``forward_impl`` (layers/attention/         ``latent_attention``
(DeepSeek, CPU MLA)         mla_attention.py): every request from the
                            paged latent cache (``kv_cache.
                            LatentCacheReader``), no absorbed decode;
                            vLLM's cache write is kept; its wrapper
                            (``MultiHeadLatentAttentionWrapper``) only
                            calls patched children
``MoERunner``               ``forward`` (fused_moe/runner/moe_runner;   ``moe_route`` or
                            gate GEMM, router and fused experts; a      ``moe_route_grouped``,
                            shared expert through its own patched       ``moe_experts``
                            linears and ``SiluAndMul``, added last;     (gpt-oss:
                            gpt-oss's biased ``swigluoai`` experts)     ``moe_experts_oai``)
``model_runner.sampler``    ``compute_logprobs`` (v1/sample/sampler.py; ``log_softmax``
                            also the prompt-logprobs path)
==========================  ==========================================  ==================

The plan is built and checked *before* anything is patched: a module on the
numerical path that no replacement covers (another norm, a RoPE class other
than ``RotaryEmbedding``, its llama3, linear and yarn subclasses and DeepSeek's
yarn (dynamic NTK, ...),
a quantized layer, speculative decoding, ...) raises
``NotImplementedError`` naming it, rather than giving a silently half-consistent
engine. Weights that the CPU build has packed away are recovered bit-exactly
(``weights``). The prefix cache is reset on entry and on exit, because a
cached block computed in the other mode would leak its numerics into this one.

The engine must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from logdiff.probes.patching import Patches


_ACTIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # models currently in consistent mode


@dataclass
class ConsistentVLLM:
    """What consistent mode replaced: kind -> module names (yielded by the context manager)."""

    replaced: dict[str, list[str]] = field(default_factory=dict)

    def add(self, kind: str, name: str) -> None:
        self.replaced.setdefault(kind, []).append(name)


@contextlib.contextmanager
def consistent_vllm(llm: Any, only: Collection[str] | None = None) -> Iterator[ConsistentVLLM]:
    """Run ``llm`` (a ``vllm.LLM``) on the logdiff reference kernels inside the block.

    ``only`` limits the swap to some op families (``linear``, ``rms_norm``, ``rope``,
    ``silu_and_mul``, ``attention``, ``moe``, ``log_softmax``): attribution installs
    one family at a time.
    """
    from logdiff import kernels

    model, runner = engine_objects(llm)
    if model in _ACTIVE:
        raise RuntimeError("consistent mode is already active on this engine")
    plan, summary = _plan(llm, model, runner)
    if only is not None:
        summary.replaced = {k: v for k, v in summary.replaced.items() if k in only}
    _ACTIVE.add(model)
    try:
        with Patches() as patches:
            # Registered first, so it runs last: once every original is back.
            patches.on_exit(lambda: _reset_prefix_cache(llm))
            _reset_prefix_cache(llm)
            for kind, obj, name, value in plan:
                if only is None or kind in only:
                    patches.set(obj, name, value)
            with kernels.weight_cache():
                yield summary
    finally:
        _ACTIVE.discard(model)


def is_active(model: Any) -> bool:
    """Whether consistent mode is on for ``model`` (the live model of ``engine_objects``)."""
    return model in _ACTIVE


def engine_objects(llm: Any) -> tuple[Any, Any]:
    """The live model and model runner; both exist only for an in-process engine."""
    holder: list[Any] = []
    llm.apply_model(holder.append)
    runners = llm.collective_rpc(_model_runner)
    if not holder or not runners or runners[0] is None or runners[0].get_model() is not holder[0]:
        raise RuntimeError(
            "consistent mode needs the engine in this process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating it"
        )
    return holder[0], runners[0]


def _model_runner(worker: Any) -> Any:
    return getattr(worker, "model_runner", None)


def _reset_prefix_cache(llm: Any) -> None:
    if not llm.reset_prefix_cache():
        raise RuntimeError("could not reset vLLM's prefix cache (requests still running?)")


def _plan(llm: Any, model: Any, runner: Any) -> tuple[list[tuple[str, Any, str, Any]], ConsistentVLLM]:
    """Every (object, attribute, replacement) to install; raises on anything unsupported."""
    from vllm.model_executor.custom_op import CustomOp, PluggableLayer
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.mla import MLAAttention, MultiHeadLatentAttentionWrapper
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    from logdiff.engines.vllm import consistent_ops as ops
    from logdiff.engines.vllm.weights import dense_weight

    config = llm.llm_engine.vllm_config
    if config.speculative_config is not None:
        raise NotImplementedError("consistent mode does not cover speculative decoding")
    if config.parallel_config.world_size > 1:
        raise NotImplementedError("consistent mode covers a single-process (TP=1, PP=1) engine only")

    plan: list[tuple[str, Any, str, Any]] = []  # (op family, object, attribute, replacement)
    summary = ConsistentVLLM()
    unsupported: list[str] = []
    replaced_parents: list[str] = []  # their submodules are only reached through the replacement
    moe_runners: list[tuple[str, Any]] = []  # MoE runners, whose shared experts are planned after the walk
    for name, module in model.named_modules():
        if any(name.startswith(parent) for parent in replaced_parents):
            continue
        qm = getattr(module, "quant_method", None)
        if isinstance(module, (LinearBase, VocabParallelEmbedding)):
            if not isinstance(qm, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
                unsupported.append(f"{name} ({type(module).__name__}, quantized: {type(qm).__name__})")
            elif "cpu_linear" not in vars(module):
                unsupported.append(f"{name} ({type(module).__name__} without a CPU GEMM)")
            else:
                sizes = getattr(module, "output_partition_sizes", None)
                plan.append(("linear", module, "cpu_linear", ops.linear_gemm(dense_weight(module), sizes)))
                summary.add("linear", name)
        elif type(module) is RMSNorm:
            if not module.has_weight or module.variance_size_override is not None:
                unsupported.append(f"{name} (RMSNorm without weight or with a variance size override)")
            else:
                plan.append(("rms_norm", module, "forward", ops.rms_norm_forward(module)))
                summary.add("rms_norm", name)
        elif isinstance(module, RotaryEmbeddingBase) or type(module).__name__.endswith("RotaryEmbedding"):
            try:  # default, llama3, linear and yarn (DeepSeek's too) rope; any other class is refused naming its type
                rope = ops.rope_params_of(module)
            except NotImplementedError as e:
                unsupported.append(f"{name} ({e})")
            else:
                plan.append(("rope", module, "forward", ops.rope_forward(module, rope)))
                summary.add("rope", name)
                replaced_parents.append(name + ".")
        elif type(module).__name__ == "GemmaRMSNorm":
            plan.append(("rms_norm", module, "forward", ops.gemma_rms_norm_forward(module)))
            summary.add("rms_norm", name)
        elif type(module) is SiluAndMul:
            plan.append(("silu_and_mul", module, "forward", ops.gated_mul_forward("silu_and_mul")))
            summary.add("silu_and_mul", name)
        elif type(module).__name__ == "GeluAndMul" and getattr(module, "approximate", None) == "tanh":
            plan.append(("silu_and_mul", module, "forward", ops.gated_mul_forward("gelu_tanh_and_mul")))
            summary.add("silu_and_mul", name)
        elif isinstance(module, Attention):
            problem = _attention_problem(module)
            if problem:
                unsupported.append(f"{name} ({problem})")
            else:
                plan.append(("attention", module.impl, "forward", ops.attention_forward(module.impl)))
                summary.add("attention", name)
        elif isinstance(module, MultiHeadLatentAttentionWrapper):  # calls its children, planned on their own
            problem = _mla_wrapper_problem(module)
            if problem:
                unsupported.append(f"{name} ({problem})")
        elif isinstance(module, MLAAttention):
            problem = _mla_problem(module)
            if problem:
                unsupported.append(f"{name} ({problem})")
            else:
                weight = dense_weight(module.kv_b_proj)
                plan.append(("attention", module, "forward_impl", ops.mla_forward_impl(module, weight)))
                summary.add("attention", name)
                replaced_parents.append(name + ".")
        elif isinstance(module, MoERunner):
            problem = _moe_problem(module)
            if problem:
                unsupported.append(f"{name} ({problem})")
            else:
                plan.append(("moe", module, "forward", _moe_replacement(module)))
                summary.add("moe", name)
                replaced_parents.append(name + ".")
                moe_runners.append((name, module))
        elif isinstance(module, LogitsProcessor):
            if module.scale != 1.0 or module.logits_as_input:
                unsupported.append(f"{name} (logit scale or logits as input)")
            elif module.soft_cap is not None:
                plan.append(("linear", module, "forward", ops.softcapped_logits_forward(module)))
                summary.add("linear", name)
        elif _holds_only_its_sinks(module):  # gpt-oss's OAIAttention: the sinks its attention kernel reads
            pass
        elif isinstance(module, (CustomOp, PluggableLayer)) or next(module.parameters(recurse=False), None) is not None:
            unsupported.append(f"{name} ({type(module).__name__})")
    for name, moe_runner in moe_runners:
        unsupported += _plan_shared_expert(name, moe_runner, plan, summary)
    if unsupported:
        raise NotImplementedError("consistent mode has no kernel for: " + "; ".join(unsupported))
    plan.append(("log_softmax", runner.sampler, "compute_logprobs", ops.log_softmax()))
    summary.add("log_softmax", "sampler.compute_logprobs")
    return plan, summary


def _holds_only_its_sinks(module: Any) -> bool:
    """A module whose only own parameter is ``sinks``, the very tensor its attention backend reads (gpt-oss)."""
    own = dict(module.named_parameters(recurse=False))
    impl = getattr(getattr(module, "attn", None), "impl", None)
    return list(own) == ["sinks"] and getattr(impl, "sinks", None) is own["sinks"]


def _attention_problem(layer: Any) -> str | None:
    """Why the consistent kernel cannot stand in for ``layer``, or None (a sliding window is covered:
    the kernel masks it)."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    impl = layer.impl
    if not isinstance(impl, CPUAttentionBackendImpl):
        return f"attention backend {type(impl).__name__}; only the CPU backend is covered"
    if impl.attn_type != AttentionType.DECODER:
        return f"{impl.attn_type} attention"
    if impl.alibi_slopes is not None:
        return "ALiBi attention"
    if impl.kv_cache_dtype != "auto" or impl.kv_sharing_target_layer_name is not None:
        return f"KV cache dtype {impl.kv_cache_dtype} or shared KV cache"
    return None


def _mla_wrapper_problem(wrapper: Any) -> str | None:
    """Why the MLA wrapper's steps are not all planned kernels (a fused norm, an indexer, a gate), or None."""
    if wrapper.fuse_qkv_rmsnorm:
        return "MLA with the fused q/kv RMSNorm"
    if wrapper.indexer is not None or wrapper.is_sparse:
        return "sparse MLA (indexer)"
    if wrapper.g_proj is not None or wrapper.dcp_q_replicate:
        return "MLA with an output gate or a replicated query"
    return None


def _mla_problem(layer: Any) -> str | None:
    """Why the consistent latent attention cannot stand in for ``layer`` (an ``MLAAttention``), or None."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    impl = layer.impl
    if not isinstance(impl, CPUMLAImpl):
        return f"MLA backend {type(impl).__name__}; only the CPU MLA backend is covered"
    if layer.kv_cache_dtype != "auto" or getattr(layer, "use_sparse", False):
        return f"MLA KV cache dtype {layer.kv_cache_dtype} or sparse MLA"
    if layer.sliding_window is not None or layer.non_causal_multi_token_decode:
        return "MLA with a sliding window or non-causal decode"
    if impl.dcp_world_size > 1 or getattr(layer, "use_pcp", False):
        return "MLA with context parallelism"
    if not isinstance(getattr(layer.kv_b_proj, "quant_method", None), UnquantizedLinearMethod):
        return "MLA with a quantized kv_b_proj"
    return None


def _plan_shared_expert(name: str, runner: Any, plan: list, summary: ConsistentVLLM) -> list[str]:
    """Plan the linears and ``SiluAndMul`` of ``runner``'s shared expert that the walk has not (the
    runner's subtree is skipped; GLM registers the expert on the block too); returns what is unsupported."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    from logdiff.engines.vllm import consistent_ops as ops
    from logdiff.engines.vllm.weights import dense_weight

    shared = runner.shared_experts
    if shared is None:
        return []
    planned = {id(obj) for _, obj, _, _ in plan}
    problems = []
    for sub, module in shared._layer.named_modules(prefix=f"{name}.shared_experts"):
        if id(module) in planned:
            continue
        if isinstance(module, LinearBase) and isinstance(module.quant_method, UnquantizedLinearMethod):
            sizes = getattr(module, "output_partition_sizes", None)
            plan.append(("linear", module, "cpu_linear", ops.linear_gemm(dense_weight(module), sizes)))
            summary.add("linear", sub)
        elif type(module) is SiluAndMul:
            plan.append(("silu_and_mul", module, "forward", ops.gated_mul_forward("silu_and_mul")))
            summary.add("silu_and_mul", sub)
        elif next(module.parameters(recurse=False), None) is not None or module is not shared._layer:
            problems.append(f"{sub} ({type(module).__name__} in a shared expert)")
    return problems


def _moe_problem(runner: Any) -> str | None:
    import torch

    router = runner.router
    experts = runner.routed_experts
    scoring, grouped = getattr(router, "scoring_func", None), getattr(router, "use_grouped_topk", True)
    if scoring not in ("softmax", "sigmoid") or router.custom_routing_function is not None:
        return f"MoE routing {type(router).__name__} ({scoring}, custom function {router.custom_routing_function})"
    if grouped and (router.num_expert_group is None or router.topk_group is None):
        return "MoE grouped routing without its group counts"
    scale = router.routed_scaling_factor * runner.routed_scaling_factor
    if scale != 1.0 and runner.shared_experts is not None and runner.moe_config.in_dtype == torch.float16:
        return "MoE routed scaling in float16 (vLLM rescales the shared output instead)"
    if runner.shared_experts is not None and runner.shared_expert_gate is not None:
        return "MoE shared expert with a gate"
    if runner.routed_input_transform or runner.routed_output_transform:
        return "MoE routed transforms"
    activation = str(getattr(experts.activation, "value", experts.activation))
    oai = activation == "swigluoai" and hasattr(experts, "w13_bias") and hasattr(experts, "w2_bias")
    if (runner.moe_config.has_bias and not oai) or experts.expert_map is not None:
        return "MoE expert bias or expert parallelism"
    if activation not in ("silu", "swigluoai") or (activation == "swigluoai" and not oai):
        return f"MoE activation {experts.activation}"
    if getattr(experts.quant_method.moe_kernel.fused_experts, "_use_zentorch", False):
        return "MoE experts on zentorch"
    if runner.gate is not None and "cpu_linear" not in vars(runner.gate):
        return "MoE gate without a CPU GEMM"
    return None


def _moe_replacement(runner: Any) -> Any:
    from logdiff.engines.vllm import consistent_ops as ops
    from logdiff.engines.vllm.weights import dense_weight, moe_runner_weights

    w13, w2 = moe_runner_weights(runner)
    gate_weight = dense_weight(runner.gate) if runner.gate is not None else None
    experts = runner.routed_experts
    if str(getattr(experts.activation, "value", experts.activation)) == "swigluoai":  # gpt-oss: biased experts
        return ops.moe_forward(runner, gate_weight, w13, w2, (experts.w13_bias.data, experts.w2_bias.data))
    return ops.moe_forward(runner, gate_weight, w13, w2)
