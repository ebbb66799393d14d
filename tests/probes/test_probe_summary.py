"""Streaming diff summaries: ulps, bitwise equality, worst position, per-position maxima."""

from __future__ import annotations

import math

import numpy as np
import pytest
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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_ordered_bits_is_the_sign_magnitude_line_for_every_pattern(dtype: str) -> None:
    """Every 16-bit pattern (and random wider ones, the extremes included) against the definition in Python:
    a pattern with its sign bit set maps to minus its magnitude bits, any other to itself (so -0 and +0 to 0)."""
    from logdiff.records.ulps import INT_OF, ordered_bits

    int_name, bits = INT_OF[dtype]
    if bits == 16:
        raw = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    else:
        info = torch.iinfo(getattr(torch, int_name))
        extremes = torch.tensor([info.min, info.min + 1, -1, 0, 1, info.max], dtype=getattr(torch, int_name))
        raw = torch.cat([extremes, torch.randint(info.min, info.max, (4096,), dtype=getattr(torch, int_name))])
    mask = (1 << (bits - 1)) - 1
    expect = [-(r & mask) if r < 0 else r for r in raw.tolist()]
    got = ordered_bits(raw.view(getattr(torch, dtype)), dtype)
    assert got.dtype == (torch.int32 if bits == 16 else torch.int64) and got.tolist() == expect


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


def _naive(ref: torch.Tensor, other: torch.Tensor, dtype: str) -> dict[str, float]:
    """The summary's numbers, element by element in Python: the streamed version must match them exactly."""
    a, b = ref.double().flatten().tolist(), other.double().flatten().tolist()
    ra, rb = ref.flatten(), other.flatten()
    ulps = [int(ulp_distance(ra[i : i + 1], rb[i : i + 1], dtype)) for i in range(len(a)) if a[i] != b[i]]
    return {
        "max_abs_diff": max(abs(x - y) for x, y in zip(a, b)),
        "sum_abs_diff": sum(abs(x - y) for x, y in zip(a, b)),
        "max_ulp": max(ulps, default=0),
        "unequal": len(ulps),
        "max_abs_ref": max(abs(x) for x in a),
    }


@pytest.mark.parametrize("dtypes", [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"),
                                    ("bfloat16", "float32")])  # fmt: skip
def test_streamed_numbers_match_an_elementwise_count(dtypes: tuple[str, str]) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 40, generator=gen) * torch.tensor([1e-3, 1.0, 50.0]).repeat_interleave(2)[:, None]
    ref = x.to(getattr(torch, dtypes[0]))
    noise = torch.randn(6, 40, generator=gen) * 1e-2 * (torch.rand(6, 40, generator=gen) < 0.4)
    other = (x + noise).to(getattr(torch, dtypes[1]))
    other[0, :3] = -other[0, :3]  # sign flips: distances across zero
    ref[1, 0], other[1, 0] = 0.0, -0.0  # +0 and -0 are equal
    s = DiffSummary(8)
    s.update(ref, other, np.zeros(6, dtype=np.int64), np.arange(6))
    want = _naive(ref, other, coarser(*dtypes))
    assert s.max_abs_diff == want["max_abs_diff"] and s.max_ulp == want["max_ulp"] and s.max_ulp > 0
    assert s.elements - s.equal_elements == want["unequal"]
    assert s.max_abs_ref == want["max_abs_ref"]
    assert math.isclose(s.sum_abs_diff, want["sum_abs_diff"], rel_tol=1e-6)


