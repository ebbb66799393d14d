"""GLM-4.5 MoE (``Glm4MoeForCausalLM``): a Llama-like decoder with a shared expert and sigmoid grouped routing.

What differs from Qwen3-MoE, and how the adapter covers it:

* **First layers dense.** Layers below ``first_k_dense_replace`` hold a plain
  gated MLP (``mlp.gate_proj/up_proj/down_proj``); the others an MoE block.
* **A shared expert.** The MoE block is ``gate`` (router), ``experts``
  (routed, 3-D fused in HF, a FusedMoE in vLLM) and ``shared_experts`` (a
  gated MLP of ``moe_intermediate_size * n_shared_experts``, run on every
  token). HF adds ``experts(x) + shared_experts(x)``; vLLM's fused-MoE runner
  calls the shared expert itself and returns the sum. The shared expert gets
  its own boundaries (``mlp.shared_experts.gate_proj/up_proj/act_mul/down_proj``,
  vLLM's packed ``gate_up_proj`` split as in the dense MLP), so a fault in it
  is found there. The block boundary ``mlp`` reads it as an input, and its
  weights too: HF's replay of the block reruns the shared expert, so a stale
  shared weight is blamed on the shared op and on the block, both as weights.
* **Routing.** ``sigmoid`` scores of fp32 router logits (vLLM keeps the gate
  in fp32), experts chosen on ``scores + e_score_correction_bias`` within the
  best ``topk_group`` of ``n_group`` groups (a group scores the sum of its top
  two), weights from the unbiased scores, renormalized (``norm_topk_prob``)
  and scaled by ``routed_scaling_factor``. The rule's settings are contract
  keys read from both engines' routers (each engine's ``contract_extras.py``; groups that are
  all kept read as one, greedy top-k); routing keys a preflight alone finds are
  blamed on the first MoE layer (``configured``: ``first_k_dense_replace``); the per-layer
  bias is a weight (``mlp.gate.e_score_correction_bias``, read by the router)
  and the routing diagnostics read it from each engine (``router_bias``,
  ``routing_rule_of``: ``DecoderAdapter``'s, for every router with a correction bias).
* **Partial rotary.** RoPE on the first ``partial_rotary_factor`` of each head
  (default 0.5); ``rotary_dim`` is a contract key read from both engines.
* **Optional q/k norm** (``use_qk_norm``), switched on per config.

The demo: 8 routed experts of 128 in 2 groups (top-1 group, top-2 experts),
one shared expert, layer 0 dense, partial rotary 0.5, q/k norms and a routed
scaling of 2.5 (as GLM-4.5).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from logdiff.probes.arch.base import Demo, first_router_layer, register
from logdiff.probes.arch.decoder import (
    FUNCTION_BOUNDARIES,
    KEY_BOUNDARY,
    ROUTING_KEYS,
    DecoderAdapter,
    _layer_boundaries,
    model_boundaries,
)
from logdiff.probes.correspondence import Boundary, CorrespondenceMap

ROTARY_KEYS = ("rotary_dim",)
BIAS = "e_score_correction_bias"


def _shared_boundaries(n: int, norm: str) -> list[Boundary]:
    s = f"model.layers.{n}.mlp.shared_experts"
    return [
        Boundary(f"{s}.gate_proj", "linear", n, (norm,)),
        Boundary(f"{s}.up_proj", "linear", n, (norm,)),
        Boundary(f"{s}.act_mul", "act", n, (f"{s}.gate_proj", f"{s}.up_proj")),
        Boundary(f"{s}.down_proj", "linear", n, (f"{s}.act_mul",)),
    ]


def _with_shared_expert(layer: list[Boundary], n: int) -> list[Boundary]:
    """An MoE layer's boundaries with the shared expert before the block, which reads it."""
    out: list[Boundary] = []
    norm = f"model.layers.{n}.post_attention_layernorm"
    for b in layer:
        if b.kind == "moe":
            shared = _shared_boundaries(n, norm)
            out += [*shared, Boundary(b.name, b.kind, n, (*b.inputs, shared[-1].name))]
        else:
            out.append(b)
    return out


