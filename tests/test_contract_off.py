"""A feature switched off on one side is a value, not "unknown" (issue 33, item 3).

The effective contracts read a switched-off feature (no sliding window, no soft
cap, one an implementation drops) as ``OFF``; None is kept for a key a reader
could not read at all. So off against a value is listed under ``differs`` and
classified as a framework difference naming the op and the side that applies
the feature; off against off is equal; a key one side could not read stays
``unknown``. The planted scans run the real CPU vLLM on the demo models: a
one-sided window on Mistral (``--set infer.sliding_window=8``, the issue's
case) and a one-sided final soft cap on Gemma 2 (the trainer's cap removed:
vLLM alone applies it, so the cause names vLLM), each beside the same scan
without the plant, whose contracts read equal.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest
from logdiff.probes.contracts import OFF, applied, effective, soft_cap, window_size

import logdiff
from logdiff.diagnosis.classify import OpEvidence, classify_op, preflight_only_causes
from logdiff.diagnosis.preflight import compare_contracts, one_sided

SMALL = {"num_sequences": 2, "prompt_len": 12, "response_len": 12, "depth": "modules", "attribute": False}
ATTN = "model.layers.0.self_attn.attn_core"


def _contracts(train: dict[str, Any], infer: dict[str, Any]) -> dict[str, Any]:
    return {**compare_contracts(train, infer), "weights": {"differs": [], "unverified": []}}


# ---------------------------------------------------------------------------- compare_contracts


def test_off_against_a_value_differs_off_against_off_is_equal_and_unread_is_unknown() -> None:
    base = {"attention_scale": 0.125}
    one_sided_window = compare_contracts({**base, "sliding_window": OFF}, {**base, "sliding_window": 8})
    assert one_sided_window["differs"] == ["sliding_window"] and one_sided_window["unknown"] == []
    caps = compare_contracts({**base, "final_logit_softcapping": 30.0}, {**base, "final_logit_softcapping": OFF})
    assert caps["differs"] == ["final_logit_softcapping"] and caps["unknown"] == []
    # negative controls: off on both sides, and the same value on both, are equal
    for value in (OFF, 8):
        same = compare_contracts({**base, "sliding_window": value}, {**base, "sliding_window": value})
        assert same["differs"] == [] and same["unknown"] == [], value
    # a key one side could not read (None) is unknown, whether the other reads a value or off
    for value in (8, OFF):
        unread = compare_contracts({**base, "sliding_window": None}, {**base, "sliding_window": value})
        assert unread["differs"] == [] and unread["unknown"] == ["sliding_window"], value


def test_a_dropped_feature_reads_off_and_differs_from_a_side_applying_it() -> None:
    train = effective({"attn_logit_softcapping": 50.0}, {"attn_logit_softcapping": "sdpa drops it"})
    assert train["attn_logit_softcapping"] == OFF and "attn_logit_softcapping" in train["dropped"]
    assert compare_contracts(train, {"attn_logit_softcapping": 50.0})["differs"] == ["attn_logit_softcapping"]
    # a feature already off is not "dropped" by an implementation that would drop it
    off = {"attn_logit_softcapping": OFF}
    assert effective(off, {"attn_logit_softcapping": "sdpa drops it"}) == off
    # a result written before off was a value: the dropped feature as None still differs, never unknown
    old = compare_contracts({"attn_logit_softcapping": None, "dropped": {"attn_logit_softcapping": "sdpa"}},
                            {"attn_logit_softcapping": 50.0})  # fmt: skip
    assert old["differs"] == ["attn_logit_softcapping"] and old["unknown"] == []


def test_one_sided_names_the_side_applying_the_feature_and_nothing_else() -> None:
    contracts = _contracts({"sliding_window": OFF, "rms_norm_eps": 1e-6}, {"sliding_window": 8, "rms_norm_eps": 1e-5})
    assert one_sided(["sliding_window"], contracts) == ["infer"]
    assert one_sided(["rms_norm_eps"], contracts) == []  # two values: a difference, not a one-sided feature
    flipped = _contracts({"sliding_window": 4096}, {"sliding_window": OFF})
    assert one_sided(["sliding_window"], flipped) == ["train"]
    assert one_sided(["sliding_window"], _contracts({"sliding_window": None}, {"sliding_window": 8})) == []


# ---------------------------------------------------------------------------- the readers' off values


def test_vllm_spellings_of_off_read_off_and_a_window_reads_its_width() -> None:
    for none in (None, -1, (-1, -1)):
        assert window_size(none) == OFF, none
    assert window_size(8) == 8
    assert window_size((7, 0)) == 8  # FlashAttention keeps (window - 1, 0): the keys left of the query's own
    assert soft_cap(None) == soft_cap(0) == soft_cap(0.0) == OFF and soft_cap(30) == 30.0
    assert applied(OFF) is None and applied(8) == 8 and applied(None) is None


def _vllm_gemma2(impl: Any, processor: Any) -> Any:
    layer = NS(self_attn=NS(attn=NS(impl=impl)) if impl is not None else NS())
    embed = NS(weight=NS(dtype=None))
    model = NS(model=NS(layers=[layer], embed_tokens=embed, normalizer=None))
    if processor is not None:
        model.logits_processor = processor
    return model


def test_vllm_readers_tell_off_from_unread() -> None:
    """Without vLLM: stand-ins of vLLM's tree. A backend with no window or cap reads off; no backend, unread."""
    from logdiff.probes.arch import adapter_for

    from logdiff.sources.vllm.contract_extras import EXTRAS
    from logdiff.sources.vllm.contract_extras import backend_window as _backend_window

    assert _backend_window(NS(sliding_window=-1)) == OFF and _backend_window(NS(sliding_window=8)) == 8
    assert _backend_window(None) is None and _backend_window(NS()) is None
    gemma2 = adapter_for("Gemma2ForCausalLM")
    off = EXTRAS.read(gemma2, _vllm_gemma2(NS(logits_soft_cap=0), NS(soft_cap=None)))
    assert off["attn_logit_softcapping"] == off["final_logit_softcapping"] == OFF
    on = EXTRAS.read(gemma2, _vllm_gemma2(NS(logits_soft_cap=50.0), NS(soft_cap=30.0)))
    assert (on["attn_logit_softcapping"], on["final_logit_softcapping"]) == (50.0, 30.0)
    unread = EXTRAS.read(gemma2, _vllm_gemma2(None, None))
    assert unread["attn_logit_softcapping"] is None and unread["final_logit_softcapping"] is None


