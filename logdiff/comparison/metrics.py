"""Per-token logprob metrics between a training path and an inference path.

Every metric is over the *scored* tokens: the response tokens whose
``response_mask`` is 1 (all of them without a mask). Masked tokens were still
replayed through every path, since they condition later tokens, but are not scored.

The metrics that carry a verl name are computed the way verl computes them, on a
padded ``(sequences, positions)`` batch: token-level means are verl's
``masked_mean`` (``sum / (count + 1e-8)``), per-sequence means first where verl
takes them, ``torch.std`` where verl calls it (the N-1 estimator, NaN, written null, at
N = 1; ``rollout_is_std`` is verl's population ``sqrt(E[w^2] - E[w]^2)``), log ratios
are clamped at +-20 where verl clamps them. Two differences are deliberate: logdiff
computes in float64 over the whole batch, where verl computes in float32 and, for the
metrics its actor logs, per micro-batch and then averages. Sources (volcengine/verl):
``verl/utils/debug/metrics.py`` (``training/rollout_probs_diff_*``, the Pearson r),
``verl/trainer/ppo/rollout_corr_helper.py`` (``rollout_corr/*``: ``compute_offpolicy_metrics``,
``compute_is_metrics``, ``compute_rollout_rejection_mask``), ``verl/trainer/ppo/core_algos.py``
(``compute_policy_loss_vanilla``: ``ppo_kl``, ``pg_clipfrac``). Definitions: docs/result-schema.md#metrics.
Samples come from the inference engine, so ``r = exp(lp_train - lp_infer)``.

``compare_pair`` is the comparison of one (train, infer) pair of paths, the ``Pair`` of the result: a scan
(``pipeline``) and a comparison of bundles (``offline``) both call it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from logdiff.reports.format import METRIC_ALIASES

#: verl's ``rollout_is_threshold`` default T: verl truncates IS weights to at most T (from above only);
#: its std and ESS clamp them to [1/T, T], its shares count r > T and r < 1/T
IS_THRESHOLD = 2.0
#: the symmetric ratio bands of ``ratio_outside_band_{eps}``
BAND_EPSILONS = (0.2, 0.28)
#: PPO's clip ratio (both sides), DAPO's clip-higher upper side, dual-clip PPO's ``clip_ratio_c``
PPO_EPS, DAPO_EPS_HIGH, DUAL_CLIP_C = 0.2, 0.28, 3.0
#: verl's ``SAFETY_BOUND``: log ratios are clamped to [-20, 20] before exp
SAFETY_BOUND = 20.0
#: deprecated key -> the key it repeats (kept in result.json for readers of the old names)
ALIASES = METRIC_ALIASES
#: verl's ``rollout_rs`` options, all reported: k1 bounds the ratio to [1/T, T], k2 and k3 a divergence from above
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
#: the k2/k3 options' upper bound: verl's ``rollout_rs_threshold`` for ``seq_mean_k3`` in its
#: ``decoupled_k3_rs`` / ``bypass_ppo_clip_k3_rs`` presets (verl/trainer/config/algorithm.py)
RS_DIVERGENCE_BOUND = 0.01
#: the chain of the combined ``rollout_rs_masked_fraction``: the three ratio bounds at T
RS_CHAIN = ("token_k1", "seq_sum_k1", "seq_mean_k1")


def padded(arrays: list[np.ndarray], masks: list[Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Ragged per-sequence arrays as a right-padded float64 batch and its scored-token mask.

    Unscored entries (padding, masked tokens) are 0, so no NaN or inf there reaches a formula.
    """
    width = max((len(a) for a in arrays), default=0)
    values, mask = np.zeros((len(arrays), width)), np.zeros((len(arrays), width), bool)
    for s, a in enumerate(arrays):
        mask[s, : len(a)] = True if masks is None or masks[s] is None else np.asarray(masks[s], bool)
        values[s, : len(a)] = np.where(mask[s, : len(a)], np.asarray(a, np.float64), 0.0)
    return values, mask


