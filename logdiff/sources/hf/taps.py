"""Where transformers' modules expose each adapter's boundaries: the HF engine's ``TapMapping``.

The adapters (probes/arch/) say which boundaries a model has; this module says
which HF module call yields each one (``probes.correspondence.Tap``). HF computes
most boundaries in a module of the same name, so a tap is mostly a forward hook
on it; the residual adds are read from the input of the norm that follows them
and from the decoder layer's output, the gated activation from ``down_proj``'s
input, and RoPE and the attention core are not taps at all (the recorder wraps
the functions the adapter's ``functions`` name).

``TAPS.default`` is the Llama-like layout every ``DecoderAdapter`` shares;
``TAPS.builders`` holds one builder per adapter ``name`` whose modules differ
(Phi-3's packed projections, Gemma's four norms and soft-capped logits, GPT-OSS's
router, DeepSeek's MLA, GLM-4.5's shared expert). Each builder takes the adapter
and the model's HF config. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from logdiff.probes.correspondence import Tap, TapMapping

_L = r"model\.layers\.{N}"
_N = "model.layers.{N}"

#: the Llama-like decoder (dense MLP or routed MoE; q/k norms tapped where the module exists)
DECODER_TAPS = (
    Tap(r"model\.embed_tokens", "output", "tensor", ("model.embed_tokens",)),
    Tap(_L, "input", "tensor", ("{RES_IN}",), emit=False),
    Tap(_L + r"\.input_layernorm", "output", "tensor", (f"{_N}.input_layernorm",)),
    Tap(_L + r"\.self_attn\.q_proj", "output", "tensor", (f"{_N}.self_attn.q_proj",)),
    Tap(_L + r"\.self_attn\.k_proj", "output", "tensor", (f"{_N}.self_attn.k_proj",)),
    Tap(_L + r"\.self_attn\.v_proj", "output", "tensor", (f"{_N}.self_attn.v_proj",)),
    Tap(_L + r"\.self_attn\.q_norm", "output", "tensor", (f"{_N}.self_attn.q_norm",)),
    Tap(_L + r"\.self_attn\.k_norm", "output", "tensor", (f"{_N}.self_attn.k_norm",)),
    Tap(_L + r"\.self_attn\.o_proj", "output", "tensor", (f"{_N}.self_attn.o_proj",)),
    Tap(_L + r"\.post_attention_layernorm", "input", "tensor", (f"{_N}.residual_attn",)),
    Tap(_L + r"\.post_attention_layernorm", "output", "tensor", (f"{_N}.post_attention_layernorm",)),
    Tap(_L + r"\.mlp\.gate_proj", "output", "tensor", (f"{_N}.mlp.gate_proj",)),
    Tap(_L + r"\.mlp\.up_proj", "output", "tensor", (f"{_N}.mlp.up_proj",)),
    Tap(_L + r"\.mlp\.down_proj", "input", "tensor", (f"{_N}.mlp.act_mul",)),
    Tap(_L + r"\.mlp\.down_proj", "output", "tensor", (f"{_N}.mlp.down_proj",)),
    Tap(_L + r"\.mlp\.gate", "output", "first", (f"{_N}.mlp.gate",)),
    Tap(_L + r"\.mlp", "output", "tensor", (f"{_N}.mlp",)),
    Tap(_L, "output", "tensor", (f"{_N}.residual_mlp",)),
    Tap(r"model\.norm", "output", "tensor", ("model.norm",)),
    Tap(r"lm_head", "output", "tensor", ("logits",)),
)

_SE = _L + r"\.mlp\.shared_experts"
_SEB = f"{_N}.mlp.shared_experts"
#: a MoE block's shared experts: a plain gated MLP on every token (GLM-4.5, DeepSeek)
SHARED_EXPERT_TAPS = (
    Tap(_SE + r"\.gate_proj", "output", "tensor", (f"{_SEB}.gate_proj",)),
    Tap(_SE + r"\.up_proj", "output", "tensor", (f"{_SEB}.up_proj",)),
    Tap(_SE + r"\.down_proj", "input", "tensor", (f"{_SEB}.act_mul",)),
    Tap(_SE + r"\.down_proj", "output", "tensor", (f"{_SEB}.down_proj",)),
)

#: Phi-3's own packed projections, split like vLLM's (replacing the per-projection decoder taps)
PHI3_PACKED_TAPS = (
    Tap(
        _L + r"\.self_attn\.qkv_proj",
        "output",
        "split_qkv",
        (f"{_N}.self_attn.q_proj", f"{_N}.self_attn.k_proj", f"{_N}.self_attn.v_proj"),
    ),
    Tap(_L + r"\.mlp\.gate_up_proj", "output", "split_half", (f"{_N}.mlp.gate_proj", f"{_N}.mlp.up_proj")),
)
_PHI3_SPLIT = tuple(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")) + ("mlp.gate_proj", "mlp.up_proj")

#: Gemma 2: four norms per layer (the attention add read at ``pre_feedforward_layernorm``'s input)
GEMMA2_TAPS = (
    Tap(r"model\.embed_tokens", "output", "tensor", ("model.embed_tokens",)),
    Tap(_L, "input", "tensor", ("{RES_IN}",), emit=False),
    Tap(_L + r"\.input_layernorm", "output", "tensor", (f"{_N}.input_layernorm",)),
    Tap(_L + r"\.self_attn\.q_proj", "output", "tensor", (f"{_N}.self_attn.q_proj",)),
    Tap(_L + r"\.self_attn\.k_proj", "output", "tensor", (f"{_N}.self_attn.k_proj",)),
    Tap(_L + r"\.self_attn\.v_proj", "output", "tensor", (f"{_N}.self_attn.v_proj",)),
    Tap(_L + r"\.self_attn\.o_proj", "output", "tensor", (f"{_N}.self_attn.o_proj",)),
    Tap(_L + r"\.post_attention_layernorm", "output", "tensor", (f"{_N}.post_attention_layernorm",)),
    Tap(_L + r"\.pre_feedforward_layernorm", "input", "tensor", (f"{_N}.residual_attn",)),
    Tap(_L + r"\.pre_feedforward_layernorm", "output", "tensor", (f"{_N}.pre_feedforward_layernorm",)),
    Tap(_L + r"\.mlp\.gate_proj", "output", "tensor", (f"{_N}.mlp.gate_proj",)),
    Tap(_L + r"\.mlp\.up_proj", "output", "tensor", (f"{_N}.mlp.up_proj",)),
    Tap(_L + r"\.mlp\.down_proj", "input", "tensor", (f"{_N}.mlp.act_mul",)),
    Tap(_L + r"\.mlp\.down_proj", "output", "tensor", (f"{_N}.mlp.down_proj",)),
    Tap(_L + r"\.post_feedforward_layernorm", "output", "tensor", (f"{_N}.post_feedforward_layernorm",)),
    Tap(_L, "output", "tensor", (f"{_N}.residual_mlp",)),
    Tap(r"model\.norm", "output", "tensor", ("model.norm",)),
    Tap(r"", "output", "logits_field", ("logits",)),  # the whole model's output: soft-capped logits
)
#: Gemma 3's q/k norms, which HF runs on ``[B, heads, L, D]`` (after its transpose)
GEMMA3_QK_NORM_TAPS = tuple(
    Tap(_L + rf"\.self_attn\.{norm}", "output", "heads_first", (f"{_N}.self_attn.{norm}",))
    for norm in ("q_norm", "k_norm")
)
#: the logits where no final soft cap follows ``lm_head`` (replayable)
LOGITS_FROM_LM_HEAD = Tap(r"lm_head", "output", "tensor", ("logits",))

#: GPT-OSS: the router returns (logits, scores, ids) and the MoE block (out, scores)
GPT_OSS_TAPS = (
    *(t for t in DECODER_TAPS if t.pattern not in (_L + r"\.mlp\.gate", _L + r"\.mlp")),
    Tap(_L + r"\.mlp\.router", "output", "first", (f"{_N}.mlp.router",)),
    Tap(_L + r"\.mlp", "output", "first", (f"{_N}.mlp",)),
)

_A = _L + r"\.self_attn(?:\.mla_attn)?"
_Q_SPLIT = "split_heads:qk_nope_head_dim,qk_rope_head_dim"
_KV_SPLIT = "split:kv_lora_rank,qk_rope_head_dim"
_KV = f"{_N}.self_attn.kv_a_proj_with_mqa"


def _q_taps(q: str) -> tuple[Tap, ...]:
    """An MLA query projection, split per head into its no-position and RoPE parts."""
    return (Tap(_A + rf"\.{q}", "output", _Q_SPLIT, (f"{_N}.self_attn.{q}.nope", f"{_N}.self_attn.{q}.pe")),)


#: DeepSeek-V2/V3: MLA (the latent and ``k_pe`` split out of ``kv_a_proj_with_mqa``) and shared experts
DEEPSEEK_TAPS = (
    Tap(r"model\.embed_tokens", "output", "tensor", ("model.embed_tokens",)),
    Tap(_L, "input", "tensor", ("{RES_IN}",), emit=False),
    Tap(_L + r"\.input_layernorm", "output", "tensor", (f"{_N}.input_layernorm",)),
    *_q_taps("q_proj"),
    Tap(_A + r"\.q_a_proj", "output", "tensor", (f"{_N}.self_attn.q_a_proj",)),
    Tap(_A + r"\.q_a_layernorm", "output", "tensor", (f"{_N}.self_attn.q_a_layernorm",)),
    *_q_taps("q_b_proj"),
    Tap(_A + r"\.kv_a_proj_with_mqa", "output", _KV_SPLIT, (f"{_KV}.compressed_kv", f"{_KV}.k_pe")),
    Tap(_A + r"\.kv_a_layernorm", "output", "tensor", (f"{_N}.self_attn.kv_a_layernorm",)),
    Tap(_L + r"\.self_attn\.o_proj", "output", "tensor", (f"{_N}.self_attn.o_proj",)),
    Tap(_L + r"\.post_attention_layernorm", "input", "tensor", (f"{_N}.residual_attn",)),
    Tap(_L + r"\.post_attention_layernorm", "output", "tensor", (f"{_N}.post_attention_layernorm",)),
    Tap(_L + r"\.mlp\.gate_proj", "output", "tensor", (f"{_N}.mlp.gate_proj",)),
    Tap(_L + r"\.mlp\.up_proj", "output", "tensor", (f"{_N}.mlp.up_proj",)),
    Tap(_L + r"\.mlp\.down_proj", "input", "tensor", (f"{_N}.mlp.act_mul",)),
    Tap(_L + r"\.mlp\.down_proj", "output", "tensor", (f"{_N}.mlp.down_proj",)),
    *SHARED_EXPERT_TAPS,
    Tap(_L + r"\.mlp\.gate", "output", "first", (f"{_N}.mlp.gate",)),
    Tap(_L + r"\.mlp", "output", "tensor", (f"{_N}.mlp",)),
    Tap(_L, "output", "tensor", (f"{_N}.residual_mlp",)),
    Tap(r"model\.norm", "output", "tensor", ("model.norm",)),
    Tap(r"lm_head", "output", "tensor", ("logits",)),
)


def decoder_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    """Any Llama-like ``DecoderAdapter``: HF's MoE block is always ``mlp``, whatever ``moe_block`` says."""
    return list(DECODER_TAPS)


