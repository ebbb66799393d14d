"""Phi-3: the Llama-like decoder whose HF modules are fused like vLLM's.

HF's ``Phi3Attention`` has one ``qkv_proj`` and ``Phi3MLP`` one
``gate_up_proj`` (with ``activation_fn``, not ``act_fn``), the layout vLLM
uses for every family (vLLM runs Phi-3 as its Llama model). So the HF taps
split the packed outputs exactly like the vLLM taps: q/k/v by the attention's
head counts, gate/up in halves, and the boundaries stay per q, k, v, gate and
up (a fault in k's rows is found at ``k_proj``).

Weights are compared packed against packed: both engines hold
``qkv_proj.weight``/``gate_up_proj.weight`` (no split, ``packed`` is empty)
and each split boundary reads its packed tensor, so a stale ``qkv_proj`` is
blamed on the projection whose output it changes. Consistent mode replaces
the fused MLP with one ``linear`` and ``silu_and_mul`` on its halves
(``mlp_parts`` of three names: gate_up, down, activation). vLLM needs
``pad_token_id`` inside the vocabulary (Phi3Config defaults to 32000): the
demo config sets 0, and the demo builder its tokenizer's ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from logdiff.probes.arch.base import Demo, register
from logdiff.probes.arch.decoder import HF_TAPS, DecoderAdapter
from logdiff.probes.correspondence import CorrespondenceMap, Tap

_L = r"model\.layers\.{N}"
_SPLIT = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}

#: HF's fused projections, split like vLLM's (replacing the four Llama taps per projection)
_FUSED_TAPS = (
    Tap(
        _L + r"\.self_attn\.qkv_proj",
        "output",
        "split_qkv",
        ("model.layers.{N}.self_attn.q_proj", "model.layers.{N}.self_attn.k_proj", "model.layers.{N}.self_attn.v_proj"),
    ),
    Tap(_L + r"\.mlp\.gate_up_proj", "output", "split_half", ("model.layers.{N}.mlp.gate_proj", "model.layers.{N}.mlp.up_proj")),
)


@dataclass(frozen=True)
class Phi3Adapter(DecoderAdapter):
    """``DecoderAdapter`` with HF's own ``qkv_proj``/``gate_up_proj``."""

    def correspondence(self, config: Mapping[str, Any]) -> CorrespondenceMap:
        cmap = super().correspondence(config)
        split = tuple(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")) + ("mlp.gate_proj", "mlp.up_proj")
        kept = [t for t in HF_TAPS if not any(s.replace(".", r"\.") in t.pattern for s in split)]
        cmap.taps["hf"] = [*kept, *_FUSED_TAPS]
        return cmap

    def contract_keys(self, boundary: str, kind: str) -> tuple[list[str], list[str]]:
        keys, weights = super().contract_keys(boundary, kind)
        return keys, [self._packed_name(w) for w in weights]

    def weight_boundary(self, name: str) -> tuple[str, str]:
        """A packed weight belongs to the first boundary it feeds (q_proj, gate_proj)."""
        for part, packed in _SPLIT.items():
            if name.endswith(f".{packed}.weight"):
                return name.rsplit(".", 2)[0] + f".{part}", "linear"
        return super().weight_boundary(name)

    @staticmethod
    def _packed_name(weight: str) -> str:
        owner, _, leaf = weight.rpartition(".")
        prefix, _, short = owner.rpartition(".")
        return f"{prefix}.{_SPLIT[short]}.{leaf}" if short in _SPLIT else weight

    @property
    def packed(self) -> dict[str, tuple[str, ...]]:
        return {}  # compared packed against packed: HF stores them fused too

    mlp_parts = ("gate_up_proj", "down_proj", "activation_fn")

    def is_attention(self, module: Any) -> bool:
        return hasattr(module, "qkv_proj") and hasattr(module, "o_proj")


PHI3 = register(
    Phi3Adapter("Phi3", "phi3", sliding_window_flag=None),
    Demo(
        "phi3",
        "Phi3ForCausalLM",
        "Phi3Config",
        {"intermediate_size": 768, "sliding_window": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
         # inside any vocabulary (Phi3Config's defaults are 32000); the demo builder sets its tokenizer's ids
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 1.0}},
        "Phi-3: fused qkv_proj and gate_up_proj in HF too",
    ),
)
