"""Consistent mode for a loaded transformers model of a supported architecture (probes/arch/).

``with consistent_hf(model): ...`` routes every operator on the numerical path
of ``model`` through ``logdiff.kernels`` and restores every original on exit,
exceptions included. A full teacher-forced forward and a token-by-token
KV-cache decode then give bitwise-equal logits, and so do HF and a vLLM engine
under ``consistent_vllm``.

What is replaced (instance attributes and refcounted globals; classes are never
edited):

====================================  =====================================  ====================
HF object                             how                                    kernel
====================================  =====================================  ====================
every ``nn.Linear`` (incl. lm_head)   instance ``forward``                   ``linear``
``*RMSNorm`` (HF formula)             instance ``forward``                   ``rms_norm``
``*RotaryEmbedding`` (default,        instance ``forward``: fp32 cos/sin     ``rope_cos_sin``
``llama3``, ``linear``, ``yarn``)     from the shared table of the layer
                                      type's ``RopeParams`` (Gemma 3),
                                      checked against ``inv_freq``, tagged
``apply_rotary_pos_emb`` (modeling    module global, refcounted: tagged      ``rope_apply``
module)                               cos/sin -> kernel, else the original
MLA attention (DeepSeek-V2/V3;        instance ``forward``: HF's own steps,  ``rope_apply``
the ``rope`` family)                  RoPE on the tagged cos/sin; the
                                      latent's ``kv_b_proj`` and the core
                                      through the entries above
attention core                        ``AttentionInterface`` +               ``attention_batched``
                                      ``AttentionMaskInterface`` entry
                                      ``"logdiff_consistent"``;
                                      ``config._attn_implementation``
``*RMSNorm``, ``(1 + w)`` (Gemma)     instance ``forward``                   ``gemma_rms_norm``
gated MLP (``gate/up/down_proj``)     instance ``forward``                   ``silu_and_mul`` or
                                                                             ``gelu_tanh_and_mul``
``lm_head`` with a final soft cap     instance ``forward`` (+ config's cap   ``linear`` + ``softcap``
(Gemma 2)                             set to None while inside)
MoE router (``*TopKRouter``)          instance ``forward`` (fp32 weights)    ``moe_route``
MoE router with a correction bias     instance ``forward`` (fp32 logits,     ``moe_route_grouped``
(``*TopkRouter``: GLM-4.5, DS-V3)     the adapter's ``routing_rule_of``)
MoE experts (``*Experts``, 3-D)       instance ``forward``                   ``moe_experts``
gpt-oss experts (transposed, biased,  instance ``forward``                   ``moe_experts_oai``
interleaved gate/up, clamped SwiGLU)
shared expert (a gated MLP)           as any gated MLP; the block adds it    ``silu_and_mul``
                                      to the routed sum in the model dtype
====================================  =====================================  ====================

Shared experts: a block whose shared expert is a plain gated MLP (the
adapter's ``mlp_parts``) and has no gate of its own (the adapter's
``shared_expert_gate``, Qwen2-MoE's) is covered: the MLP goes through the kernels like any
other, and the block's own ``routed + shared`` is one addition of two
model-dtype tensors, correctly rounded and order-free, so every engine that
adds the same two tensors gets the same bits. Anything else is refused.

Logprobs: consistent mode covers the model up to the logits. Engines compute
logprobs from them with ``logdiff.kernels.log_softmax`` (or
``token_log_probs`` for the chosen tokens), on every path alike.

Which module classes and attributes count as the norm, the gated MLP, the
experts and the attention module is the architecture adapter's knowledge
(``hf_norm_classes``, ``mlp_parts``, ``experts_parts``, ``is_attention``).
Everything is checked before anything is patched: a module that no replacement
covers (another norm, a RoPE type other than default, llama3, linear and yarn, a non-SiLU MLP, a gated shared expert, ...)
raises ``NotImplementedError`` naming it. Every patch goes through
``patching.Patches`` and is undone newest first.

The installer is split by role. This module holds the plan (``_plan``: every module checked and
assigned its replacement before anything is patched) and the context manager that installs and
restores the replacements (``consistent_hf``, with the refcounted process-wide patches of
``_SharedPatch``). The replacements themselves live beside it:
``consistent_forwards`` (linear, norms, the soft-capped head, gated MLPs, MoE routers and
experts), ``consistent_rope`` (the rope parameters read from HF's rotary modules and checked
against their ``inv_freq``, the rotary forward, ``apply_rotary_pos_emb``) and
``consistent_attention`` (the attention function and its mask: positions, key placement).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from logdiff.probes.patching import Patches
from logdiff.sources.hf.consistent_attention import attention_function, consistent_mask
from logdiff.sources.hf.consistent_forwards import (
    OAI_EXPERTS,
    experts_forward,
    linear_forward,
    mlp_forward,
    norm_forward,
    oai_experts_forward,
    router_forward,
    softcapped_logits_forward,
)
from logdiff.sources.hf.consistent_rope import apply_rotary, is_consistent_rope, rope_params_of, rotary_forward

ATTN_IMPLEMENTATION = "logdiff_consistent"
_SILU = {"silu", "swish"}
#: HF activation name -> the gated-MLP kernel that covers it
_GATED = {"silu": "silu_and_mul", "swish": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}


@dataclass
class ConsistentHF:
    """What consistent mode replaced: kind -> module names (yielded by the context manager)."""

    replaced: dict[str, list[str]] = field(default_factory=dict)

    def add(self, kind: str, name: str) -> None:
        self.replaced.setdefault(kind, []).append(name)


class _SharedPatch:
    """A process-wide replacement (module global, registry entry) held while any context needs it."""

    _holders: dict[tuple[int, str], list[Any]] = {}

    @classmethod
    def acquire(cls, mapping: Any, key: str, value: Any, get: Callable, put: Callable, drop: Callable) -> Callable:
        """Install ``value`` under ``key`` (first holder only); returns the release function."""
        slot = (id(mapping), key)
        if slot not in cls._holders:
            present, old = get(mapping, key)
            put(mapping, key, value)
            cls._holders[slot] = [0, present, old]
        cls._holders[slot][0] += 1

        def release() -> None:
            entry = cls._holders[slot]
            entry[0] -= 1
            if entry[0] == 0:
                del cls._holders[slot]
                if entry[1]:
                    put(mapping, key, entry[2])
                else:
                    drop(mapping, key)

        return release


def _get_attr(obj: Any, key: str) -> tuple[bool, Any]:
    return hasattr(obj, key), getattr(obj, key, None)


def _get_item(mapping: dict, key: str) -> tuple[bool, Any]:
    return key in mapping, mapping.get(key)


def _put_item(mapping: dict, key: str, value: Any) -> None:
    mapping[key] = value


def _drop_item(mapping: dict, key: str) -> None:
    mapping.pop(key, None)


# ----------------------------------------------------------------------------- planning


@dataclass
class _Plan:
    linears: list[tuple[str, Any]] = field(default_factory=list)
    norms: list[tuple[str, Any]] = field(default_factory=list)
    rotaries: list[tuple[str, Any, dict]] = field(default_factory=list)  # (name, module, {layer type: RopeParams})
    mlps: list[tuple[str, Any, tuple[str, ...]]] = field(default_factory=list)  # (name, module, mlp_parts)
    gated: str = "silu_and_mul"  # the gated-MLP kernel (by the adapter's activation)
    norm_offset: bool = False  # (1 + w) RMSNorm (Gemma)
    final_softcap: float | None = None  # the logits' soft cap (Gemma 2)
    routers: list[tuple[str, Any, bool, dict | None]] = field(default_factory=list)  # (name, module, renormalize, rule)
    correction_bias: Callable[[Any], Any] | None = None  # a router -> its correction bias (the adapter's)
    experts: list[tuple[str, Any, tuple[str, ...]]] = field(default_factory=list)  # (name, module, experts_parts)
    modeling_modules: set[str] = field(default_factory=set)
    mlas: list[tuple[str, Any, Any]] = field(default_factory=list)  # (name, MLA attention module, its forward)


def _plan(model: Any) -> _Plan:
    import torch.nn as nn

    from logdiff.probes.arch import adapter_of

    config = getattr(model, "config", None)
    if config is None:
        raise NotImplementedError("consistent_hf: the model has no config")
    arch = adapter_of(model)
    window = arch.sliding_window(config)  # the attention kernel masks it (``window``), whatever its length
    layer_types = set(getattr(config, "layer_types", None) or [])
    if layer_types - ({"full_attention", "sliding_attention"} if window else {"full_attention"}):
        raise NotImplementedError(f"consistent_hf: layer types {sorted(layer_types)}")
    plan = _Plan(norm_offset=arch.norm_offset, final_softcap=arch.final_softcap(config))
    plan.correction_bias = arch.correction_bias
    for name, module in model.named_modules():
        cls = type(module).__name__
        refusal = arch.consistent_refusal(module)
        if refusal:
            raise NotImplementedError(f"consistent_hf: {refusal} ({name})")
        if isinstance(module, nn.Linear):
            plan.linears.append((name, module))
        elif cls.endswith("RMSNorm"):
            if cls not in arch.hf_norm_classes:
                raise NotImplementedError(f"consistent_hf: {name} is a {cls} (unknown norm formula)")
            plan.norms.append((name, module))
        elif "Norm" in cls:
            raise NotImplementedError(f"consistent_hf: {name} is a {cls}, not an RMSNorm")
        elif cls.endswith("RotaryEmbedding"):
            plan.rotaries.append((name, module, rope_params_of(module)))
        elif cls.lower().endswith("topkrouter"):  # TopKRouter; GLM-4.5 and DeepSeek-V3: TopkRouter
            renormalize = getattr(module, "norm_topk_prob", arch.router_renormalizes)
            if not all(hasattr(module, a) for a in ("weight", "top_k")) or renormalize is None:
                raise NotImplementedError(f"consistent_hf: router {name} ({cls})")
            plan.routers.append((name, module, bool(renormalize), arch.routing_rule_of(module)))
        elif cls.endswith("Experts") and hasattr(module, arch.experts_parts[0]):
            flags = (getattr(module, "is_transposed", False), getattr(module, "has_bias", False))
            if arch.experts_activation == "swiglu_oai":  # gpt-oss: transposed, biased, gate/up interleaved
                if not all(hasattr(module, a) for a in OAI_EXPERTS):
                    raise NotImplementedError(f"consistent_hf: experts layout of {name} ({cls})")
                plan.experts.append((name, module, oai_experts_forward(module)))
                continue
            if flags != (False, False) or not getattr(module, "is_concatenated", True):
                raise NotImplementedError(f"consistent_hf: experts layout of {name} ({cls})")
            if config.hidden_act not in _SILU:
                raise NotImplementedError(f"consistent_hf: experts activation {config.hidden_act!r}")
            plan.experts.append((name, module, experts_forward(module, arch.experts_parts)))
        elif all(hasattr(module, a) for a in arch.mlp_parts):
            activation = arch.mlp_activation(config)
            if activation not in _GATED:
                raise NotImplementedError(f"consistent_hf: MLP activation {activation!r}")
            plan.gated = _GATED[activation]
            plan.mlps.append((name, module, arch.mlp_parts))
        elif hasattr(module, arch.shared_expert):
            shared = getattr(module, arch.shared_expert)
            if not all(hasattr(shared, a) for a in arch.mlp_parts) or hasattr(module, arch.shared_expert_gate):
                raise NotImplementedError(f"consistent_hf: {name} has a shared expert that is not a plain gated MLP")
        if arch.latent_attention(module):  # MLA: its forward is replaced (RoPE inside it), no apply_rotary_pos_emb
            forward = arch.consistent_attention_forward(module, arch.hf_rope_style(config), is_consistent_rope)
            plan.mlas.append((name, module, forward))
        elif arch.is_attention(module):
            plan.modeling_modules.add(type(module).__module__)
    if not plan.rotaries:
        raise NotImplementedError("consistent_hf: no rotary embedding module found")
    if len(plan.routers) != len(plan.experts):
        raise NotImplementedError("consistent_hf: MoE blocks without a TopKRouter/Experts pair")
    for mod_name in plan.modeling_modules:
        if not hasattr(sys.modules[mod_name], "apply_rotary_pos_emb"):
            raise NotImplementedError(f"consistent_hf: {mod_name} has no apply_rotary_pos_emb")
    return plan


# ----------------------------------------------------------------------------- the context manager


def _aten_overrides_on_cuda(model: Any) -> Any:
    """On CUDA, the aten GEMMs/log-softmax/mean no patch reaches go fixed-order too, as under the vLLM
    ``cuda`` backend in the same process (``kernels.aten_overrides``; not yet run on a GPU). CPU: nothing."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return contextlib.nullcontext()
    from logdiff.kernels.aten_overrides import aten_overrides

    return aten_overrides("CUDA")