def masked_sum(v: np.ndarray, m: np.ndarray, axis: int | None = None) -> np.ndarray:
    """verl's ``masked_sum`` (verl/utils/torch_functional.py)."""
    return np.where(m, v, 0.0).sum(axis=axis)


def masked_mean(v: np.ndarray, m: np.ndarray, axis: int | None = None) -> np.ndarray:
    """verl's ``masked_mean``: the masked sum over ``count + 1e-8``."""
    return masked_sum(v, m, axis) / (m.sum(axis=axis) + 1e-8)


def _std1(x: np.ndarray) -> float:
    """``torch.std``: the N-1 estimator, NaN for a single value."""
    return float(x.std(ddof=1)) if x.size > 1 else math.nan


@np.errstate(over="ignore", invalid="ignore")  # an overflowing ratio is inf, as in verl; NaN stays NaN
def token_metrics(
    train: list[np.ndarray],
    infer: list[np.ndarray],
    train_top1: list[np.ndarray] | None = None,
    infer_top1: list[np.ndarray] | None = None,
    masks: list[Any] | None = None,
    is_threshold: float = IS_THRESHOLD,
    rs_bound: float = RS_DIVERGENCE_BOUND,
) -> dict[str, Any]:
    """All scalar metrics over the scored response tokens (``masks``: one 0/1 list per sequence, or None).

    ``is_threshold`` is T of the rollout_is_* and k1 rollout_rs_* metrics, ``rs_bound`` the upper
    bound of the k2/k3 rollout_rs_* ones.
    """
    lp_t, m = padded(train, masks)
    lp_i, _ = padded(infer, masks)
    if not m.any():
        raise ValueError("no scored token: every response token is masked")
    t, i = lp_t[m], lp_i[m]  # row-major, as torch.masked_select
    diff = np.abs(t - i)
    p_t, p_i = np.exp(t), np.exp(i)
    prob_diff = np.abs(p_t - p_i)
    ratio = np.exp(t - i)
    pearson = float(np.corrcoef(p_t, p_i)[0, 1]) if p_t.std() > 0 and p_i.std() > 0 else None
    flips = None
    if train_top1 is not None and infer_top1 is not None:
        flips = float(np.mean(padded(train_top1, masks)[0][m] != padded(infer_top1, masks)[0][m]))
    out: dict[str, Any] = {
        "num_tokens": int(m.sum()),
        "nonfinite_tokens": int((~(np.isfinite(t) & np.isfinite(i))).sum()),
        "abs_diff_max": float(diff.max()),
        "abs_diff_mean": float(diff.mean()),
        "abs_diff_p99": float(np.percentile(diff, 99)),
        "bitwise_equal_fraction": float(np.mean(t == i)),
        "rollout_probs_diff_max": float(prob_diff.max()),
        "rollout_probs_diff_mean": float(prob_diff.mean()),
        "rollout_probs_diff_std": _std1(prob_diff),
        "rollout_actor_probs_pearson_corr": pearson,
        "ratio_mean": float(ratio.mean()),
        "ratio_std": float(ratio.std()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "argmax_flip_fraction": flips,
    }
    for eps in BAND_EPSILONS:
        out[f"ratio_outside_band_{eps}"] = float(np.mean(np.abs(ratio - 1.0) > eps))
    out.update(offpolicy_metrics(lp_t, lp_i, m))
    for level in ("token", "sequence"):
        out.update(is_metrics(lp_t - lp_i, m, is_threshold, level))
    out.update(rs_masked_fractions(lp_t - lp_i, m, is_threshold, rs_bound))
    out.update(policy_loss_metrics(lp_t - lp_i, m))
    out.update({old: out[new] for old, new in ALIASES.items()})
    return out


def offpolicy_metrics(lp_t: np.ndarray, lp_i: np.ndarray, m: np.ndarray) -> dict[str, float]:
    """verl's ``compute_offpolicy_metrics``: KL, perplexities and chi-squared (``rollout_corr/*``)."""
    seq_t, seq_i = masked_mean(lp_t, m, -1), masked_mean(lp_i, m, -1)
    log_ratio = lp_t - lp_i
    log_ppl_diff = seq_i - seq_t
    seq_sum = np.clip(masked_sum(log_ratio, m, -1), -SAFETY_BOUND, SAFETY_BOUND)
    rho = np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    return {
        "training_ppl": float(np.exp(-seq_t).mean()),
        "training_log_ppl": float((-seq_t).mean()),
        "kl": float(masked_mean(lp_i - lp_t, m)),
        "k3_kl": float(masked_mean(np.exp(log_ratio) - log_ratio - 1, m)),
        "rollout_ppl": float(np.exp(-seq_i).mean()),
        "rollout_log_ppl": float((-seq_i).mean()),
        "log_ppl_diff": float(log_ppl_diff.mean()),
        "log_ppl_abs_diff": float(np.abs(log_ppl_diff).mean()),
        "log_ppl_diff_max": float(log_ppl_diff.max()),
        "log_ppl_diff_min": float(log_ppl_diff.min()),
        "ppl_ratio": float(np.exp(log_ppl_diff).mean()),
        "chi2_token": float(masked_mean(rho**2, m) - 1.0),
        "chi2_seq": float(np.exp(2.0 * seq_sum).mean() - 1.0),
    }


def is_metrics(log_ratio: np.ndarray, m: np.ndarray, threshold: float, level: str = "token") -> dict[str, float]:
    """verl's ``compute_is_metrics`` (on the weights before truncation) at ``rollout_is=token`` or ``sequence``.

    Token level gives verl's ``rollout_is_*`` names; sequence level (one weight per sequence, the
    exp of its summed log ratio) the same statistics as ``rollout_is_sequence_*``.
    """
    low = 1.0 / threshold
    if level == "token":
        w = np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)) * m
        out = {"mean": masked_mean(w, m), "ratio_fraction_high": masked_mean(w > threshold, m),
               "ratio_fraction_low": masked_mean(w < low, m), "max": w[m].max(), "min": w[m].min()}
    else:
        seq = masked_sum(log_ratio, m, -1)
        w = np.exp(np.clip(seq, -SAFETY_BOUND, SAFETY_BOUND))[:, None] * m
        out = {"max": math.exp(min(seq.max(), SAFETY_BOUND)), "min": math.exp(seq.min()), "mean": masked_mean(w, m),
               "ratio_fraction_high": np.mean(seq > math.log(threshold)),
               "ratio_fraction_low": np.mean(seq < math.log(low))}
    clamped = np.clip(w, low, threshold)
    if m.sum() > 1:
        var = masked_mean(clamped**2, m) - masked_mean(clamped, m) ** 2
        out["std"] = math.sqrt(max(float(var), 0.0))
    else:
        out["std"] = 0.0
    normalized = clamped / (masked_mean(clamped, m) + 1e-8)
    out["eff_sample_size"] = 1.0 / masked_mean(normalized**2, m)
    per_seq = masked_mean(w, m, -1)
    out.update({"seq_mean": per_seq.mean(), "seq_std": per_seq.std(ddof=1) if per_seq.size > 1 else 0.0,
                    "seq_max": per_seq.max(), "seq_min": per_seq.min(),
                    "seq_max_deviation": np.abs(per_seq - 1.0).max(),
                    "seq_fraction_high": np.mean(per_seq > threshold), "seq_fraction_low": np.mean(per_seq < low)})
    prefix = "rollout_is_" if level == "token" else "rollout_is_sequence_"
    return {prefix + k: float(v) for k, v in out.items()}


