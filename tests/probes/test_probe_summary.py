"""Streaming diff summaries: ulps, bitwise equality, worst position, per-position maxima."""

from __future__ import annotations

import math

import numpy as np
import torch

from logdiff.probes.summary import DiffSummary, coarser, ulp_distance


def _next_up(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int16)
    return (bits + 1).view(x.dtype)


def test_ulp_distance_counts_representable_steps() -> None:
    a = torch.tensor([1.0, -2.5, 0.0, 3.0], dtype=torch.bfloat16)
    b = _next_up(a.clone())
    d = ulp_distance(a, b, "bfloat16")
    # +1 in the bit pattern is one ulp (for negatives it moves away from zero: still one step)
    assert d[:2].tolist() == [1, 1]
    assert ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0]), "float32").item() == 0
    # crossing zero counts every representable value in between
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert ulp_distance(tiny, -tiny, "float32").item() == 2 * tiny.view(torch.int32).item()
    assert ulp_distance(a, a, "bfloat16").sum().item() == 0


def test_coarser() -> None:
    assert coarser("float32", "bfloat16") == "bfloat16"
    assert coarser("float16", "bfloat16") == "bfloat16"
    assert coarser("float32", "float64") == "float32"


def test_summary_tracks_worst_and_per_position() -> None:
    s = DiffSummary(max_positions=8)
    ref = torch.zeros(3, 4, dtype=torch.bfloat16)
    other = ref.clone()
    other[1, 2] = 0.5
    s.update(ref, other, seq=np.array([0, 1, 2]), pos=np.array([5, 6, 7]))
    assert s.max_abs_diff == 0.5 and s.worst_sequence == 1 and s.worst_position == 6
    assert s.elements == 12 and s.equal_elements == 11 and not s.equal
    assert s.rows_equal == 2
    assert math.isnan(s.per_position[0]) and s.per_position[5] == 0.0 and s.per_position[6] == 0.5
    s.update(ref[:1], ref[:1], np.array([4]), np.array([6]))  # more rows at the same position keep the max
    assert s.per_position[6] == 0.5 and s.max_abs_diff == 0.5
    assert s.to_dict()["bitwise_equal_fraction"] == 15 / 16


def test_identical_values_are_equal_and_nan_pairs_count_as_equal() -> None:
    s = DiffSummary(4)
    x = torch.tensor([[1.0, float("nan")]])
    s.update(x, x.clone(), np.array([0]), np.array([0]))
    assert s.equal and s.max_abs_diff == 0.0 and s.nonfinite == 0


def test_one_sided_nan_is_a_divergence() -> None:
    s = DiffSummary(4)
    s.update(torch.tensor([[1.0]]), torch.tensor([[float("nan")]]), np.array([0]), np.array([1]))
    assert not s.equal and s.nonfinite == 1
