"""Levers and kinds, without engines: the rescan settings attribution derives."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from logdiff.diagnosis import attribute, classify, diagnose, rescan
from logdiff.config import ScanConfig
from logdiff.result import Cause, Pair, ScanResult, ScanSettings, SequencesInfo


def test_levers_on_a_stock_scan_install_only_their_families() -> None:
    cfg = ScanConfig(model=Path("m"), depth="modules", infer_set={"rms_norm_eps": 0.01})
    c = attribute.apply_levers(cfg, {("kernel", "attention"), ("config", "rms_norm_eps")})
    assert (c.consistent, c.consistent_kernels, c.depth) == (True, ("attention",), "logprobs")
    assert c.infer_set == {}
    assert attribute.apply_levers(cfg, set()).consistent is False


def test_levers_on_a_consistent_scan_keep_its_kernels() -> None:
    cfg = ScanConfig(model=Path("m"), depth="modules", consistent=True, infer_set={"rms_norm_eps": 0.01})
    c = attribute.apply_levers(cfg, {("config", "rms_norm_eps")})
    assert c.consistent is True and c.consistent_kernels is None  # every family, as the scan had
    partial = ScanConfig(model=Path("m"), consistent=True, consistent_kernels=("rope",))
    assert attribute.apply_levers(partial, {("kernel", "attention")}).consistent_kernels == ("attention", "rope")


def test_norm_kind_depends_on_whether_the_engine_fuses_the_residual_add() -> None:
    ev = classify.OpEvidence("model.layers.0.input_layernorm", "norm", 0, 0.01, 1.0, True)
    assert classify.classify_op(ev, None, fused_add_norm=True).kind == "fused_vs_unfused"
    assert classify.classify_op(ev, None, fused_add_norm=False).kind == "reduction_order"


def _counting_rescanner(gap: Callable[[ScanConfig], float]) -> tuple[rescan.Rescanner, list[ScanConfig]]:
    seen: list[ScanConfig] = []

    def measure(c: ScanConfig) -> ScanResult:
        seen.append(c)
        settings = ScanSettings(c.seed, c.depth, c.consistent, {}, "probe", False, c.is_threshold)
        pair = Pair("hf", "vllm", {"abs_diff_max": gap(c)}, {}, {}, {})
        return ScanResult(str(c.model), None, None, "Qwen3ForCausalLM", c.dtype, settings, {}, [],
                          SequencesInfo(0, "probe", None, [], []), [pair])  # fmt: skip

    return rescan.Rescanner(measure), seen


def _operator_path(family: str) -> Cause:
    return Cause(f"model.layers.0.{family}", 0, "module", family, "operator_path", "reduction_order", [], "")


def test_one_cause_family_costs_attribution_no_rescan_of_its_own() -> None:
    """The reference check swaps in the introducing ops' families only: with one family, that rescan is
    also "this cause alone", and "every other cause fixed" is the scan itself."""
    cfg = ScanConfig(model=Path("m"), depth="modules")
    rescanner, seen = _counting_rescanner(lambda c: 0.0 if c.consistent_kernels == ("rope",) else 0.5)
    vanished = diagnose.reference_rerun(cfg, rescanner, {"rope"}, [])
    assert vanished is not None and vanished("model.layers.0.self_attn.rope_q") is True
    assert [(c.consistent, c.consistent_kernels, c.depth) for c in seen] == [(True, ("rope",), "logprobs")]
    rescanner.remember(cfg, 0.5)
    causes = [_operator_path("rope")]
    summary = attribute.attribute(causes, cfg, 0.5, rescanner.logdiff)
    assert len(seen) == 1  # nothing rescanned
    assert causes[0].share == 1.0 and causes[0].necessity is True and summary["residual_abs_diff_max"] == 0.0


def test_several_families_reuse_the_reference_rescan_as_everything_fixed() -> None:
    """Control: three families need their own "alone" and "all but" rescans; only "everything" is shared."""
    cfg = ScanConfig(model=Path("m"), depth="modules")
    families = {"rope", "attention", "rms_norm"}
    rescanner, seen = _counting_rescanner(lambda c: 0.0 if set(c.consistent_kernels or ()) == families else 0.5)
    diagnose.reference_rerun(cfg, rescanner, families, [])
    rescanner.remember(cfg, 0.5)
    causes = [_operator_path(f) for f in sorted(families)]
    attribute.attribute(causes, cfg, 0.5, rescanner.logdiff)
    assert len(seen) == 1 + 3 + 3  # the reference check, three alone, three all-but-one
    assert all(c.necessity is True and c.share == 0.0 for c in causes)
