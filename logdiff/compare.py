"""Per-token logprob metrics between a training path and an inference path.

The names follow what RL dashboards already show (verl's ``rollout_probs_diff_*``,
the k1/k3 KL estimators, PPO's importance ratio and clip fraction); every
definition is in docs/result-schema.md. Samples come from the inference engine,
so the importance ratio is ``r = exp(lp_train - lp_infer)`` and the KL
estimators estimate KL(infer || train).
"""

from __future__ import annotations

from typing import Any

import numpy as np

CLIP_EPSILONS = (0.2, 0.28)


def _flat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float64) for a in arrays]) if arrays else np.zeros(0)


def token_metrics(
    train: list[np.ndarray],
    infer: list[np.ndarray],
    train_top1: list[np.ndarray] | None = None,
    infer_top1: list[np.ndarray] | None = None,
) -> dict[str, Any]:
    """All scalar metrics over every response token of every sequence."""
    bitwise = float(np.mean(np.concatenate([np.asarray(a) == np.asarray(b) for a, b in zip(train, infer)])))
    lp_t, lp_i = _flat(train), _flat(infer)
    diff = np.abs(lp_t - lp_i)
    p_t, p_i = np.exp(lp_t), np.exp(lp_i)
    prob_diff = np.abs(p_i - p_t)
    log_ratio = lp_t - lp_i
    ratio = np.exp(log_ratio)
    pearson = None
    if p_t.std() > 0 and p_i.std() > 0:
        pearson = float(np.corrcoef(p_t, p_i)[0, 1])
    flips = None
    if train_top1 is not None and infer_top1 is not None:
        flips = float(np.mean(_flat(train_top1) != _flat(infer_top1)))
    out = {
        "num_tokens": int(diff.size),
        "nonfinite_tokens": int((~(np.isfinite(lp_t) & np.isfinite(lp_i))).sum()),
        "abs_diff_max": float(diff.max()),
        "abs_diff_mean": float(diff.mean()),
        "abs_diff_p99": float(np.percentile(diff, 99)),
        "bitwise_equal_fraction": bitwise,
        "rollout_probs_diff_max": float(prob_diff.max()),
        "rollout_probs_diff_mean": float(prob_diff.mean()),
        "rollout_probs_diff_std": float(prob_diff.std()),
        "probs_pearson": pearson,
        "kl_k1": float(np.mean(-log_ratio)),
        "kl_k3": float(np.mean(ratio - 1.0 - log_ratio)),
        "ratio_mean": float(ratio.mean()),
        "ratio_std": float(ratio.std()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "argmax_flip_fraction": flips,
    }
    for eps in CLIP_EPSILONS:
        out[f"clip_fraction_{eps}"] = float(np.mean(np.abs(ratio - 1.0) > eps))
    return out


def per_position(train: list[np.ndarray], infer: list[np.ndarray]) -> dict[str, list[float]]:
    """Mean and max ``|Δ logprob|`` at each response position, over sequences."""
    width = max(len(a) for a in train)
    sums, maxs, counts = np.zeros(width), np.zeros(width), np.zeros(width)
    for a, b in zip(train, infer):
        d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        sums[: len(d)] += d
        counts[: len(d)] += 1
        maxs[: len(d)] = np.maximum(maxs[: len(d)], d)
    return {"abs_diff_mean": (sums / np.maximum(counts, 1)).tolist(), "abs_diff_max": maxs.tolist()}


def histogram(train: list[np.ndarray], infer: list[np.ndarray]) -> dict[str, list[float]]:
    """Counts of ``|Δ logprob|`` in decades from 1e-9 to 10; bin 0 also holds the exactly-equal tokens."""
    diff = np.abs(_flat(train) - _flat(infer))
    edges = [0.0] + [10.0**e for e in range(-9, 2)]
    counts, _ = np.histogram(np.clip(diff, 0.0, edges[-1]), bins=edges)
    return {"edges": edges, "counts": counts.tolist()}


def worst(train: list[np.ndarray], infer: list[np.ndarray]) -> dict[str, Any]:
    """The sequence and response position with the largest ``|Δ logprob|`` (the first NaN/inf one if any)."""
    best = (-1.0, 0, 0)
    for s, (a, b) in enumerate(zip(train, infer)):
        d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        d = np.where(np.isfinite(d), d, np.inf)
        if d.size and d.max() > best[0]:
            best = (float(d.max()), s, int(d.argmax()))
    _, s, p = best
    return {"sequence": s, "position": p, "train_logprob": float(train[s][p]), "infer_logprob": float(infer[s][p])}
