"""Every verl-named metric equals verl's own formula, on padded, masked batches.

The functions below are faithful torch copies of verl's code (volcengine/verl at commit
b178a3cd56f58b2d502255daba591e92833930a7), cited per function; logdiff's numpy
implementation (logdiff/compare.py) must give the same numbers to float64 rounding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from logdiff import compare

SAFETY_BOUND = 20.0  # verl/trainer/ppo/rollout_corr_helper.py: SAFETY_BOUND


# verl/utils/torch_functional.py: masked_sum, masked_mean
def masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
    s = masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


# verl/utils/debug/metrics.py: calculate_debug_metrics (rollout = rollout_log_probs, actor = old_log_probs)
def debug_metrics(actor_old_log_probs, rollout_old_log_probs, response_mask):
    actor_probs = torch.exp(actor_old_log_probs)
    rollout_probs = torch.exp(rollout_old_log_probs)
    mask = response_mask.bool()
    mt1, mt2 = torch.masked_select(actor_probs, mask), torch.masked_select(rollout_probs, mask)
    pearson = torch.corrcoef(torch.stack([mt1, mt2], dim=0))[0][1].item()  # pearson_correlation_coefficient
    diff = torch.masked_select(torch.abs(actor_probs - rollout_probs), mask)  # calculate_log_prob_diff
    return {
        "rollout_probs_diff_max": torch.max(diff).item(),
        "rollout_probs_diff_mean": torch.mean(diff).item(),
        "rollout_probs_diff_std": torch.std(diff).item(),
        "rollout_actor_probs_pearson_corr": pearson,
    }


# verl/trainer/ppo/rollout_corr_helper.py: compute_offpolicy_metrics
def offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask):
    metrics = {}
    mean_log_prob_training = masked_mean(old_log_prob, response_mask, axis=-1)
    metrics["training_ppl"] = torch.exp(-mean_log_prob_training).mean().item()
    metrics["training_log_ppl"] = (-mean_log_prob_training).mean().item()
    metrics["kl"] = masked_mean(rollout_log_prob - old_log_prob, response_mask).item()
    log_ratio = old_log_prob - rollout_log_prob
    metrics["k3_kl"] = masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item()
    mean_log_prob_rollout = masked_mean(rollout_log_prob, response_mask, axis=-1)
    metrics["rollout_ppl"] = torch.exp(-mean_log_prob_rollout).mean().item()
    metrics["rollout_log_ppl"] = (-mean_log_prob_rollout).mean().item()
    log_ppl_diff = mean_log_prob_rollout - mean_log_prob_training
    metrics["log_ppl_diff"] = log_ppl_diff.mean().item()
    metrics["log_ppl_abs_diff"] = log_ppl_diff.abs().mean().item()
    metrics["log_ppl_diff_max"] = log_ppl_diff.max().item()
    metrics["log_ppl_diff_min"] = log_ppl_diff.min().item()
    metrics["ppl_ratio"] = torch.exp(log_ppl_diff).mean().item()
    rho_token = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    metrics["chi2_token"] = (masked_mean(rho_token.square(), response_mask) - 1.0).item()
    log_ratio_sum = masked_sum(log_ratio, response_mask, axis=-1)
    log_ratio_sum_safe = torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    metrics["chi2_seq"] = (torch.exp(2.0 * log_ratio_sum_safe).mean() - 1.0).item()
    return metrics


# verl/trainer/ppo/rollout_corr_helper.py: compute_rollout_correction_weights (the weights) + compute_is_metrics
def is_metrics(log_ratio, response_mask, rollout_is, rollout_is_threshold):
    if rollout_is == "token":
        log_ratio_for_metrics = log_ratio
        rollout_is_weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        log_ratio_sum = masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        log_ratio_for_metrics = log_ratio_sum
        log_ratio_sum_safe = torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)
        rollout_is_weights = torch.exp(log_ratio_sum_safe).expand_as(log_ratio)
    rollout_is_weights = rollout_is_weights * response_mask
    metrics = {}
    rollout_is_threshold_lower = 1.0 / rollout_is_threshold
    log_threshold_upper = torch.log(torch.tensor(rollout_is_threshold))
    log_threshold_lower = torch.log(torch.tensor(rollout_is_threshold_lower))
    if rollout_is == "sequence":
        metrics["rollout_is_max"] = torch.exp(torch.clamp(log_ratio_for_metrics.max(), max=SAFETY_BOUND)).item()
        metrics["rollout_is_min"] = torch.exp(log_ratio_for_metrics.min()).item()
        metrics["rollout_is_mean"] = masked_mean(rollout_is_weights, response_mask).item()
        metrics["rollout_is_ratio_fraction_high"] = (log_ratio_for_metrics > log_threshold_upper).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (log_ratio_for_metrics < log_threshold_lower).float().mean().item()
    else:
        metrics["rollout_is_mean"] = masked_mean(rollout_is_weights, response_mask).item()
        above = rollout_is_weights > rollout_is_threshold
        below = rollout_is_weights < rollout_is_threshold_lower
        metrics["rollout_is_ratio_fraction_high"] = masked_mean(above.float(), response_mask).item()
        metrics["rollout_is_ratio_fraction_low"] = masked_mean(below.float(), response_mask).item()
        mask_bool = response_mask.bool()
        metrics["rollout_is_max"] = rollout_is_weights.masked_fill(~mask_bool, float("-inf")).max().item()
        metrics["rollout_is_min"] = rollout_is_weights.masked_fill(~mask_bool, float("inf")).min().item()
    if response_mask.sum() > 1:
        weights_for_std = rollout_is_weights.clamp(min=rollout_is_threshold_lower, max=rollout_is_threshold)
        mean_clamped = masked_mean(weights_for_std, response_mask)
        var = masked_mean(weights_for_std.square(), response_mask) - mean_clamped.square()
        metrics["rollout_is_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        metrics["rollout_is_std"] = 0.0
    weights_for_ess = rollout_is_weights.clamp(min=rollout_is_threshold_lower, max=rollout_is_threshold)
    mean_for_ess = masked_mean(weights_for_ess, response_mask)
    is_weights_normalized = weights_for_ess / (mean_for_ess + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean(is_weights_normalized.square(), response_mask).item()
    if rollout_is_weights.dim() > 1:
        seq_mean_weights = masked_mean(rollout_is_weights, response_mask, axis=-1)
        metrics["rollout_is_seq_mean"] = seq_mean_weights.mean().item()
        metrics["rollout_is_seq_std"] = seq_mean_weights.std().item() if seq_mean_weights.numel() > 1 else 0.0
        metrics["rollout_is_seq_max"] = seq_mean_weights.max().item()
        metrics["rollout_is_seq_min"] = seq_mean_weights.min().item()
        metrics["rollout_is_seq_max_deviation"] = (seq_mean_weights - 1.0).abs().max().item()
        metrics["rollout_is_seq_fraction_high"] = (seq_mean_weights > rollout_is_threshold).float().mean().item()
        metrics["rollout_is_seq_fraction_low"] = (seq_mean_weights < rollout_is_threshold_lower).float().mean().item()
    return metrics


# verl/trainer/ppo/rollout_corr_helper.py: compute_rollout_rejection_mask, one k1 option, threshold "T" (bounds 1/T, T)
def rs_masked_fractions(log_ratio, response_mask, option, threshold):
    lower_log, upper_log = math.log(float(str(1.0 / threshold))), math.log(threshold)
    token_k1 = -torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    response_mask_bool = response_mask.bool()
    seq_valid_mask = response_mask.sum(dim=-1) > 0
    if option == "token_k1":
        token_keep_bool = (token_k1 >= lower_log) & (token_k1 <= upper_log)
    else:
        agg = masked_sum if option == "seq_sum_k1" else masked_mean
        seq_stat = agg(token_k1, response_mask, axis=-1)
        seq_keep = (seq_stat >= lower_log) & (seq_stat <= upper_log)
        token_keep_bool = seq_keep.unsqueeze(-1).expand_as(response_mask_bool)
    token_keep_mask = token_keep_bool.to(dtype=log_ratio.dtype)
    seq_keep_bool_tensor = (~((~token_keep_bool) & response_mask_bool)).all(dim=-1)
    token_masked_fraction = masked_mean(1 - token_keep_mask, response_mask).item()
    seq_valid_float = seq_valid_mask.float()
    seq_keep_float = seq_keep_bool_tensor.to(dtype=log_ratio.dtype)
    seq_masked_fraction = (((1.0 - seq_keep_float) * seq_valid_float).sum() / seq_valid_float.sum()).item()
    return {f"rollout_rs_{option}_masked_fraction": token_masked_fraction,
            f"rollout_rs_{option}_seq_masked_fraction": seq_masked_fraction}


# verl/trainer/ppo/core_algos.py: compute_policy_loss_vanilla (pg_clipfrac, pg_clipfrac_lower), old = rollout (bypass)
def pg_clipfrac(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high, clip_ratio_c=3.0):
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    return pg_clipfrac.item(), pg_clipfrac_lower.item()


def verl_metrics(train: list, infer: list, masks: list, threshold: float = 2.0) -> dict[str, float]:
    """Every verl-named metric from the copies above, under logdiff's keys; padding holds NaN."""
    width = max(len(a) for a in train)
    lp_t = torch.full((len(train), width), float("nan"), dtype=torch.float64)
    lp_i, mask = lp_t.clone(), torch.zeros((len(train), width), dtype=torch.float64)
    for s, (a, b, m) in enumerate(zip(train, infer, masks)):
        lp_t[s, : len(a)], lp_i[s, : len(b)] = torch.tensor(a), torch.tensor(b)
        mask[s, : len(m)] = torch.tensor(m, dtype=torch.float64)
    out = {**debug_metrics(lp_t, lp_i, mask), **offpolicy_metrics(lp_t, lp_i, mask)}
    out.update(is_metrics(lp_t - lp_i, mask, "token", threshold))
    seq = is_metrics(lp_t - lp_i, mask, "sequence", threshold)
    out.update({k.replace("rollout_is_", "rollout_is_sequence_"): v for k, v in seq.items()})
    for option in compare.RS_OPTIONS:
        out.update(rs_masked_fractions(lp_t - lp_i, mask, option, threshold))
    pos, neg = torch.ones_like(lp_t), -torch.ones_like(lp_t)
    out["pg_clipfrac_adv_pos"] = pg_clipfrac(lp_i, lp_t, pos, mask, 0.2, 0.2)[0]
    out["pg_clipfrac_adv_pos_dapo"] = pg_clipfrac(lp_i, lp_t, pos, mask, 0.2, 0.28)[0]
    out["pg_clipfrac_adv_neg"], out["pg_clipfrac_lower_adv_neg"] = pg_clipfrac(lp_i, lp_t, neg, mask, 0.2, 0.2)
    return out