def rejection_keeps(log_ratio: np.ndarray, m: np.ndarray, threshold: float,
                    bound: float = RS_DIVERGENCE_BOUND) -> dict[str, np.ndarray]:
    """Which tokens each of verl's ``compute_rollout_rejection_mask`` options keeps: option -> bool array like ``m``.

    Per token, k1 is ``-log r``, k2 ``(log r)^2 / 2``, k3 ``r - 1 - log r`` (``log r`` clamped to +-20);
    ``token_*`` judges each token, ``seq_sum_*`` / ``seq_mean_*`` / ``seq_max_*`` each sequence by the
    sum / mean / max over its scored tokens (a sequence with none: 0). A k1 statistic is kept inside
    [log(1/T), log T], a k2 or k3 one at or below ``bound``. What an unscored entry's flag says does
    not matter: every share counts scored tokens only.
    """
    lr = np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -lr, "k2": 0.5 * lr**2, "k3": np.exp(lr) - 1.0 - lr}
    lo, hi = math.log(1.0 / threshold), math.log(threshold)

    def seq_max(v: np.ndarray) -> np.ndarray:
        top = np.where(m, v, -np.inf).max(-1)
        return np.where(top == -np.inf, 0.0, top)

    level = {"token": lambda v: v, "seq_sum": lambda v: masked_sum(v, m, -1)[:, None],
             "seq_mean": lambda v: masked_mean(v, m, -1)[:, None], "seq_max": lambda v: seq_max(v)[:, None]}
    keeps = {}
    for option in RS_OPTIONS:
        where, kind = option.rsplit("_", 1)
        stat = level[where](per_token[kind])
        keep = (stat >= lo) & (stat <= hi) if kind == "k1" else stat <= bound
        keeps[option] = np.broadcast_to(keep, m.shape)
    return keeps


