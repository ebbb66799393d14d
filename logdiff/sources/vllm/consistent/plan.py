"""The platform-neutral plan of consistent mode: the module walk, what it replaces, what it refuses.

``build_plan(llm, model, runner, backend)`` walks ``model`` once and returns every
``(op family, object, attribute, replacement)`` to install, *before* anything is
patched. The walk knows vLLM's module classes (linear layers, norms, RoPE, gated
activations, attention, MLA, MoE, the logits processor, the sampler); the
``backend`` (``cpu``, ``cuda``, ``npu``) knows how each is reached on its platform:
which attribute holds a linear layer's GEMM, which attention implementations it
can stand in for, how an MoE runner's weights are read. A module on the numerical
path that neither covers raises ``NotImplementedError`` naming it, so an engine is
never silently half-consistent. A backend may also leave an op to the platform
(``Left``): it is then listed in ``ConsistentVLLM.left`` (the scan reports it) and
no bitwise claim is made for it.

The replacement forwards themselves are in ``consistent_ops`` (platform neutral
except the CPU attention's cache reader).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

Patch = tuple[Any, str, Any]
"""(object, attribute, replacement): one instance attribute to set."""


@dataclass(frozen=True)
class Left:
    """An op the backend leaves to the platform's own (batch-invariant) kernel: no bitwise claim for it."""

    why: str


@dataclass
class ConsistentVLLM:
    """What consistent mode replaced (kind -> module names) and which ops it left to the platform."""

    replaced: dict[str, list[str]] = field(default_factory=dict)
    left: list[str] = field(default_factory=list)
    platform: str = "cpu"

    def add(self, kind: str, name: str) -> None:
        self.replaced.setdefault(kind, []).append(name)


class Backend(Protocol):
    """How a platform's vLLM modules are reached (``cpu.CPUBackend``, ``cuda.CUDABackend``)."""

    name: str

    def check(self, config: Any) -> None:
        """Raise ``NotImplementedError`` (one line) for an engine configuration the backend cannot cover."""

    def linear(self, module: Any, shared_expert: bool = False) -> Patch | Left | str:
        """The patch replacing ``module``'s (unquantized) GEMM, a ``Left``, or why neither."""

    def attention(self, layer: Any) -> Patch | Left | str:
        """The patch for an ``Attention`` layer's implementation, a ``Left``, or why neither."""

    def mla(self, layer: Any) -> Patch | Left | str:
        """The patch for an ``MLAAttention`` layer, a ``Left``, or why neither."""

    def moe(self, runner: Any) -> Patch | Left | str:
        """The patch for an ``MoERunner`` (the neutral checks passed), a ``Left``, or why neither."""


Step = tuple[str, Any, str, Any]  # (op family, object, attribute, replacement)


