"""Levers, kinds and Shapley attribution, without engines.

The attribution tests use a fake rescanner whose metrics are a known function
of the levers a configuration applies (a *game*), so the Shapley shares can be
checked against values worked out by hand, and every rescan can be counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from logdiff.reports.groups import group_causes

from logdiff.commands.config import KERNEL_FAMILIES, ScanConfig
from logdiff.comparison.result import Cause, Pair, ScanResult, ScanSettings, SequencesInfo
from logdiff.diagnosis import attribute, classify, diagnose, rescan

Game = Callable[[frozenset], float]  # the set of lever names applied -> a metric


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
    from logdiff.diagnosis.conformance import Conformance, SideCheck

    within = Conformance({s: SideCheck(0.5, 3.0, 8, "rms_norm(eps=1e-06)") for s in ("train", "infer")})
    ev = classify.OpEvidence("model.layers.0.input_layernorm", "norm", 0, 0.01, 1.0, True, within)
    assert classify.classify_op(ev, None, fused_add_norm=True).kind == "fused_vs_unfused"
    assert classify.classify_op(ev, None, fused_add_norm=False).kind == "reduction_order"


# --- the fake rescanner -------------------------------------------------------------------------


def _applied(c: ScanConfig, scan: ScanConfig) -> frozenset:
    """The lever names ``c`` applies on top of ``scan`` (the inverse of ``apply_levers``)."""
    kernels = set(c.consistent_kernels or KERNEL_FAMILIES) if c.consistent else set()
    out = {f"kernel:{f}" for f in kernels}
    out |= {"weights"} if scan.infer_ckpt is not None and c.infer_ckpt is None else set()
    return frozenset(out | {f"config:{k}" for k in scan.infer_set if k not in c.infer_set})


def _rescanner(scan: ScanConfig, mean: Game, kl: Game | None = None, mx: Game | None = None,
               ) -> tuple[rescan.Rescanner, list[frozenset]]:
    """A Rescanner whose primary pair's metrics are ``mean``/``kl``/``mx`` of the applied levers; and its log."""
    seen: list[frozenset] = []

    def metrics(c: ScanConfig) -> dict:
        s = _applied(c, scan)
        return {"abs_diff_mean": mean(s), "k3_kl": (kl or mean)(s), "abs_diff_max": (mx or (lambda s: 10 * mean(s)))(s)}

    def measure(c: ScanConfig) -> ScanResult:
        seen.append(_applied(c, scan))
        settings = ScanSettings(c.seed, c.depth, c.consistent, {}, "probe", False, c.is_threshold)
        pair = Pair("hf", "vllm", metrics(c), {}, {}, {})
        return ScanResult(str(c.model), None, None, "Qwen3ForCausalLM", c.dtype, settings, {}, [],
                          SequencesInfo(0, "probe", None, [], []), [pair])  # fmt: skip

    r = rescan.Rescanner(measure)
    r.remember(scan, metrics(scan))  # the scan being diagnosed, as diagnose does
    return r, seen


def _operator_path(family: str, layer: int = 0) -> Cause:
    return Cause(f"model.layers.{layer}.{family}", layer, "module", family, "operator_path", "reduction_order", [], "")


def _attribute(causes: list[Cause], cfg: ScanConfig, r: rescan.Rescanner, **kw) -> dict:
    return attribute.attribute(causes, cfg, r.metrics, known=r.knows, **kw)


def _shares(summary: dict, key: str = "share") -> dict[str, float]:
    return {lv["lever"]: lv[key] for lv in summary["levers"]}


def _additive(effects: dict[str, float], base: float = 1.0) -> Game:
    return lambda s: base - sum(effects.get(x, 0.0) for x in s)


STOCK = ScanConfig(model=Path("m"), depth="modules", attribution="rescan")  # the rescan game itself
THREE = ["attention", "rms_norm", "rope"]


# --- Shapley shares -----------------------------------------------------------------------------


