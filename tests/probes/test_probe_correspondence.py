"""Correspondence maps: semantic order is a topological order of the data flow."""

from __future__ import annotations

import pytest
from logdiff.probes import arch
from logdiff.probes import correspondence as c

from logdiff.sources.hf.taps import TAPS as HF_TAPS
from logdiff.sources.vllm.taps import TAPS as VLLM_TAPS

CONFIG = {"num_hidden_layers": 3}


@pytest.mark.parametrize("arch", sorted(c.MAPS))
def test_every_input_comes_before_its_boundary(arch: str) -> None:
    cmap = c.build(arch, {**CONFIG, "mlp_only_layers": [1], "decoder_sparse_step": 1})
    seen: set[str] = set()
    for b in cmap.boundaries:
        for i in b.inputs:
            assert i in seen, f"{b.name} reads {i} before it is computed"
        seen.add(b.name)
    assert cmap.order[0] == "model.embed_tokens" and cmap.order[-2:] == ["logits", "log_softmax"]
    assert len(set(cmap.order)) == len(cmap.order)


def test_maps_differ_where_the_architectures_do() -> None:
    qwen3 = c.build("Qwen3ForCausalLM", CONFIG)
    llama = c.build("LlamaForCausalLM", CONFIG)
    moe = c.build("Qwen3MoeForCausalLM", {**CONFIG, "mlp_only_layers": [1]})
    assert qwen3.get("model.layers.0.self_attn.q_norm") is not None
    assert llama.get("model.layers.0.self_attn.q_norm") is None
    assert llama.get("model.layers.0.self_attn.rope_q").inputs == ("model.layers.0.self_attn.q_proj",)
    assert moe.get("model.layers.0.mlp.gate").kind == "router"
    assert moe.get("model.layers.1.mlp.down_proj") is not None  # a dense layer inside the MoE model
    assert c.build("FalconForCausalLM", CONFIG) is None  # no adapter (docs/architectures.md)
    assert not c.fallback("FalconForCausalLM", CONFIG).mapped


def test_fused_residual_taps_name_the_previous_layer() -> None:
    cmap = c.build("Qwen3ForCausalLM", CONFIG)
    tap = next(t for t in VLLM_TAPS.taps(cmap) if t.pattern.endswith(r"\.input_layernorm"))
    assert cmap.names_for(tap, 0) == ["model.layers.0.input_layernorm", None]
    assert cmap.names_for(tap, 2) == ["model.layers.2.input_layernorm", "model.layers.1.residual_mlp"]
    norm = next(t for t in VLLM_TAPS.taps(cmap) if t.pattern == r"model\.norm")
    assert cmap.names_for(norm, None) == ["model.norm", "model.layers.2.residual_mlp"]
    assert tap.regex().match("model.layers.12.input_layernorm").group("N") == "12"


@pytest.mark.parametrize("mapping", [HF_TAPS, VLLM_TAPS], ids=["hf", "vllm"])
def test_an_unmapped_map_gets_the_leaf_taps_on_every_engine(mapping: c.TapMapping) -> None:
    fallback = c.fallback("FalconForCausalLM", CONFIG)
    assert mapping.taps(fallback) == list(c.LEAF_TAPS)
    assert fallback.config == CONFIG and fallback.num_layers == 3


@pytest.mark.parametrize("mapping", [HF_TAPS, VLLM_TAPS], ids=["hf", "vllm"])
def test_every_tap_builder_names_a_registered_adapter(mapping: c.TapMapping) -> None:
    names = {a.name for a in arch.adapters().values()}
    assert set(mapping.builders) <= names


def test_a_derived_engine_extends_its_parents_mapping() -> None:
    lm_head_only = c.Tap(r"lm_head", "output", "tensor", ("logits",))
    derived = VLLM_TAPS.extended({"llama": lambda adapter, config: [lm_head_only]})
    llama, gemma2 = c.build("LlamaForCausalLM", CONFIG), c.build("Gemma2ForCausalLM", CONFIG)
    assert derived.taps(llama) == [lm_head_only] and VLLM_TAPS.taps(llama) != [lm_head_only]
    assert derived.taps(gemma2) == VLLM_TAPS.taps(gemma2)  # the parent's entries are inherited
    assert derived.taps(c.build("Qwen3ForCausalLM", CONFIG)) == VLLM_TAPS.taps(c.build("Qwen3ForCausalLM", CONFIG))


def test_taps_follow_the_config_the_map_was_built_from() -> None:
    v3 = {**CONFIG, "n_routed_experts": 0}
    rope = [t.select for t in VLLM_TAPS.taps(c.build("DeepseekV3ForCausalLM", v3)) if t.pattern.endswith("rotary_emb")]
    plain = c.build("DeepseekV3ForCausalLM", {**v3, "rope_interleave": False})
    assert rope == ["pair_deinterleaved"]
    assert [t.select for t in VLLM_TAPS.taps(plain) if t.pattern.endswith("rotary_emb")] == ["pair"]


def test_layer_of() -> None:
    assert c.layer_of("model.layers.3.mlp.down_proj") == 3
    assert c.layer_of("logits") is None
