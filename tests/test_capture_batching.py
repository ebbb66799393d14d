"""Sequences captured as frameworks batch them: left padding, right padding, packed rows (logdiff/records/batching.py,
probes/capture.py's ``_begin_step``, the pairing and its warnings in logdiff/commands/compare.py).

A tiny random Qwen3 in float32 is captured with ``logdiff.capture`` on one batching and compared against a
capture of the same sequences one per forward, unpadded. Every sequence must be paired whatever the batching;
the measured gap must be the one the two forwards' own logprobs show (computed here from the same logits, so
no assertion depends on the CPU's kernels); a left pad's shifted positions (HF numbers every row 0..L-1 when
no ``position_ids`` are given) must be reported as a ``position_ids`` difference, and not when the trainer passes
``position_ids = mask.cumsum - 1``. Negative control: sequences with other tokens are counted unpaired.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tiny_batches import PAD, left_padded, tiny_qwen3

SEQS = [[5, 17, 3, 9, 42, 7, 11, 2], [8, 1, 30, 4, 6], [8, 1, 30, 4, 9, 9], [60, 61, 62]]
OTHER = [SEQS[0], SEQS[3], [5, 17, 3, 9, 42, 7, 11, 3][::-1], [99, 98, 97, 96]]  # two shared, two not


# ---- the rules, without torch ------------------------------------------------------------------------


def test_right_padding_keeps_the_tokens_and_drops_the_pads() -> None:
    from logdiff.records.batching import split_rows

    pos = np.tile(np.arange(5), (2, 1))
    valid = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    s = split_rows(pos, valid, first=3)
    assert s.offsets == [0, 0]
    assert s.seq.tolist() == [3, 3, 3, 3, 3, 4, 4, 4, -1, -1]
    assert s.pos[s.valid].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]


def test_left_padding_without_position_ids_keeps_the_shift_as_an_offset() -> None:
    from logdiff.records.batching import split_rows

    pos = np.tile(np.arange(5), (2, 1))  # what HF feeds when no position_ids are given
    valid = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], bool)
    s = split_rows(pos, valid)
    assert s.offsets == [2, 0]
    assert s.pos[s.valid].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    # a careful trainer's position_ids (mask.cumsum - 1, pads at 1 as HF's generate fills them): no shift
    careful = np.where(valid, valid.cumsum(-1) - 1, 1)
    assert split_rows(careful, valid).offsets == [0, 0]


def test_packed_rows_split_where_positions_restart_or_cu_seqlens_start() -> None:
    from logdiff.records.batching import segment_starts, split_rows

    pos = np.array([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    s = split_rows(pos, np.ones_like(pos, bool))
    assert s.count == 3 and s.offsets == [0, 0, 0]
    assert s.seq.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2] and s.pos.tolist() == pos[0].tolist()
    # cu_seqlens alone (positions that do not restart): each segment its own sequence, its shift reported
    run = np.arange(9)[None]
    s = split_rows(run, np.ones_like(run, bool), starts=segment_starts([0, 3, 5, 9]))
    assert s.seq.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2] and s.offsets == [0, 3, 5]
    assert s.pos.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]


def test_a_cache_step_keeps_absolute_positions_and_a_pad_row_is_no_sequence() -> None:
    from logdiff.records.batching import split_rows

    s = split_rows(np.array([[7], [7]]), np.array([[1], [0]], bool))
    assert s.count == 1 and s.offsets == [0] and s.pos[0] == 7  # a KV-cache decode step continues its sequence
    assert s.seq.tolist() == [0, -1]
    with pytest.raises(ValueError, match="batch, length"):
        split_rows(np.arange(3), np.ones(3, bool))


# ---- captured and compared ---------------------------------------------------------------------------


def _right(seqs: list[list[int]]) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    import torch

    n = max(map(len, seqs))
    return ({"input_ids": torch.tensor([s + [PAD] * (n - len(s)) for s in seqs]),
             "attention_mask": torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs])},
            [(b, 0) for b in range(len(seqs))])


def _packed(seqs: list[list[int]]) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """One row, positions restarting per sequence, no attention mask and no cache: HF's packed format (it then
    masks attention to each sequence), as verl's ``use_remove_padding`` feeds it."""
    import torch

    starts = np.cumsum([0, *map(len, seqs)])[:-1].tolist()
    return ({"input_ids": torch.tensor([[t for s in seqs for t in s]]),
             "position_ids": torch.tensor([[p for s in seqs for p in range(len(s))]]), "use_cache": False},
            [(0, int(j)) for j in starts])


def _single(seqs: list[list[int]]) -> list[tuple[dict[str, Any], list[tuple[int, int]]]]:
    import torch

    return [({"input_ids": torch.tensor([s])}, [(0, 0)]) for s in seqs]