def batch(seed: int, n: int = 6, spread: float = 0.6) -> tuple[list, list, list]:
    """Ragged sequences (lengths 1..14), some tokens masked, log ratios up to |24| (past the clamp)."""
    rng = np.random.default_rng(seed)
    train, infer, masks = [], [], []
    for s in range(n):
        length = 1 if s == 0 else int(rng.integers(2, 15))
        t = -rng.exponential(1.5, length)
        i = t + rng.normal(0, spread, length)
        i = np.minimum(i, 0.0)
        m = (rng.random(length) > 0.3).astype(int)
        m[rng.integers(length)] = 1  # never all masked
        if s == 1:
            i[0], m[0] = t[0] - 24.0, 1  # a ratio past verl's SAFETY_BOUND
        if s == 2:
            t[0], i[0], m[0] = -8.0, -0.01, 1  # a ratio far below every lower bound
        train.append(t), infer.append(i), masks.append(m.tolist())
    return train, infer, masks


@pytest.mark.parametrize("seed,threshold", [(0, 2.0), (1, 2.0), (2, 1.5), (3, 5.0)])
def test_every_verl_metric_matches_verl(seed: int, threshold: float) -> None:
    train, infer, masks = batch(seed)
    ours = compare.token_metrics(train, infer, masks=masks, is_threshold=threshold)
    theirs = verl_metrics(train, infer, masks, threshold)
    assert len(theirs) == 55
    for key, value in theirs.items():
        # verl takes these shares of sequences with `.float().mean()`: float32; logdiff keeps the exact fraction
        rel = 1e-7 if "fraction" in key and ("_seq_" in key or "sequence_ratio" in key) else 1e-12
        assert ours[key] == pytest.approx(value, rel=rel, abs=1e-15), key
    # the thresholds are exercised: something is above and below the bounds on both levels
    assert 0 < ours["rollout_is_ratio_fraction_high"] < 1 and 0 < ours["rollout_is_ratio_fraction_low"] < 1
    assert 0 < ours["rollout_rs_token_k1_masked_fraction"] < 1 and ours["pg_clipfrac_lower_adv_neg"] > 0