@dataclass(frozen=True)
class Glm4MoeAdapter(DecoderAdapter):
    """GLM-4.5 MoE: ``DecoderAdapter`` plus dense first layers, a shared expert, sigmoid grouped routing."""

    #: the first MoE layer, where routing keys are read first (``key_boundary``): ``configured`` sets it from
    #: the model's ``first_k_dense_replace`` (1 unconfigured: its default)
    first_moe_layer: int = 1

    def configured(self, config: Any) -> Glm4MoeAdapter:
        return replace(self, first_moe_layer=first_router_layer(self, config, self.first_moe_layer))

    def correspondence(self, config: Mapping[str, Any]) -> CorrespondenceMap:
        n_layers = int(config["num_hidden_layers"])
        dense = int(config.get("first_k_dense_replace", 1) or 0)
        qk_norm = bool(config.get("use_qk_norm", False))

        def layer(n: int) -> list[Boundary]:
            sparse = n >= dense
            out = _layer_boundaries(n, qk_norm, sparse)
            return _with_shared_expert(out, n) if sparse and config.get("n_shared_experts") else out

        boundaries = model_boundaries(n_layers, layer)
        return CorrespondenceMap(
            self.architecture, boundaries, n_layers, config=config, functions=dict(FUNCTION_BOUNDARIES)
        )

    # ---- classification ----------------------------------------------------------------------

    def contract_keys(self, boundary: str, kind: str) -> tuple[list[str], list[str]]:
        keys, weights = super().contract_keys(boundary, kind)
        if kind in ("router", "moe"):
            keys += list(ROUTING_KEYS)
            prefix = boundary if kind == "moe" else boundary.rsplit(".", 1)[0]
            weights.insert(1, f"{prefix}.gate.{BIAS}")
        if kind == "moe":  # HF's replay of the block runs its shared expert too
            weights += [f"{boundary}.shared_experts.{part}.weight" for part in ("gate_proj", "up_proj", "down_proj")]
        elif kind == "rope":
            keys += list(ROTARY_KEYS)
        return keys, weights

    @property
    def key_boundary(self) -> dict[str, tuple[str, str]]:
        router = (f"model.layers.{self.first_moe_layer}.mlp.gate", "router")
        keys = {**KEY_BOUNDARY, "num_experts_per_tok": router, "norm_topk_prob": router}
        keys.update({k: router for k in ROUTING_KEYS})
        keys.update({k: KEY_BOUNDARY["rope_theta"] for k in ROTARY_KEYS})
        return keys

    def weight_boundary(self, name: str) -> tuple[str, str]:
        if name.endswith(f".gate.{BIAS}"):
            return name[: -len(f".{BIAS}")], "router"
        return super().weight_boundary(name)

    # ---- contract readers ----------------------------------------------------------------------

    def rotary_dim(self, model: Any) -> int | None:
        """The rotary width, from the first attention's rotary module (vLLM) or the model's one (HF)."""
        rotary = getattr(self.attention(self.layers(model)[0]), "rotary_emb", None)  # vLLM: per attention module
        if rotary is None:
            rotary = getattr(model.model, "rotary_emb", None)  # HF: one per model
        return _rotary_dim(rotary)

    #: attribute of an MoE block holding its shared expert (a plain gated MLP)
    shared_expert = "shared_experts"


def _rotary_dim(rotary: Any) -> int | None:
    if rotary is None:
        return None
    if hasattr(rotary, "rotary_dim"):  # vLLM
        return int(rotary.rotary_dim)
    return 2 * int(rotary.inv_freq.numel())  # HF: inv_freq has rotary_dim / 2 entries



GLM4_MOE = register(
    Glm4MoeAdapter("Glm4Moe", "glm4-moe", moe=True, sliding_window_flag=None),
    Demo(
        "glm4-moe",
        "Glm4MoeForCausalLM",
        "Glm4MoeConfig",
        {
            "intermediate_size": 768,  # the dense first layer
            "moe_intermediate_size": 128,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,  # as GLM-4.5: HF scales the weights, vLLM the routed output
            "first_k_dense_replace": 1,
            "use_qk_norm": True,  # as GLM-4.5
            "num_nextn_predict_layers": 0,
            "output_router_logits": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
        },
        "GLM-4.5 MoE: 8 routed experts in 2 groups + 1 shared, top-2, layer 0 dense, partial rotary",
    ),
)
