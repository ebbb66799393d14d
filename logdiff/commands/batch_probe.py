"""Is the inference engine batch-invariant? The same sequences at several batch compositions.

An engine whose kernels tile by batch shape gives a sequence different bits
when it is decoded alone, in a batch of 4, or next to sequences of other
lengths. RL rollouts run at whatever batch the scheduler forms, so that
alone makes rollout logprobs irreproducible. The probe scores the scan's
sequences (same ids, responses forced) in chunks of each requested size and
compares every composition with the first one, path by path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from logdiff.comparison import metrics as compare
from logdiff.sources.base import Engine, TokenSequence


def score_in_chunks(engine: Engine, seqs: list[TokenSequence], size: int) -> dict[str, list[np.ndarray]]:
    """Per path, the logprobs of every sequence when the engine sees ``size`` sequences per call."""
    out: dict[str, list[np.ndarray]] = {}
    for start in range(0, len(seqs), size):
        for scores in engine.score(seqs[start : start + size]):
            out.setdefault(scores.path, []).extend(scores.logprobs)
    return out


def probe(engine: Engine, seqs: list[TokenSequence], sizes: tuple[int, ...]) -> dict[str, Any]:
    """The ``batch_invariance`` block of result.json."""
    runs = {size: score_in_chunks(engine, seqs, size) for size in sizes}
    reference = sizes[0]
    comparisons = []
    for size in sizes[1:]:
        for path, logprobs in runs[size].items():
            ref = runs[reference][path]
            m = compare.token_metrics(ref, logprobs)
            w = compare.at(compare.worst(ref, logprobs), seqs)
            comparisons.append({
                "path": path,
                "batch_size": size,
                "abs_diff_max": m["abs_diff_max"],
                "abs_diff_mean": m["abs_diff_mean"],
                "bitwise_equal_fraction": m["bitwise_equal_fraction"],
                "worst": {k: w[k] for k in ("sequence", "position", "response_index")},
            })  # fmt: skip
    return {
        "engine": engine.name,
        "reference_batch_size": reference,
        "batch_sizes": list(sizes),
        "sequence_lengths": [len(s.prompt_ids) + len(s.response_ids) for s in seqs],
        "comparisons": comparisons,
        "invariant": all(c["bitwise_equal_fraction"] == 1.0 for c in comparisons),
    }

