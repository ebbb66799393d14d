"""Does today's inference engine reproduce the rollout that was recorded?

With recorded rollout logprobs (the ``rollout`` path, from ``--sequences``),
every inference path that replayed the same ids here is compared against the
recording over the scored tokens (``response_mask`` honoured), with the same
metric code as every pair (``compare.token_metrics``). ``reproduced`` means
bitwise: every scored token's logprob equal to the recorded one. Anything
less is reported as measured (bitwise share, max and mean |Δ|), never judged
against a CPU-specific tolerance; docs/rollout-dumps.md says how to read it.
The first replaying path (vLLM decode when present) gives the headline.
"""

from __future__ import annotations

from typing import Any

from logdiff.comparison import metrics as compare
from logdiff.sources.base import PathScores

RECORDED_MODE = "recorded"


def rollout_replay(paths: list[PathScores], masks: list[Any], layout: str | None) -> dict[str, Any] | None:
    """``result["rollout_replay"]``: each fresh inference path against the recorded logprobs (None without any)."""
    recorded = next((p for p in paths if p.mode == RECORDED_MODE), None)
    fresh = [p for p in paths if p.mode != RECORDED_MODE]
    if recorded is None or not fresh:
        return None
    engines = []
    for p in fresh:
        m = compare.token_metrics(recorded.logprobs, p.logprobs, masks=masks)
        engines.append({
            "path": p.path,
            "mode": p.mode,
            "num_tokens": m["num_tokens"],
            "bitwise_equal_fraction": m["bitwise_equal_fraction"],
            "abs_diff_max": m["abs_diff_max"],
            "abs_diff_mean": m["abs_diff_mean"],
            "reproduced": m["bitwise_equal_fraction"] == 1.0,
        })  # fmt: skip
    head = engines[0]
    return {"recorded": recorded.path, "format": layout, "engines": engines, "reproduced": head["reproduced"],
            "summary": summary(head)}  # fmt: skip


def summary(entry: dict[str, Any]) -> str:
    """One line: whether ``entry['path']`` reproduces the recording, and by how much it misses."""
    n = entry["num_tokens"]
    if entry["reproduced"]:
        return f"{entry['path']} reproduces the recorded rollout logprobs bitwise ({n} scored tokens)"
    return (
        f"{entry['path']} does not reproduce the recorded rollout logprobs: "
        f"{entry['bitwise_equal_fraction']:.1%} of {n} scored tokens bitwise equal, "
        f"max |Δ| {entry['abs_diff_max']:.3g}, mean {entry['abs_diff_mean']:.3g}"
    )
