"""Closure (issue 48, item 3): the last compared boundary bounds what the ops before it can explain.

The bound itself is checked on random rows (|Δ log_softmax_i| <= max δ - min δ <= 2 max |δ|, and that it is
nearly reached, so a looser bound would be caught); the closure on synthetic results (what exceeds the bound,
identified or not, and where no bound can be taken); and on two small scans of the demo Qwen3: unplanted
(operator path, closure 1), and with a transform of the training side's returned logprobs after every record
(a one-sided logits bias no boundary saw): ``unexplained``, with the amount and ``enters after logits``, never
``operator_path``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from logdiff.comparison.cause import Cause, framework_cause, verdict
from logdiff.diagnosis.closure import closure


def _lsm(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_the_log_softmax_bound_holds_and_is_nearly_reached() -> None:
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(200):
        z = rng.normal(0, 4, 64)
        d = rng.normal(0, rng.uniform(0.01, 2.0), 64)
        diff = np.abs(_lsm(z + d) - _lsm(z))
        assert diff.max() <= d.max() - d.min() + 1e-12 <= 2 * np.abs(d).max() + 1e-12
        worst = max(worst, diff.max() / (2 * np.abs(d).max()))
    # reached in the limit: one logit up by D on a peaked row, the others down by D
    z = np.array([30.0, 0.0, 0.0, 0.0])
    d = np.array([-1.0, 1.0, 1.0, 1.0])
    assert abs(_lsm(z + d)[1] - _lsm(z)[1]) > 0.99 * 2.0
    assert worst < 1.0


def _result(gaps: list[float], logits: float | None, causes: list[Cause] | None = None,
            sketched: bool = False, temperature: float = 1.0) -> Any:
    """A one-sequence result: prompt of 3 tokens, the given |Δ logprob| per response token, and the logits'
    largest difference ``logits`` at every row (None: the logits were not compared)."""
    n = len(gaps)
    train = [np.full(n, -1.0, np.float32)]
    infer = [np.asarray(-1.0 - np.asarray(gaps), np.float32)]
    boundaries = [{"boundary": "model.norm", "max_abs_diff": 0.01, "max_abs_ref": 4.0}]
    names, rows = ["model.norm"], [[0.01] * (n + 3)]
    if logits is not None:
        boundaries.append({"boundary": "logits", "max_abs_diff": logits, "max_abs_ref": 8.0,
                           **({"sketched": True} if sketched else {})})
        names.append("logits")
        rows.append([logits] * (n + 3))
    pair = SimpleNamespace(tokens=(train, infer, [None]), boundaries=boundaries)
    table = {"boundaries": names, "positions": list(range(n + 3)), "max_abs_diff": rows}
    return SimpleNamespace(primary=pair, non_finite=None, located=SimpleNamespace(divergence_table=table),
                           sequences=SimpleNamespace(prompt_lens=[3]), causes=causes or [], dtype="bfloat16",
                           contracts={"train": {"temperature": temperature}, "infer": {"temperature": temperature}})


def test_a_gap_within_the_bound_closes() -> None:
    c = closure(_result([0.01, 0.05, 0.0], logits=0.03))
    assert c["closure"] == 1.0 and c["beyond_tokens"] == 0 and c["unexplained"] == 0.0
    assert c["boundary"] == "logits" and c["bound_max"] == pytest.approx(0.06)


def test_what_exceeds_the_bound_enters_after_the_logits_and_is_unexplained() -> None:
    c = closure(_result([0.01, 0.5, 0.0], logits=0.03))
    assert c["enters_after"] == "logits" and c["beyond_tokens"] == 1
    assert c["unexplained_max"] == pytest.approx(0.5 - 0.06, abs=1e-4)
    assert c["unexplained"] == pytest.approx((0.5 - 0.06) / 3, abs=1e-4)
    assert c["closure"] == pytest.approx((0.01 + 0.06) / 0.51, abs=1e-4)
    assert verdict([], consistent=False, unexplained=True) == "unexplained"


def test_the_temperature_widens_the_bound() -> None:
    assert closure(_result([0.1], logits=0.03, temperature=0.5))["beyond_tokens"] == 0  # 2 * 0.03 / 0.5 = 0.12
    assert closure(_result([0.1], logits=0.03))["beyond_tokens"] == 1


def test_a_cause_after_the_boundary_identifies_the_excess() -> None:
    sampling = framework_cause("log_softmax", "log_softmax", "sampling_semantics", ["fit"], "fix")
    c = closure(_result([0.01, 0.5], logits=0.03, causes=[sampling]))
    assert c["identified_by"] == ["framework_difference/sampling_semantics at log_softmax"]
    assert c["closure"] == 1.0 and c["unexplained"] == 0.0 and c["enters_after"] == "logits"


def test_an_operator_path_cause_never_identifies_it_negative_control() -> None:
    kernel = Cause("log_softmax", None, "log_softmax", "log_softmax", "operator_path", "reduction_order", [], "")
    c = closure(_result([0.5], logits=0.03, causes=[kernel]))
    assert c["identified_by"] == [] and c["unexplained"] > 0


def test_without_logits_the_final_norm_is_carried_through_the_head() -> None:
    assert closure(_result([0.5], logits=None))["closure"] is None  # no head weights: nothing bounds it
    c = closure(_result([0.5], logits=None), head_norm=3.0)
    # 2 * ||W||_inf * (D_h + 2 u max|h|) = 2 * 3 * (0.01 + 2 * 2^-8 * 4.01)
    assert c["bound"] == "final_norm_through_head" and c["bound_max"] == pytest.approx(6 * (0.01 + 8.02 / 256))
    assert c["beyond_tokens"] == 1 and c["enters_after"] == "model.norm"


def test_a_sketched_logits_boundary_bounds_nothing() -> None:
    """A sketch's difference is a lower bound: never a bound on the logprobs."""
    assert closure(_result([0.01], logits=0.03, sketched=True))["closure"] is None