def _capture(model: Any, out: Path, seqs: list[list[int]], batches: list[Any]) -> tuple[Path, list[np.ndarray]]:
    """The bundle of ``batches`` (each a forward's kwargs and where each of its sequences sits) and each sequence's
    logprobs of its tokens after the first, read from the same logits the capture recorded."""
    import torch

    import logdiff

    out_lp: list[np.ndarray] = []
    with logdiff.capture(model, out, "train", window="all") as cap, torch.no_grad():
        for kw, where in batches:
            lp = cap.logprobs(model(**kw).logits)
            for (b, j), s in zip(where, seqs[len(out_lp):]):
                rows = lp[b, j: j + len(s) - 1]
                out_lp.append(rows.gather(1, torch.tensor(s[1:])[:, None])[:, 0].double().numpy())
    return out, out_lp


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = tiny_qwen3()
    root = tmp_path_factory.mktemp("batching")
    out = {
        "ref": _capture(model, root / "ref", SEQS, _single(SEQS)),
        "left": _capture(model, root / "left", SEQS, [left_padded(SEQS)]),
        "left_pos": _capture(model, root / "left_pos", SEQS, [left_padded(SEQS, position_ids=True)]),
        "right": _capture(model, root / "right", SEQS, [_right(SEQS)]),
        "packed": _capture(model, root / "packed", SEQS, [_packed(SEQS)]),
        "other": _capture(model, root / "other", OTHER, _single(OTHER)),
    }
    return out


def _compare(captured: dict[str, Any], name: str, against: str = "ref") -> dict[str, Any]:
    from logdiff.reports.schema import validate_result

    from logdiff.commands.compare import compare_bundles

    result = compare_bundles(captured[name][0], captured[against][0]).to_dict()
    validate_result(result)
    return result


def _gap(captured: dict[str, Any], name: str) -> float:
    """The max |Δ logprob| of the two captures' own forwards, over every token after the first."""
    return max(float(np.abs(a - b).max()) for a, b in zip(captured[name][1], captured["ref"][1]))


@pytest.mark.parametrize("name", ["left", "left_pos", "right", "packed"])
def test_every_sequence_is_captured_as_itself_and_paired(captured, name: str) -> None:
    from logdiff.records.bundle import Bundle

    assert Bundle(captured[name][0]).sequences() == SEQS
    result = _compare(captured, name)
    assert result["sequences"]["count"] == len(SEQS)
    assert result["logprobs"]["num_tokens"] == sum(len(s) - 1 for s in SEQS)
    assert not any("no partner" in w for w in result["warnings"])
    assert result["logprobs"]["abs_diff_max"] == pytest.approx(_gap(captured, name), rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("name", ["right", "packed", "left_pos"])
def test_same_math_gives_no_gap_beyond_rounding_and_no_offset(captured, name: str) -> None:
    result = _compare(captured, name)
    assert result["logprobs"]["abs_diff_max"] < 1e-5  # float32: the same function, at most reordered sums
    assert not any(w.startswith("position_ids") for w in result["warnings"])
    assert not any(c["kind"] == "position_ids" for c in result["causes"])
    from logdiff.records.bundle import Bundle

    assert "position_offsets" not in Bundle(captured[name][0]).meta


def test_left_padding_without_position_ids_is_reported_as_shifted_positions(captured) -> None:
    from logdiff.records.bundle import Bundle

    pads = {str(i): max(map(len, SEQS)) - len(s) for i, s in enumerate(SEQS) if len(s) < max(map(len, SEQS))}
    assert Bundle(captured["left"][0]).meta["position_offsets"] == pads
    result = _compare(captured, "left")
    (line,) = [w for w in result["warnings"] if w.startswith("position_ids")]
    assert f"{len(pads)} of {len(SEQS)} paired sequences were fed at shifted positions" in line
    assert "model position 2, 3, 5 (train) against 0 (infer)" in line
    # a cause where the logprobs differ: Qwen3's RoPE is shift-invariant, so the same function (operator path)
    causes = [c for c in result["causes"] if c["kind"] in ("position_ids", "position_offset")]
    assert len(causes) == (1 if result["logprobs"]["abs_diff_max"] > 0 else 0)
    assert all(c["class"] == "operator_path" and c["kind"] == "position_offset" and "rope" in c["boundary"]
               for c in causes)
    # the other way round: the shifted side is the inference bundle's
    swapped = _compare(captured, "ref", against="left")
    assert any(w.startswith("position_ids") and "0 (train) against 2, 3, 5 (infer)" in w for w in swapped["warnings"])


@pytest.mark.parametrize(("config", "invariant"), [
    ({"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, True),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, True),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, False),  # reads the length
    ({"rope_theta": 1e4, "rope_scaling": {"type": "longrope"}}, False),
    ({"n_positions": 1024}, False),  # a learned position table (GPT-2): a shift is another input
])
def test_a_shift_is_the_same_function_only_where_rope_is_linear_in_the_position(config, invariant) -> None:
    from logdiff.comparison.bundle_checks import shift_invariant

    assert bool(shift_invariant(config)) is invariant


def test_sequences_with_other_tokens_are_counted_unpaired(captured) -> None:
    result = _compare(captured, "right", against="other")
    assert result["sequences"]["count"] == 2
    (line,) = [w for w in result["warnings"] if "no partner" in w]
    assert line.startswith("4 of 8 sequences found no partner")
    assert "2 of the training bundle's 4, 2 of the inference bundle's 4" in line
