"""Contracts are the function each layer computes, and a cause only where they change it (issue 48, item 6).

The readers record the window each layer's attention masks (``layer_types`` and ``sliding_window``), not the
config key: Qwen2's ``sliding_window`` acts only with ``use_sliding_window`` and only from layer
``max_window_layers`` on, so a window that no layer applies reads off on both engines (the negative control,
against the real CPU vLLM), while a window one side applies on every layer still is a ``mask`` difference (the
positive control: ``tests/test_set_fuzz.py``'s list-valued ``layer_types`` scan at the default depth). An op is
judged on its own layer's view (``at_layer``); a window no shorter than every sequence changes no attention and
is evidence, not a cause; and where the conformance measurement contradicts the contracts the result says so.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest
from logdiff.probes.contracts import OFF, at_layer, layer_keys, per_layer

import logdiff
from logdiff.diagnosis.classify import OpEvidence, classify_op, preflight_only_causes
from logdiff.diagnosis.conformance import Conformance, SideCheck
from logdiff.diagnosis.contract_effect import (
    DISAGREE,
    inert_differences,
    inert_window,
    layer_differs,
)
from logdiff.diagnosis.preflight import compare_contracts

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules", "attribute": False}
ATTN = "model.layers.{}.self_attn.attn_core"
PATHS = {"train": "hf", "infer": "vllm"}


def _contracts(train: dict[str, Any], infer: dict[str, Any]) -> dict[str, Any]:
    return {**compare_contracts(train, infer), "weights": {"differs": [], "unverified": []}}


def _tiny(config_class: str, model_class: str, layers: int = 4, **config: Any) -> Any:
    import transformers

    base = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 64}
    cfg = getattr(transformers, config_class)(**{**base, **config})
    return getattr(transformers, model_class)(cfg).eval()


# ---------------------------------------------------------------------------- the readers, per layer


def test_hf_reader_reads_the_window_each_qwen2_layer_applies() -> None:
    from logdiff.sources.hf.contract import hf_contract

    def read(**config: Any) -> tuple[Any, Any]:
        c = hf_contract(_tiny("Qwen2Config", "Qwen2ForCausalLM", **config), {})
        return c["sliding_window"], c["layer_types"]

    window = {"use_sliding_window": True, "sliding_window": 8}
    assert read(**window, max_window_layers=4) == (OFF, "full,full,full,full")  # the config: no layer slides
    assert read(**window, max_window_layers=0) == (8, "sliding,sliding,sliding,sliding")  # every layer slides
    assert read(**window, max_window_layers=2) == (8, "full,full,sliding,sliding")  # from max_window_layers on
    assert read(use_sliding_window=False, sliding_window=8, max_window_layers=0) == (OFF, "full,full,full,full")
    # Mistral has no layer types: its window acts on every layer; Llama never windows
    mistral = hf_contract(_tiny("MistralConfig", "MistralForCausalLM", sliding_window=8), {})
    assert (mistral["sliding_window"], mistral["layer_types"]) == (8, "sliding,sliding,sliding,sliding")
    llama = hf_contract(_tiny("LlamaConfig", "LlamaForCausalLM"), {})
    assert (llama["sliding_window"], llama["layer_types"]) == (OFF, "full,full,full,full")


def test_vllm_reader_reads_each_layers_backend_and_rotary() -> None:
    """Without vLLM: a stand-in of vLLM's Llama-like tree. Each layer's backend window and rotary are read."""
    from logdiff.probes.arch import adapter_for

    from logdiff.sources.vllm.contract import vllm_contract

    class RotaryEmbedding(NS):
        pass

    def layer(window: int, base: float) -> NS:
        impl = NS(sliding_window=window, scale=0.125)
        return NS(self_attn=NS(attn=NS(impl=impl), rotary_emb=RotaryEmbedding(base=base, is_neox_style=True)),
                  input_layernorm=NS(variance_epsilon=1e-6), named_modules=lambda: iter(()))  # fmt: skip

    def model(*layers: NS) -> Any:
        import torch

        embed = torch.nn.Embedding(8, 4)
        tree = NS(model=NS(layers=list(layers), embed_tokens=embed, norm=NS(variance_epsilon=1e-6)),
                  config=NS(architectures=["Qwen2ForCausalLM"], vocab_size=8), lm_head=embed)  # fmt: skip
        tree.parameters = embed.parameters
        tree.modules = lambda: iter(())
        return tree

    assert adapter_for("Qwen2ForCausalLM") is not None
    off = vllm_contract(model(layer(-1, 1e6), layer(-1, 1e6)), {})
    assert (off["sliding_window"], off["layer_types"], off["rope_theta"]) == (OFF, "full,full", 1e6)
    mixed = vllm_contract(model(layer(-1, 1e6), layer(8, 1e4)), {})
    assert (mixed["sliding_window"], mixed["layer_types"]) == (8, "full,sliding")
    assert mixed["rope_theta"] == [1e6, 1e4]  # a RoPE base per layer, where the layers differ
    assert at_layer(mixed, 1)["rope_theta"] == 1e4 and at_layer(mixed, 0)["sliding_window"] == OFF


def test_layer_keys_and_views() -> None:
    assert layer_keys([OFF, OFF]) == {"layer_types": "full,full", "sliding_window": OFF}
    assert layer_keys([8, OFF, 8]) == {"layer_types": "sliding,full,sliding", "sliding_window": 8}
    assert layer_keys([8, 16]) == {"layer_types": "sliding,sliding", "sliding_window": [8, 16]}
    assert layer_keys([8, None]) == {"layer_types": None, "sliding_window": None}  # a layer not read: unread
    assert per_layer([1.0, 1.0]) == 1.0 and per_layer([1.0, 2.0]) == [1.0, 2.0] and per_layer([1.0, None]) is None
    gemma3 = {"layer_types": "sliding,full", "sliding_window": 8, "rope_theta": 1e6, "rope_local_base_freq": 1e4}
    assert at_layer(gemma3, 0) == {"layer_types": "sliding", "sliding_window": 8, "rope_theta": 1e4}
    assert at_layer(gemma3, 1) == {"layer_types": "full", "sliding_window": OFF, "rope_theta": 1e6}
    assert at_layer(gemma3, None) is gemma3 and at_layer({"sliding_window": 8}, 0) == {"sliding_window": 8}


# ---------------------------------------------------------------------------- judged per layer, and where it acts


def test_a_difference_is_judged_at_the_ops_own_layer() -> None:
    """gpt-oss: vLLM slides layer 1 too. Layer 1's attention reads the difference; layer 0's does not."""
    hf = {"attention_scale": 0.125, "layer_types": "sliding,full", "sliding_window": 8}
    vllm = {**hf, "layer_types": "sliding,sliding"}
    contracts = _contracts(hf, vllm)
    keys = ["attention_scale", "sliding_window", "layer_types"]
    assert contracts["differs"] == ["layer_types"]
    assert layer_differs(keys, contracts, 0) == []
    assert layer_differs(keys, contracts, 1) == ["sliding_window", "layer_types"]  # off on HF's layer 1, 8 on vLLM's
    at0 = classify_op(OpEvidence(ATTN.format(0), "attn", 0, 0.5, 100.0, None, paths=PATHS, longest=16), contracts,
                      True).to_dict()  # fmt: skip
    assert at0["class"] != "framework_difference" and not at0["differs"]
    at1 = classify_op(OpEvidence(ATTN.format(1), "attn", 1, 0.5, 100.0, None, paths=PATHS, longest=16), contracts,
                      True).to_dict()  # fmt: skip
    assert (at1["class"], at1["kind"], at1["paths"]) == ("framework_difference", "mask", ["vllm"])
    assert any(line.startswith("contract differs at layer 1: sliding_window = 'off' (train) vs 8 (infer)")
               for line in at1["evidence"]), at1["evidence"]  # fmt: skip


def test_a_window_no_sequence_reaches_is_evidence_not_a_cause() -> None:
    contracts = _contracts({"attention_scale": 0.125, "layer_types": "full,full", "sliding_window": OFF},
                           {"attention_scale": 0.125, "layer_types": "sliding,sliding", "sliding_window": 64})
    keys = ["sliding_window", "layer_types"]
    assert inert_window(keys, contracts, 0, 16) and inert_window(keys, contracts, 0, 64)
    assert inert_window(keys, contracts, 0, 65) is None  # control: a 65-token sequence loses a key
    ev = OpEvidence(ATTN.format(0), "attn", 0, 0.5, 100.0, None, paths=PATHS, longest=16)
    cause = classify_op(ev, contracts, True).to_dict()
    assert cause["class"] != "framework_difference" and not cause["differs"]
    assert any("no sequence here is longer than 64 tokens (the longest has 16)" in e for e in cause["evidence"])
    inert = inert_differences(contracts, 16)
    assert set(inert) == {"sliding_window", "layer_types"}
    assert preflight_only_causes(contracts, [], None, PATHS, inert=inert) == []
    # the positive control: sequences longer than the window, the same contracts are a mask cause
    longer = classify_op(OpEvidence(ATTN.format(0), "attn", 0, 0.5, 100.0, None, paths=PATHS, longest=80),
                         contracts, True).to_dict()  # fmt: skip
    assert (longer["class"], longer["kind"]) == ("framework_difference", "mask")
    assert inert_differences(contracts, 80) == {}
    assert [c.kind for c in preflight_only_causes(contracts, [], None, PATHS)] == ["mask"]


def _check(error: float) -> SideCheck:
    return SideCheck(error, 3.0, 8, "attention(scale=0.125)")


def test_contract_and_conformance_disagreeing_is_said_and_not_decided() -> None:
    """The contracts read a window on the train side only, but its output is within its bound of the unwindowed
    attention (the other contract's) and outside its own: both sides compute one function."""
    contracts = _contracts({"attention_scale": 0.125, "layer_types": "sliding", "sliding_window": 8},
                           {"attention_scale": 0.125, "layer_types": "full", "sliding_window": OFF})
    conf = Conformance(sides={"train": _check(40.0), "infer": _check(0.5)},
                       crossed={"train": _check(0.6), "infer": _check(45.0)})  # fmt: skip
    ev = OpEvidence(ATTN.format(0), "attn", 0, 0.5, 100.0, None, conformance=conf, paths=PATHS, longest=16)
    cause = classify_op(ev, contracts, True).to_dict()
    assert (cause["class"], cause["differs"]) == ("not_judged", ["sliding_window", "layer_types"])
    line = next(e for e in cause["evidence"] if e.startswith(DISAGREE))
    assert "the train side (hf) is outside" in line and "both sides compute one function" in line
    assert cause["conformance"]["under_other_contract"]["train"]["error"] == 0.6
    # the control: each side within its own contract's function and outside the other's confirms the difference
    agree = Conformance(sides={"train": _check(0.5), "infer": _check(0.5)},
                        crossed={"train": _check(40.0), "infer": _check(45.0)})  # fmt: skip
    ev = OpEvidence(ATTN.format(0), "attn", 0, 0.5, 100.0, None, conformance=agree, paths=PATHS, longest=16)
    confirmed = classify_op(ev, contracts, True).to_dict()
    assert (confirmed["class"], confirmed["kind"], confirmed["paths"]) == ("framework_difference", "mask", ["hf"])
    assert not any(e.startswith(DISAGREE) for e in confirmed["evidence"])
    assert any("the contract difference changes this op's output" in e for e in confirmed["evidence"])


def test_a_rope_override_is_neutralised_by_dropping_rope_parameters() -> None:
    from logdiff.commands.config import ScanConfig
    from logdiff.comparison.cause import Cause
    from logdiff.diagnosis import attribute

    rope = {"rope_type": "default", "rope_theta": 5e5}
    cfg = ScanConfig(model=Path("m"), depth="modules", infer_set={"rope_parameters": rope, "rms_norm_eps": 1e-5})
    cause = Cause("model.layers.0.self_attn.rope_q", 0, "rope", "rope", "framework_difference", "config_contract",
                  [], "", differs=["rope_type"])  # fmt: skip
    lever = attribute.lever_of(cause, cfg)
    assert lever == ("config", "rope_parameters")
    applied = attribute.apply_levers(cfg, {lever})
    assert applied.infer_set == {"rms_norm_eps": 1e-5}
    window = Cause(ATTN.format(0), 0, "attn", "attention", "framework_difference", "mask", [], "",
                   differs=["sliding_window", "layer_types"])  # fmt: skip
    both = ScanConfig(model=Path("m"), depth="modules", infer_set={"layer_types": ["sliding_attention"] * 4,
                                                                     "sliding_window": 64})  # fmt: skip
    assert attribute.lever_of(window, both) == ("config", "layer_types+sliding_window")
    assert attribute.apply_levers(both, {("config", "layer_types+sliding_window")}).infer_set == {}


# ---------------------------------------------------------------------------- scans


@pytest.mark.vllm
def test_qwen2_window_on_no_layer_is_no_framework_difference_against_vllm(qwen2_window_layers: Path) -> None:
    """The issue's config: HF reads ``layer_types`` all full, vLLM windows no layer; the gap is stock."""
    r = logdiff.scan(qwen2_window_layers, infer=["vllm"], **SMALL)
    contracts = r["contracts"]
    for side in ("train", "infer"):
        assert (contracts[side]["sliding_window"], contracts[side]["layer_types"]) == (OFF, "full,full,full,full")
    assert contracts["differs"] == [] and contracts["unknown"] == []
    assert not [c for c in r["causes"] if c["class"] == "framework_difference"], r["causes"]
    assert r["verdict"] == "operator_path"


def test_a_window_longer_than_every_sequence_is_a_warning_not_a_cause(qwen2_window_layers: Path,
                                                                        stock_varies: Any) -> None:
    """Every layer of the infer side slides, with a window of 64: the 16-token sequences never reach it."""
    longer = {"layer_types": ["sliding_attention"] * 4, "sliding_window": 64}
    r = logdiff.scan(qwen2_window_layers, infer=["hf-decode"], infer_set=longer, **SMALL)
    stock_varies(r["verdict"] == "consistent", "HF forward and KV-cache decode agree bitwise here")
    assert (r["contracts"]["train"]["sliding_window"], r["contracts"]["infer"]["sliding_window"]) == (OFF, 64)
    assert "sliding_window" in r["contracts"]["differs"]
    assert any("no sequence here is longer than 64 tokens (the longest has 16)" in w for w in r["warnings"])
    assert not [c for c in r["causes"] if c["class"] == "framework_difference"], r["causes"]
    attn = [c for c in r["causes"] if c["op_kind"] == "attn"]
    assert attn and all(any("evidence, not a cause" in e for e in c["evidence"]) for c in attn)