def build_plan(llm: Any, model: Any, runner: Any, backend: Backend) -> tuple[list[Step], ConsistentVLLM]:
    """Every (family, object, attribute, replacement) to install; raises on anything unsupported."""
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

    from logdiff.sources.vllm import consistent_ops as ops

    config = llm.llm_engine.vllm_config
    if config.speculative_config is not None:
        raise NotImplementedError("consistent mode does not cover speculative decoding")
    backend.check(config)

    plan: list[Step] = []
    summary = ConsistentVLLM(platform=backend.name)
    unsupported: list[str] = []
    replaced_parents: list[str] = []  # their submodules are only reached through the replacement
    moe_runners: list[tuple[str, Any]] = []  # MoE runners, whose shared experts are planned after the walk

    def take(kind: str, name: str, found: Patch | Left | str, parent: bool = False) -> None:
        if isinstance(found, str):
            unsupported.append(f"{name} ({found})")
        else:
            if isinstance(found, Left):  # the platform runs the whole subtree
                summary.left.append(f"{kind} {name}: {found.why}")
            else:
                plan.append((kind, *found))
                summary.add(kind, name)
            if parent:
                replaced_parents.append(name + ".")

    for name, module in model.named_modules():
        if any(name.startswith(parent) for parent in replaced_parents):
            continue
        if isinstance(module, (LinearBase, VocabParallelEmbedding)):
            qm = getattr(module, "quant_method", None)
            if getattr(module, "scheme", None) is not None and isinstance(module, LinearBase):  # INT8 W8A8
                from logdiff.sources.vllm.consistent_int8 import int8_linear_patch

                take("linear", name, int8_linear_patch(module, config.model_config.dtype))
            elif not isinstance(qm, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
                unsupported.append(f"{name} ({type(module).__name__}, quantized: {type(qm).__name__})")
            else:
                take("linear", name, backend.linear(module))
        elif type(module) is RMSNorm:
            if not module.has_weight or module.variance_size_override is not None:
                unsupported.append(f"{name} (RMSNorm without weight or with a variance size override)")
            else:
                take("rms_norm", name, (module, "forward", ops.rms_norm_forward(module)))
        elif isinstance(module, RotaryEmbeddingBase) or type(module).__name__.endswith("RotaryEmbedding"):
            try:  # default, llama3, linear and yarn (DeepSeek's too) rope; any other class is refused naming its type
                rope = ops.rope_params_of(module)
            except NotImplementedError as e:
                unsupported.append(f"{name} ({e})")
            else:
                take("rope", name, (module, "forward", ops.rope_forward(module, rope)), parent=True)
        elif type(module).__name__ == "GemmaRMSNorm":
            take("rms_norm", name, (module, "forward", ops.gemma_rms_norm_forward(module)))
        elif type(module) is SiluAndMul:
            take("silu_and_mul", name, (module, "forward", ops.gated_mul_forward("silu_and_mul")))
        elif type(module).__name__ == "GeluAndMul" and getattr(module, "approximate", None) == "tanh":
            take("silu_and_mul", name, (module, "forward", ops.gated_mul_forward("gelu_tanh_and_mul")))
        elif isinstance(module, Attention):
            take("attention", name, backend.attention(module))
        elif isinstance(module, MultiHeadLatentAttentionWrapper):  # calls its children, planned on their own
            problem = mla_wrapper_problem(module)
            if problem:
                unsupported.append(f"{name} ({problem})")
        elif isinstance(module, MLAAttention):
            take("attention", name, backend.mla(module), parent=True)
        elif isinstance(module, MoERunner):
            found = moe_problem(module) or backend.moe(module)
            take("moe", name, found, parent=True)
            if not isinstance(found, (str, Left)):
                moe_runners.append((name, module))
        elif isinstance(module, LogitsProcessor):
            if module.scale != 1.0 or module.logits_as_input:
                unsupported.append(f"{name} (logit scale or logits as input)")
            elif module.soft_cap is not None:
                take("linear", name, (module, "forward", ops.softcapped_logits_forward(module)))
        elif holds_only_its_sinks(module):  # gpt-oss's OAIAttention: the sinks its attention kernel reads
            pass
        elif isinstance(module, (CustomOp, PluggableLayer)) or next(module.parameters(recurse=False), None) is not None:
            unsupported.append(f"{name} ({type(module).__name__})")
    for name, moe_runner in moe_runners:
        unsupported += _plan_shared_expert(name, moe_runner, plan, summary, backend)
    if unsupported:
        raise NotImplementedError("consistent mode has no kernel for: " + "; ".join(unsupported))
    plan.append(("log_softmax", runner.sampler, "compute_logprobs", ops.log_softmax()))
    summary.add("log_softmax", "sampler.compute_logprobs")
    sampler = getattr(runner.sampler, "topk_topp_sampler", None)  # processed logprobs of a sampling step
    if sampler is not None and hasattr(sampler, "logprobs_mode"):
        plan.append(("log_softmax", sampler, "forward", ops.processed_log_softmax(sampler)))
        summary.add("log_softmax", "sampler.topk_topp_sampler (processed_logprobs)")
    return plan, summary


def holds_only_its_sinks(module: Any) -> bool:
    """A module whose only own parameter is ``sinks``, the very tensor its attention backend reads (gpt-oss)."""
    own = dict(module.named_parameters(recurse=False))
    impl = getattr(getattr(module, "attn", None), "impl", None)
    return list(own) == ["sinks"] and getattr(impl, "sinks", None) is own["sinks"]


def attention_problem(impl: Any) -> str | None:
    """Why no consistent kernel can stand in for attention ``impl`` on any platform, or None (a sliding
    window is covered: the kernel masks it). Backends call it once they know the implementation class."""
    from vllm.v1.attention.backend import AttentionType

    if impl.attn_type != AttentionType.DECODER:
        return f"{impl.attn_type} attention"
    if impl.alibi_slopes is not None:
        return "ALiBi attention"
    if impl.kv_cache_dtype != "auto" or impl.kv_sharing_target_layer_name is not None:
        return f"KV cache dtype {impl.kv_cache_dtype} or shared KV cache"
    return None


def mla_wrapper_problem(wrapper: Any) -> str | None:
    """Why the MLA wrapper's steps are not all planned kernels (a fused norm, an indexer, a gate), or None."""
    if wrapper.fuse_qkv_rmsnorm:
        return "MLA with the fused q/kv RMSNorm"
    if wrapper.indexer is not None or wrapper.is_sparse:
        return "sparse MLA (indexer)"
    if wrapper.g_proj is not None or wrapper.dcp_q_replicate:
        return "MLA with an output gate or a replicated query"
    return None


def moe_problem(runner: Any) -> str | None:
    """Why no consistent MoE can stand in for ``runner`` on any platform, or None."""
    import torch

    router = runner.router
    experts = runner.routed_experts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    method = getattr(experts, "quant_method", None)
    if method is not None and not isinstance(method, UnquantizedFusedMoEMethod):
        return f"quantized MoE experts ({type(method).__name__})"
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
    return None


def _plan_shared_expert(name: str, runner: Any, plan: list, summary: ConsistentVLLM, backend: Backend) -> list[str]:
    """Plan the linears and ``SiluAndMul`` of ``runner``'s shared expert that the walk has not (the
    runner's subtree is skipped; GLM registers the expert on the block too); returns what is unsupported."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    from logdiff.sources.vllm import consistent_ops as ops

    shared = runner.shared_experts
    if shared is None:
        return []
    planned = {id(obj) for _, obj, _, _ in plan}
    problems = []
    for sub, module in shared._layer.named_modules(prefix=f"{name}.shared_experts"):
        if id(module) in planned:
            continue
        if isinstance(module, LinearBase) and isinstance(module.quant_method, UnquantizedLinearMethod):
            found = backend.linear(module, shared_expert=True)
            if isinstance(found, str):
                problems.append(f"{sub} ({found})")
            elif isinstance(found, Left):
                summary.left.append(f"linear {sub}: {found.why}")
            else:
                plan.append(("linear", *found))
                summary.add("linear", sub)
        elif type(module) is SiluAndMul:
            plan.append(("silu_and_mul", module, "forward", ops.gated_mul_forward("silu_and_mul")))
            summary.add("silu_and_mul", sub)
        elif next(module.parameters(recurse=False), None) is not None or module is not shared._layer:
            problems.append(f"{sub} ({type(module).__name__} in a shared expert)")
    return problems
