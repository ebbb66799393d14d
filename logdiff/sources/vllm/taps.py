"""Where vLLM's modules expose each adapter's boundaries: the vLLM engine's ``TapMapping``.

The adapters (probes/arch/) say which boundaries a model has; this module says
which vLLM module call yields each one (``probes.correspondence.Tap``), undoing
vLLM's fusions: the packed ``qkv_proj`` output is split into q/k/v with the
attention module's ``q_size``/``kv_size``, ``gate_up_proj`` into halves; its
RMSNorm adds the residual and returns ``(normed, residual)``, so
``input_layernorm`` of layer N also yields layer N-1's ``residual_mlp``,
``post_attention_layernorm`` yields ``residual_attn`` and ``model.norm`` the last
layer's ``residual_mlp``. RoPE and the attention core are modules here
(``rotary_emb``, ``attn``); the logits come from vLLM's logits processor, not a tap.

``TAPS.default`` is the Llama-like layout every ``DecoderAdapter`` shares (the
MoE block renamed to the adapter's ``moe_block``: Mixtral's
``block_sparse_moe``); ``TAPS.builders`` holds one builder per adapter ``name``
whose modules differ, each taking the adapter and the model's HF config.
vllm-ascend runs vLLM's model code and reuses this mapping (a derived engine
would ``TAPS.extended({...})`` where its modules differ). Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from logdiff.probes.correspondence import Tap, TapMapping

_L = r"model\.layers\.{N}"
_N = "model.layers.{N}"

#: the Llama-like decoder (dense MLP or routed MoE; q/k norms tapped where the module exists)
DECODER_TAPS = (
    Tap(r"model\.embed_tokens", "output", "tensor", ("model.embed_tokens",)),
    Tap(_L + r"\.input_layernorm", "output", "norm_pair", (f"{_N}.input_layernorm", "{PREV_RES}")),
    Tap(
        _L + r"\.self_attn\.qkv_proj",
        "output",
        "split_qkv",
        (f"{_N}.self_attn.q_proj", f"{_N}.self_attn.k_proj", f"{_N}.self_attn.v_proj"),
    ),
    Tap(_L + r"\.self_attn\.q_norm", "output", "tensor", (f"{_N}.self_attn.q_norm",)),
    Tap(_L + r"\.self_attn\.k_norm", "output", "tensor", (f"{_N}.self_attn.k_norm",)),
    Tap(_L + r"\.self_attn\.rotary_emb", "output", "pair", (f"{_N}.self_attn.rope_q", f"{_N}.self_attn.rope_k")),
    Tap(_L + r"\.self_attn\.attn", "output", "tensor", (f"{_N}.self_attn.attn_core",)),
    Tap(_L + r"\.self_attn\.o_proj", "output", "first", (f"{_N}.self_attn.o_proj",)),
    Tap(
        _L + r"\.post_attention_layernorm",
        "output",
        "pair",
        (f"{_N}.post_attention_layernorm", f"{_N}.residual_attn"),
    ),
    Tap(_L + r"\.mlp\.gate_up_proj", "output", "split_half", (f"{_N}.mlp.gate_proj", f"{_N}.mlp.up_proj")),
    Tap(_L + r"\.mlp\.act_fn", "output", "tensor", (f"{_N}.mlp.act_mul",)),
    Tap(_L + r"\.mlp\.down_proj", "output", "first", (f"{_N}.mlp.down_proj",)),
    # the MoE router: vLLM's fused-MoE runner calls the gate as its own child
    Tap(_L + r"\.mlp(?:\.experts)?\.gate", "output", "first", (f"{_N}.mlp.gate",)),
    Tap(_L + r"\.mlp", "output", "tensor", (f"{_N}.mlp",)),
    Tap(r"model\.norm", "output", "norm_pair", ("model.norm", "{LAST_RES}")),
)

#: vLLM's fused-MoE runner calls the shared experts through its ``SharedExperts`` wrapper (holding them as
#: ``_layer``): that call-stack name, or the plain one
_SE = _L + r"\.mlp(?:\.shared_experts|\.experts\._shared_experts\._layer)"
_SEB = f"{_N}.mlp.shared_experts"
#: a MoE block's shared experts: a plain gated MLP on every token (GLM-4.5, DeepSeek)
SHARED_EXPERT_TAPS = (
    Tap(_SE + r"\.gate_up_proj", "output", "split_half", (f"{_SEB}.gate_proj", f"{_SEB}.up_proj")),
    Tap(_SE + r"\.act_fn", "output", "tensor", (f"{_SEB}.act_mul",)),
    Tap(_SE + r"\.down_proj", "output", "first", (f"{_SEB}.down_proj",)),
)

#: Gemma 2: the scaled embeddings read where they enter layer 0 (vLLM scales outside any module); the attention
#: add fused into ``pre_feedforward_layernorm``, the post-norms plain
GEMMA2_TAPS = (
    Tap(r"model\.layers\.0\.input_layernorm", "input", "tensor", ("model.embed_tokens",)),
    Tap(_L + r"\.input_layernorm", "output", "norm_pair", (f"{_N}.input_layernorm", "{PREV_RES}")),
    Tap(
        _L + r"\.self_attn\.qkv_proj",
        "output",
        "split_qkv",
        (f"{_N}.self_attn.q_proj", f"{_N}.self_attn.k_proj", f"{_N}.self_attn.v_proj"),
    ),
    Tap(_L + r"\.self_attn\.rotary_emb", "output", "pair", (f"{_N}.self_attn.rope_q", f"{_N}.self_attn.rope_k")),
    Tap(_L + r"\.self_attn\.attn", "output", "tensor", (f"{_N}.self_attn.attn_core",)),
    Tap(_L + r"\.self_attn\.o_proj", "output", "first", (f"{_N}.self_attn.o_proj",)),
    Tap(_L + r"\.post_attention_layernorm", "output", "first", (f"{_N}.post_attention_layernorm",)),
    Tap(
        _L + r"\.pre_feedforward_layernorm",
        "output",
        "pair",
        (f"{_N}.pre_feedforward_layernorm", f"{_N}.residual_attn"),
    ),
    Tap(_L + r"\.mlp\.gate_up_proj", "output", "split_half", (f"{_N}.mlp.gate_proj", f"{_N}.mlp.up_proj")),
    Tap(_L + r"\.mlp\.act_fn", "output", "tensor", (f"{_N}.mlp.act_mul",)),
    Tap(_L + r"\.mlp\.down_proj", "output", "first", (f"{_N}.mlp.down_proj",)),
    Tap(_L + r"\.post_feedforward_layernorm", "output", "first", (f"{_N}.post_feedforward_layernorm",)),
    Tap(r"model\.norm", "output", "norm_pair", ("model.norm", "{LAST_RES}")),
)
#: Gemma 3's q/k norms, which vLLM runs on ``[T, heads, D]``
GEMMA3_QK_NORM_TAPS = tuple(
    Tap(_L + rf"\.self_attn\.{norm}", "output", "tensor", (f"{_N}.self_attn.{norm}",)) for norm in ("q_norm", "k_norm")
)

_GA = _L + r"\.attn"
#: GPT-OSS: vLLM's own names (``model.embedding``, ``layers.N.attn``, ``mlp.router``) mapped to HF's boundaries
GPT_OSS_TAPS = (
    Tap(r"model\.embedding", "output", "tensor", ("model.embed_tokens",)),
    Tap(_L + r"\.input_layernorm", "output", "norm_pair", (f"{_N}.input_layernorm", "{PREV_RES}")),
    Tap(
        _GA + r"\.qkv_proj",
        "output",
        "split_qkv",
        (f"{_N}.self_attn.q_proj", f"{_N}.self_attn.k_proj", f"{_N}.self_attn.v_proj"),
    ),
    Tap(_GA + r"\.rotary_emb", "output", "pair", (f"{_N}.self_attn.rope_q", f"{_N}.self_attn.rope_k")),
    Tap(_GA + r"\.attn", "output", "tensor", (f"{_N}.self_attn.attn_core",)),
    Tap(_GA + r"\.o_proj", "output", "first", (f"{_N}.self_attn.o_proj",)),
    Tap(
        _L + r"\.post_attention_layernorm",
        "output",
        "pair",
        (f"{_N}.post_attention_layernorm", f"{_N}.residual_attn"),
    ),
    Tap(_L + r"\.mlp\.router", "output", "first", (f"{_N}.mlp.router",)),
    Tap(_L + r"\.mlp", "output", "first", (f"{_N}.mlp",)),
    Tap(r"model\.norm", "output", "norm_pair", ("model.norm", "{LAST_RES}")),
)

_A = _L + r"\.self_attn(?:\.mla_attn)?"  # vLLM's MLA wrapper calls the attention's children
_Q_SPLIT = "split_heads:qk_nope_head_dim,qk_rope_head_dim"
_KV_SPLIT = "split:kv_lora_rank,qk_rope_head_dim"
_KV = f"{_N}.self_attn.kv_a_proj_with_mqa"


def _q_taps(q: str) -> tuple[Tap, ...]:
    """An MLA query projection, split per head into its no-position and RoPE parts."""
    return (Tap(_A + rf"\.{q}", "output", _Q_SPLIT, (f"{_N}.self_attn.{q}.nope", f"{_N}.self_attn.{q}.pe")),)


#: DeepSeek-V2/V3: MLA (q-LoRA's packed ``fused_qkv_a_proj`` split in three; the MLA core read as
#: ``latent_attn``) and shared experts
DEEPSEEK_TAPS = (
    Tap(r"model\.embed_tokens", "output", "tensor", ("model.embed_tokens",)),
    Tap(_L + r"\.input_layernorm", "output", "norm_pair", (f"{_N}.input_layernorm", "{PREV_RES}")),
    *_q_taps("q_proj"),
    Tap(
        _A + r"\.fused_qkv_a_proj",
        "output",
        "split:q_lora_rank,kv_lora_rank,qk_rope_head_dim",
        (f"{_N}.self_attn.q_a_proj", f"{_KV}.compressed_kv", f"{_KV}.k_pe"),
    ),
    Tap(_A + r"\.q_a_layernorm", "output", "tensor", (f"{_N}.self_attn.q_a_layernorm",)),
    *_q_taps("q_b_proj"),
    Tap(_A + r"\.kv_a_proj_with_mqa", "output", _KV_SPLIT, (f"{_KV}.compressed_kv", f"{_KV}.k_pe")),
    Tap(_A + r"\.kv_a_layernorm", "output", "tensor", (f"{_N}.self_attn.kv_a_layernorm",)),
    Tap(_A + r"\.rotary_emb", "output", "pair", (f"{_N}.self_attn.rope_q", f"{_N}.self_attn.rope_k")),
    Tap(_L + r"\.self_attn\.mla_attn\.mla_attn", "output", "tensor", (f"{_N}.self_attn.latent_attn",)),
    Tap(_A + r"\.o_proj", "output", "first", (f"{_N}.self_attn.o_proj",)),
    Tap(
        _L + r"\.post_attention_layernorm",
        "output",
        "pair",
        (f"{_N}.post_attention_layernorm", f"{_N}.residual_attn"),
    ),
    Tap(_L + r"\.mlp\.gate_up_proj", "output", "split_half", (f"{_N}.mlp.gate_proj", f"{_N}.mlp.up_proj")),
    Tap(_L + r"\.mlp\.act_fn", "output", "tensor", (f"{_N}.mlp.act_mul",)),
    Tap(_L + r"\.mlp\.down_proj", "output", "first", (f"{_N}.mlp.down_proj",)),
    *SHARED_EXPERT_TAPS,
    Tap(_L + r"\.mlp(?:\.experts)?\.gate", "output", "first", (f"{_N}.mlp.gate",)),
    Tap(_L + r"\.mlp", "output", "tensor", (f"{_N}.mlp",)),
    Tap(r"model\.norm", "output", "norm_pair", ("model.norm", "{LAST_RES}")),
)


def decoder_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    """Any Llama-like ``DecoderAdapter``, its MoE block under the name vLLM gives it (``moe_block``)."""
    if adapter.moe_block == "mlp":
        return list(DECODER_TAPS)
    return [replace(t, pattern=t.pattern.replace(r"\.mlp", "\\." + adapter.moe_block)) for t in DECODER_TAPS]


def gemma2_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    return list(GEMMA2_TAPS)


def gemma3_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    return [*GEMMA2_TAPS, *GEMMA3_QK_NORM_TAPS]


def glm4_moe_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    return [*DECODER_TAPS, *SHARED_EXPERT_TAPS]


def gpt_oss_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    return list(GPT_OSS_TAPS)


def deepseek_v2_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    return list(DEEPSEEK_TAPS)


def deepseek_v3_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    """V2's taps; with ``rope_interleave`` (the default) vLLM's interleaved RoPE pair is compared de-interleaved,
    the order HF's ``apply_rotary_pos_emb_interleave`` returns."""
    if not config.get("rope_interleave", True):
        return list(DEEPSEEK_TAPS)
    return [replace(t, select="pair_deinterleaved") if t.pattern.endswith("rotary_emb") else t for t in DEEPSEEK_TAPS]


TAPS = TapMapping(
    decoder_taps,
    {
        "gemma2": gemma2_taps,
        "gemma3": gemma3_taps,
        "glm4-moe": glm4_moe_taps,
        "gpt-oss": gpt_oss_taps,
        "deepseek-v2": deepseek_v2_taps,
        "deepseek-v3": deepseek_v3_taps,
    },
)
