"""Every verl-named metric equals verl's own formula, on padded, masked batches.

The functions below are faithful torch copies of verl's code (volcengine/verl at commit
b178a3cd56f58b2d502255daba591e92833930a7), cited per function with file and line; logdiff's numpy
implementation (logdiff/comparison/metrics.py) must give the same numbers to float64 rounding. The copies run
in float64 on one batch: verl itself runs them in float32, per micro-batch (docs/result-schema.md).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from logdiff.comparison import metrics as compare

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


# verl/trainer/ppo/rollout_corr_helper.py: _parse_rollout_rs_thresholds (L93-153), the branches this file uses
def parse_rs_thresholds(options, threshold_spec):
    raw_specs = [str(threshold_spec)] if isinstance(threshold_spec, (int, float)) else \
        [part.strip() for part in threshold_spec.split(",") if part.strip()]
    if len(raw_specs) == 1 and len(options) > 1:
        raw_specs = raw_specs * len(options)
    thresholds = {}
    for option, spec in zip(options, raw_specs, strict=True):
        if option.endswith("k1"):
            upper_str = spec
            lower_str = str(1.0 / float(upper_str))
            thresholds[option] = {"lower": float(lower_str), "upper": float(upper_str)}
        else:
            thresholds[option] = {"lower": None, "upper": float(spec)}
    return thresholds


# verl/trainer/ppo/rollout_corr_helper.py: compute_rollout_rejection_mask (L156-372), its masks and
# masked fractions (compute_rs_metrics, L375-478, logs other statistics, not reported by logdiff)
def rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold):
    normalized_options = [opt.strip() for opt in rollout_rs.split(",") if opt.strip()]
    threshold_specs = parse_rs_thresholds(normalized_options, rollout_rs_threshold)
    log_ratio_safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)  # L221-224
    token_k1 = -log_ratio_safe
    token_k2 = 0.5 * log_ratio_safe**2
    token_k3 = torch.exp(log_ratio_safe) - 1.0 - log_ratio_safe
    per_token = {"k1": token_k1, "k2": token_k2, "k3": token_k3}
    response_mask_bool = response_mask.bool()
    seq_valid_mask = response_mask.sum(dim=-1) > 0
    combined_mask = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics = {}

    def _sequence_max(values):  # L238-243
        mask_bool = response_mask.bool()
        neg_inf = torch.tensor(float("-inf"), device=values.device, dtype=values.dtype)
        masked_values = values.masked_fill(~mask_bool, neg_inf)
        max_values = masked_values.max(dim=-1).values
        return torch.where(max_values == neg_inf, torch.zeros_like(max_values), max_values)

    aggregate = {"seq_sum": lambda v: masked_sum(v, response_mask, axis=-1),
                 "seq_mean": lambda v: masked_mean(v, response_mask, axis=-1), "seq_max": _sequence_max}
    for option_name in normalized_options:  # L245-363, the branches written once per level and kind
        upper_value, lower_value = threshold_specs[option_name]["upper"], threshold_specs[option_name]["lower"]
        level, kind = option_name.rsplit("_", 1)
        if kind == "k1":
            lower_log, upper_log = math.log(lower_value), math.log(upper_value)
        stat = per_token[kind] if level == "token" else aggregate[level](per_token[kind])
        keep = (stat >= lower_log) & (stat <= upper_log) if kind == "k1" else stat <= upper_value
        token_keep_bool = keep if level == "token" else keep.unsqueeze(-1).expand_as(response_mask_bool)
        token_keep_mask = token_keep_bool.to(dtype=log_ratio.dtype)
        combined_mask = combined_mask * token_keep_mask
        seq_keep_bool_tensor = (~((~token_keep_bool) & response_mask_bool)).all(dim=-1)
        token_masked_fraction = masked_mean(1 - token_keep_mask, response_mask).item()
        seq_valid_float = seq_valid_mask.float()
        if seq_valid_float.sum() > 0:
            seq_keep_float = seq_keep_bool_tensor.to(dtype=log_ratio.dtype)
            seq_masked_fraction = (((1.0 - seq_keep_float) * seq_valid_float).sum() / seq_valid_float.sum()).item()
        else:
            seq_masked_fraction = 0.0
        metrics[f"rollout_rs_{option_name}_masked_fraction"] = token_masked_fraction
        metrics[f"rollout_rs_{option_name}_seq_masked_fraction"] = seq_masked_fraction
    final_mask = combined_mask  # L365-369
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - final_mask, response_mask).item()
    final_keep_bool = (final_mask > 0.5) & response_mask_bool
    seq_has_masked = (~final_keep_bool & response_mask_bool).any(dim=-1)
    metrics["rollout_rs_seq_masked_fraction"] = seq_has_masked.float().mean().item()
    return metrics


def rs_fractions(log_ratio, response_mask, threshold, bound=compare.RS_DIVERGENCE_BOUND):
    """logdiff's rollout_rs_* keys from verl: every option in one call (each option's own fractions do
    not depend on the others), the combined ones from a call with logdiff's chain at T."""
    spec = ",".join(str(threshold) if o.endswith("k1") else str(bound) for o in compare.RS_OPTIONS)
    out = rejection_mask(log_ratio, response_mask, ",".join(compare.RS_OPTIONS), spec)
    del out["rollout_rs_masked_fraction"], out["rollout_rs_seq_masked_fraction"]
    chained = rejection_mask(log_ratio, response_mask, ",".join(compare.RS_CHAIN), threshold)
    out["rollout_rs_masked_fraction"] = chained["rollout_rs_masked_fraction"]
    out["rollout_rs_seq_masked_fraction"] = chained["rollout_rs_seq_masked_fraction"]
    return out


