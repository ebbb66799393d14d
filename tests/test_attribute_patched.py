"""Attribution's patched game (logdiff/diagnosis/attribute_patched.py) against today's rescans.

Without engines: which game runs and why it falls back, and that a patched game's
shares add up and are confirmed by exactly one rescan. On the demo Qwen3: the
patched game on a real HF vs vLLM scan (shares add up to its closed fraction, the
confirming rescan is today's "every lever" configuration), both games on the same
scan side by side, and the controls: identical paths attribute nothing, and a
planted reduction-order change in one linear op is closed by its family alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import logdiff
from logdiff.commands.config import ScanConfig
from logdiff.comparison.result import Cause
from logdiff.diagnosis import attribute, rescan
from logdiff.errors import InputError

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules"}
PATCHED = ScanConfig(model=Path("m"), depth="modules", attribution="patched")


def _operator_path(family: str) -> Cause:
    return Cause(f"model.layers.0.{family}", 0, "module", family, "operator_path", "reduction_order", [], "")


class FakeGame:
    """A patched game whose gap is a known function of the patched families; it counts its forwards."""

    def __init__(self, gap: Callable[[frozenset], float], uncovered: dict[str, str] | None = None):
        self.gap, self._uncovered, self.forwards = gap, uncovered or {}, []

    def prepare(self, families: set[str]) -> dict[str, str]:
        return {f: why for f, why in self._uncovered.items() if f in families}

    def report(self) -> dict[str, Any]:
        return {"forwards": len(self.forwards)}

    def metrics(self, families: frozenset) -> dict[str, float]:
        self.forwards.append(families)
        g = self.gap(families)
        return {"abs_diff_mean": g, "k3_kl": g / 10, "abs_diff_max": 10 * g}


def _rescanner(base_gap: float, every_gap: float) -> tuple[rescan.Rescanner, list[ScanConfig]]:
    seen: list[ScanConfig] = []

    def measure(c: ScanConfig) -> Any:
        seen.append(c)
        gap = every_gap if c.consistent else base_gap
        return type("R", (), {"primary": type("P", (), {"metrics": {"abs_diff_mean": gap, "abs_diff_max": 10 * gap,
                                                                    "k3_kl": gap / 10}})})()

    r = rescan.Rescanner(measure)
    r.remember(PATCHED, {"abs_diff_mean": base_gap, "abs_diff_max": 10 * base_gap, "k3_kl": base_gap / 10})
    return r, seen


def test_the_attribution_game_is_a_validated_setting() -> None:
    assert ScanConfig(model=Path("m")).attribution == "patched"  # the default, rescans where it cannot
    with pytest.raises(InputError, match="--attribution"):
        ScanConfig(model=Path("m"), attribution="guess")


def test_patched_game_shares_add_up_and_one_rescan_confirms() -> None:
    """An interacting game on three families: the shares sum to the patched closed, each coalition costs one
    forward and no rescan, and exactly one rescan (every lever applied) confirms it."""
    table = {frozenset(): 1.0, frozenset({"attention"}): 1.3, frozenset({"rope"}): 0.7, frozenset({"rms_norm"}): 0.9,
             frozenset({"attention", "rope"}): 0.5, frozenset({"attention", "rms_norm"}): 0.6,
             frozenset({"rope", "rms_norm"}): 0.2, frozenset({"attention", "rope", "rms_norm"}): 0.05}
    game = FakeGame(table.__getitem__)
    r, seen = _rescanner(1.0, 0.0)
    r.patched = game
    causes = [_operator_path(f) for f in ("attention", "rope", "rms_norm")]
    summary = attribute.attribute(causes, PATCHED, r.metrics, known=r.knows, patched=r.patched)
    shares = {lv["lever"]: lv["share"] for lv in summary["levers"]}
    assert summary["game"] == "patched" and "fallback" not in summary
    assert sum(shares.values()) == pytest.approx(summary["closed"], abs=1e-9) and summary["closed"] == pytest.approx(0.95)
    assert sorted(map(sorted, game.forwards)) == sorted(map(sorted, table))  # one forward per coalition, each once
    assert len(seen) == 1 and seen[0].consistent and set(seen[0].consistent_kernels) == {"attention", "rope", "rms_norm"}
    assert summary["confirmed"]["closed"] == 1.0 and summary["confirmed"]["baseline_reproduced"] is True
    assert sum(c.share for c in causes) == pytest.approx(summary["closed"], abs=1e-9)
    assert "recorded attention outputs" in causes[0].evidence[0]


@pytest.mark.parametrize(
    ("causes", "uncovered", "reason", "rescans"),
    [  # dropping the override gives the stock configuration, remembered already: no rescan
        ([Cause("model.layers.0.input_layernorm", 0, "norm", "rms_norm", "framework_difference", "config_contract",
                [], "", differs=["rms_norm_eps"])], {}, "config:rms_norm_eps", 0),
        ([_operator_path("rope")], {"rope": "1 of its 2 ops were not replayed"}, "rope: 1 of its 2 ops", 1),
    ],
)  # fmt: skip
def test_levers_the_records_cannot_patch_fall_back_to_rescans(causes: list[Cause], uncovered: dict, reason: str,
                                                              rescans: int) -> None:
    cfg = ScanConfig(model=Path("m"), depth="modules", attribution="patched", infer_set={"rms_norm_eps": 0.01})
    game = FakeGame(lambda s: 1.0, uncovered)
    r, seen = _rescanner(1.0, 0.0)
    r.remember(cfg, {"abs_diff_mean": 1.0, "abs_diff_max": 10.0, "k3_kl": 0.1})
    r.patched = game
    summary = attribute.attribute(causes, cfg, r.metrics, known=r.knows, patched=r.patched)
    assert summary["game"] == "rescan" and reason in summary["fallback"] and "confirmed" not in summary
    assert game.forwards == [] and len(seen) == rescans


def test_without_a_patched_game_the_default_falls_back_to_rescans_and_says_why() -> None:
    r, seen = _rescanner(1.0, 0.0)
    summary = attribute.attribute([_operator_path("rope")], ScanConfig(model=Path("m"), depth="modules"),
                                  r.metrics, known=r.knows)
    assert summary["game"] == "rescan" and "inference rows were not kept" in summary["fallback"] and len(seen) == 1


def test_asked_for_rescans_run_rescans_without_a_fallback() -> None:
    cfg = ScanConfig(model=Path("m"), depth="modules", attribution="rescan")
    game = FakeGame(lambda s: 0.0)
    r, seen = _rescanner(1.0, 0.0)
    r.remember(cfg, {"abs_diff_mean": 1.0, "abs_diff_max": 10.0, "k3_kl": 0.1})
    summary = attribute.attribute([_operator_path("rope")], cfg, r.metrics, known=r.knows, patched=game)
    assert summary["game"] == "rescan" and "fallback" not in summary and len(seen) == 1 and game.forwards == []


# --- on the demo Qwen3 -----------------------------------------------------------------------------


def _shares(r: dict[str, Any]) -> dict[str, float]:
    return {lv["lever"]: lv["share"] for lv in r["attribution"]["levers"]}


@pytest.mark.vllm
@pytest.mark.isa_sensitive
def test_patched_and_rescan_games_on_the_same_hf_vs_vllm_scan(qwen3: Path, stock_varies: Callable,
                                                               shared_scan: Callable[..., dict]) -> None:
    patched = shared_scan(qwen3, infer=["vllm"], attribution="patched", **SMALL)  # also test_scan_window.py's
    stock_varies(patched["verdict"] == "consistent", "HF and vLLM agree bitwise here")
    a = patched["attribution"]
    assert a["game"] == "patched", a.get("fallback")
    assert sum(_shares(patched).values()) == pytest.approx(a["closed"], abs=1e-9)
    assert a["confirmed"]["baseline_reproduced"] is True  # D_p(∅) is the scan's own gap
    assert a["patched"]["forwards"] == a["configurations"] and "not_patched" not in a["patched"]
    rescanned = logdiff.scan(qwen3, infer=["vllm"], attribution="rescan", **SMALL)
    b = rescanned["attribution"]
    assert b["game"] == "rescan" and b["baseline"] == a["baseline"]  # the same scan
    assert sum(_shares(rescanned).values()) == pytest.approx(b["closed"], abs=1e-9)
    assert set(_shares(patched)) == set(_shares(rescanned))  # the same players
    # the confirming rescan is the rescan game's "every lever applied": the same configuration, the same number
    assert a["confirmed"]["closed"] == b["closed"] and a["confirmed"]["residual"] == b["residual"]
    print("\npatched", a["closed"], _shares(patched), "\nrescan ", b["closed"], _shares(rescanned))


def test_identical_paths_attribute_nothing(qwen3: Path) -> None:
    r = logdiff.scan(qwen3, infer=["hf"], attribution="patched", **SMALL)
    assert r["verdict"] == "consistent" and r["causes"] == []
    assert (r.get("attribution") or {}).get("levers", []) == []


@pytest.mark.isa_sensitive
def test_a_planted_linear_change_is_closed_by_its_family_alone(qwen3: Path, shared_scan: Callable[..., dict]) -> None:
    """With attention consistent on both sides, the one difference left is a split-K plant in one o_proj of
    the inference side (of the pooled engine): the linear family takes the whole share, and patching it closes
    the gap exactly. The scan is test_scan_window.py's unwindowed planted one."""
    target = "model.layers.2.self_attn.o_proj"
    r = shared_scan(qwen3, split_k=("hf-decode", target), infer=["hf-decode"], consistent=True,
                    consistent_kernels=("attention",), attribution="patched", **SMALL)
    a = r["attribution"]
    assert a["game"] == "patched", a.get("fallback")
    assert any(c["boundary"] == target and c["family"] == "linear" for c in r["causes"]), r["causes"]
    shares = _shares(r)
    assert max(shares, key=shares.get) == "kernel:linear"
    assert sum(shares.values()) == pytest.approx(a["closed"], abs=1e-9)
    linear = next(lv for lv in a["levers"] if lv["lever"] == "kernel:linear")
    assert linear["alone_abs_diff_mean"] == 0.0 and a["residual_abs_diff_max"] == 0.0
    print("\nplanted", shares, "confirmed by rescan:", a["confirmed"])