@contextlib.contextmanager
def consistent_hf(model: Any, only: Collection[str] | None = None) -> Iterator[ConsistentHF]:
    """Install the consistent kernels into ``model`` for the duration of the block.

    ``only`` limits the swap to some op families (``linear``, ``rms_norm``, ``rope``,
    ``silu_and_mul``, ``attention``, ``moe``); attribution installs one at a time.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from logdiff import kernels

    plan = _plan(model)
    report = ConsistentHF()

    def want(family: str) -> bool:
        return only is None or family in only

    with Patches() as patches, kernels.weight_cache(), _aten_overrides_on_cuda(model):
        for name, module in plan.linears if want("linear") else []:
            patches.set(module, "forward", linear_forward(module))
            report.add("linear", name)
        if plan.final_softcap is not None and want("linear"):
            head = model.get_output_embeddings()
            patches.set(model.config, "final_logit_softcapping", None)
            patches.set(head, "forward", softcapped_logits_forward(head, plan.final_softcap))
            report.add("linear", "final_logit_softcapping")
        for name, module in plan.norms if want("rms_norm") else []:
            patches.set(module, "forward", norm_forward(module, plan.norm_offset))
            report.add("rms_norm", name)
        for name, module, ropes in plan.rotaries if want("rope") else []:
            patches.set(module, "forward", rotary_forward(ropes))
            report.add("rope", name)
        for mod_name in sorted(plan.modeling_modules) if want("rope") else []:
            modeling = importlib.import_module(mod_name)
            original = modeling.apply_rotary_pos_emb
            patches.on_exit(
                _SharedPatch.acquire(
                    modeling, "apply_rotary_pos_emb", apply_rotary(original), _get_attr, setattr, delattr
                )
            )
            report.add("rope", f"{mod_name}.apply_rotary_pos_emb")
        for name, module, forward in plan.mlas if want("rope") else []:
            patches.set(module, "forward", forward)
            report.add("rope", f"{name}.forward")
        for name, module, parts in plan.mlps if want("silu_and_mul") else []:
            patches.set(module, "forward", mlp_forward(module, parts, plan.gated))
            report.add("silu_and_mul", name)
        for name, module, renormalize, rule in plan.routers if want("moe") else []:
            patches.set(module, "forward", router_forward(module, renormalize, rule, plan.correction_bias))
            report.add("moe_route", name)
        for name, module, forward in plan.experts if want("moe") else []:
            patches.set(module, "forward", forward)
            report.add("moe_combine", name)
        if want("attention"):
            for interface, value in (
                (AttentionInterface._global_mapping, attention_function()),
                (AttentionMaskInterface._global_mapping, consistent_mask),
            ):
                patches.on_exit(
                    _SharedPatch.acquire(interface, ATTN_IMPLEMENTATION, value, _get_item, _put_item, _drop_item)
                )
            previous = model.config._attn_implementation
            model.config._attn_implementation = ATTN_IMPLEMENTATION
            patches.on_exit(lambda: setattr(model.config, "_attn_implementation", previous))
            report.add("attention", ATTN_IMPLEMENTATION)
        yield report