# verl/trainer/ppo/core_algos.py: compute_policy_loss_vanilla (L1160-1251: ppo_kl L1210-1214, pg_clipfrac,
# pg_clipfrac_lower), old = rollout (bypass mode, compute_policy_loss_bypass_mode L2065)
def pg_clipfrac(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high, clip_ratio_c=3.0):
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    return pg_clipfrac.item(), pg_clipfrac_lower.item(), ppo_kl.item()


def verl_metrics(train: list, infer: list, masks: list, threshold: float = 2.0,
                 bound: float = compare.RS_DIVERGENCE_BOUND) -> dict[str, float]:
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
    out.update(rs_fractions(lp_t - lp_i, mask, threshold, bound))
    pos, neg = torch.ones_like(lp_t), -torch.ones_like(lp_t)
    out["pg_clipfrac_adv_pos"], _, out["ppo_kl"] = pg_clipfrac(lp_i, lp_t, pos, mask, 0.2, 0.2)
    out["pg_clipfrac_adv_pos_dapo"] = pg_clipfrac(lp_i, lp_t, pos, mask, 0.2, 0.28)[0]
    out["pg_clipfrac_adv_neg"], out["pg_clipfrac_lower_adv_neg"], _ = pg_clipfrac(lp_i, lp_t, neg, mask, 0.2, 0.2)
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


@pytest.mark.parametrize("seed,threshold,spread,bound", [(0, 2.0, 0.6, 0.01), (1, 2.0, 0.6, 0.01), (2, 1.5, 0.6, 0.01),
                                                         (3, 5.0, 0.6, 0.01), (8, 1.5, 0.1, 0.01), (9, 1.5, 0.1, 0.01),
                                                         (10, 3.0, 0.1, 0.02)])
def test_every_verl_metric_matches_verl(seed: int, threshold: float, spread: float, bound: float) -> None:
    train, infer, masks = batch(seed, spread=spread)
    ours = compare.token_metrics(train, infer, masks=masks, is_threshold=threshold, rs_bound=bound)
    theirs = verl_metrics(train, infer, masks, threshold, bound)
    assert len(theirs) == 74
    for key, value in theirs.items():
        # verl takes these shares of sequences with `.float().mean()`: float32; logdiff keeps the exact fraction
        rel = 1e-7 if "fraction" in key and ("_seq_" in key or "sequence_ratio" in key) else 1e-12
        assert ours[key] == pytest.approx(value, rel=rel, abs=1e-15), key
    # the thresholds are exercised: something is above and below the bounds on both levels
    assert 0 < ours["rollout_is_ratio_fraction_high"] < 1 and 0 < ours["rollout_is_ratio_fraction_low"] < 1
    assert 0 < ours["rollout_rs_token_k1_masked_fraction"] < 1 and ours["pg_clipfrac_lower_adv_neg"] > 0
    if spread < 0.6:  # small divergences: every rejection option keeps some tokens and rejects others
        assert all(0 < ours[f"rollout_rs_{o}_masked_fraction"] < 1 for o in compare.RS_OPTIONS)
        assert 0 < ours["rollout_rs_masked_fraction"] < 1 and 0 < ours["rollout_rs_seq_masked_fraction"] < 1


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


