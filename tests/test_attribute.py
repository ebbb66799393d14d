"""Levers and kinds, without engines: the rescan settings attribution derives."""

from __future__ import annotations

from pathlib import Path

from logdiff import attribute, classify
from logdiff.config import ScanConfig


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
    assert classify.classify_op(ev, None, fused_add_norm=True)["kind"] == "fused_vs_unfused"
    assert classify.classify_op(ev, None, fused_add_norm=False)["kind"] == "reduction_order"