def rs_masked_fractions(log_ratio: np.ndarray, m: np.ndarray, threshold: float,
                        bound: float = RS_DIVERGENCE_BOUND, chain: tuple[str, ...] = RS_CHAIN) -> dict[str, float]:
    """verl's rejection-sampling shares: per option, and for the ``chain`` of options every token must pass.

    ``rollout_rs_{option}_masked_fraction`` is the share of scored tokens the option rejects,
    ``_seq_masked_fraction`` the share of sequences with a scored token (the others do not count)
    that have one rejected. The combined ``rollout_rs_masked_fraction`` / ``rollout_rs_seq_masked_fraction``
    are the same for verl's ``rollout_rs=",".join(chain)``, except that verl divides the sequence share
    by every sequence, a sequence with no scored token included.
    """
    keeps = rejection_keeps(log_ratio, m, threshold, bound)
    seq_valid = m.any(-1)
    out = {}
    for option, keep in keeps.items():
        out[f"rollout_rs_{option}_masked_fraction"] = float(masked_mean(~keep, m))
        out[f"rollout_rs_{option}_seq_masked_fraction"] = float((~keep & m).any(-1).sum() / seq_valid.sum())
    kept = np.logical_and.reduce([keeps[option] for option in chain])
    out["rollout_rs_masked_fraction"] = float(masked_mean(~kept, m))
    out["rollout_rs_seq_masked_fraction"] = float((~kept & m).any(-1).mean())
    return out


def policy_loss_metrics(log_ratio: np.ndarray, m: np.ndarray) -> dict[str, float]:
    """verl's PPO policy-loss metrics in bypass mode (the rollout logprobs are the old ones), first step.

    ``ppo_kl`` (``actor/ppo_kl``) is the mean of ``-log r``, clamped to +-20. ``actor/pg_clipfrac`` (and
    ``pg_clipfrac_lower``) as if every advantage had one sign: with A > 0 PPO clips r > 1 + eps_high;
    with A < 0 it clips r < 1 - eps_low, and dual-clip bounds r > clip_ratio_c. Advantage magnitudes
    do not matter, only their sign.
    """
    lr = np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    r = np.exp(lr)
    return {
        "ppo_kl": float(masked_mean(-lr, m)),
        "pg_clipfrac_adv_pos": float(masked_mean(r > 1 + PPO_EPS, m)),
        "pg_clipfrac_adv_pos_dapo": float(masked_mean(r > 1 + DAPO_EPS_HIGH, m)),
        "pg_clipfrac_adv_neg": float(masked_mean(r < 1 - PPO_EPS, m)),
        "pg_clipfrac_lower_adv_neg": float(masked_mean(r > DUAL_CLIP_C, m)),
    }