def tensors(train: list, infer: list, masks: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The log ratio and the mask of equal-length sequences, as verl's float64 tensors."""
    lr = torch.tensor(np.array(train) - np.array(infer), dtype=torch.float64)
    return lr, torch.tensor(masks, dtype=torch.float64)


def test_rejection_identical_paths_reject_nothing_and_a_planted_token_is_found() -> None:
    rng = np.random.default_rng(11)
    train = [-rng.exponential(1.5, 8) for _ in range(3)]
    masks = [[1] * 8, [1] * 8, [1, 1, 1, 1, 0, 0, 1, 1]]
    same = compare.token_metrics(train, [t.copy() for t in train], masks=masks)
    rs = {k: v for k, v in same.items() if k.startswith("rollout_rs_")}
    assert len(rs) == 2 * len(compare.RS_OPTIONS) + 2 and set(rs.values()) == {0.0} and same["ppo_kl"] == 0.0
    infer = [t.copy() for t in train]
    infer[1][5] -= 0.3  # r = e^0.3 = 1.35: inside [1/2, 2], but k2 = 0.045 and k3 = 0.050 are above 0.01
    planted = compare.token_metrics(train, infer, masks=masks)
    theirs = rs_fractions(*tensors(train, infer, masks), 2.0)
    assert {k: planted[k] for k in theirs} == pytest.approx(theirs, rel=1e-7)
    for kind in ("k2", "k3"):
        assert planted[f"rollout_rs_token_{kind}_masked_fraction"] == pytest.approx(1 / 22)  # the token
        assert planted[f"rollout_rs_seq_max_{kind}_masked_fraction"] == pytest.approx(8 / 22)  # its sequence
        assert planted[f"rollout_rs_seq_max_{kind}_seq_masked_fraction"] == pytest.approx(1 / 3)
    assert planted["rollout_rs_token_k1_masked_fraction"] == 0.0 and planted["rollout_rs_masked_fraction"] == 0.0
    infer[1][5] -= 0.7  # r = e^1.0: above T = 2, so the k1 chain rejects the token and, by its sum, the sequence
    far = compare.token_metrics(train, infer, masks=masks)
    assert far["rollout_rs_token_k1_masked_fraction"] == pytest.approx(1 / 22)
    assert far["rollout_rs_masked_fraction"] == pytest.approx(8 / 22)
    assert far["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 3)


def test_combined_sequence_share_counts_sequences_without_a_scored_token() -> None:
    train = [np.array([-1.0, -2.0, -0.5]), np.array([-1.0, -0.2, -3.0]), np.array([-0.7, -0.9, -1.1])]
    infer = [np.array([-1.0, -0.5, -0.5]), np.array([-1.0, -0.2, -3.0]), np.array([-5.0, -0.9, -1.1])]
    masks = [[1, 1, 1], [1, 1, 1], [0, 0, 0]]  # the third sequence differs, but scores nothing
    ours = compare.token_metrics(train, infer, masks=masks)
    theirs = rs_fractions(*tensors(train, infer, masks), 2.0)
    assert ours["rollout_rs_token_k1_seq_masked_fraction"] == theirs["rollout_rs_token_k1_seq_masked_fraction"] == 0.5
    assert ours["rollout_rs_seq_masked_fraction"] == pytest.approx(theirs["rollout_rs_seq_masked_fraction"]) == 1 / 3


def test_ppo_kl_is_the_k1_kl_clamped_at_the_safety_bound() -> None:
    train, infer, masks = batch(12, spread=0.3)
    train[1][0], infer[1][0], masks[1][0] = -1.0, -2.0, 1  # batch() plants a ratio past the bound here: undo it
    within = compare.token_metrics(train, infer, masks=masks)
    assert within["ppo_kl"] == pytest.approx(within["kl"], rel=1e-12)
    infer[1][0] = -1.0 - 30.0  # log r = 30, clamped to 20 in ppo_kl only
    past = compare.token_metrics(train, infer, masks=masks)
    assert past["ppo_kl"] - past["kl"] == pytest.approx(10.0 / past["num_tokens"], rel=1e-9)