def test_additive_game_shares_are_the_alone_effects() -> None:
    effects = {"kernel:attention": 0.5, "kernel:rope": 0.2, "kernel:rms_norm": 0.1}
    r, _ = _rescanner(STOCK, _additive(effects, 1.0), kl=_additive({"kernel:attention": 0.02}, 0.04))
    summary = _attribute([_operator_path(f) for f in THREE], STOCK, r)
    assert _shares(summary) == pytest.approx({k: v for k, v in effects.items()})
    assert summary["closed"] == pytest.approx(0.8) and summary["interaction"] == pytest.approx(0.0, abs=1e-12)
    assert (summary["metric"], summary["method"], summary["configurations"]) == ("abs_diff_mean", "exact", 8)
    assert "permutations" not in summary
    assert _shares(summary, "share_k3_kl") == pytest.approx({"kernel:attention": 0.5, "kernel:rope": 0.0,
                                                              "kernel:rms_norm": 0.0})
    assert summary["closed_k3_kl"] == pytest.approx(0.5)
    assert summary["baseline"] == 1.0 and summary["residual"] == pytest.approx(0.2)
    assert summary["baseline_abs_diff_max"] == 10.0 and summary["residual_abs_diff_max"] == pytest.approx(2.0)
    attention = next(lv for lv in summary["levers"] if lv["lever"] == "kernel:attention")
    assert (attention["alone"], attention["alone_abs_diff_mean"]) == pytest.approx((5.0, 0.5))
    assert (attention["all_others"], attention["all_others_abs_diff_mean"]) == pytest.approx((7.0, 0.7))


def test_interacting_levers_share_what_they_close_together() -> None:
    """Two levers that close the gap only together (each alone 10%): Shapley splits it by hand-worked values."""
    table = {frozenset(): 1.0, frozenset({"kernel:attention"}): 0.9, frozenset({"kernel:rope"}): 0.7,
             frozenset({"kernel:attention", "kernel:rope"}): 0.0}
    r, _ = _rescanner(STOCK, table.__getitem__)
    summary = _attribute([_operator_path("attention"), _operator_path("rope")], STOCK, r)
    # φ_attention = ½(0.1 + (0.7 - 0)) = 0.4; φ_rope = ½(0.3 + (0.9 - 0)) = 0.6
    assert _shares(summary) == pytest.approx({"kernel:attention": 0.4, "kernel:rope": 0.6})
    assert summary["closed"] == 1.0 and sum(_shares(summary).values()) == pytest.approx(1.0)
    assert summary["interaction"] == pytest.approx(0.1 + 0.3 - 1.0)  # the alone effects fall 60% short


def test_a_lever_that_alone_widens_the_gap_gets_a_negative_share() -> None:
    """The demo's shape: each family alone makes the gap larger, all three together close it."""
    alone = {"kernel:attention": 1.85, "kernel:rope": 1.08, "kernel:rms_norm": 1.06}

    def gap(s: frozenset) -> float:  # any pair with attention is still wider than the baseline
        if len(s) in (0, 3):
            return 1.0 if not s else 0.0
        return alone[next(iter(s))] if len(s) == 1 else (1.5 if "kernel:attention" in s else 0.9)

    r, _ = _rescanner(STOCK, gap)
    causes = [_operator_path(f) for f in THREE]
    summary = _attribute(causes, STOCK, r)
    shares = _shares(summary)
    # φ_attention = ⅓(-0.85 + ½((1.08 - 1.5) + (1.06 - 1.5)) + 0.9)
    assert shares["kernel:attention"] == pytest.approx((-0.85 - 0.43 + 0.9) / 3) and shares["kernel:rope"] > 0
    assert sum(shares.values()) == pytest.approx(summary["closed"]) and summary["closed"] == 1.0
    assert summary["interaction"] == pytest.approx(-0.85 - 0.08 - 0.06 - 1.0)
    attention = next(c for c in causes if c.family == "attention")
    assert any(e.startswith("negative: ") for e in attention.evidence), attention.evidence
    assert not any(e.startswith("negative: ") for e in causes[1].evidence + causes[2].evidence)


def test_a_lever_with_no_effect_gets_share_zero() -> None:
    """Negative control: a dummy lever (the game ignores it) gets exactly 0, with or without interaction."""
    table = {frozenset(): 1.0, frozenset({"kernel:attention"}): 0.9, frozenset({"kernel:rope"}): 0.7,
             frozenset({"kernel:attention", "kernel:rope"}): 0.0}
    r, _ = _rescanner(STOCK, lambda s: table[s - {"kernel:rms_norm"}])
    summary = _attribute([_operator_path(f) for f in THREE], STOCK, r)
    assert _shares(summary)["kernel:rms_norm"] == 0.0
    assert _shares(summary) == pytest.approx({"kernel:attention": 0.4, "kernel:rope": 0.6, "kernel:rms_norm": 0.0})


FIVE = ["attention", "linear", "rms_norm", "rope", "silu_and_mul"]