def test_the_cli_flag_reaches_the_scan(qwen3: Path, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from logdiff.cli import app

    fast = ["scan", str(qwen3), "--infer", "hf-decode", "--num-sequences", "2", "--prompt-len", "8",
            "--response-len", "6", "--quiet"]
    bad = CliRunner().invoke(app, [*fast, "--attribution", "guess"])
    assert bad.exit_code == 2 and "'--attribution': 'guess' is not one of 'rescan', 'patched'" in bad.output
    res = CliRunner().invoke(app, [*fast, "--attribution", "patched", "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    a = json.loads((tmp_path / "r.json").read_text()).get("attribution")
    if a is not None:  # HF and its KV-cache decode may agree bitwise on some CPUs: then nothing is attributed
        assert a["game"] == "patched", a.get("fallback")


def test_a_patched_forward_that_fails_falls_back_to_rescans() -> None:
    def broken(s: frozenset) -> float:
        raise RuntimeError("stored rows of width 64 for a live op of width 128")

    r, seen = _rescanner(1.0, 0.0)
    r.patched = FakeGame(broken)
    summary = attribute.attribute([_operator_path("rope")], PATCHED, r.metrics, known=r.knows, patched=r.patched)
    assert summary["game"] == "rescan" and "width 64" in summary["fallback"] and len(seen) == 1
