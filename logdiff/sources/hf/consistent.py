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

Attention: HF hands the function the whole cache (decode) or the whole padded
batch (prefill) and a boolean 4-D mask. The consistent mask function tags the
mask with each query's and key's absolute position (from the 2-D padding mask
and the cache's offsets: a sliding-window cache holds only the last
``window - 1`` keys), and each sequence's keys go to their absolute slots, so
key ``j`` of the kernel is the sequence's ``j``-th real token; slots of keys a
sliding-window cache dropped stay zero. The layer's ``sliding_window`` goes to
the kernel's ``window``. The mask must equal what the kernel then sees (causal,
within the window) for every real query, and every key a query sees must be in
the cache; anything else (packed sequences, bidirectional masks) raises
``NotImplementedError``. An untagged mask is compacted instead (visible keys to
the front, a causal prefix required, no window). Soft-capped scores (Gemma 2's
``softcap``) go to the kernel's ``softcap``, attention sinks (gpt-oss's ``s_aux``) to its ``sinks``.
The layout is computed once per
mask object (layers of one type share it).

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
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from logdiff.probes.patching import Patches

ATTN_IMPLEMENTATION = "logdiff_consistent"
_ROPE_TAG = "_logdiff_consistent_rope"
_POSITIONS_TAG = "_logdiff_consistent_positions"  # on a mask: (query positions [B, T], key positions [B, S])
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


def rope_params_of(module: Any) -> dict[str | None, Any]:
    """``{layer type: RopeParams}`` of an HF rotary module, each checked against its inv_freq buffer.

    A module with one rope gives one entry under ``None``; Gemma 3's computes cos/sin per layer type
    (``forward(x, position_ids, layer_type)``, ``{type}_inv_freq``, ``rope_parameters[type]``).
    """
    config = module.config
    params = getattr(config, "rope_parameters", None) or {}
    types = getattr(module, "layer_types", None)
    if not types:
        if "rope_theta" not in params and getattr(config, "rope_theta", None) is not None:
            params = {**params, "rope_theta": config.rope_theta}
        buffer = getattr(module, "original_inv_freq", module.inv_freq)
        scaling = getattr(module, "attention_scaling", 1.0)
        return {None: _checked_rope(getattr(module, "rope_type", "default"), scaling, params, buffer)}
    return {
        t: _checked_rope(
            module.rope_type[t],
            getattr(module, f"{t}_attention_scaling", 1.0),
            params.get(t) or {},
            getattr(module, f"{t}_original_inv_freq", getattr(module, f"{t}_inv_freq")),
        )
        for t in types
    }


#: HF ``rope_parameters`` keys of each covered scaled rope type -> their default (None: required), as HF
#: reads them; each fills the ``RopeParams`` field of its name
_ROPE_FIELDS: dict[str, dict[str, Any]] = {
    "llama3": dict.fromkeys(("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")),
    "linear": {"factor": None},
    "yarn": {"factor": None, "original_max_position_embeddings": None, "beta_fast": 32, "beta_slow": 1, "truncate": True},
}


def _checked_rope(rope_type: str, scaling: float, params: dict, buffer: Any) -> Any:
    """The ``RopeParams`` of one HF rope (``params``: its ``rope_parameters``), whose inv_freq ``buffer``
    must be what the kernel computes from them (``kernels.rope.inv_freq_matches``). yarn's cos/sin factor
    is the module's ``attention_scaling`` (HF resolves it from the config)."""
    from logdiff.kernels import RopeParams
    from logdiff.kernels.rope import inv_freq_matches, rope_attention_scaling

    if rope_type != "default" and rope_type not in _ROPE_FIELDS:
        raise NotImplementedError(
            f"consistent_hf: rope_type {rope_type!r} (covered: default, {', '.join(_ROPE_FIELDS)})"
        )
    theta = params.get("rope_theta")
    if theta is None:
        raise NotImplementedError("consistent_hf: cannot find rope_theta in the config")
    wanted = _ROPE_FIELDS.get(rope_type, {})
    missing = [k for k, default in wanted.items() if default is None and params.get(k) is None]
    if missing:
        raise NotImplementedError(f"consistent_hf: rope_type {rope_type!r} without {', '.join(missing)} in the config")
    fields = {k: default if params.get(k) is None else params[k] for k, default in wanted.items()}
    if rope_type == "yarn":
        fields["attention_factor"] = float(scaling)
    try:
        rope = RopeParams(float(theta), 2 * buffer.numel(), rope_type, **fields)
    except ValueError as e:
        raise NotImplementedError(f"consistent_hf: {e}") from None
    if float(scaling) != rope_attention_scaling(rope):
        raise NotImplementedError(f"consistent_hf: rope_type {rope_type!r} with attention scaling {float(scaling)}")
    if not inv_freq_matches(rope, buffer):
        raise NotImplementedError(
            f"consistent_hf: the rotary module's inv_freq is not what its rope_parameters give ({rope_type} rope)"
        )
    return rope


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
                if not all(hasattr(module, a) for a in _OAI_EXPERTS):
                    raise NotImplementedError(f"consistent_hf: experts layout of {name} ({cls})")
                plan.experts.append((name, module, _oai_experts_forward(module)))
                continue
            if flags != (False, False) or not getattr(module, "is_concatenated", True):
                raise NotImplementedError(f"consistent_hf: experts layout of {name} ({cls})")
            if config.hidden_act not in _SILU:
                raise NotImplementedError(f"consistent_hf: experts activation {config.hidden_act!r}")
            plan.experts.append((name, module, _experts_forward(module, arch.experts_parts)))
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
            forward = arch.consistent_attention_forward(module, arch.hf_rope_style(config), _is_consistent_rope)
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


