"""Which value in each engine is which boundary, per architecture, in semantic order.

A *boundary* is one value both paths compute, named after the HF module that
computes it (``model.layers.0.self_attn.q_proj``) or, for the ops HF calls as
plain functions, a documented synthetic name:

=====================================  ==============================================
``model.layers.N.self_attn.rope_q``    query after rotary embedding
``model.layers.N.self_attn.rope_k``    key after rotary embedding (the step's new tokens)
``model.layers.N.self_attn.attn_core`` attention output before ``o_proj``, heads flattened
``model.layers.N.residual_attn``       residual stream after the attention add
``model.layers.N.residual_mlp``        residual stream after the MLP add (the layer output)
``model.layers.N.mlp.act_mul``         ``act(gate) * up``, the input of ``down_proj``
``logits``                             ``lm_head`` output
``log_softmax``                        the engine's log-probabilities over the vocabulary
=====================================  ==============================================

A ``CorrespondenceMap`` lists the boundaries in *semantic execution order*
(the order the math happens in one token's forward, not the order hooks fire
in, and never alphabetical), each with the boundaries that feed it; that is what
"first divergence" and "inputs equal" are measured against. It also lists the
*taps*: where each engine exposes each boundary.

* HF taps are mostly 1:1 module outputs. The residual adds are read from the
  input of ``post_attention_layernorm`` and the decoder layer's output; the
  gated activation from ``down_proj``'s input; RoPE and the attention core by
  wrapping ``apply_rotary_pos_emb`` and the attention function (record.py).
* vLLM taps undo vLLM's fusions: the packed ``qkv_proj`` output is split into
  ``q_proj``/``k_proj``/``v_proj`` with the attention module's ``q_size`` and
  ``kv_size``, ``gate_up_proj`` into halves; RMSNorm with a fused residual add
  returns ``(normed, residual)``, so ``input_layernorm`` of layer N also yields
  layer N-1's ``residual_mlp``, ``post_attention_layernorm`` yields
  ``residual_attn``, and ``model.norm`` yields the last layer's ``residual_mlp``.
  ``SiluAndMul`` is ``act_mul``; the shared ``rotary_emb`` module is told apart
  per layer by the module call stack.

Maps are keyed by the HF architecture class. For any other architecture,
``fallback_taps`` hooks every leaf module on both sides under its own name;
boundaries whose names exist on only one side are reported as unaligned and the
order is the observed execution order.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: kinds of boundary; replay in replay.py dispatches on them
KINDS = ("embed", "linear", "norm", "rope", "attn", "act", "add", "router", "moe", "logits", "log_softmax", "module")


@dataclass(frozen=True)
class Boundary:
    """One value both paths compute."""

    name: str
    kind: str
    layer: int | None
    inputs: tuple[str, ...] = ()  # the boundaries this one is computed from
    causal: bool = False  # also reads its inputs at every earlier position (attention)


@dataclass(frozen=True)
class Tap:
    """Where one engine exposes boundaries.

    ``pattern`` matches the module's call-stack name (``N`` captures the layer).
    ``source`` is ``output`` (forward hook) or ``input`` (first positional
    argument, pre-hook). ``select`` says how to pull tensors out of that value:
    ``tensor``, ``first`` (element 0 of a tuple), ``pair`` (both elements of a
    2-tuple), ``norm_pair`` (a tensor, or ``(normed, residual)``),
    ``split_qkv`` (q/k/v sizes from the attention module), ``split_half``.
    ``names`` are format strings (``{N}``, ``{RES_IN}``: the residual stream
    entering layer N, ``{PREV_RES}``: layer N-1's ``residual_mlp`` or nothing
    for N = 0, ``{LAST_RES}``: the last layer's). ``emit=False`` keeps the
    value only as context for replays in the same layer.
    """

    pattern: str
    source: str
    select: str
    names: tuple[str, ...]
    emit: bool = True

    def regex(self) -> re.Pattern[str]:
        return re.compile("^" + self.pattern.replace("{N}", r"(?P<N>\d+)") + "$")


@dataclass
class CorrespondenceMap:
    """Boundaries in semantic order plus each engine family's taps."""

    architecture: str
    boundaries: list[Boundary]
    taps: dict[str, list[Tap]]  # engine family ("hf", "vllm") -> taps
    num_layers: int
    mapped: bool = True  # False for the name-matching fallback
    _index: dict[str, Boundary] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._index = {b.name: b for b in self.boundaries}

    def get(self, name: str) -> Boundary | None:
        return self._index.get(name)

    @property
    def order(self) -> list[str]:
        return [b.name for b in self.boundaries]

    def names_for(self, tap: Tap, layer: int | None, name: str = "") -> list[str | None]:
        """The boundary names a tap yields for a call in ``layer`` (``name``: the module's name)."""
        out: list[str | None] = []
        for template in tap.names:
            if "{PREV_RES}" in template:
                out.append(None if not layer else f"model.layers.{layer - 1}.residual_mlp")
            elif "{RES_IN}" in template:
                out.append("model.embed_tokens" if not layer else f"model.layers.{layer - 1}.residual_mlp")
            elif "{LAST_RES}" in template:
                out.append(f"model.layers.{self.num_layers - 1}.residual_mlp")
            elif "{name}" in template:
                out.append(FALLBACK_RENAMES.get(name, name))
            else:
                out.append(template.format(N=layer))
        return out


#: the fallback names HF's ``lm_head`` output like the synthetic boundary vLLM's logits processor feeds
FALLBACK_RENAMES = {"lm_head": "logits"}


def _layer_boundaries(n: int, qk_norm: bool, moe: bool) -> list[Boundary]:
    p = f"model.layers.{n}"
    res_in = "model.embed_tokens" if n == 0 else f"model.layers.{n - 1}.residual_mlp"
    a = f"{p}.self_attn"
    out = [
        Boundary(f"{p}.input_layernorm", "norm", n, (res_in,)),
        Boundary(f"{a}.q_proj", "linear", n, (f"{p}.input_layernorm",)),
        Boundary(f"{a}.k_proj", "linear", n, (f"{p}.input_layernorm",)),
        Boundary(f"{a}.v_proj", "linear", n, (f"{p}.input_layernorm",)),
    ]
    q_in, k_in = f"{a}.q_proj", f"{a}.k_proj"
    if qk_norm:
        out += [Boundary(f"{a}.q_norm", "norm", n, (q_in,)), Boundary(f"{a}.k_norm", "norm", n, (k_in,))]
        q_in, k_in = f"{a}.q_norm", f"{a}.k_norm"
    out += [
        Boundary(f"{a}.rope_q", "rope", n, (q_in,)),
        Boundary(f"{a}.rope_k", "rope", n, (k_in,)),
        Boundary(f"{a}.attn_core", "attn", n, (f"{a}.rope_q", f"{a}.rope_k", f"{a}.v_proj"), causal=True),
        Boundary(f"{a}.o_proj", "linear", n, (f"{a}.attn_core",)),
        Boundary(f"{p}.residual_attn", "add", n, (res_in, f"{a}.o_proj")),
        Boundary(f"{p}.post_attention_layernorm", "norm", n, (f"{p}.residual_attn",)),
    ]
    ln = f"{p}.post_attention_layernorm"
    if moe:
        out += [
            Boundary(f"{p}.mlp.gate", "router", n, (ln,)),
            Boundary(f"{p}.mlp", "moe", n, (ln,)),
        ]
        mlp_out = f"{p}.mlp"
    else:
        out += [
            Boundary(f"{p}.mlp.gate_proj", "linear", n, (ln,)),
            Boundary(f"{p}.mlp.up_proj", "linear", n, (ln,)),
            Boundary(f"{p}.mlp.act_mul", "act", n, (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")),
            Boundary(f"{p}.mlp.down_proj", "linear", n, (f"{p}.mlp.act_mul",)),
        ]
        mlp_out = f"{p}.mlp.down_proj"
    out.append(Boundary(f"{p}.residual_mlp", "add", n, (f"{p}.residual_attn", mlp_out)))
    return out


_L = r"model\.layers\.{N}"

_HF_DENSE = [
    Tap(r"model\.embed_tokens", "output", "tensor", ("model.embed_tokens",)),
    Tap(_L, "input", "tensor", ("{RES_IN}",), emit=False),
    Tap(_L + r"\.input_layernorm", "output", "tensor", ("model.layers.{N}.input_layernorm",)),
    Tap(_L + r"\.self_attn\.q_proj", "output", "tensor", ("model.layers.{N}.self_attn.q_proj",)),
    Tap(_L + r"\.self_attn\.k_proj", "output", "tensor", ("model.layers.{N}.self_attn.k_proj",)),
    Tap(_L + r"\.self_attn\.v_proj", "output", "tensor", ("model.layers.{N}.self_attn.v_proj",)),
    Tap(_L + r"\.self_attn\.q_norm", "output", "tensor", ("model.layers.{N}.self_attn.q_norm",)),
    Tap(_L + r"\.self_attn\.k_norm", "output", "tensor", ("model.layers.{N}.self_attn.k_norm",)),
    Tap(_L + r"\.self_attn\.o_proj", "output", "tensor", ("model.layers.{N}.self_attn.o_proj",)),
    Tap(_L + r"\.post_attention_layernorm", "input", "tensor", ("model.layers.{N}.residual_attn",)),
    Tap(_L + r"\.post_attention_layernorm", "output", "tensor", ("model.layers.{N}.post_attention_layernorm",)),
    Tap(_L + r"\.mlp\.gate_proj", "output", "tensor", ("model.layers.{N}.mlp.gate_proj",)),
    Tap(_L + r"\.mlp\.up_proj", "output", "tensor", ("model.layers.{N}.mlp.up_proj",)),
    Tap(_L + r"\.mlp\.down_proj", "input", "tensor", ("model.layers.{N}.mlp.act_mul",)),
    Tap(_L + r"\.mlp\.down_proj", "output", "tensor", ("model.layers.{N}.mlp.down_proj",)),
    Tap(_L + r"\.mlp\.gate", "output", "first", ("model.layers.{N}.mlp.gate",)),
    Tap(_L + r"\.mlp", "output", "tensor", ("model.layers.{N}.mlp",)),
    Tap(_L, "output", "tensor", ("model.layers.{N}.residual_mlp",)),
    Tap(r"model\.norm", "output", "tensor", ("model.norm",)),
    Tap(r"lm_head", "output", "tensor", ("logits",)),
]

_VLLM_DENSE = [
    Tap(r"model\.embed_tokens", "output", "tensor", ("model.embed_tokens",)),
    Tap(_L + r"\.input_layernorm", "output", "norm_pair", ("model.layers.{N}.input_layernorm", "{PREV_RES}")),
    Tap(
        _L + r"\.self_attn\.qkv_proj",
        "output",
        "split_qkv",
        ("model.layers.{N}.self_attn.q_proj", "model.layers.{N}.self_attn.k_proj", "model.layers.{N}.self_attn.v_proj"),
    ),
    Tap(_L + r"\.self_attn\.q_norm", "output", "tensor", ("model.layers.{N}.self_attn.q_norm",)),
    Tap(_L + r"\.self_attn\.k_norm", "output", "tensor", ("model.layers.{N}.self_attn.k_norm",)),
    Tap(
        _L + r"\.self_attn\.rotary_emb",
        "output",
        "pair",
        ("model.layers.{N}.self_attn.rope_q", "model.layers.{N}.self_attn.rope_k"),
    ),
    Tap(_L + r"\.self_attn\.attn", "output", "tensor", ("model.layers.{N}.self_attn.attn_core",)),
    Tap(_L + r"\.self_attn\.o_proj", "output", "first", ("model.layers.{N}.self_attn.o_proj",)),
    Tap(
        _L + r"\.post_attention_layernorm",
        "output",
        "pair",
        ("model.layers.{N}.post_attention_layernorm", "model.layers.{N}.residual_attn"),
    ),
    Tap(
        _L + r"\.mlp\.gate_up_proj",
        "output",
        "split_half",
        ("model.layers.{N}.mlp.gate_proj", "model.layers.{N}.mlp.up_proj"),
    ),
    Tap(_L + r"\.mlp\.act_fn", "output", "tensor", ("model.layers.{N}.mlp.act_mul",)),
    Tap(_L + r"\.mlp\.down_proj", "output", "first", ("model.layers.{N}.mlp.down_proj",)),
    # the MoE router: vLLM's fused-MoE runner calls the gate as its own child
    Tap(_L + r"\.mlp(?:\.experts)?\.gate", "output", "first", ("model.layers.{N}.mlp.gate",)),
    Tap(_L + r"\.mlp", "output", "tensor", ("model.layers.{N}.mlp",)),
    Tap(r"model\.norm", "output", "norm_pair", ("model.norm", "{LAST_RES}")),
]


def _decoder_map(arch: str, config: dict[str, Any], qk_norm: bool, moe: bool) -> CorrespondenceMap:
    n_layers = int(config["num_hidden_layers"])
    dense_layers = set(config.get("mlp_only_layers") or []) if moe else set()
    step = int(config.get("decoder_sparse_step", 1) or 1) if moe else 1
    boundaries = [Boundary("model.embed_tokens", "embed", None)]
    for n in range(n_layers):
        sparse = moe and n not in dense_layers and (n + 1) % step == 0
        boundaries += _layer_boundaries(n, qk_norm, sparse)
    last = f"model.layers.{n_layers - 1}.residual_mlp"
    boundaries += [
        Boundary("model.norm", "norm", None, (last,)),
        Boundary("logits", "logits", None, ("model.norm",)),
        Boundary("log_softmax", "log_softmax", None, ("logits",)),
    ]
    return CorrespondenceMap(arch, boundaries, {"hf": list(_HF_DENSE), "vllm": list(_VLLM_DENSE)}, n_layers)


MAPS: dict[str, Callable[[str, dict[str, Any]], CorrespondenceMap]] = {
    "Qwen3ForCausalLM": lambda a, c: _decoder_map(a, c, qk_norm=True, moe=False),
    "Qwen2ForCausalLM": lambda a, c: _decoder_map(a, c, qk_norm=False, moe=False),
    "LlamaForCausalLM": lambda a, c: _decoder_map(a, c, qk_norm=False, moe=False),
    "Qwen3MoeForCausalLM": lambda a, c: _decoder_map(a, c, qk_norm=True, moe=True),
}


def build(architecture: str, config: dict[str, Any]) -> CorrespondenceMap | None:
    """The map for an HF architecture class, or None when there is none."""
    builder = MAPS.get(architecture)
    return builder(architecture, config) if builder is not None else None


def fallback(architecture: str, config: dict[str, Any]) -> CorrespondenceMap:
    """Name-matching map: every leaf module's (first) output under its own name.

    The boundary list starts empty; the recorder adds names in the order it
    observes them. ``log_softmax`` and ``logits`` keep their engine-level taps.
    """
    leaf = [Tap(r"(?P<name>.+)", "output", "first", ("{name}",))]
    n_layers = int(config.get("num_hidden_layers", 0) or 0)
    return CorrespondenceMap(architecture, [], {"hf": leaf, "vllm": leaf}, n_layers, mapped=False)


def layer_of(name: str) -> int | None:
    """The decoder layer index in a boundary name, or None."""
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None
