"""The HF engine's ``full_logprobs`` reuses the rows its last ``score`` of the same sequences computed.

The sampling-semantics fit needs the training model's whole distribution at the response positions;
the scan's training pass has just computed it, so no second forward runs (issue 24). Any other request
(other sequences, a rewritten prompt, a tempered score) still runs its own unpadded forward.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from logdiff.records.sequences import Sequence
from logdiff.sources.base import EngineSpec
from logdiff.sources.pool import acquire


def _seqs(shift: int = 0) -> list[Sequence]:
    rng = np.random.default_rng(3 + shift)
    return [Sequence(prompt_ids=rng.integers(5, 4000, p).tolist(), response_ids=rng.integers(5, 4000, r).tolist())
            for p, r in ((7, 5), (4, 9))]


def test_full_logprobs_after_score_are_the_scored_rows(qwen3: Path) -> None:
    engine = acquire("hf", EngineSpec(model_dir=str(qwen3)))
    seqs = _seqs()
    (scores,) = engine.score(seqs)
    kept = engine.full_logprobs(seqs, 256)
    for s, rows, scored in zip(seqs, kept, scores.logprobs):
        assert np.array_equal(rows[np.arange(len(s.response_ids)), s.response_ids], scored)  # the very rows
    computed = engine.full_logprobs(_seqs(shift=1), 256)  # other sequences: a forward of their own
    assert [len(r) for r in computed] == [5, 9]
    toggled = engine.full_logprobs(seqs, 256, prompt=lambda p: p[1:])  # a rewritten prompt: never the kept rows
    assert not np.array_equal(toggled[0], kept[0])
    for rows in (*computed, *toggled):
        assert np.abs(np.log(np.exp(rows.astype(np.float64)).sum(-1))).max() < 1e-3


def test_a_tempered_score_keeps_nothing(qwen3: Path) -> None:
    engine = acquire("hf", EngineSpec(model_dir=str(qwen3), options=(("temperature", 2.0),)))
    seqs = _seqs()
    engine.score(seqs)
    assert engine._scored is None  # the fit needs the untempered distribution: computed afresh