# ----------------------------------------------------------------------------- replacements


def _linear_forward(module: Any) -> Callable:
    from logdiff import kernels

    def forward(x: Any) -> Any:
        return kernels.linear(x, module.weight, module.bias)

    return forward


def _norm_forward(module: Any, offset: bool) -> Callable:
    """``rms_norm``, or ``gemma_rms_norm`` for a ``(1 + w)`` norm (whose eps HF calls ``eps``)."""
    from logdiff import kernels

    if offset:
        return lambda hidden_states: kernels.gemma_rms_norm(hidden_states, module.weight, module.eps)

    def forward(hidden_states: Any) -> Any:
        return kernels.rms_norm(hidden_states, module.weight, module.variance_epsilon)

    return forward


def _softcapped_logits_forward(module: Any, cap: float) -> Callable:
    """``lm_head`` with the final soft cap folded in (HF's own cap is switched off meanwhile)."""
    from logdiff import kernels

    return lambda x: kernels.softcap(kernels.linear(x, module.weight, module.bias), cap)


def _rotary_forward(ropes: dict[str | None, Any]) -> Callable:
    """The rotary module's ``forward``: cos/sin from the table of the calling layer type's rope (Gemma 3 asks
    per ``layer_type``; other families have one rope, under ``None``)."""
    import torch

    from logdiff import kernels

    def forward(x: Any, position_ids: Any, layer_type: str | None = None) -> tuple[Any, Any]:
        if layer_type not in ropes:
            raise NotImplementedError(f"consistent_hf: no RoPE for layer type {layer_type!r}")
        cos, sin = kernels.rope_cos_sin(position_ids, ropes[layer_type])
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)  # HF's [.., rotary_dim] layout
        setattr(cos, _ROPE_TAG, True)
        setattr(sin, _ROPE_TAG, True)
        return cos, sin

    return forward


def _apply_rotary(original: Callable) -> Callable:
    """``apply_rotary_pos_emb`` that rotates with the kernel when handed tagged (consistent) cos/sin."""
    import inspect

    from logdiff import kernels

    signature = inspect.signature(original)

    def apply_rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if not getattr(cos, _ROPE_TAG, False):
            return original(q, k, cos, sin, *args, **kwargs)
        bound = signature.bind(q, k, cos, sin, *args, **kwargs)
        bound.apply_defaults()
        unsqueeze_dim = bound.arguments.get("unsqueeze_dim", 1)
        half = cos.shape[-1] // 2
        c = cos[..., :half].unsqueeze(unsqueeze_dim)
        s = sin[..., :half].unsqueeze(unsqueeze_dim)
        return kernels.rope_apply(q, c, s, "neox"), kernels.rope_apply(k, c, s, "neox")

    return apply_rotary_pos_emb


def _is_consistent_rope(cos: Any) -> bool:
    """Whether ``cos`` came from a rotary module this installer patched (its tables are the kernel's)."""
    return bool(getattr(cos, _ROPE_TAG, False))


def _mlp_forward(module: Any, parts: tuple[str, ...], gated: str = "silu_and_mul") -> Callable:
    """``down(act(gate(x)) * up(x))`` with the ``gated`` kernel; three parts (gate_up, down, act) mean a
    packed gate/up (Phi-3)."""
    from logdiff import kernels

    act_mul = getattr(kernels, gated)
    if len(parts) == 3:
        gate_up, down = getattr(module, parts[0]), getattr(module, parts[1])

        def fused(x: Any) -> Any:
            return down(act_mul(*gate_up(x).chunk(2, dim=-1)))

        return fused
    gate, up, down = (getattr(module, p) for p in parts[:3])

    def forward(x: Any) -> Any:
        return down(act_mul(gate(x), up(x)))

    return forward


