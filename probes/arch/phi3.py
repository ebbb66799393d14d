"""Phi-3: the Llama-like decoder whose HF modules are fused like vLLM's.

HF's ``Phi3Attention`` has one ``qkv_proj`` and ``Phi3MLP`` one
``gate_up_proj`` (with ``activation_fn``, not ``act_fn``), the layout vLLM
uses for every family (vLLM runs Phi-3 as its Llama model). The boundaries are
Llama's (``DecoderAdapter``'s), per q, k, v, gate and up (a fault in k's rows
is found at ``k_proj``); HF's taps (``logdiff/sources/hf/taps.py``, entry
``phi3``) split the packed outputs exactly like vLLM's: q/k/v by the attention's
head counts, gate/up in halves.

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

from dataclasses import dataclass
from typing import Any

from logdiff.probes.arch.base import Demo, register
from logdiff.probes.arch.decoder import DecoderAdapter

#: a boundary split out of a packed projection -> that projection (HF's and vLLM's)
_SPLIT = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


@dataclass(frozen=True)
class Phi3Adapter(DecoderAdapter):
    """``DecoderAdapter`` with HF's own ``qkv_proj``/``gate_up_proj``."""

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
