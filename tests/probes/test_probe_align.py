"""Row maps: every engine layout goes back to (sequence, absolute position)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from logdiff.probes import align


def test_hf_full_forward_right_padding() -> None:
    # two sequences of lengths 3 and 2, right-padded to width 3
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    m = align.padded_rows([5, 2], pos, mask, lengths=[0, 0, 2, 0, 0, 3])
    assert m.seq.tolist() == [5, 5, 5, 2, 2, 2]
    assert m.pos.tolist() == [0, 1, 2, 0, 1, 1]
    assert m.valid.tolist() == [True, True, True, True, True, False]


def test_hf_left_padded_prefill_and_decode_steps() -> None:
    lengths = [4, 6]
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # prompts of length 2 and 3, left-padded
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    prefill = align.padded_rows([0, 1], pos, mask, lengths)
    assert prefill.valid.tolist() == [False, True, True, True, True, True]
    assert prefill.pos[prefill.valid].tolist() == [0, 1, 0, 1, 2]
    # a decode step: one new column per row; the mask grows, positions continue
    mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    step = align.padded_rows([0, 1], pos[:, -1:] + 1, mask, lengths)
    assert step.seq.tolist() == [0, 1] and step.pos.tolist() == [2, 3] and step.valid.all()
    # rows that keep decoding past their sequence's end are dropped
    late = align.padded_rows([0, 1], torch.tensor([[4], [5]]), mask, lengths)
    assert late.valid.tolist() == [False, True]


def test_padded_rows_refuses_a_batch_size_mismatch() -> None:
    with pytest.raises(ValueError):
        align.padded_rows([0], torch.zeros(2, 3, dtype=torch.long), None, [3, 3])


def test_vllm_mixed_prefill_decode_and_chunked_prefill() -> None:
    # one step: request "7" decodes at position 9, request "5" prefills a chunk at 4..6,
    # request "8" (another generate call's) is not ours
    positions = torch.tensor([9, 4, 5, 6, 0, 1])
    qsl = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    req_ids = ["7-aaaa", "5-bbbb", "98-cccc"]
    lengths = [0] * 10 + [20, 20, 20]
    m = align.packed_rows(positions, qsl, req_ids, sequences=[10, 11, 12], request_base=5, lengths=lengths)
    assert m.seq.tolist() == [12, 10, 10, 10, -1, -1]
    assert m.pos.tolist() == [9, 4, 5, 6, 0, 1]
    assert m.valid.tolist() == [True, True, True, True, False, False]


def test_vllm_padding_rows_beyond_the_batch_are_invalid() -> None:
    m = align.packed_rows(torch.tensor([0, 1, 0]), [0, 2], ["0-x"], [0], 0, [5])
    assert m.valid.tolist() == [True, True, False]


def test_request_index() -> None:
    assert align.request_index("12-ab12", 10, 4) == 2
    assert align.request_index("14-ab12", 10, 4) == -1
    assert align.request_index("9", 10, 4) == -1
    assert align.request_index("x-1", 0, 4) == -1


def test_layouts_round_trip() -> None:
    t = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)  # [B, heads, L, D]
    rows = align.HEADS_FIRST.to_rows(t, 2 * 4)
    assert rows.shape == (8, 15)
    # row b * L + l holds heads in order, each head's D values contiguous
    assert torch.equal(rows[1 * 4 + 2], t[1, :, 2, :].reshape(-1))
    assert torch.equal(align.HEADS_FIRST.from_rows(rows, like=t), t)
    flat = torch.arange(6 * 7).reshape(2, 3, 7)
    assert torch.equal(align.PLAIN.from_rows(align.PLAIN.to_rows(flat, 6), like=flat), flat)
    with pytest.raises(ValueError):
        align.PLAIN.to_rows(flat, 4)


def test_lead_dims() -> None:
    assert align.lead_dims((2, 3, 8), 6) == 2
    assert align.lead_dims((6, 4, 8), 6) == 1
    assert align.lead_dims((2, 1, 8), 2) == 1


def test_view_rows() -> None:
    base = torch.zeros(2, 5, 7)
    flat = base.reshape(-1, 7)
    assert align.view_rows(base[1, 2:4], flat).tolist() == [7, 8]
    assert align.view_rows(base[:, -1], flat).tolist() == [4, 9]
    assert align.view_rows(base[1, 2:4].clone(), flat) is None  # a copy is not a view
    assert align.view_rows(base[0, :, :3], flat) is None  # not whole rows


def test_rowmap_take() -> None:
    m = align.RowMap(np.array([0, 0, 1]), np.array([3, 4, 0]), np.array([True, False, True]))
    sub = m.take(np.array([2, 0]))
    assert sub.seq.tolist() == [1, 0] and sub.pos.tolist() == [0, 3] and sub.num_valid == 2
