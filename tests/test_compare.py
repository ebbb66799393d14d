"""The logprob metrics, on hand-made numbers with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from logdiff.comparison import metrics as compare
from logdiff.records.sequences import Sequence


def test_identical_paths_are_all_zero() -> None:
    a = [np.array([-0.5, -1.0, -2.0], np.float32), np.array([-0.1], np.float32)]
    m = compare.token_metrics(a, [x.copy() for x in a])
    assert m["abs_diff_max"] == 0.0 and m["abs_diff_mean"] == 0.0
    assert m["bitwise_equal_fraction"] == 1.0
    assert m["kl_k1"] == 0.0 and m["kl_k3"] == 0.0
    assert m["clip_fraction_0.2"] == 0.0 and m["ratio_mean"] == 1.0


def test_known_values() -> None:
    train = [np.array([-1.0, -1.0], np.float32)]
    infer = [np.array([-1.0, -1.5], np.float32)]
    m = compare.token_metrics(train, infer)
    assert m["num_tokens"] == 2
    assert m["abs_diff_max"] == pytest.approx(0.5)
    assert m["abs_diff_mean"] == pytest.approx(0.25)
    assert m["bitwise_equal_fraction"] == 0.5
    r = math.exp(0.5)  # exp(lp_train - lp_infer) at the second token
    assert m["ratio_max"] == pytest.approx(r)
    assert m["kl_k1"] == pytest.approx((0.0 - 0.5) / 2)
    assert m["kl_k3"] == pytest.approx((r - 1 - 0.5) / 2)
    assert m["clip_fraction_0.2"] == 0.5 and m["clip_fraction_0.28"] == 0.5
    assert m["rollout_probs_diff_max"] == pytest.approx(math.exp(-1) - math.exp(-1.5))


def test_clip_fraction_thresholds() -> None:
    # ratios 1.25 and 1.1: only the first is clipped at 0.2, neither at 0.28.
    train = [np.log(np.array([0.5, 0.55])).astype(np.float64)]
    infer = [np.log(np.array([0.4, 0.5])).astype(np.float64)]
    m = compare.token_metrics(train, infer)
    assert m["clip_fraction_0.2"] == 0.5
    assert m["clip_fraction_0.28"] == 0.0


def test_argmax_flips_and_worst_position() -> None:
    train = [np.array([-1.0, -2.0]), np.array([-0.1, -0.2, -0.3])]
    infer = [np.array([-1.0, -2.0]), np.array([-0.1, -0.9, -0.3])]
    m = compare.token_metrics(train, infer, [np.array([1, 2]), np.array([3, 4, 5])], [np.array([1, 2]), np.array([3, 9, 5])])
    assert m["argmax_flip_fraction"] == pytest.approx(1 / 5)
    w = compare.worst(train, infer)
    assert (w["sequence"], w["response_index"]) == (1, 1)
    assert compare.at(w, [Sequence([1, 2, 3], [4, 5]), Sequence([6, 7], [8, 9, 10])])["position"] == 2 + 1
    pp = compare.per_position(train, infer)
    assert pp["abs_diff_max"] == pytest.approx([0.0, 0.7, 0.0])
    assert pp["abs_diff_mean"] == pytest.approx([0.0, 0.35, 0.0])


def test_histogram_counts_every_token() -> None:
    train = [np.array([0.0, -1.0, -1.0, -2.0])]
    infer = [np.array([0.0, -1.0 - 1e-5, -1.2, -2.0])]
    h = compare.histogram(train, infer)
    assert len(h["edges"]) == len(h["counts"]) + 1
    assert sum(h["counts"]) == 4
    assert h["counts"][0] == 2  # the two exactly-equal tokens
