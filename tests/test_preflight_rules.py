"""The preflight's weight comparison and the classifier's rules for what it could not compare.

Pure functions on plain dicts: no engine is loaded. The end-to-end planted
faults are in test_classify.py.
"""

from __future__ import annotations

from logdiff.diagnosis.classify import OpEvidence, classify_op
from logdiff.diagnosis.preflight import compare_fingerprints

TRAIN = {"a.weight": "01", "b.weight": "02", "experts.gate_up_proj": "03"}


def test_identical_weights_compare_equal() -> None:
    w = compare_fingerprints(TRAIN, dict(TRAIN))
    assert w["differs"] == [] and w["unverified"] == [] and w["verified"] == 3
    assert w["fingerprint_train"] == w["fingerprint_infer"]


def test_a_different_tensor_is_named_and_changes_the_fingerprint() -> None:
    w = compare_fingerprints(TRAIN, {**TRAIN, "b.weight": "ff"})
    assert w["differs"] == ["b.weight"] and w["fingerprint_train"] != w["fingerprint_infer"]


def test_an_unverified_tensor_is_listed_not_hashed() -> None:
    """The combined fingerprints differ if and only if some tensor is named in differs."""
    w = compare_fingerprints(TRAIN, {**TRAIN, "experts.gate_up_proj": None})
    assert w["unverified"] == ["experts.gate_up_proj"] and w["differs"] == [] and w["verified"] == 2
    assert w["fingerprint_train"] == w["fingerprint_infer"]
    missing = compare_fingerprints(TRAIN, {"a.weight": "01", "b.weight": "02"})
    assert missing["unverified"] == ["experts.gate_up_proj"]


def _contracts(unverified: list[str]) -> dict:
    same = {"rms_norm_eps": 1e-6}
    return {"train": same, "infer": same, "differs": [],
            "weights": {"differs": [], "unverified": unverified}}  # fmt: skip


def _persistent(boundary: str = "model.layers.1.mlp.down_proj") -> OpEvidence:
    """An op whose error persists under the reference kernel: a different function."""
    return OpEvidence(boundary, "linear", 1, 0.5, 3000.0, vanished_under_reference=False)


def test_a_different_function_reading_an_unverified_weight_is_a_possible_weights_cause() -> None:
    c = classify_op(_persistent(), _contracts(["model.layers.1.mlp.down_proj.weight"]), fused_add_norm=True)
    assert (c.class_, c.kind) == ("framework_difference", "weights")
    assert c.differs == ["model.layers.1.mlp.down_proj.weight"]
    assert any("unverified" in line for line in c.evidence)


def test_a_different_function_with_everything_verified_names_no_config_key() -> None:
    c = classify_op(_persistent(), _contracts([]), fused_add_norm=True)
    assert (c.class_, c.kind) == ("framework_difference", "hidden_difference")
    assert c.kind != "config_contract" and c.differs == []


def test_an_unverified_weight_alone_does_not_blame_reordering_noise() -> None:
    """Negative control: an op whose error vanishes under the reference kernel stays operator_path."""
    ev = OpEvidence("model.layers.1.mlp.down_proj", "linear", 1, 1e-3, 1.0, vanished_under_reference=True)
    c = classify_op(ev, _contracts(["model.layers.1.mlp.down_proj.weight"]), fused_add_norm=True)
    assert (c.class_, c.kind) == ("operator_path", "reduction_order")
