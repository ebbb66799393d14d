"""The in-loop replay runs the captured step's own call again (``compare_bundles(..., live=, rerun=)``,
``bundle_feed.CapturedCall``; issue 48, item 5).

A tiny random Qwen3 in float32: the training side is one left-padded forward without ``position_ids`` (as TRL
feeds its no-grad logprob pass: each row's positions shifted by its pad count), captured with ``logdiff.capture``;
the inference side the same sequences one per forward. The replay that re-runs the captured call reproduces every
boundary of the training bundle, so nothing is left unreplayed. Negative controls: logdiff's own batch (the
replay before: right-padded, positions from 0) does not reproduce the shifted RoPE, and a rerun that passes
``position_ids`` (another call than the captured one) or feeds other tokens is named, never replayed.
"""

from __future__ import annotations

from typing import Any

import pytest
from tiny_batches import left_padded, tiny_qwen3

SEQS = [[5, 17, 3, 9, 42, 7, 11, 2], [8, 1, 30, 4, 6], [60, 61, 62, 63, 64, 65]]
REPRODUCE = "do not reproduce the captured"


def _left(position_ids: bool = False, seqs: list[list[int]] = SEQS) -> dict[str, Any]:
    return left_padded(seqs, position_ids)[0]


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch

    import logdiff

    model = tiny_qwen3()
    root = tmp_path_factory.mktemp("loop-replay")
    with logdiff.capture(model, root / "train", "train", window="all"), torch.no_grad():
        model(**_left())
    with logdiff.capture(model, root / "infer", "infer", window="all"), torch.no_grad():
        for s in SEQS:
            model(input_ids=torch.tensor([s]))
    return {"model": model, "train": root / "train", "infer": root / "infer"}


def _compare(loop: dict[str, Any], rerun: Any) -> dict[str, Any]:
    import torch

    from logdiff.commands.compare import compare_bundles

    with torch.no_grad():
        return compare_bundles(loop["train"], loop["infer"], live=loop["model"], rerun=rerun).to_dict()


def _call(loop: dict[str, Any], **kw: Any) -> Any:
    return lambda: loop["model"](**kw)


def test_the_captured_call_run_again_reproduces_every_boundary(loop) -> None:
    result = _compare(loop, _call(loop, **_left()))
    assert not any(REPRODUCE in w or "run again" in w for w in result["warnings"]), result["warnings"]
    # the shifted RoPE was replayed on the other side's inputs: the op that introduces the shift is measured
    local = {b["boundary"]: b.get("local") for b in result["pairs"][0]["boundaries"]}
    assert local.get("model.layers.0.self_attn.rope_q") is not None, local


def test_logdiffs_own_batch_does_not_reproduce_the_shifted_positions(loop) -> None:
    (line,) = [w for w in _compare(loop, None)["warnings"] if REPRODUCE in w]
    assert "rope_q" in line and line.startswith("the train ops in this process")


def test_another_call_is_named_not_replayed(loop) -> None:
    (line,) = [w for w in _compare(loop, _call(loop, **_left(position_ids=True)))["warnings"] if REPRODUCE in w]
    assert line.startswith("the train ops of the captured step's own call, run again,") and "rope_q" in line
    other = _left(seqs=[s[::-1] for s in SEQS])
    lines = [w for w in _compare(loop, _call(loop, **other))["warnings"] if "run again" in w]
    assert lines == [("the captured step's own call, run again, fed other tokens than its capture at forwards [0]: "
                      "those were not replayed")]
