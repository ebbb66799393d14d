"""msprobe entries -> logdiff boundaries, per engine: a declarative table (docs/msprobe.md has it as prose).

A row ``(field, index, boundaries, split)`` under a module path says which tensor of the module's call holds
which boundary: ``field`` is ``output``, ``input`` (``input_args``; HF passes some by keyword) or
``kwarg:NAME``; ``{N}`` is the call's layer, ``{P}`` the layer before it, ``{LAST}`` the last layer. A packed
tensor is split along its last dimension: ``qkv`` into ``[q, kv, kv]`` by the config's head counts (vLLM's
``qkv_proj``), ``halves`` in two (vLLM's ``gate_up_proj``: gate, up).
"""

from __future__ import annotations

import re
from typing import Any

Row = tuple[str, int, tuple[str, ...], str | None]

_A, _M = "model.layers.{N}.self_attn", "model.layers.{N}.mlp"

HF: dict[str, list[Row]] = {
    "model.embed_tokens": [("output", 0, ("model.embed_tokens",), None)],
    "model.layers.{N}.input_layernorm": [("output", 0, ("model.layers.{N}.input_layernorm",), None)],
    f"{_A}.q_proj": [("output", 0, (f"{_A}.q_proj",), None)],
    f"{_A}.k_proj": [("output", 0, (f"{_A}.k_proj",), None)],
    f"{_A}.v_proj": [("output", 0, (f"{_A}.v_proj",), None)],
    f"{_A}.q_norm": [("output", 0, (f"{_A}.q_norm",), None)],
    f"{_A}.k_norm": [("output", 0, (f"{_A}.k_norm",), None)],
    # HF runs the attention core as a function: at L0 its output is o_proj's input
    f"{_A}.o_proj": [("input", 0, (f"{_A}.attn_core",), None), ("output", 0, (f"{_A}.o_proj",), None)],
    "model.layers.{N}.post_attention_layernorm": [("input", 0, ("model.layers.{N}.residual_attn",), None),
                                                  ("output", 0, ("model.layers.{N}.post_attention_layernorm",), None)],
    f"{_M}.gate_proj": [("output", 0, (f"{_M}.gate_proj",), None)],
    f"{_M}.up_proj": [("output", 0, (f"{_M}.up_proj",), None)],
    f"{_M}.down_proj": [("input", 0, (f"{_M}.act_mul",), None), ("output", 0, (f"{_M}.down_proj",), None)],
    "model.layers.{N}": [("output", 0, ("model.layers.{N}.residual_mlp",), None)],
    "model.norm": [("output", 0, ("model.norm",), None)],
    "lm_head": [("output", 0, ("logits",), None)],
}

VLLM: dict[str, list[Row]] = {
    "model.embed_tokens": [("output", 0, ("model.embed_tokens",), None)],
    # the fused add + RMSNorm of layer N > 0 returns (normed, x + residual): the previous layer's residual stream
    "model.layers.{N}.input_layernorm": [("output", 0, ("model.layers.{N}.input_layernorm",), None),
                                         ("output", 1, ("model.layers.{P}.residual_mlp",), None)],
    f"{_A}.qkv_proj": [("output", 0, (f"{_A}.q_proj", f"{_A}.k_proj", f"{_A}.v_proj"), "qkv")],
    f"{_A}.q_norm": [("output", 0, (f"{_A}.q_norm",), None)],
    f"{_A}.k_norm": [("output", 0, (f"{_A}.k_norm",), None)],
    f"{_A}.rotary_emb": [("output", 0, (f"{_A}.rope_q",), None), ("output", 1, (f"{_A}.rope_k",), None)],
    f"{_A}.attn": [("output", 0, (f"{_A}.attn_core",), None)],
    f"{_A}.o_proj": [("output", 0, (f"{_A}.o_proj",), None)],
    "model.layers.{N}.post_attention_layernorm": [("output", 0, ("model.layers.{N}.post_attention_layernorm",), None),
                                                  ("output", 1, ("model.layers.{N}.residual_attn",), None)],
    f"{_M}.gate_up_proj": [("output", 0, (f"{_M}.gate_proj", f"{_M}.up_proj"), "halves")],
    f"{_M}.act_fn": [("output", 0, (f"{_M}.act_mul",), None)],
    f"{_M}.down_proj": [("output", 0, (f"{_M}.down_proj",), None)],
    "model.norm": [("output", 0, ("model.norm",), None), ("output", 1, ("model.layers.{LAST}.residual_mlp",), None)],
    "logits_processor": [("output", 0, ("logits",), None)],
}

TABLES = {"hf": HF, "vllm": VLLM}

#: a decoder layer's boundaries in the order a forward produces them (a logdiff capture's record order)
LAYER_ORDER = ("input_layernorm", "self_attn.q_proj", "self_attn.q_norm", "self_attn.k_proj", "self_attn.k_norm",
               "self_attn.v_proj", "self_attn.rope_q", "self_attn.rope_k", "self_attn.attn_core", "self_attn.o_proj",
               "residual_attn", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.act_mul",
               "mlp.down_proj", "residual_mlp")
_LAYER = re.compile(r"^model\.layers\.(\d+)(?:\.(.*))?$")


def template(path: str) -> tuple[str, int | None]:
    """A module path as its table key and its layer (``model.layers.3.mlp`` -> ``model.layers.{N}.mlp``, 3)."""
    m = _LAYER.match(path)
    if not m:
        return path, None
    return "model.layers.{N}" + (f".{m.group(2)}" if m.group(2) else ""), int(m.group(1))


def boundary(name: str, layer: int | None, n_layers: int) -> str | None:
    """A boundary template filled in for ``layer`` (None: the layer before layer 0, which has none)."""
    if "{P}" in name and (layer is None or layer == 0):
        return None
    return (name.replace("{N}", str(layer)).replace("{P}", str((layer or 0) - 1))
            .replace("{LAST}", str(n_layers - 1)))


def order_key(name: str) -> tuple[int, int, int]:
    """Where a boundary falls in a forward: embedding, the layers in order, final norm, logits."""
    if name == "model.embed_tokens":
        return (0, 0, 0)
    m = _LAYER.match(name)
    if m:
        rest = m.group(2) or ""
        return (1, int(m.group(1)), LAYER_ORDER.index(rest) if rest in LAYER_ORDER else len(LAYER_ORDER))
    return (2, {"model.norm": 0, "logits": 1}.get(name, 2), 0)


def split_sizes(split: str, width: int, config: dict[str, Any]) -> list[int]:
    """The last-dimension sizes a packed tensor of ``width`` splits into, from the model's config."""
    if split == "halves":
        return [width // 2, width - width // 2]
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    sizes = [heads * head_dim, kv * head_dim, kv * head_dim]
    if sum(sizes) != width:
        from logdiff.errors import InputError

        raise InputError(f"qkv_proj output of width {width} does not split into q/k/v of {sizes} from the config: "
                         "another model's config, or a tensor-parallel rank's slice")
    return sizes
