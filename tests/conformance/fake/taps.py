"""Where the fake engine's modules expose a Llama-like decoder's boundaries (its ``TapMapping``).

Its own names and fusions: a packed ``wqkv`` split by the attention module's
``q_size``/``kv_size``, a packed ``w13`` split in halves, residual adds and the
log-softmax as modules. One builder serves every adapter it loads (the engine
refuses any other at load time).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from logdiff.probes.correspondence import Tap, TapMapping

_B = r"blocks\.{N}"
_L = "model.layers.{N}"


def fake_decoder_taps(adapter: Any, config: Mapping[str, Any]) -> list[Tap]:
    return [
        Tap(r"tok_embeddings", "output", "tensor", ("model.embed_tokens",)),
        Tap(_B + r"\.attn_norm", "output", "tensor", (f"{_L}.input_layernorm",)),
        Tap(_B + r"\.attn\.wqkv", "output", "split_qkv",
            (f"{_L}.self_attn.q_proj", f"{_L}.self_attn.k_proj", f"{_L}.self_attn.v_proj")),
        Tap(_B + r"\.attn\.q_norm", "output", "tensor", (f"{_L}.self_attn.q_norm",)),
        Tap(_B + r"\.attn\.k_norm", "output", "tensor", (f"{_L}.self_attn.k_norm",)),
        Tap(_B + r"\.attn\.rope", "output", "pair", (f"{_L}.self_attn.rope_q", f"{_L}.self_attn.rope_k")),
        Tap(_B + r"\.attn\.core", "output", "tensor", (f"{_L}.self_attn.attn_core",)),
        Tap(_B + r"\.attn\.wo", "output", "tensor", (f"{_L}.self_attn.o_proj",)),
        Tap(_B + r"\.add_attn", "output", "tensor", (f"{_L}.residual_attn",)),
        Tap(_B + r"\.ffn_norm", "output", "tensor", (f"{_L}.post_attention_layernorm",)),
        Tap(_B + r"\.ffn\.w13", "output", "split_half", (f"{_L}.mlp.gate_proj", f"{_L}.mlp.up_proj")),
        Tap(_B + r"\.ffn\.act", "output", "tensor", (f"{_L}.mlp.act_mul",)),
        Tap(_B + r"\.ffn\.w2", "output", "tensor", (f"{_L}.mlp.down_proj",)),
        Tap(_B + r"\.add_ffn", "output", "tensor", (f"{_L}.residual_mlp",)),
        Tap(r"norm", "output", "tensor", ("model.norm",)),
        Tap(r"output", "output", "tensor", ("logits",)),
        Tap(r"log_softmax", "output", "tensor", ("log_softmax",)),
    ]


TAPS = TapMapping(fake_decoder_taps)