def per_position(train: list[np.ndarray], infer: list[np.ndarray], masks: list[Any] | None = None) -> dict[str, list]:
    """Mean and max ``|Δ logprob|`` at each response position over the sequences that score it (0 where none does)."""
    lp_t, m = padded(train, masks)
    lp_i, _ = padded(infer, masks)
    d = np.where(m, np.abs(lp_t - lp_i), 0.0)
    return {"abs_diff_mean": (d.sum(0) / np.maximum(m.sum(0), 1)).tolist(), "abs_diff_max": d.max(0).tolist()}


def histogram(train: list[np.ndarray], infer: list[np.ndarray], masks: list[Any] | None = None) -> dict[str, list]:
    """Counts of scored ``|Δ logprob|`` in decades from 1e-9 to 10; bin 0 also holds the exactly-equal tokens."""
    lp_t, m = padded(train, masks)
    lp_i, _ = padded(infer, masks)
    diff = np.abs(lp_t[m] - lp_i[m])
    edges = [0.0] + [10.0**e for e in range(-9, 2)]
    counts, _ = np.histogram(np.clip(diff, 0.0, edges[-1]), bins=edges)
    return {"edges": edges, "counts": counts.tolist()}


def worst(train: list[np.ndarray], infer: list[np.ndarray], masks: list[Any] | None = None) -> dict[str, Any]:
    """The scored token with the largest ``|Δ logprob|`` (the first NaN/inf one if any): its sequence and
    ``response_index`` (0: the first response token; ``at`` adds the absolute position)."""
    lp_t, m = padded(train, masks)
    lp_i, _ = padded(infer, masks)
    with np.errstate(invalid="ignore"):
        d = np.abs(lp_t - lp_i)
    d = np.where(m, np.where(np.isfinite(d), d, np.inf), -1.0)
    s, p = np.unravel_index(int(np.argmax(d)), d.shape)
    return {"sequence": int(s), "response_index": int(p),
            "train_logprob": float(train[s][p]), "infer_logprob": float(infer[s][p])}


def at(token: dict[str, Any], seqs: list[Any]) -> dict[str, Any]:
    """A ``worst`` token in the result's one position convention: sequence, absolute ``position`` (prompt +
    response) and ``response_index``, then the rest of its fields."""
    head = {"sequence": token["sequence"],
            "position": len(seqs[token["sequence"]].prompt_ids) + token["response_index"],
            "response_index": token["response_index"]}
    return {**head, **{k: v for k, v in token.items() if k not in head}}


def compare_pair(train: Any, infer: Any, seqs: list[Any], tok: Any, is_threshold: float) -> Any:
    """The logprob comparison of one (train, infer) pair of paths (``PathScores``) over the scored response
    tokens of ``seqs``, as the result's ``Pair``; ``tok`` (a tokenizer, or None) spells the worst token."""
    from logdiff.comparison.result import Pair

    masks = [s.response_mask for s in seqs]  # masked tokens were replayed; they are not scored
    w = at(worst(train.logprobs, infer.logprobs, masks), seqs)
    w["token_id"] = int(seqs[w["sequence"]].response_ids[w["response_index"]])
    w["token_text"] = tok.decode([w["token_id"]]) if tok is not None else None
    return Pair(
        train=train.path,
        infer=infer.path,
        metrics=token_metrics(train.logprobs, infer.logprobs, train.top1, infer.top1, masks, is_threshold),
        per_position=per_position(train.logprobs, infer.logprobs, masks),
        histogram=histogram(train.logprobs, infer.logprobs, masks),
        worst=w,
        tokens=(train.logprobs, infer.logprobs, masks),
    )