def test_the_first_unequal_row_is_the_smallest_position_then_the_smallest_sequence() -> None:
    """Not the worst row, nor the first unequal row in time: a later chunk with an earlier position wins, and at
    one position the smallest sequence does. Equal rows never count (negative control: an all-equal summary has
    none)."""
    s = DiffSummary(max_positions=16)
    ref = torch.zeros(3, 2)
    big = ref.clone()
    big[0, 0] = 9.0  # the worst row, first in time: sequence 4, position 9
    big[2, 1] = 0.5  # sequence 5, position 6
    s.update(ref, big, seq=np.array([4, 4, 5]), pos=np.array([9, 2, 6]))
    assert (s.first_sequence, s.first_position) == (5, 6) and (s.worst_sequence, s.worst_position) == (4, 9)
    small = ref.clone()
    small[1, 0] = small[2, 0] = 0.25  # position 3 in sequences 7 and 1: the smaller sequence is the first
    s.update(ref, small, seq=np.array([7, 7, 1]), pos=np.array([1, 3, 3]))
    assert (s.first_sequence, s.first_position) == (1, 3) and s.worst_position == 9
    assert s.to_dict()["first_position"] == 3 and s.to_dict()["first_sequence"] == 1
    later = ref.clone()
    later[0, 1] = 1.0  # position 3 again, but a larger sequence: the first stays
    s.update(ref, later, seq=np.array([2, 2, 2]), pos=np.array([3, 4, 5]))
    assert (s.first_sequence, s.first_position) == (1, 3)
    same = DiffSummary(4)
    x = torch.tensor([[1.0, float("nan")], [-0.0, 2.0]])
    same.update(x, torch.tensor([[1.0, float("nan")], [0.0, 2.0]]), np.array([0, 0]), np.array([0, 1]))
    assert same.equal and same.first_position is None and same.first_sequence is None


def test_row_sketches_name_the_first_unequal_row_too() -> None:
    from logdiff.records.sketch import sketch

    raw = torch.randn(4, 8).to(torch.bfloat16)
    other = raw.clone()
    other[3, 1] += 1  # sequence 0, position 5: the first in position order (bound possibly 0: still unequal)
    other[0, 0] += 4  # sequence 2, position 7
    seq, pos = np.array([2, 2, 0, 0]), np.array([7, 2, 6, 5])
    s = DiffSummary(8, sketched=True)
    cols = np.arange(8)
    s.update_sketches(sketch(raw.view(torch.int16).numpy(), "bfloat16", cols),
                      sketch(other.view(torch.int16).numpy(), "bfloat16", cols), seq, pos)
    assert (s.first_sequence, s.first_position) == (0, 5)


def test_a_samplers_minus_inf_is_a_mask_and_nan_or_inf_elsewhere_a_finding() -> None:
    """``-inf`` at the logits or log_softmax boundary is a sampler's mask (processed logprobs after top-p keep it):
    no finding, one line. The controls: the same ``-inf`` inside the decoder, and a NaN at log_softmax, are."""
    from types import SimpleNamespace

    from logdiff.comparison.locate import first_nonfinite

    def pair(kind: str, bad: float) -> SimpleNamespace:
        s = DiffSummary(4)
        ref = torch.tensor([[-1.0, bad, -2.0], [-0.5, -1.5, -3.0]])  # the stored side: the engine's
        s.update(ref, torch.tensor([[-1.0, -9.0, -2.0], [-0.5, -1.5, -3.0]]), np.array([0, 0]), np.array([0, 1]))
        return SimpleNamespace(comparer=SimpleNamespace(summaries={"b": s}), train="hf", infer="vllm",
                               cmap=SimpleNamespace(get=lambda _: SimpleNamespace(kind=kind, layer=None, inputs=())))

    warnings: list[str] = []
    assert first_nonfinite(pair("log_softmax", -math.inf), ["b"], warnings) is None
    assert len(warnings) == 1 and "a sampler's mask" in warnings[0] and "vllm 1" in warnings[0]
    for kind, bad in (("linear", -math.inf), ("log_softmax", math.nan), ("logits", math.inf)):
        found = first_nonfinite(pair(kind, bad), ["b"], [])
        assert found is not None and found["paths"] == ["vllm"] and found["position"] == 0, (kind, bad)