def _tiny(config_class: str, model_class: str, **config: Any) -> Any:
    import transformers

    base = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 64}
    cfg = getattr(transformers, config_class)(**{**base, **config})
    cfg._attn_implementation = "eager"
    return getattr(transformers, model_class)(cfg).eval()


def test_hf_reader_reads_no_window_and_no_soft_cap_as_off() -> None:
    from logdiff.sources.hf.contract import hf_contract

    assert hf_contract(_tiny("MistralConfig", "MistralForCausalLM", sliding_window=None), {})["sliding_window"] == OFF
    assert hf_contract(_tiny("MistralConfig", "MistralForCausalLM", sliding_window=8), {})["sliding_window"] == 8
    uncapped = hf_contract(_tiny("Gemma2Config", "Gemma2ForCausalLM", attn_logit_softcapping=None,
                                 final_logit_softcapping=None), {})  # fmt: skip
    assert uncapped["attn_logit_softcapping"] == uncapped["final_logit_softcapping"] == OFF
    capped = hf_contract(_tiny("Gemma2Config", "Gemma2ForCausalLM", attn_logit_softcapping=50.0,
                               final_logit_softcapping=30.0), {})  # fmt: skip
    assert (capped["attn_logit_softcapping"], capped["final_logit_softcapping"]) == (50.0, 30.0)
    # Mixtral's config has no norm_topk_prob; its router always renormalizes (vLLM reads True): read, not unknown
    mixtral = hf_contract(_tiny("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2), {})
    assert mixtral["norm_topk_prob"] is True


# ---------------------------------------------------------------------------- classification


def test_a_one_sided_window_classifies_as_mask_naming_the_side() -> None:
    contracts = _contracts({"attention_scale": 0.125, "sliding_window": OFF},
                           {"attention_scale": 0.125, "sliding_window": 8})  # fmt: skip
    ev = OpEvidence(ATTN, "attn", 0, 0.5, 100.0, None, paths={"train": "hf", "infer": "vllm"})
    cause = classify_op(ev, contracts, fused_add_norm=True).to_dict()
    assert (cause["class"], cause["kind"], cause["paths"]) == ("framework_difference", "mask", ["vllm"])
    assert cause["differs"] == ["sliding_window"]
    assert any("'off' (train) vs 8 (infer)" in line and "only the infer side" in line for line in cause["evidence"])
    # negative control: the same window on both sides reads no contract difference at the op
    same = _contracts({"attention_scale": 0.125, "sliding_window": 8}, {"attention_scale": 0.125, "sliding_window": 8})
    control = classify_op(ev, same, fused_add_norm=True).to_dict()
    assert control["class"] != "framework_difference" and not control["differs"]


def test_a_one_sided_soft_cap_no_op_showed_is_still_a_cause_naming_the_side() -> None:
    from logdiff.probes.arch import adapter_for

    gemma2 = adapter_for("Gemma2ForCausalLM")
    contracts = _contracts({"final_logit_softcapping": 30.0}, {"final_logit_softcapping": OFF})
    [cause] = [c.to_dict() for c in preflight_only_causes(contracts, [], gemma2)]
    assert (cause["boundary"], cause["class"], cause["kind"]) == ("logits", "framework_difference", "config_contract")
    assert cause["paths"] == ["train"]
    assert preflight_only_causes(_contracts({"final_logit_softcapping": OFF}, {"final_logit_softcapping": OFF}),
                                 [], gemma2) == []  # fmt: skip


# ---------------------------------------------------------------------------- planted on the real CPU vLLM


def _contract_framework_causes(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in r["causes"] if c["class"] == "framework_difference" and c.get("differs")]


@pytest.mark.vllm
def test_one_sided_window_on_mistral_is_a_mask_difference_naming_vllm(demo_model: Callable[[str], Path]) -> None:
    model = demo_model("mistral")  # no sliding window (v0.2+)
    control = logdiff.scan(model, infer=["vllm"], **SMALL)
    assert control["contracts"]["train"]["sliding_window"] == control["contracts"]["infer"]["sliding_window"] == OFF
    assert control["contracts"]["differs"] == [] and control["contracts"]["unknown"] == []
    assert not _contract_framework_causes(control), control["causes"]

    r = logdiff.scan(model, infer=["vllm"], infer_set={"sliding_window": 8}, **SMALL)  # 24 tokens: it hides keys
    contracts = r["contracts"]
    assert (contracts["train"]["sliding_window"], contracts["infer"]["sliding_window"]) == (OFF, 8)
    assert "sliding_window" in contracts["differs"] and "sliding_window" not in contracts["unknown"]
    cause = next((c for c in r["causes"] if "sliding_window" in c.get("differs", [])), None)
    assert cause is not None, [(c["boundary"], c["class"], c["kind"]) for c in r["causes"]]
    assert (cause["boundary"], cause["class"], cause["kind"]) == (ATTN, "framework_difference", "mask")
    assert cause["paths"] == ["vllm"]
    assert r["verdict"] in ("framework_difference", "mixed")


def _cap_cause(r: dict[str, Any]) -> dict[str, Any]:
    contracts = r["contracts"]
    assert "final_logit_softcapping" in contracts["differs"] and "final_logit_softcapping" not in contracts["unknown"]
    cause = next((c for c in r["causes"] if "final_logit_softcapping" in c.get("differs", [])), None)
    assert cause is not None, [(c["boundary"], c["class"], c["kind"]) for c in r["causes"]]
    return cause


@pytest.mark.vllm
def test_one_sided_final_soft_cap_on_gemma2_names_the_logits_and_vllm(demo_model: Callable[[str], Path]) -> None:
    """The trainer's cap removed: vLLM alone caps. At the demo's cap of 30 the demo's small logits hardly change
    (the contracts alone find it); at a cap of 5 on vLLM the logits op itself shows it."""
    model = demo_model("gemma2")  # both caps on, on both sides
    control = logdiff.scan(model, infer=["vllm"], **SMALL)
    assert control["contracts"]["infer"]["final_logit_softcapping"] == 30.0
    assert "final_logit_softcapping" not in control["contracts"]["differs"] + control["contracts"]["unknown"]
    assert not [c for c in _contract_framework_causes(control) if "final_logit_softcapping" in c["differs"]]

    uncapped = {"final_logit_softcapping": None}
    r = logdiff.scan(model, infer=["vllm"], train_set=uncapped, **SMALL)
    assert (r["contracts"]["train"]["final_logit_softcapping"], r["contracts"]["infer"]["final_logit_softcapping"]) \
        == (OFF, 30.0)
    cause = _cap_cause(r)
    assert (cause["boundary"], cause["class"], cause["paths"]) == ("logits", "framework_difference", ["vllm"])
    assert r["verdict"] in ("framework_difference", "mixed")

    shown = logdiff.scan(model, infer=["vllm"], train_set=uncapped, infer_set={"final_logit_softcapping": 5.0}, **SMALL)
    assert shown["logprobs"]["abs_diff_max"] > control["logprobs"]["abs_diff_max"], "the plant changed nothing"
    cause = _cap_cause(shown)
    assert (cause["boundary"], cause["class"], cause["paths"]) == ("logits", "framework_difference", ["vllm"])
    assert any("only the infer side applies final_logit_softcapping" in line for line in cause["evidence"])
    # the logits op itself, judged against each side's own function (locate could not replay it)
    assert cause.get("conformance"), cause["evidence"]
