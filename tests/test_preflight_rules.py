"""The preflight's weight comparison and the classifier's rules for what it could not compare.

Pure functions on plain dicts: no engine is loaded. The end-to-end planted
faults are in test_classify.py.
"""

from __future__ import annotations

from dataclasses import replace

from logdiff.comparison.cause import verdict
from logdiff.diagnosis.classify import OpEvidence, classify_op
from logdiff.diagnosis.conformance import Conformance, SideCheck
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


def test_a_fingerprint_of_another_hash_is_unverified_never_different() -> None:
    """A bundle written before XXH3 holds blake2b's 16 hex digits: against today's it is unverified; today's against
    today's still differ where the tensors do (the control)."""
    import torch

    from logdiff.probes.contracts import fingerprint

    one, other = fingerprint(torch.ones(3)), fingerprint(torch.zeros(3))
    assert len(one) == 32 and one != other and fingerprint(torch.ones(3)) == one
    w = compare_fingerprints({"old.weight": "0123456789abcdef", "new.weight": one},
                             {"old.weight": one, "new.weight": other})
    assert w["unverified"] == ["old.weight"] and w["differs"] == ["new.weight"]
    damaged = compare_fingerprints({"a.weight": one, "b.weight": one}, {"a.weight": [one], "b.weight": 7})
    assert damaged["unverified"] == ["a.weight", "b.weight"] and damaged["differs"] == []


def _contracts(unverified: list[str]) -> dict:
    same = {"rms_norm_eps": 1e-6}
    return {"train": same, "infer": same, "differs": [],
            "weights": {"differs": [], "unverified": unverified}}  # fmt: skip


def _persistent(boundary: str = "model.layers.1.mlp.down_proj") -> OpEvidence:
    """An op whose error persists under the reference kernel, far above reordering noise, unmeasured against
    its exact function."""
    return OpEvidence(boundary, "linear", 1, 0.5, 3000.0, vanished_under_reference=False)


def _outside(side: str) -> Conformance:
    """Conformance that measured ``side`` far outside its bound and the other side within."""
    inside, outside = SideCheck(0.5, 3.0, 8, "linear(K=64)"), SideCheck(400.0, 3.0, 8, "linear(K=64)")
    return Conformance({s: outside if s == side else inside for s in ("train", "infer")})


def test_a_side_outside_its_bound_reading_an_unverified_weight_is_a_possible_weights_cause() -> None:
    ev = replace(_persistent(), conformance=_outside("infer"))
    c = classify_op(ev, _contracts(["model.layers.1.mlp.down_proj.weight"]), fused_add_norm=True)
    assert (c.class_, c.kind) == ("framework_difference", "weights")
    assert c.differs == ["model.layers.1.mlp.down_proj.weight"]
    assert any("unverified" in line for line in c.evidence)


def test_the_kernel_swap_is_evidence_never_a_verdict() -> None:
    """No exact function measured: persisting under the reference kernel, or vanishing, is not judged."""
    for vanished in (False, True, None):
        ev = replace(_persistent(), vanished_under_reference=vanished)
        c = classify_op(ev, _contracts([]), fused_add_norm=True)
        assert (c.class_, c.kind) == ("not_judged", "not_judged") and c.differs == []
        if vanished is not None:
            assert any(("persists" if not vanished else "vanishes") in line for line in c.evidence)


def test_an_unverified_weight_alone_blames_nothing() -> None:
    """Not judged: the unverified weight is said, not blamed."""
    ev = OpEvidence("model.layers.1.mlp.down_proj", "linear", 1, 1e-3, 1.0, vanished_under_reference=True)
    c = classify_op(ev, _contracts(["model.layers.1.mlp.down_proj.weight"]), fused_add_norm=True)
    assert c.class_ == "not_judged" and c.differs == []
    assert any("unverified" in line for line in c.evidence)


def test_not_judged_causes_decide_no_verdict() -> None:
    ev = OpEvidence("model.layers.1.mlp.down_proj", "linear", 1, 1e-3, 1.0, vanished_under_reference=True)
    inside = replace(ev, conformance=_outside("none"))
    judged, unjudged = classify_op(inside, _contracts([]), True), classify_op(ev, _contracts([]), True)
    assert judged.class_ == "operator_path"
    assert verdict([unjudged], consistent=False) == "divergent"
    assert verdict([unjudged, judged], consistent=False) == "operator_path"