def phi3_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    """The decoder's taps with HF's packed ``qkv_proj``/``gate_up_proj`` split instead of the projections."""
    kept = [t for t in DECODER_TAPS if not any(s.replace(".", r"\.") in t.pattern for s in _PHI3_SPLIT)]
    return [*kept, *PHI3_PACKED_TAPS]


def gemma2_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    return list(GEMMA2_TAPS)


def gemma3_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    """Gemma 2's taps plus the heads-first q/k norms; the logits from ``lm_head`` unless a final cap is set."""
    taps = [*GEMMA2_TAPS, *GEMMA3_QK_NORM_TAPS]
    if not config.get("final_logit_softcapping"):
        taps = [t for t in taps if t.select != "logits_field"] + [LOGITS_FROM_LM_HEAD]
    return taps


def glm4_moe_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    return [*DECODER_TAPS, *SHARED_EXPERT_TAPS]


def gpt_oss_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    return list(GPT_OSS_TAPS)


def deepseek_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    return list(DEEPSEEK_TAPS)


TAPS = TapMapping(
    decoder_taps,
    {
        "phi3": phi3_taps,
        "gemma2": gemma2_taps,
        "gemma3": gemma3_taps,
        "glm4-moe": glm4_moe_taps,
        "gpt-oss": gpt_oss_taps,
        "deepseek-v2": deepseek_taps,
        "deepseek-v3": deepseek_taps,
    },
)
