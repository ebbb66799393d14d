"""``response_mask``: masked tokens are replayed on every path but not scored by any metric."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from logdiff.reports.schema import validate_result
from test_verl_metrics import verl_metrics

import logdiff
from logdiff.commands.config import ScanConfig
from logdiff.commands.outputs import dump_json
from logdiff.comparison import metrics as compare
from logdiff.errors import InputError
from logdiff.records.sequences import load_jsonl

# A multi-turn agent rollout: assistant turn, tool call output, assistant turn, observation, answer.
TURNS = [(1, 4), (0, 3), (1, 3), (0, 5), (1, 2)]


def multiturn(seed: int, n: int = 4) -> tuple[list, list, list]:
    rng = np.random.default_rng(seed)
    train, infer, masks = [], [], []
    for _ in range(n):
        mask = [bit for bit, length in TURNS for _ in range(length)][: int(rng.integers(9, 18))]
        t = -rng.exponential(1.0, len(mask))
        train.append(t), infer.append(np.minimum(t + rng.normal(0, 0.3, len(mask)), 0.0)), masks.append(mask)
    return train, infer, masks


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])) for k in a
    )


def test_multiturn_tool_tokens_masked_give_verls_metrics() -> None:
    train, infer, masks = multiturn(0)
    ours = compare.token_metrics(train, infer, masks=masks)
    assert ours["num_tokens"] == sum(map(sum, masks)) < sum(map(len, masks))
    for key, value in verl_metrics(train, infer, masks).items():
        rel = 1e-7 if "fraction" in key and ("_seq_" in key or "sequence_ratio" in key) else 1e-12
        assert ours[key] == pytest.approx(value, rel=rel, abs=1e-15), key


def test_an_outlier_on_a_masked_token_moves_nothing() -> None:
    train, infer, masks = multiturn(1)
    s, p = 2, 5  # a tool-output token
    assert masks[s][p] == 0
    planted = [x.copy() for x in infer]
    planted[s][p] = train[s][p] - 40.0  # r = exp(40): past every bound, and past verl's clamp

    def everything(inf: list, msk: list) -> tuple:
        return (compare.token_metrics(train, inf, masks=msk), compare.per_position(train, inf, msk),
                compare.histogram(train, inf, msk), compare.worst(train, inf, msk))

    clean, dirty = everything(infer, masks), everything(planted, masks)
    assert same(clean[0], dirty[0]) and clean[1:] == dirty[1:]
    assert clean[3]["response_index"] != p or clean[3]["sequence"] != s

    # negative control: the same outlier on a scored token moves the metrics and is the worst token
    unmasked = [list(m) for m in masks]
    unmasked[s][p] = 1
    base, moved = everything(infer, unmasked), everything(planted, unmasked)
    assert moved[0]["abs_diff_max"] == pytest.approx(40.0) and base[0]["abs_diff_max"] < 4.0
    assert moved[0]["k3_kl"] > 1e3 * base[0]["k3_kl"] and moved[0]["chi2_seq"] > base[0]["chi2_seq"]
    assert moved[1]["abs_diff_max"][p] == pytest.approx(40.0)
    assert (moved[3]["sequence"], moved[3]["response_index"]) == (s, p)


def test_masked_positions_leave_per_position_and_worst() -> None:
    train = [np.array([-1.0, -1.0, -1.0]), np.array([-1.0, -1.0])]
    infer = [np.array([-1.0, -9.0, -1.5]), np.array([-1.0, -1.2])]
    masks = [[1, 0, 1], [1, 1]]
    pp = compare.per_position(train, infer, masks)
    assert pp["abs_diff_max"] == pytest.approx([0.0, 0.2, 0.5])
    assert pp["abs_diff_mean"] == pytest.approx([0.0, 0.2, 0.5])  # position 1: only sequence 1 scores it
    assert (compare.worst(train, infer, masks)["sequence"], compare.worst(train, infer, masks)["response_index"]) == (0, 2)
    assert sum(compare.histogram(train, infer, masks)["counts"]) == 4


@pytest.mark.parametrize("mask,problem", [
    ([1, 0], "needs one 0 or 1 per response token (3)"),
    ([1, 2, 0], "response_mask at response position 1 is 2, not 0 or 1"),
    ([1, True, 0], "response_mask at response position 1 is True, not 0 or 1"),
    ("110", "needs one 0 or 1 per response token"),
    ([0, 0, 0], "'response_mask' is all 0: no response token would be scored"),
])  # fmt: skip
def test_bad_masks_name_the_line(tmp_path: Path, mask: object, problem: str) -> None:
    f = tmp_path / "s.jsonl"
    good = {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "response_mask": [1, 0, 1]}
    f.write_text(json.dumps(good) + "\n" + json.dumps({**good, "response_mask": mask}) + "\n")
    with pytest.raises(InputError) as e:
        load_jsonl(f)
    assert str(e.value).startswith(f"{f}:2: ") and problem in str(e.value) and "\n" not in str(e.value)


def test_a_valid_mask_is_read(tmp_path: Path) -> None:
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps({"prompt_ids": [1], "response_ids": [3, 4], "response_mask": [0, 1]}) + "\n"
                 + json.dumps({"prompt_ids": [1], "response_ids": [3]}) + "\n")
    a, b = load_jsonl(f)
    assert a.response_mask == [0, 1] and b.response_mask is None


def test_scan_scores_only_unmasked_tokens(qwen3: Path, tmp_path: Path) -> None:
    """End to end: a masked outlier in the recorded rollout logprobs changes no pair's metrics."""
    mask = [1, 1, 0, 0, 0, 1, 1, 1]
    rows = [{"prompt_ids": [5, 6, 7, 8], "response_ids": [11, 12, 13, 14, 15, 16, 17, 18], "response_mask": mask,
             "rollout_logprobs": [-3.0] * 8},
            {"prompt_ids": [9, 10, 11], "response_ids": [21, 22, 23, 24, 25], "rollout_logprobs": [-3.0] * 5}]
    results = []
    for outlier in (-3.0, -60.0):
        rows[0]["rollout_logprobs"][3] = outlier  # a masked position
        f = tmp_path / f"s{outlier}.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        results.append(logdiff.scan(qwen3, infer=["hf-decode"], sequences=f, depth="logprobs", is_threshold=1.5))
    clean, dirty = results
    assert [(p["train"], p["infer"]) for p in clean["pairs"]] == [("hf", "hf-decode"), ("hf", "rollout")]
    for a, b in zip(clean["pairs"], dirty["pairs"]):
        assert a["metrics"]["num_tokens"] == sum(mask) + 5
        assert same(a["metrics"], b["metrics"]) and a["per_position"] == b["per_position"]
        assert a["worst"] == b["worst"] and not (a["worst"]["sequence"] == 0 and mask[a["worst"]["response_index"]] == 0)
        assert a["worst"]["position"] == len(rows[a["worst"]["sequence"]]["prompt_ids"]) + a["worst"]["response_index"]
    assert dirty["pairs"][1]["metrics"]["abs_diff_max"] < 40 and dirty["settings"]["is_threshold"] == 1.5
    dump_json(dirty, tmp_path / "result.json")
    assert validate_result(json.loads((tmp_path / "result.json").read_text())) == []


@pytest.mark.parametrize("threshold", [1.0, 0.5, float("inf"), True])
def test_is_threshold_must_exceed_one(qwen3: Path, threshold: object) -> None:
    with pytest.raises(InputError, match="--is-threshold must be a finite number > 1"):
        ScanConfig(model=qwen3, is_threshold=threshold)


def test_cli_bad_mask_is_one_line_and_exit_2(qwen3: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from logdiff.cli import app

    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 4], "response_mask": [1, 7]}) + "\n")
    res = CliRunner().invoke(app, ["scan", str(qwen3), "--infer", "hf", "--depth", "logprobs", "--sequences", str(f)])
    lines = [line for line in (res.output + (res.stderr if res.stderr_bytes is not None else "")).splitlines() if line]
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert lines[-1].startswith("logdiff: error: ") and f"{f.name}:1: response_mask at response position 1" in lines[-1]
