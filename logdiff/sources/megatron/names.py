"""Megatron-core's module names as logdiff's boundaries, and the splits of its packed outputs.

A ``GPTModel`` built from the local or the Transformer Engine spec is ``embedding``,
``decoder.layers.{i}`` (``TransformerLayer``: ``input_layernorm``, ``self_attention`` with
``linear_qkv``, ``q_layernorm``/``k_layernorm``, ``core_attention`` and ``linear_proj``,
``pre_mlp_layernorm``, ``mlp`` with ``linear_fc1``/``linear_fc2`` or a ``MoELayer``),
``decoder.final_layernorm`` and ``output_layer``. Each maps to the HF-style boundary the
architecture adapter names (``probes/arch/decoder.py``):

=============================  =============================================
Megatron                        logdiff
=============================  =============================================
``embedding`` output            ``model.embed_tokens``
``input_layernorm``             ``model.layers.N.input_layernorm``
``linear_qkv`` (split)          ``...self_attn.q_proj`` / ``k_proj`` / ``v_proj``
``q_layernorm``/``k_layernorm``  ``...self_attn.q_norm`` / ``k_norm``
``core_attention`` inputs       ``...self_attn.rope_q`` / ``rope_k`` (after ``apply_rotary_pos_emb``)
``core_attention`` output       ``...self_attn.attn_core``
``linear_proj``                 ``...self_attn.o_proj``
``pre_mlp_layernorm`` input     ``model.layers.N.residual_attn``
``pre_mlp_layernorm``           ``model.layers.N.post_attention_layernorm``
``linear_fc1`` (halves)         ``...mlp.gate_proj`` / ``up_proj``
``linear_fc2`` input / output   ``...mlp.act_mul`` / ``...mlp.down_proj``
``mlp.router`` logits           ``model.layers.N.mlp.gate`` (MoE)
``mlp`` output (``MoELayer``)   ``model.layers.N.mlp`` (MoE)
``TransformerLayer`` output     ``model.layers.N.residual_mlp``
``decoder.final_layernorm``     ``model.norm``
``output_layer``                ``logits``
=============================  =============================================

``N`` is the global layer: ``TransformerLayer.layer_number - 1`` (Megatron numbers from 1, across
pipeline stages), so a stage's records carry the names the whole model gives them.

``linear_qkv``'s rows interleave per query group: group ``g`` holds ``[q heads of g, k_g, v_g]``, so an
HF-style ``[q | k | v]`` split would give the wrong q. ``split_qkv`` splits per group; a rank of a
tensor-parallel group holds whole query groups (``ng / tp`` of them, in rank order), so each of q, k, v
is a plain column shard of the logical one. ``linear_fc1`` holds ``[gate_i; up_i]`` on rank ``i``
(``partition_stride`` 2): its halves are the rank's gate and up slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: per-layer Megatron submodule -> the boundary it produces (its forward output), HF-style suffix
LAYER_OUTPUTS = {
    "input_layernorm": "input_layernorm",
    "self_attention.q_layernorm": "self_attn.q_norm",
    "self_attention.k_layernorm": "self_attn.k_norm",
    "self_attention.core_attention": "self_attn.attn_core",
    "self_attention.linear_proj": "self_attn.o_proj",
    "pre_mlp_layernorm": "post_attention_layernorm",
    "mlp.linear_fc2": "mlp.down_proj",
}
#: per-layer submodule -> the boundary its (first) input is
LAYER_INPUTS = {"pre_mlp_layernorm": "residual_attn", "mlp.linear_fc2": "mlp.act_mul"}


@dataclass(frozen=True)
class Geometry:
    """The attention and MLP shapes of a ``TransformerConfig``, per tensor-parallel rank."""

    heads: int
    groups: int
    head_dim: int
    ffn: int
    tp: int = 1

    @classmethod
    def of(cls, config: Any, tp: int) -> Geometry:
        groups = config.num_query_groups or config.num_attention_heads
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        return cls(config.num_attention_heads, groups, head_dim, config.ffn_hidden_size, tp)

    @property
    def q_per_group(self) -> int:
        return self.heads // self.groups


def layer_prefix(layer: Any) -> str:
    """``model.layers.N`` of a ``TransformerLayer``: its global, 1-based ``layer_number`` less one."""
    return f"model.layers.{int(layer.layer_number) - 1}"


def split_qkv(out: Any, geo: Geometry) -> tuple[Any, Any, Any]:
    """A rank's ``linear_qkv`` output ``[..., groups_local * (q_per_group + 2) * head_dim]`` as (q, k, v), each
    ``[..., heads_local * head_dim]`` (k, v: ``groups_local * head_dim``), heads in group order."""
    lead = out.shape[:-1]
    per_group = (geo.q_per_group + 2) * geo.head_dim
    local_groups = out.shape[-1] // per_group
    grouped = out.reshape(*lead, local_groups, per_group)
    q_width = geo.q_per_group * geo.head_dim
    q = grouped[..., :q_width].reshape(*lead, -1)
    k = grouped[..., q_width : q_width + geo.head_dim].reshape(*lead, -1)
    v = grouped[..., q_width + geo.head_dim :].reshape(*lead, -1)
    return q, k, v


def split_fc1(out: Any) -> tuple[Any, Any]:
    """A rank's ``linear_fc1`` output ``[..., 2 * ffn_local]`` as its (gate, up) slices."""
    half = out.shape[-1] // 2
    return out[..., :half], out[..., half:]