def _five_game(s: frozenset) -> float:
    """Five levers: attention and rope interact, linear alone widens the gap, silu_and_mul does nothing."""
    gap = 1.0 - 0.2 * ("kernel:rms_norm" in s) + 0.1 * ("kernel:linear" in s)
    gap -= 0.3 * ("kernel:attention" in s) + 0.1 * ("kernel:rope" in s)
    gap -= 0.35 * ({"kernel:attention", "kernel:rope"} <= s)  # only together
    return max(gap, 0.0)


def test_five_levers_are_sampled_and_still_add_up() -> None:
    r, seen = _rescanner(STOCK, _five_game)
    causes = [_operator_path(f) for f in FIVE]
    summary = _attribute(causes, STOCK, r)
    assert summary["method"] == "sampled" and summary["permutations"] == attribute.PERMUTATIONS
    shares = _shares(summary)
    assert sum(shares.values()) == pytest.approx(summary["closed"], abs=1e-12)
    assert summary["closed"] == pytest.approx(1.0 - 0.15)
    assert shares["kernel:silu_and_mul"] == 0.0 and shares["kernel:linear"] < 0  # a dummy, and a widening lever
    assert shares["kernel:rms_norm"] == pytest.approx(0.2) and shares["kernel:linear"] == pytest.approx(-0.1)
    # a pairwise interaction is split exactly by antithetic orders: each gets half of the joint 0.35
    assert (shares["kernel:attention"], shares["kernel:rope"]) == pytest.approx((0.3 + 0.175, 0.1 + 0.175))
    assert len(seen) == len(set(seen)) == summary["configurations"] - 1 <= 2**5 - 1
    again = _attribute([_operator_path(f) for f in FIVE], STOCK, _rescanner(STOCK, _five_game)[0])
    assert again == summary                                          # the fixed seed: the same orders
    assert sum(c.share for c in causes) == pytest.approx(summary["closed"])


def test_sampled_shares_of_a_three_way_interaction_are_an_estimate_fixed_by_the_seed() -> None:
    """Six levers, three of which close 90% only all together: the estimate depends on the orders drawn,
    so it is reproducible only through the fixed seed; it still sums to closed exactly."""
    trio = {"kernel:attention", "kernel:rope", "kernel:rms_norm"}

    def gap(s: frozenset) -> float:
        return 1.0 - 0.9 * (trio <= s) - 0.1 * ("kernel:linear" in s)

    families = FIVE + ["log_softmax"]
    runs = [_attribute([_operator_path(f) for f in families], STOCK, _rescanner(STOCK, gap)[0]) for _ in range(2)]
    assert runs[0] == runs[1] and runs[0]["permutations"] == 16
    shares = _shares(runs[0])
    assert sum(shares.values()) == pytest.approx(runs[0]["closed"], abs=1e-12) and runs[0]["closed"] == 1.0
    assert sum(shares[x] for x in trio) == pytest.approx(0.9) and shares["kernel:linear"] == pytest.approx(0.1)
    assert shares["kernel:silu_and_mul"] == shares["kernel:log_softmax"] == 0.0
    assert all(0.0 <= shares[x] <= 0.9 for x in trio)                 # near the exact 0.3 each, not exactly


