"""The on-disk store and the on-the-spot comparer with teacher-forced replay."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from logdiff.probes.align import PLAIN, RowMap
from logdiff.probes.replay import ReplaySpec
from logdiff.probes.summary import PathComparer

from logdiff.records.store import PathStore, RowStore


def test_rowstore_round_trips_bf16_bits(tmp_path: Path) -> None:
    store = RowStore(tmp_path / "b.bin", num_sequences=3, max_len=6, width=5, dtype="bfloat16")
    rows = torch.randn(4, 5).to(torch.bfloat16)
    seq, pos = np.array([2, 0, 2, 1]), np.array([3, 5, 4, 0])
    store.write(seq, pos, rows)
    back = store.read(np.array([2, 2, 0, 1]), np.array([4, 3, 5, 0]))
    assert torch.equal(back.view(torch.int16), rows[[2, 0, 1, 3]].view(torch.int16))
    assert store.has(np.array([2, 2, 0]), np.array([3, 2, 9])).tolist() == [True, False, False]
    store.write(np.array([2, 2, 2]), np.array([0, 1, 2]), torch.zeros(3, 5))
    assert store.has_prefix(np.array([2, 2, 1]), np.array([4, 5, 0])).tolist() == [True, False, True]
    store.close()


def test_small_writes_wait_in_a_buffer_and_read_back_as_written(tmp_path: Path) -> None:
    """Decode-step writes (a few rows each) are held back and written together; a later write of a position
    wins, a read sees everything written, and mutating the source after its write changes nothing stored."""
    store = RowStore(tmp_path / "d.bin", num_sequences=2, max_len=40, width=8, dtype="float32")
    expect = np.zeros((2, 40, 8), np.float32)
    source = torch.zeros(2, 8)
    for step in range(40):
        source.copy_(torch.randn(2, 8))
        store.write(np.array([0, 1]), np.array([step, step]), source)  # a view the "engine" overwrites next step
        expect[:, step] = source.numpy()
        if step == 20:
            store.write(np.array([1]), np.array([3]), torch.full((1, 8), 7.0))  # a later write of position 3
            expect[1, 3] = 7.0
    assert store._pending  # small writes are waiting
    assert store.has(np.array([0, 1]), np.array([39, 39])).all()
    back = store.read(np.repeat([0, 1], 40), np.tile(np.arange(40), 2)).numpy().reshape(2, 40, 8)
    assert np.array_equal(back, expect) and not store._pending
    assert store.written_bytes == (2 * 40 + 1) * 8 * 4  # every row written once, position 3 of sequence 1 twice
    store.close()


def _rmap(seq: list[int], pos: list[int]) -> RowMap:
    return RowMap(np.array(seq), np.array(pos), np.ones(len(seq), dtype=bool))


def test_comparer_compares_only_rows_both_paths_have(tmp_path: Path) -> None:
    store = PathStore(tmp_path, "infer", num_sequences=2, max_len=4)
    x = torch.randn(4, 3)
    store.emit("b", x[:3], np.array([0, 0, 1]), np.array([0, 1, 0]))  # the stored path lacks (1, 1)
    cmp = PathComparer(store, max_len=4)
    live = x.clone()
    live[3] += 100.0  # only in the row the stored path does not have
    cmp.emit("b", live, _rmap([0, 0, 1, 1], [0, 1, 0, 1]))
    s = cmp.summaries["b"]
    assert s.rows == 3 and s.equal
    cmp.emit("unknown", live, _rmap([0, 0, 1, 1], [0, 1, 0, 1]))
    assert cmp.not_stored == {"unknown"} and cmp.order == ["b", "unknown"]


def test_replay_separates_introduced_from_propagated_error(tmp_path: Path) -> None:
    store = PathStore(tmp_path, "infer", num_sequences=1, max_len=4)
    w = torch.randn(3, 3)
    x_infer = torch.randn(4, 3)
    store.emit("x", x_infer, np.zeros(4, dtype=int), np.arange(4))
    store.emit("y", x_infer @ w, np.zeros(4, dtype=int), np.arange(4))
    x_live = x_infer + 0.5  # the live path's input already differs
    rmap = _rmap([0, 0, 0, 0], [0, 1, 2, 3])

    def spec(weight: torch.Tensor, template: torch.Tensor) -> ReplaySpec:
        return ReplaySpec([("x", template, PLAIN)], lambda xs: xs[0] @ weight)

    same_op = PathComparer(store, 4)
    same_op.emit("y", x_live @ w, rmap, spec(w, x_live))
    assert not same_op.summaries["y"].equal  # the output differs (propagated) ...
    assert same_op.local["y"].equal  # ... but the op itself introduces nothing

    other_op = PathComparer(store, 4)  # negative control: an op that computes differently
    w2 = w * 1.01
    other_op.emit("y", x_live @ w2, rmap, spec(w2, x_live))
    assert other_op.local["y"].max_abs_diff > 0


def test_replay_without_the_input_on_record_is_skipped(tmp_path: Path) -> None:
    store = PathStore(tmp_path, "infer", num_sequences=1, max_len=2)
    store.emit("y", torch.ones(2, 2), np.zeros(2, dtype=int), np.arange(2))
    cmp = PathComparer(store, 2)
    t = torch.ones(2, 2)
    cmp.emit("y", t, _rmap([0, 0], [0, 1]), ReplaySpec([("x", t, PLAIN)], lambda xs: xs[0]))
    assert "y" not in cmp.local and "x" in cmp.replay_skipped["y"]