def _router_forward(
    module: Any, renormalize: bool, rule: dict | None = None, bias_of: Callable | None = None
) -> Callable:
    """Softmax top-k routing, or with a ``rule`` the grouped, bias-corrected one on fp32 logits (as HF's
    DeepSeek-V3 and GLM-4.5 routers compute them); ``bias_of`` reads the router's correction bias at
    each call (training may move it)."""
    from logdiff import kernels

    def forward(hidden_states: Any) -> tuple[Any, Any, Any]:
        rows = hidden_states.reshape(-1, module.weight.shape[1])
        if rule is None:
            router_logits = kernels.linear(rows, module.weight, getattr(module, "bias", None))  # gpt-oss: biased
            weights, ids = kernels.moe_route(router_logits, int(module.top_k), renormalize)
            return router_logits, weights, ids
        router_logits = kernels.linear(rows.float(), module.weight)  # fp32 GEMM (the kernel casts the weight)
        bias = bias_of(module) if bias_of is not None else None
        weights, ids = kernels.moe_route_grouped(router_logits, int(module.top_k), renormalize, bias=bias, **rule)
        return router_logits, weights, ids

    return forward


def _experts_forward(module: Any, parts: tuple[str, ...]) -> Callable:
    from logdiff import kernels

    gate_up, down = parts

    def forward(hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        return kernels.moe_experts(hidden_states, top_k_weights, top_k_index, getattr(module, gate_up), getattr(module, down))

    return forward


#: a gpt-oss experts module's parameters and constants
_OAI_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias", "alpha", "limit")


def _oai_experts_forward(module: Any) -> Callable:
    """gpt-oss's experts (``gate_up_proj [E, H, 2I]``, gate/up interleaved, biased, clamped SwiGLU) through
    ``moe_experts_oai``, which takes vLLM's ``[E, 2I, H]`` layout: HF's tensors transposed, read at each call
    (training may move them)."""
    from logdiff import kernels

    def forward(hidden_states: Any, router_indices: Any, routing_weights: Any) -> Any:
        m = module
        return kernels.moe_experts_oai(
            hidden_states, routing_weights, router_indices, m.gate_up_proj.transpose(1, 2), m.gate_up_proj_bias,
            m.down_proj.transpose(1, 2), m.down_proj_bias, float(m.alpha), float(m.limit),
        )

    return forward


class _MaskLayout:
    """Per-sequence key compaction and query positions derived from HF's 4-D mask, cached per mask."""

    def __init__(self) -> None:
        self._mask: Any = None
        self._shape: tuple[int, ...] = ()
        self._layout: tuple[Any, Any, Any] = (None, None, None)

    def get(self, mask: Any, b: int, t: int, s: int, device: Any) -> tuple[Any, Any, Any]:
        """``(q_positions [B, T], key_index [B, S'] or None, kv_lens [B])``."""
        if mask is not None and mask is self._mask and self._shape == (b, t, s):
            return self._layout
        layout = self._compute(mask, b, t, s, device)
        self._mask, self._shape, self._layout = mask, (b, t, s), layout
        return layout

    @staticmethod
    def _compute(mask: Any, b: int, t: int, s: int, device: Any) -> tuple[Any, Any, Any]:
        import torch

        if mask is None:  # plain causal, no padding
            q_pos = torch.arange(s - t, s, device=device).expand(b, t)
            return q_pos, None, torch.full((b,), s, dtype=torch.int64, device=device)
        if mask.dim() != 4 or mask.shape[1] != 1:
            raise NotImplementedError(f"consistent attention: mask of shape {tuple(mask.shape)}")
        visible = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
        visible = visible.expand(b, t, s)
        key_real = visible.any(1)
        kv_lens = key_real.sum(-1)
        q_pos = visible.sum(-1) - 1
        order = torch.sort((~key_real).to(torch.uint8), dim=-1, stable=True).indices
        identity = bool((order == torch.arange(s, device=device)).all())
        compact = visible if identity else visible.gather(-1, order[:, None, :].expand(b, t, s))
        if not torch.equal(compact, torch.arange(s, device=device) <= q_pos[..., None]):
            raise NotImplementedError(
                "consistent attention: the mask is not a causal prefix per sequence (sliding window, packed sequences?)"
            )
        key_index = None if identity else order[:, : int(kv_lens.max())]
        return q_pos, key_index, kv_lens


def _attention_function() -> Callable:
    from logdiff import kernels

    layouts = _MaskLayout()
    placed = _PlacedKeys()

    def consistent_attention(
        module: Any,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any,
        scaling: float | None = None,
        dropout: float = 0.0,
        sliding_window: int | None = None,
        **kwargs: Any,
    ) -> tuple[Any, None]:
        if dropout:
            raise NotImplementedError("consistent attention: dropout (call model.eval())")
        b, _, t, d = query.shape
        s = key.shape[2]
        window = int(sliding_window) if sliding_window else None
        positions = getattr(attention_mask, _POSITIONS_TAG, None)
        if positions is not None:  # the mask came from _consistent_mask: keys go to their absolute positions
            q_pos, slots, kv_lens = placed.get(attention_mask, positions, window)
            key, value = _place_keys(key, slots, int(kv_lens.max())), _place_keys(value, slots, int(kv_lens.max()))
        else:
            if window:
                raise NotImplementedError("consistent attention: a sliding window needs the consistent mask")
            q_pos, key_index, kv_lens = layouts.get(attention_mask, b, t, s, query.device)
            if key_index is not None:
                index = key_index[:, None, :, None].expand(-1, key.shape[1], -1, d)
                v_index = key_index[:, None, :, None].expand(-1, value.shape[1], -1, value.shape[-1])
                key, value = key.gather(2, index), value.gather(2, v_index)
        scale = d**-0.5 if scaling is None else float(scaling)
        out = kernels.attention_batched(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), q_pos, scale, kv_lens,
            kwargs.get("softcap"), window, kwargs.get("s_aux"),
        )
        return out, None

    return consistent_attention