def test_five_additive_levers_sample_to_the_exact_shares() -> None:
    """Control: with no interaction every order gives the same marginals, so sampling is exact."""
    effects = dict(zip((f"kernel:{f}" for f in FIVE), (0.3, 0.2, 0.1, 0.05, 0.0)))
    r, _ = _rescanner(STOCK, _additive(effects))
    summary = _attribute([_operator_path(f) for f in FIVE], STOCK, r)
    assert summary["method"] == "sampled" and _shares(summary) == pytest.approx(effects)
    assert summary["interaction"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("families", [THREE, THREE + ["linear"]])
def test_no_configuration_is_rescanned_twice(families: list[str]) -> None:
    """2^n configurations, the empty set remembered: 2^n - 1 rescans, each once; a second run costs none."""
    r, seen = _rescanner(STOCK, _additive({"kernel:rope": 0.5}))
    steps: list[tuple] = []
    causes = [_operator_path(f, layer) for f in families for layer in (0, 1)]
    summary = _attribute(causes, STOCK, r, progress=lambda msg, phase, step: steps.append(step))
    n = len(families)
    assert len(seen) == len(set(seen)) == 2**n - 1 and summary["configurations"] == 2**n
    assert steps == [(k, 2**n - 1) for k in range(1, 2**n)]        # progress counts real rescans only
    assert frozenset() not in seen
    assert _attribute(causes, STOCK, r) == summary and len(seen) == 2**n - 1


def test_a_lever_share_is_split_among_its_causes_and_groups_sum_to_closed() -> None:
    """Four layers' attention is one lever: each attention cause carries a quarter of its share."""
    effects = {"kernel:attention": 0.6, "kernel:rope": 0.2, "kernel:rms_norm": -0.1}
    r, _ = _rescanner(STOCK, _additive(effects))
    causes = [_operator_path("attention", n) for n in range(4)] + [_operator_path("rope", n) for n in range(2)]
    causes.append(Cause("model.layers.0.input_layernorm", 0, "norm", "rms_norm", "operator_path", "fused_vs_unfused",
                        [], ""))
    summary = _attribute(causes, STOCK, r)
    assert [c.share for c in causes] == pytest.approx([0.15] * 4 + [0.1] * 2 + [-0.1])
    assert sum(c.share for c in causes) == pytest.approx(summary["closed"]) == pytest.approx(0.7)
    assert {lv["lever"]: lv["causes"] for lv in summary["levers"]} == {"kernel:attention": 4, "kernel:rope": 2,
                                                                          "kernel:rms_norm": 1}
    assert "split equally among the 4 causes it neutralises: 15.0% each" in causes[0].evidence[0]
    groups = group_causes([c.to_dict() for c in causes])
    assert sum(g["share"] for g in groups) == pytest.approx(summary["closed"])
    assert {g["family"]: g["share"] for g in groups} == pytest.approx({"attention": 0.6, "rope": 0.2,
                                                                        "rms_norm": -0.1})


def test_config_and_weight_levers_are_players_too() -> None:
    cfg = ScanConfig(model=Path("m"), depth="modules", infer_set={"rms_norm_eps": 0.01}, infer_ckpt=Path("stale.pt"))
    effects = {"config:rms_norm_eps": 0.5, "weights": 0.3, "kernel:attention": 0.2}
    r, seen = _rescanner(cfg, _additive(effects))
    eps = Cause("model.layers.0.input_layernorm", 0, "norm", "rms_norm", "framework_difference", "config_contract",
                [], "", differs=["rms_norm_eps"])
    stale = Cause("model.layers.0.mlp.down_proj", 0, "linear", "linear", "framework_difference", "weights", [], "",
                  differs=["model.layers.0.mlp.down_proj.weight"])
    causes = [eps, stale, _operator_path("attention")]
    summary = _attribute(causes, cfg, r)
    assert _shares(summary) == pytest.approx(effects) and summary["closed"] == pytest.approx(1.0)
    assert len(seen) == 7 and frozenset(effects) in seen
    assert (eps.share, stale.share) == pytest.approx((0.5, 0.3))


def test_rescans_on_the_same_engines_run_together_the_scans_own_first() -> None:
    """A weight lever (another inference checkpoint) and a config lever (another ``--set``) each change the engines a
    rescan loads; vLLM keeps one per process, so the rescans are grouped by engines: 4 groups (neither, either, both),
    3 switches (in size order it was 10 of 14). The shares do not depend on the order."""
    cfg = ScanConfig(model=Path("m"), depth="modules", infer_set={"rms_norm_eps": 0.01}, infer_ckpt=Path("stale.pt"))
    effects = {"config:rms_norm_eps": 0.5, "weights": 0.3, "kernel:attention": 0.2, "kernel:rope": 0.1}
    r, seen = _rescanner(cfg, _additive(effects))
    eps = Cause("model.layers.0.input_layernorm", 0, "norm", "rms_norm", "framework_difference", "config_contract",
                [], "", differs=["rms_norm_eps"])
    stale = Cause("model.layers.0.mlp.down_proj", 0, "linear", "linear", "framework_difference", "weights", [], "",
                  differs=["model.layers.0.mlp.down_proj.weight"])
    summary = _attribute([eps, stale, _operator_path("attention"), _operator_path("rope")], cfg, r)
    assert _shares(summary) == pytest.approx(effects)
    engines = [(("weights" in s), ("config:rms_norm_eps" in s)) for s in seen]
    assert len(seen) == 2**4 - 1 and sum(a != b for a, b in zip(engines, engines[1:])) == 3, engines
    assert engines[0] == (False, False)  # the scan's own engines, loaded already, first


def test_necessity_is_whether_all_other_levers_leave_a_gap() -> None:
    """rope alone reopens nothing once attention is fixed: not necessary; attention is."""
    r, _ = _rescanner(STOCK, lambda s: 0.0 if "kernel:attention" in s else 1.0)
    causes = [_operator_path("attention"), _operator_path("rope")]
    summary = _attribute(causes, STOCK, r)
    assert [c.necessity for c in causes] == [True, False]
    assert _shares(summary) == {"kernel:attention": 1.0, "kernel:rope": 0.0}


def test_a_cause_no_rescan_can_neutralise_gets_no_share() -> None:
    """A weight difference without --infer-ckpt has no lever: not measured, and not counted in closed."""
    stale = Cause("model.layers.0.mlp.down_proj", 0, "linear", "linear", "framework_difference", "weights", [], "")
    r, seen = _rescanner(STOCK, _additive({"kernel:rope": 0.25}))
    summary = _attribute([stale, _operator_path("rope")], STOCK, r)
    assert stale.share is None and stale.necessity is None and "share not measured" in stale.evidence[0]
    assert summary["closed"] == 0.25 and len(summary["levers"]) == 1 and len(seen) == 1


def test_no_lever_at_all_closes_nothing() -> None:
    stale = Cause("model.layers.0.mlp.down_proj", 0, "linear", "linear", "framework_difference", "weights", [], "")
    r, seen = _rescanner(STOCK, lambda s: 1.0)
    summary = _attribute([stale], STOCK, r)
    assert (summary["closed"], summary["interaction"], summary["levers"], seen) == (0.0, 0.0, [], [])


def test_a_metric_that_is_not_a_number_is_not_attributed() -> None:
    """Control: a NaN KL gives null k3 shares; the attributed metric is unaffected."""
    r, _ = _rescanner(STOCK, _additive({"kernel:rope": 0.5}), kl=lambda s: math.nan)
    causes = [_operator_path("rope")]
    summary = _attribute(causes, STOCK, r)
    assert summary["closed_k3_kl"] is None and _shares(summary, "share_k3_kl") == {"kernel:rope": None}
    assert causes[0].share == 0.5


# --- the Rescanner and the reference rerun ------------------------------------------------------


def test_rescanner_caches_each_configurations_metrics() -> None:
    r, seen = _rescanner(STOCK, _additive({"kernel:rope": 0.5}))
    rope = attribute.apply_levers(STOCK, {("kernel", "rope")})
    assert not r.knows(rope)
    assert r.metrics(rope)["abs_diff_mean"] == 0.5 and r.logdiff(rope) == 5.0 and r.knows(rope)
    assert r.metrics(STOCK)["abs_diff_max"] == r.logdiff(STOCK) == 10.0  # remembered: not rescanned
    assert len(seen) == 1


def test_one_cause_family_costs_attribution_no_rescan_of_its_own() -> None:
    """The reference check swaps in the introducing ops' families only: with one family, that rescan is
    the lever's whole game (the empty set of levers is the scan itself)."""
    r, seen = _rescanner(STOCK, lambda s: 0.0 if "kernel:rope" in s else 0.5)
    vanished = diagnose.reference_rerun(STOCK, r, {"rope"}, [])
    assert vanished is not None and vanished("model.layers.0.self_attn.rope_q") is True
    assert seen == [frozenset({"kernel:rope"})]
    causes = [_operator_path("rope")]
    summary = _attribute(causes, STOCK, r)
    assert len(seen) == 1  # nothing rescanned
    assert causes[0].share == 1.0 and causes[0].necessity is True
    assert (summary["closed"], summary["residual_abs_diff_max"]) == (1.0, 0.0)


def test_several_families_reuse_the_reference_rescan_as_everything_fixed() -> None:
    """Control: three families need their own subsets (three alone, three pairs); only "every lever" is
    shared. Only all three together close the gap, so they split it equally, interacting fully."""
    families = set(THREE)
    r, seen = _rescanner(STOCK, lambda s: 0.0 if len(s) == 3 else 0.5)
    diagnose.reference_rerun(STOCK, r, families, [])
    causes = [_operator_path(f) for f in sorted(families)]
    summary = _attribute(causes, STOCK, r)
    assert len(seen) == 1 + 3 + 3  # the reference check, three alone, three all-but-one
    assert all(c.necessity is True and c.share == pytest.approx(1 / 3) for c in causes)
    assert summary["interaction"] == pytest.approx(-1.0)
