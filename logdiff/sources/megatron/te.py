"""The Transformer Engine spec's names (``get_gpt_layer_with_transformer_engine_spec``): coded, not run.

Transformer Engine is not installed on this project's machines (it needs CUDA), so nothing here was run
against a TE model; the mapping is read from megatron-core 0.16.1's spec and TE's module attributes.

What the TE spec changes for a capture:

* **Norms fused into the next linear.** ``linear_qkv`` and ``linear_fc1`` are
  ``TELayerNormColumnParallelLinear``: the RMSNorm runs inside them (weight ``layer_norm_weight``), and
  ``input_layernorm`` / ``pre_mlp_layernorm`` are ``IdentityOp``. Their outputs are never a module's output,
  so ``input_layernorm`` and ``post_attention_layernorm`` are **hidden** (not recorded). The residual before
  the MLP is still seen, as ``linear_fc1``'s input (``residual_attn``); the layer's output is ``residual_mlp``.
  Their weights are mapped by name (``TE_LAYER_PARAMS``), so the fingerprints still verify them.
* **Attention.** ``TEDotProductAttention`` is called like the local one (query, key, value after RoPE), so
  ``rope_q``, ``rope_k`` and ``attn_core`` are recorded; with ``apply_rope_fusion`` RoPE runs inside the
  fused kernel on the query and key ``core_attention`` receives, which are then the rotated tensors too.
* **Grouped GEMM experts** (``TEGroupedMLP``): one module for all local experts, parameters
  ``mlp.experts.linear_fc1.weight{i}`` / ``linear_fc2.weight{i}``; mapped to expert ``i``
  (``grouped_expert_name``). The per-expert GEMMs are hidden; the router logits and the MoE output are not.
* **Packed sequences** (``PackedSeqParams``, THD layout: ``[tokens, 1, hidden]`` with ``cu_seqlens_q``): not
  read; the capture's row table assumes one whole sequence per batch row.
"""

from __future__ import annotations

import re

#: per-layer TE parameter -> HF parameter (the layer prefix aside)
TE_LAYER_PARAMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
}
#: boundaries the TE spec hides, and why
HIDDEN = {
    "input_layernorm": "fused into linear_qkv (TELayerNormColumnParallelLinear): no module returns its output",
    "post_attention_layernorm": "fused into linear_fc1 (TELayerNormColumnParallelLinear): no module returns it",
}
#: per-layer submodule -> the boundary its input is, where the TE spec fused the norm before it
TE_LAYER_INPUTS = {"mlp.linear_fc1": "residual_attn"}

_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")


def grouped_expert_name(rest: str) -> str:
    """A ``TEGroupedMLP`` parameter (``mlp.experts.linear_fc1.weight3``) under the local spec's name
    (``mlp.experts.local_experts.3.linear_fc1.weight``); other names unchanged."""
    m = _GROUPED.match(rest)
    return f"mlp.experts.local_experts.{m.group(2)}.{m.group(1)}.weight" if m else rest


def fused_norm(layer_modules: dict) -> bool:
    """Whether a layer's norms are fused into its linears (the TE spec): ``input_layernorm`` is an ``IdentityOp``
    and ``linear_qkv`` holds a ``layer_norm_weight``."""
    norm = layer_modules.get("input_layernorm")
    qkv = layer_modules.get("self_attention.linear_qkv")
    return type(norm).__name__ == "IdentityOp" and hasattr(qkv, "layer_norm_weight")