def _consistent_mask(*args: Any, **kwargs: Any) -> Any:
    """HF's boolean sdpa mask, always materialised (never the ``None`` 'is_causal' shortcut), tagged with
    each query's and key's absolute position (:func:`_mask_positions`)."""
    import inspect

    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    mask = sdpa_mask(*args, **kwargs)
    if mask is not None:
        bound = inspect.signature(sdpa_mask).bind(*args, **kwargs)
        bound.apply_defaults()
        setattr(mask, _POSITIONS_TAG, _mask_positions(**{k: bound.arguments[k] for k in _POSITION_ARGS}))
    return mask


_POSITION_ARGS = ("batch_size", "q_length", "kv_length", "q_offset", "kv_offset", "attention_mask")


def _mask_positions(
    batch_size: int, q_length: int, kv_length: int, q_offset: Any, kv_offset: int, attention_mask: Any
) -> tuple[Any, Any]:
    """``(query positions [B, T], key positions [B, S])``: the absolute position of each query and key of a
    mask call, -1 for padding. Columns of the 2-D padding mask are the cache's token slots (a sliding-window
    cache's keys start at ``kv_offset``); a token's position is the number of real tokens before it."""
    import torch

    total = int(kv_offset) + int(kv_length)
    if attention_mask is None:
        real = torch.ones(batch_size, total, dtype=torch.bool)
    else:
        real = attention_mask.bool().cpu()
        if real.shape[-1] < total:  # HF pads the 2-D mask with real tokens the same way (prepare_padding_mask)
            real = torch.nn.functional.pad(real, (0, total - real.shape[-1]), value=True)
        real = real[:, :total].expand(batch_size, total)
    slot_pos = torch.where(real, real.long().cumsum(-1) - 1, -1)
    q_slots = torch.arange(int(q_offset), int(q_offset) + int(q_length))
    return slot_pos[:, q_slots], slot_pos[:, int(kv_offset) : total]


def _place_keys(x: Any, slots: Any, length: int) -> Any:
    """Keys (or values) ``[B, H, S, D]`` moved to their absolute positions ``[B, H, length, D]``; slots no key
    fills (keys a sliding-window cache dropped) stay zero, and padding keys (slot ``length``) are dropped."""
    b, h, _, d = x.shape
    out = x.new_zeros(b, h, length + 1, d)
    out.scatter_(2, slots[:, None, :, None].expand(b, h, -1, d).to(x.device), x)
    return out[:, :, :length]


