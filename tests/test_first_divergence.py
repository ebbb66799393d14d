"""The first divergence names where a boundary *starts* to differ, and its worst row apart.

Planted differences at known rows of a stored path, compared by the real ``PathComparer`` and located by
``locate`` (no model): the first diverging boundary, its first position (the smallest at which any sequence
differs) and the first sequence there, its worst row, all in the one position convention (absolute position,
response index where the position holds a response token). The negative controls: identical paths have no
first divergence, and a worst row that comes first in the data never stands in for the first position.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from logdiff.probes.align import RowMap
from logdiff.probes.correspondence import CorrespondenceMap
from logdiff.probes.summary import PathComparer
from logdiff.reports.schema import validate_result

from logdiff.comparison.locate import locate
from logdiff.records.sequences import Sequence
from logdiff.records.store import PathStore

PROMPT, RESPONSE, SEQS, WIDTH = 5, 5, 3, 4
LEN = PROMPT + RESPONSE
NAMES = ["embed", "mid", "out"]  # semantic order: embed equal, mid the first to differ, out after it


def _values(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(NAMES.index(name))
    return torch.round(torch.randn(SEQS, LEN, WIDTH, generator=gen) * 64) / 64  # a planted delta adds exactly


def _pair(tmp_path: Path, plants: dict[str, list[tuple[int, int, float]]], tolerance: float = 0.0) -> dict | None:
    """Store every boundary's values, then compare a live path whose ``plants[name]`` rows (sequence,
    position, added value) differ; the live path runs one sequence at a time, last sequence first, so the
    first unequal row in time is not the first in position order. Returns locate's first divergence."""
    store = PathStore(tmp_path, "infer", SEQS, LEN)
    seq_all, pos_all = np.repeat(np.arange(SEQS), LEN), np.tile(np.arange(LEN), SEQS)
    for name in NAMES:
        store.emit(name, _values(name).reshape(-1, WIDTH), seq_all, pos_all)
    comparer = PathComparer(store, LEN, replay=False)
    for s in reversed(range(SEQS)):
        rmap = RowMap(np.full(LEN, s), np.arange(LEN), np.ones(LEN, dtype=bool))
        for name in NAMES:
            live = _values(name)[s].clone()
            for seq, pos, delta in plants.get(name, []):
                if seq == s:
                    live[pos, 0] += delta
            comparer.emit(name, live, rmap)
    seqs = [Sequence(list(range(1, PROMPT + 1)), list(range(10, 10 + RESPONSE))) for _ in range(SEQS)]
    pair = SimpleNamespace(train="hf", infer="vllm", cmap=CorrespondenceMap("Planted", [], 0, mapped=False),
                           comparer=comparer, store=store, seqs=seqs, tracer_train=None, tracer_infer=None)
    try:
        return locate(pair, tolerance=tolerance).first_divergence
    finally:
        store.close()


# mid: a small difference at position 3 (in the prompt) in sequences 2 and 1, a large one at position 7 of
# sequence 0 (response index 2); out differs from position 2 on, but comes after mid in semantic order
PLANTS = {"mid": [(2, 3, 0.25), (1, 3, 0.25), (0, 7, 8.0), (2, 8, 0.5)], "out": [(0, 2, 1.0)]}


def test_the_first_position_and_sequence_are_where_the_boundary_starts_to_differ(tmp_path: Path) -> None:
    fd = _pair(tmp_path, PLANTS)
    assert fd["boundary"] == "mid" and fd["inputs_equal"] is True
    # the smallest position at which any sequence differs, and the smallest sequence differing there
    assert (fd["position"], fd["sequence"], fd["response_index"]) == (3, 1, None)
    assert fd["worst"] == {"sequence": 0, "position": 7, "response_index": 2, "max_abs_diff": 8.0}
    assert fd["max_abs_diff"] == 8.0


def test_a_first_position_in_the_response_has_its_response_index(tmp_path: Path) -> None:
    fd = _pair(tmp_path, {"mid": [(1, 8, 0.5), (2, 6, 0.25)]})
    assert (fd["position"], fd["sequence"], fd["response_index"]) == (6, 2, 1)
    assert fd["worst"] == {"sequence": 1, "position": 8, "response_index": 3, "max_abs_diff": 0.5}


def test_identical_paths_have_no_first_divergence(tmp_path: Path) -> None:
    assert _pair(tmp_path, {}) is None


def test_a_tolerance_starts_at_the_first_position_over_it(tmp_path: Path) -> None:
    fd = _pair(tmp_path, PLANTS, tolerance=1.0)
    assert fd["boundary"] == "mid" and fd["position"] == 7 and fd["sequence"] is None  # not tracked per sequence
    assert fd["worst"]["position"] == 7
    assert _pair(tmp_path, PLANTS, tolerance=10.0) is None  # negative control: nothing exceeds it


def test_the_result_validates_only_with_consistent_positions(sample_json_v2: dict) -> None:
    """The schema's cross-field rule: a response_index that does not match the sequence's prompt, or a first
    position after its worst one, is rejected."""
    assert validate_result(sample_json_v2) == []
    fd = sample_json_v2["first_divergence"]
    bad = {**fd, "response_index": 0}  # position 0 lies in the prompt
    assert any("first_divergence.response_index" in e for e in validate_result({**sample_json_v2, "first_divergence": bad}))
    late = {**fd, "position": fd["worst"]["position"] + 1, "response_index": fd["worst"]["position"] + 1 - 16}
    assert any("comes after its worst" in e for e in validate_result({**sample_json_v2, "first_divergence": late}))
    pair = {**sample_json_v2["pairs"][0], "worst": {**sample_json_v2["pairs"][0]["worst"], "position": 3}}
    errors = validate_result({**sample_json_v2, "pairs": [pair, *sample_json_v2["pairs"][1:]]})
    assert any("pairs[0].worst.position" in e and "prompt" in e for e in errors), errors


@pytest.fixture
def sample_json_v2() -> dict:
    import json

    return json.loads((Path(__file__).parent / "reports" / "data" / "sample_result.json").read_text())
