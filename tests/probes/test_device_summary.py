"""The device-side fold (``device_summary``) gives exactly the summary the host fold gives.

Run on the CPU with ``DiffSummary(on_device=True)`` (tests/test_gpu_conformance.py runs it on CUDA, where it
must also never synchronize): the same chunks, equal and unequal rows, NaN and inf on either side, ties for
the worst row, positions past ``max_positions``, in bf16, fp32 and mixed dtypes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from logdiff.probes.summary import DiffSummary


def _chunks(dtype: torch.dtype, other_dtype: torch.dtype, seed: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for c, rows in enumerate((5, 1, 7, 4)):
        ref = torch.randn(rows, 6, generator=gen).to(dtype)
        other = ref.to(other_dtype).clone()
        if c == 0:
            other[1, 3] += 0.25  # one unequal element
        if c == 1:
            pass  # an all-equal chunk (the host's fast path)
        if c == 2:
            other[0] += 0.01
            ref[3, 0], other[3, 0] = float("nan"), float("nan")  # NaN on both sides: equal
            other[4, 1] = float("inf")  # a one-sided inf
            other[1, 3] = -float("inf")  # a one-sided -inf (a sampler's mask where the boundary is the sampler's)
            ref[5, 2] = float("nan")  # a one-sided NaN
        if c == 3:
            other[2, 5] -= 0.25  # ties the first chunk's worst: the first one stays worst
        seq = np.arange(rows) + 10 * c
        pos = np.array([0, 3, 9, 1, 2, 5, 6][:rows]) + c  # positions past max_positions (8) are dropped
        out.append((ref, other, seq, pos))
    return out


@pytest.mark.parametrize(("dtype", "other_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                    (torch.bfloat16, torch.float32)])
def test_the_device_fold_is_the_host_fold(dtype: torch.dtype, other_dtype: torch.dtype) -> None:
    host, device = DiffSummary(8), DiffSummary(8, on_device=True)
    for ref, other, seq, pos in _chunks(dtype, other_dtype, seed=3):
        host.update(ref, other, seq, pos)
        device.update(ref, other, seq, pos)
    assert device.elements == 0  # nothing read back until asked
    device.settle()
    h, d = host.to_dict(), device.to_dict()
    assert math.isclose(h.pop("mean_abs_diff"), d.pop("mean_abs_diff"), rel_tol=1e-12)
    assert h == d and host.nonfinite_at == device.nonfinite_at
    assert (host.neginf_ref, host.neginf_other) == (device.neginf_ref, device.neginf_other) == (0, 1)
    assert h["first_position"] is not None and h["first_position"] != h["worst_position"]  # both were compared
    np.testing.assert_array_equal(host.per_position, device.per_position)  # NaN where never seen, on both
    assert h["nonfinite"] > 0 and h["max_abs_diff"] == math.inf  # the chunks did exercise the odd cases


def test_a_planted_difference_is_seen_and_identical_rows_are_equal_on_the_device_path() -> None:
    ref = torch.randn(4, 8).to(torch.bfloat16)
    same = DiffSummary(4, on_device=True)
    same.update(ref, ref.clone(), np.arange(4), np.arange(4))
    assert same.settle().equal
    planted = ref.clone()
    planted[2, 5] = -planted[2, 5] + 1
    differs = DiffSummary(4, on_device=True)
    differs.update(ref, planted, np.arange(4), np.arange(4))
    assert not differs.settle().equal and (differs.worst_sequence, differs.worst_position) == (2, 2)


def test_the_device_path_names_the_first_unequal_row_in_position_order() -> None:
    """Across chunks, the smallest position wins, then the smallest sequence, whatever the order they came in."""
    host, device = DiffSummary(16), DiffSummary(16, on_device=True)
    ref = torch.zeros(3, 4)
    for rows, seq, pos in (([0], [4, 4, 5], [9, 2, 6]), ([1, 2], [7, 3, 1], [1, 3, 3]), ([], [0, 0, 0], [0, 1, 2])):
        other = ref.clone()
        other[rows, 0] = 1.0
        for s in (host, device):
            s.update(ref, other, np.array(seq), np.array(pos))
    device.settle()
    assert (device.first_sequence, device.first_position) == (host.first_sequence, host.first_position) == (1, 3)