class _PlacedKeys:
    """Per mask (and window): query positions, each key's slot and ``kv_lens``, checked against the mask."""

    def __init__(self) -> None:
        self._last: list[tuple[Any, Any, tuple[Any, Any, Any]]] = []  # (mask, window, layout), newest last

    def get(self, mask: Any, positions: tuple[Any, Any], window: int | None) -> tuple[Any, Any, Any]:
        for held, held_window, layout in self._last:
            if held is mask and held_window == window:
                return layout
        layout = self._compute(mask, *positions, window)
        self._last = [*self._last[-3:], (mask, window, layout)]  # a hybrid model alternates two masks
        return layout

    @staticmethod
    def _compute(mask: Any, q_pos: Any, key_pos: Any, window: int | None) -> tuple[Any, Any, Any]:
        """Raises where the kernel would not see what the mask shows (another mask function, missing keys)."""
        import torch

        device = mask.device
        q_pos, key_pos = q_pos.to(device), key_pos.to(device)
        kv_lens = (key_pos.amax(-1) + 1).clamp(min=0)
        length = int(kv_lens.max())
        slots = torch.where(key_pos >= 0, key_pos, length)
        # what the kernel shows each real query, in the mask's own columns
        sees = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= q_pos[..., None])
        if window:
            sees &= key_pos[:, None, :] > q_pos[..., None] - window
        visible = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
        real = (q_pos >= 0)[..., None]
        if not torch.equal(visible.expand_as(sees) & real, sees & real):
            raise NotImplementedError(
                "consistent attention: the mask is not causal per sequence (with the layer's window): packed sequences?"
            )
        # every key a real query sees must be in the cache (a sliding-window cache drops only older ones)
        present = torch.zeros(key_pos.shape[0], length + 1, dtype=torch.long, device=device)
        present.scatter_(1, slots, 1)
        needed = q_pos + 1 if not window else torch.minimum(q_pos + 1, torch.full_like(q_pos, window))
        have = present[:, :length].cumsum(-1)
        first = (q_pos - needed).clamp(min=-1)
        count = have.gather(1, q_pos.clamp(min=0)) - torch.where(first >= 0, have.gather(1, first.clamp(min=0)), 0)
        if bool(((count != needed) & (q_pos >= 0)).any()):
            raise NotImplementedError("consistent attention: a key in a query's window is missing from the cache")
        return q_pos, slots, kv_lens


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
            patches.set(module, "forward", _linear_forward(module))
            report.add("linear", name)
        if plan.final_softcap is not None and want("linear"):
            head = model.get_output_embeddings()
            patches.set(model.config, "final_logit_softcapping", None)
            patches.set(head, "forward", _softcapped_logits_forward(head, plan.final_softcap))
            report.add("linear", "final_logit_softcapping")
        for name, module in plan.norms if want("rms_norm") else []:
            patches.set(module, "forward", _norm_forward(module, plan.norm_offset))
            report.add("rms_norm", name)
        for name, module, ropes in plan.rotaries if want("rope") else []:
            patches.set(module, "forward", _rotary_forward(ropes))
            report.add("rope", name)
        for mod_name in sorted(plan.modeling_modules) if want("rope") else []:
            modeling = importlib.import_module(mod_name)
            original = modeling.apply_rotary_pos_emb
            patches.on_exit(
                _SharedPatch.acquire(
                    modeling, "apply_rotary_pos_emb", _apply_rotary(original), _get_attr, setattr, delattr
                )
            )
            report.add("rope", f"{mod_name}.apply_rotary_pos_emb")
        for name, module, forward in plan.mlas if want("rope") else []:
            patches.set(module, "forward", forward)
            report.add("rope", f"{name}.forward")
        for name, module, parts in plan.mlps if want("silu_and_mul") else []:
            patches.set(module, "forward", _mlp_forward(module, parts, plan.gated))
            report.add("silu_and_mul", name)
        for name, module, renormalize, rule in plan.routers if want("moe") else []:
            patches.set(module, "forward", _router_forward(module, renormalize, rule, plan.correction_bias))
            report.add("moe_route", name)
        for name, module, forward in plan.experts if want("moe") else []:
            patches.set(module, "forward", forward)
            report.add("moe_combine", name)
        if want("attention"):
            for interface, value in (
                (AttentionInterface._global_mapping, _attention_function()),
                (AttentionMaskInterface._global_mapping, _consistent_mask),
            ):
                patches.on_exit(
                    _SharedPatch.acquire(interface, ATTN_IMPLEMENTATION, value, _get_item, _put_item, _drop_item)
                )
            previous = model.config._attn_implementation
            model.config._attn_implementation = ATTN_IMPLEMENTATION
            patches.on_exit(lambda: setattr(model.config, "_attn_implementation", previous))
            report.add("attention", ATTN_IMPLEMENTATION)
        yield report