def test_torch_std_semantics_and_the_single_token_case() -> None:
    train, infer = [np.array([-1.0, -2.0, -0.5, -3.0, -0.1])], [np.array([-1.1, -1.9, -0.5, -2.0, -0.3])]
    m = compare.token_metrics(train, infer)
    diff = np.abs(np.exp(train[0]) - np.exp(infer[0]))
    assert m["rollout_probs_diff_std"] == pytest.approx(diff.std(ddof=1), rel=1e-12)
    assert m["rollout_probs_diff_std"] != pytest.approx(diff.std(), rel=1e-3)  # not numpy's N: 11% off at N=5
    one = compare.token_metrics([np.array([-1.0, -2.0])], [np.array([-1.5, -2.0])], masks=[[1, 0]])
    with pytest.warns(UserWarning):  # torch warns about the degrees of freedom, and gives NaN
        theirs = debug_metrics(torch.tensor([[-1.0]], dtype=torch.float64), torch.tensor([[-1.5]], dtype=torch.float64),
                               torch.ones((1, 1), dtype=torch.float64))
    assert math.isnan(theirs["rollout_probs_diff_std"]) and math.isnan(one["rollout_probs_diff_std"])
    assert one["num_tokens"] == 1 and one["rollout_is_std"] == 0.0 and one["rollout_is_seq_std"] == 0.0
    assert one["rollout_actor_probs_pearson_corr"] is None


def test_all_masked_is_refused() -> None:
    with pytest.raises(ValueError, match="every response token is masked"):
        compare.token_metrics([np.array([-1.0])], [np.array([-1.0])], masks=[[0]])


def test_old_names_repeat_the_new_ones() -> None:
    train, infer, masks = batch(4)
    m = compare.token_metrics(train, infer, masks=masks)
    for old, new in compare.ALIASES.items():
        assert m[old] == m[new] and m[old] is not None
    # the band is both tails at the same eps: PPO's positive- plus negative-advantage clip fractions
    assert m["ratio_outside_band_0.2"] == pytest.approx(m["pg_clipfrac_adv_pos"] + m["pg_clipfrac_adv_neg"], abs=1e-7)
