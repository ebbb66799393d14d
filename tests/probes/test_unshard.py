"""Un-sharding records into logical tensors, and the bundle that carries them (issue 22), without torch.

Every case splits a known logical tensor the way a sharded run would, rebuilds it, and
asserts bitwise equality; each detector has its control (replicas that differ are
reported, identical ones are not; a missing rank is an error, a complete set is not).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from logdiff.errors import InputError
from logdiff.records.bundle import Bundle
from logdiff.records.bundle_writer import BundleWriter
from logdiff.records.layout import REPLICATE, ParallelLayout, Placement, shard
from logdiff.records.unshard import to_float32, unshard

RNG = np.random.default_rng(0)


def tp(world: int, dp: int = 1) -> list[ParallelLayout]:
    """Layouts of ``world * dp`` ranks: tp groups of consecutive ranks, dp groups across them."""
    out = []
    for rank in range(world * dp):
        t, d = divmod(rank, world)
        out.append(ParallelLayout(rank, world * dp, {"tp": tuple(range(t * world, (t + 1) * world)),
                                                     "dp": tuple(range(d, world * dp, world))}))
    return out


def test_column_shards_join_in_tp_order() -> None:
    full = RNG.standard_normal((5, 12)).astype(np.float32)
    layouts = tp(3)
    pieces = [(layouts[i], full[:, 4 * i:4 * (i + 1)]) for i in (2, 0, 1)]  # any arrival order
    (logical,) = unshard("q", pieces, shard(-1), "float32").values()
    assert np.array_equal(logical.value, full) and logical.ranks == (0, 1, 2)


def test_packed_parts_are_gathered_part_by_part() -> None:
    q, k, v = (RNG.standard_normal((3, w)).astype(np.float32) for w in (8, 4, 4))
    layouts = tp(2)
    # vLLM's qkv_proj on rank i holds [q_i, k_i, v_i]
    local = [np.concatenate([x[:, i * x.shape[1] // 2:(i + 1) * x.shape[1] // 2] for x in (q, k, v)], axis=1)
             for i in range(2)]
    (logical,) = unshard("qkv", list(zip(layouts, local)), shard(-1, parts=(4, 2, 2)), "float32").values()
    assert np.array_equal(logical.value, np.concatenate([q, k, v], axis=1))
    naive = np.concatenate(local, axis=1)  # control: joining without the parts scrambles q, k and v
    assert not np.array_equal(naive, logical.value)


def test_vocabulary_padding_is_trimmed() -> None:
    logits = RNG.standard_normal((2, 10)).astype(np.float32)
    padded = np.concatenate([logits, np.zeros((2, 2), np.float32)], axis=1)
    pieces = list(zip(tp(2), np.split(padded, 2, axis=1)))
    (logical,) = unshard("logits", pieces, shard(1, size=10), "float32").values()
    assert np.array_equal(logical.value, logits)


def test_replicas_equal_and_a_differing_replica_is_reported() -> None:
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    (same,) = unshard("o", [(layout, x.copy()) for layout in tp(2)], REPLICATE, "float32").values()
    assert same.replicas_equal is True and same.replica_max_diff == 0.0 and np.array_equal(same.value, x)
    y = x.copy()
    y[1, 2] += 0.5
    (differ,) = unshard("o", list(zip(tp(2), [x, y])), REPLICATE, "float32").values()
    assert differ.replicas_equal is False and differ.replica_max_diff == pytest.approx(0.5, rel=1e-6)


def test_partial_sums_in_one_fixed_order() -> None:
    parts = [RNG.standard_normal((3, 5)).astype(np.float32) for _ in range(4)]
    (logical,) = unshard("down", list(zip(tp(4), parts)), Placement("partial"), "float32").values()
    expected = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    assert np.array_equal(logical.value, expected)
    shuffled = list(zip(tp(4), parts))[::-1]  # arrival order does not change the sum's order
    (again,) = unshard("down", shuffled, Placement("partial"), "float32").values()
    assert np.array_equal(again.value, expected)


def test_data_parallel_sets_are_rebuilt_apart() -> None:
    layouts = tp(2, dp=2)
    a, b = (RNG.standard_normal((2, 8)).astype(np.float32) for _ in range(2))
    pieces = [(layouts[r], (a if r < 2 else b)[:, 4 * (r % 2):4 * (r % 2 + 1)]) for r in range(4)]
    out = unshard("q", pieces, shard(-1), "float32")
    assert len(out) == 2
    values = sorted((logical.ranks, logical.value.tobytes()) for logical in out.values())
    assert values == [((0, 1), a.tobytes()), ((2, 3), b.tobytes())]


def test_a_missing_rank_is_an_input_error() -> None:
    layouts = tp(3)
    with pytest.raises(InputError, match=r"tp ranks \[0, 2\], expected all of \[0, 1, 2\]"):
        unshard("q", [(layouts[0], np.zeros((1, 2))), (layouts[2], np.zeros((1, 2)))], shard(-1), "float32")


def test_bfloat16_bits_widen_exactly() -> None:
    values = np.array([1.0, -2.5, 3.140625, 0.0], dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)  # exact in bf16
    assert np.array_equal(to_float32(bits, "bfloat16"), values)


def test_bundle_round_trip_without_torch(tmp_path: Path) -> None:
    full = RNG.standard_normal((6, 8)).astype(np.float32)
    ids, pos = np.arange(6), np.arange(6)
    for layout in tp(2):
        writer = BundleWriter(tmp_path, "train", layout, meta={"model": "demo"})
        for step in range(2):
            writer.begin_step(ids + step, pos)
            i = layout.index_in("tp")
            writer.record("q", full[:, 4 * i:4 * (i + 1)] + step, shard(-1))
            writer.record("o", full + step, REPLICATE)
        writer.close()
    bundle = Bundle(tmp_path)
    assert bundle.role == "train" and bundle.num_steps == 2 and bundle.names(1) == ["q", "o"]
    (table,) = bundle.rows(1).values()
    assert np.array_equal(table["tokens"], ids + 1) and np.array_equal(table["positions"], pos)
    assert set(table) == {"tokens", "positions"} and bundle.record_rows(1, "q") is None
    (q,) = bundle.logical(1, "q").values()
    (o,) = bundle.logical(1, "o").values()
    assert np.array_equal(q.value, full + 1) and np.array_equal(o.value, full + 1) and o.replicas_equal


def test_bad_bundles_are_one_line_input_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not a capture bundle"):
        Bundle(tmp_path)
    (tmp_path / "bundle.json").write_text(json.dumps({"format": "logdiff-capture", "version": 99}))
    with pytest.raises(InputError, match="bundle version 99"):
        Bundle(tmp_path)
    writer = BundleWriter(tmp_path, "infer", tp(2)[0])  # rank 1 never wrote
    writer.begin_step(np.arange(2), np.arange(2))
    writer.record("o", np.zeros((2, 2), np.float32), REPLICATE)
    writer.close()
    with pytest.raises(InputError, match=r"world size 2 \(.*bundle\.json\), no records from ranks 1$"):
        Bundle(tmp_path)
