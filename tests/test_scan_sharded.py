"""``logdiff scan MODEL --set train.tensor_parallel_size=2 | train.fsdp_size=2 --infer hf`` (issue 22).

The training path runs on 2 gloo ranks of its own (``sources/hf/sharded.py``), captured into a bundle
that the scan feeds into the same probes as a live path (``pipeline._score``, ``bundle_feed.scores_of_capture``);
the in-process HF model replays its ops where it reproduces the capture.

* stock TP = 2: the first divergence has bitwise-equal inputs and every cause is a row-parallel sum,
  ``collective_order`` (where this CPU's stock kernels give a slice of a column-parallel or per-head op
  other bits, the test skips naming it: tests/sharding.py);
* ``--consistent``: the fixed-order row-parallel reduction on both sides makes TP = 2 bitwise equal to
  the unsharded model; FSDP2 is bitwise equal too (the negative control of the first: stock kernels);
* what cannot be done is one line, before anything loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sharding import expect_collective_order_only

pytestmark = pytest.mark.slow

SMALL = {"num_sequences": 3, "prompt_len": 10, "response_len": 8}


def _scan(model: Path, consistent: bool = False, **train_set: int) -> dict:
    from logdiff.reports.schema import validate_result

    from logdiff.commands.config import ScanConfig
    from logdiff.commands.scan import scan

    result = scan(ScanConfig(model=model, infer=["hf"], depth="modules", consistent=consistent, attribute=False,
                             train_set=dict(train_set), **SMALL)).to_dict()
    assert [e for e in validate_result(result) if "is not a path with role" not in e] == []
    return result


def test_stock_tp2_is_a_collective_order_difference(qwen3: Path) -> None:
    result = _scan(qwen3, tensor_parallel_size=2)
    train = result["paths"][0]
    assert train["settings"]["tensor_parallel_size"] == 2
    expect_collective_order_only(result)
    # the unsharded op in this process must not stand in for a row-parallel sum (the replay's negative control):
    # the first divergence is the first boundary it does not reproduce, so the warning names it
    first = result["first_divergence"]["boundary"]
    assert any("do not reproduce the captured hf path" in w and first in w for w in result["warnings"])


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2}, {"fsdp_size": 2}])
def test_consistent_sharded_training_path_is_bitwise_equal(qwen3: Path, sizes: dict) -> None:
    result = _scan(qwen3, consistent=True, **sizes)
    assert result["verdict"] == "consistent" and result["logprobs"]["abs_diff_max"] == 0.0
    assert all(row["max_abs_diff"] == 0.0 for row in result["pairs"][0]["boundaries"])


def test_stock_fsdp2_is_compared_through_its_capture(qwen3: Path) -> None:
    """FSDP2 gathers exact weights: whatever the stock kernels give, every boundary is compared and the weights
    (gathered whole on entry) are those of the unsharded model."""
    result = _scan(qwen3, fsdp_size=2)
    assert result["contracts"]["weights"]["differs"] == []
    assert {row["boundary"] for row in result["pairs"][0]["boundaries"]} >= {"logits", "model.norm"}