@pytest.fixture(scope="module")
def planted(qwen3: Path) -> tuple[dict, dict]:
    """The demo Qwen3 scanned against hf-decode, unplanted, then with the training side's returned logprobs
    lowered by 0.5 at odd token ids: a one-sided logit bias applied after every recorded boundary."""
    import logdiff
    from logdiff.commands.config import ScanConfig
    from logdiff.commands.scan import engine_spec
    from logdiff.sources import checkpoint, pool
    from logdiff.sources.base import PathScores

    small = {"num_sequences": 2, "prompt_len": 12, "response_len": 12, "depth": "modules", "attribute": False}
    control = logdiff.scan(qwen3, infer=["hf-decode"], **small)
    engine = pool.acquire("hf", engine_spec("hf", checkpoint.stage(qwen3), ScanConfig(model=qwen3), {}))
    score = engine.score

    def biased(seqs: list) -> list:
        return [PathScores(p.path, p.mode, [np.asarray(lp - 0.5 * (np.asarray(s.response_ids) % 2), np.float32)
                                            for lp, s in zip(p.logprobs, seqs)], p.top1) for p in score(seqs)]

    engine.score = biased
    try:
        r = logdiff.scan(qwen3, infer=["hf-decode"], **small)
    finally:
        del engine.score
    return control, r


def test_an_ordinary_operator_path_scan_closes(planted: tuple[dict, dict]) -> None:
    from plants import assert_closes

    control, _ = planted
    assert control["verdict"] == "operator_path"
    assert_closes(control)


def test_a_plant_after_the_last_boundary_is_unexplained_never_operator_path(planted: tuple[dict, dict]) -> None:
    from logdiff.reports.schema import validate_result

    control, r = planted
    c = r["closure"]
    assert r["logprobs"]["abs_diff_max"] > 10 * control["logprobs"]["abs_diff_max"], "the plant changed nothing"
    assert r["verdict"] == "unexplained" and validate_result(r) == []
    assert c["enters_after"] == "logits" and c["identified_by"] == []
    assert 0.3 < c["unexplained_max"] <= 0.5 and c["unexplained"] > 0 and c["closure"] < 0.5
    assert 0 < c["beyond_tokens"] <= c["tokens"]  # the odd token ids only
    assert any("enters after logits" in w for w in r["warnings"])
