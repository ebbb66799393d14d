"""Number and value formatting shared by the HTML page and the terminal summary.

Both renderers show the same numbers the same way, and both read the metric
catalogue below, so a metric gets one label and one verl name everywhere.
Everything here is pure and works on plain JSON values.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

# (key in the metrics dict, label, the name RL frameworks log it under, what it means). T is --is-threshold.
METRICS: list[tuple[str, str, str, str]] = [
    ("num_tokens", "tokens scored", "", "response tokens compared (response_mask 1)"),
    ("nonfinite_tokens", "NaN/inf tokens", "", "scored tokens whose logprob is NaN or inf on either path"),
    ("abs_diff_max", "max |Δ logprob|", "", "largest |lp_train − lp_infer| over all tokens"),
    ("abs_diff_mean", "mean |Δ logprob|", "", "mean |lp_train − lp_infer|"),
    ("abs_diff_p99", "p99 |Δ logprob|", "", "99th percentile of |lp_train − lp_infer|"),
    ("bitwise_equal_fraction", "bitwise-equal tokens", "", "tokens whose two logprobs are the same float"),
    ("rollout_probs_diff_max", "max |Δ prob|", "training/rollout_probs_diff_max",
     "verl: max |p_infer − p_train|"),
    ("rollout_probs_diff_mean", "mean |Δ prob|", "training/rollout_probs_diff_mean",
     "verl: mean |p_infer − p_train|"),
    ("rollout_probs_diff_std", "std |Δ prob|", "training/rollout_probs_diff_std",
     "verl: torch.std (N − 1) of |p_infer − p_train|"),
    ("rollout_actor_probs_pearson_corr", "Pearson r of probs", "training/rollout_actor_probs_pearson_corr",
     "correlation of p_train and p_infer"),
    ("kl", "KL (k1)", "rollout_corr/kl", "mean of lp_infer − lp_train"),
    ("k3_kl", "KL (k3)", "rollout_corr/k3_kl", "mean of r − 1 − log r, r = p_train / p_infer"),
    ("training_ppl", "training PPL", "rollout_corr/training_ppl", "mean over sequences of exp(−mean lp_train)"),
    ("rollout_ppl", "rollout PPL", "rollout_corr/rollout_ppl", "mean over sequences of exp(−mean lp_infer)"),
    ("training_log_ppl", "training log PPL", "rollout_corr/training_log_ppl", "mean over sequences of −mean lp_train"),
    ("rollout_log_ppl", "rollout log PPL", "rollout_corr/rollout_log_ppl", "mean over sequences of −mean lp_infer"),
    ("log_ppl_diff", "log PPL diff", "rollout_corr/log_ppl_diff",
     "mean over sequences of (mean lp_infer − mean lp_train)"),
    ("log_ppl_abs_diff", "|log PPL diff|", "rollout_corr/log_ppl_abs_diff", "mean over sequences of its absolute value"),
    ("log_ppl_diff_max", "log PPL diff, largest", "rollout_corr/log_ppl_diff_max",
     "largest per-sequence (mean lp_infer − mean lp_train)"),
    ("log_ppl_diff_min", "log PPL diff, smallest", "rollout_corr/log_ppl_diff_min",
     "smallest per-sequence (mean lp_infer − mean lp_train)"),
    ("ppl_ratio", "PPL ratio", "rollout_corr/ppl_ratio", "mean over sequences of training PPL / rollout PPL"),
    ("chi2_token", "χ² (token)", "rollout_corr/chi2_token", "mean of r² − 1"),
    ("chi2_seq", "χ² (sequence)", "rollout_corr/chi2_seq", "mean over sequences of (Π r)² − 1"),
    ("rollout_is_mean", "IS weight mean", "rollout_corr/rollout_is_mean", "mean of r (rollout_is=token)"),
    ("rollout_is_ratio_fraction_high", "IS weight > T", "rollout_corr/rollout_is_ratio_fraction_high",
     "tokens with r > T"),
    ("rollout_is_ratio_fraction_low", "IS weight < 1/T", "rollout_corr/rollout_is_ratio_fraction_low",
     "tokens with r < 1/T"),
    ("rollout_is_eff_sample_size", "IS effective sample size", "rollout_corr/rollout_is_eff_sample_size",
     "1 / mean of (w / mean w)², w = r clamped to [1/T, T]"),
    ("rollout_is_max", "IS weight max", "rollout_corr/rollout_is_max", "largest r (rollout_is=token)"),
    ("rollout_is_min", "IS weight min", "rollout_corr/rollout_is_min", "smallest r (rollout_is=token)"),
    ("rollout_is_std", "IS weight std, truncated", "rollout_corr/rollout_is_std",
     "population std (N) of r clamped to [1/T, T]"),
    ("rollout_is_seq_mean", "IS weight per sequence: mean", "rollout_corr/rollout_is_seq_mean",
     "mean over sequences of each sequence's mean r"),
    ("rollout_is_seq_std", "IS weight per sequence: std", "rollout_corr/rollout_is_seq_std",
     "std (N − 1) over sequences of each sequence's mean r"),
    ("rollout_is_seq_max", "IS weight per sequence: max", "rollout_corr/rollout_is_seq_max",
     "largest sequence mean r"),
    ("rollout_is_seq_min", "IS weight per sequence: min", "rollout_corr/rollout_is_seq_min",
     "smallest sequence mean r"),
    ("rollout_is_seq_max_deviation", "IS weight per sequence: max deviation from 1",
     "rollout_corr/rollout_is_seq_max_deviation", "largest |sequence mean r − 1|"),
    ("rollout_is_seq_fraction_high", "IS weight per sequence > T", "rollout_corr/rollout_is_seq_fraction_high",
     "sequences whose mean r is > T"),
    ("rollout_is_seq_fraction_low", "IS weight per sequence < 1/T", "rollout_corr/rollout_is_seq_fraction_low",
     "sequences whose mean r is < 1/T"),
    ("rollout_is_sequence_ratio_fraction_high", "sequence IS > T", "rollout_corr/rollout_is_ratio_fraction_high",
     "rollout_is=sequence: sequences with Π r > T"),
    ("rollout_is_sequence_ratio_fraction_low", "sequence IS < 1/T", "rollout_corr/rollout_is_ratio_fraction_low",
     "rollout_is=sequence: sequences with Π r < 1/T"),
    ("rollout_is_sequence_mean", "sequence IS mean", "rollout_corr/rollout_is_mean",
     "rollout_is=sequence: token-weighted mean of each sequence's Π r"),
    ("rollout_is_sequence_max", "sequence IS max", "rollout_corr/rollout_is_max",
     "rollout_is=sequence: largest Π r (capped at exp 20)"),
    ("rollout_is_sequence_min", "sequence IS min", "rollout_corr/rollout_is_min",
     "rollout_is=sequence: smallest Π r"),
    ("rollout_is_sequence_std", "sequence IS std, truncated", "rollout_corr/rollout_is_std",
     "rollout_is=sequence: std of Π r clamped to [1/T, T], token-weighted"),
    ("rollout_is_sequence_eff_sample_size", "sequence IS effective sample size",
     "rollout_corr/rollout_is_eff_sample_size", "rollout_is=sequence: effective sample size of Π r clamped"),
    ("rollout_is_sequence_seq_mean", "sequence IS per sequence: mean", "rollout_corr/rollout_is_seq_mean",
     "rollout_is=sequence: mean over sequences of Π r (each sequence once)"),
    ("rollout_is_sequence_seq_std", "sequence IS per sequence: std", "rollout_corr/rollout_is_seq_std",
     "rollout_is=sequence: std (N − 1) over sequences of Π r"),
    ("rollout_is_sequence_seq_max", "sequence IS per sequence: max", "rollout_corr/rollout_is_seq_max",
     "rollout_is=sequence: largest Π r, clamped at exp 20"),
    ("rollout_is_sequence_seq_min", "sequence IS per sequence: min", "rollout_corr/rollout_is_seq_min",
     "rollout_is=sequence: smallest Π r, clamped at exp −20"),
    ("rollout_is_sequence_seq_max_deviation", "sequence IS per sequence: max deviation from 1",
     "rollout_corr/rollout_is_seq_max_deviation", "rollout_is=sequence: largest |Π r − 1|"),
    ("rollout_is_sequence_seq_fraction_high", "sequence IS per sequence > T",
     "rollout_corr/rollout_is_seq_fraction_high", "rollout_is=sequence: sequences with Π r > T (clamped)"),
    ("rollout_is_sequence_seq_fraction_low", "sequence IS per sequence < 1/T",
     "rollout_corr/rollout_is_seq_fraction_low", "rollout_is=sequence: sequences with Π r < 1/T (clamped)"),
    ("rollout_rs_token_k1_masked_fraction", "RS by token: tokens rejected",
     "rollout_corr/rollout_rs_token_k1_masked_fraction", "rollout_rs=token_k1: tokens with r outside [1/T, T]"),
    ("rollout_rs_token_k1_seq_masked_fraction", "RS by token: sequences hit",
     "rollout_corr/rollout_rs_token_k1_seq_masked_fraction", "rollout_rs=token_k1: sequences with a rejected token"),
    ("rollout_rs_seq_sum_k1_masked_fraction", "RS by sequence sum: tokens rejected",
     "rollout_corr/rollout_rs_seq_sum_k1_masked_fraction",
     "rollout_rs=seq_sum_k1: tokens of sequences with Π r outside [1/T, T]"),
    ("rollout_rs_seq_sum_k1_seq_masked_fraction", "RS by sequence sum: sequences rejected",
     "rollout_corr/rollout_rs_seq_sum_k1_seq_masked_fraction", "rollout_rs=seq_sum_k1: those sequences"),
    ("rollout_rs_seq_mean_k1_masked_fraction", "RS by sequence mean: tokens rejected",
     "rollout_corr/rollout_rs_seq_mean_k1_masked_fraction",
     "rollout_rs=seq_mean_k1: tokens of sequences whose geometric-mean r is outside [1/T, T]"),
    ("rollout_rs_seq_mean_k1_seq_masked_fraction", "RS by sequence mean: sequences rejected",
     "rollout_corr/rollout_rs_seq_mean_k1_seq_masked_fraction", "rollout_rs=seq_mean_k1: those sequences"),
    ("rollout_rs_token_k2_masked_fraction", "RS by token k2: tokens rejected",
     "rollout_corr/rollout_rs_token_k2_masked_fraction", "rollout_rs=token_k2: tokens with (log r)²/2 > 0.01"),
    ("rollout_rs_token_k2_seq_masked_fraction", "RS by token k2: sequences hit",
     "rollout_corr/rollout_rs_token_k2_seq_masked_fraction", "rollout_rs=token_k2: sequences with a rejected token"),
    ("rollout_rs_token_k3_masked_fraction", "RS by token k3: tokens rejected",
     "rollout_corr/rollout_rs_token_k3_masked_fraction", "rollout_rs=token_k3: tokens with r − 1 − log r > 0.01"),
    ("rollout_rs_token_k3_seq_masked_fraction", "RS by token k3: sequences hit",
     "rollout_corr/rollout_rs_token_k3_seq_masked_fraction", "rollout_rs=token_k3: sequences with a rejected token"),
    ("rollout_rs_seq_sum_k2_masked_fraction", "RS by sequence sum k2: tokens rejected",
     "rollout_corr/rollout_rs_seq_sum_k2_masked_fraction",
     "rollout_rs=seq_sum_k2: tokens of sequences whose summed (log r)²/2 > 0.01"),
    ("rollout_rs_seq_sum_k2_seq_masked_fraction", "RS by sequence sum k2: sequences rejected",
     "rollout_corr/rollout_rs_seq_sum_k2_seq_masked_fraction", "rollout_rs=seq_sum_k2: those sequences"),
    ("rollout_rs_seq_sum_k3_masked_fraction", "RS by sequence sum k3: tokens rejected",
     "rollout_corr/rollout_rs_seq_sum_k3_masked_fraction",
     "rollout_rs=seq_sum_k3: tokens of sequences whose summed r − 1 − log r > 0.01"),
    ("rollout_rs_seq_sum_k3_seq_masked_fraction", "RS by sequence sum k3: sequences rejected",
     "rollout_corr/rollout_rs_seq_sum_k3_seq_masked_fraction", "rollout_rs=seq_sum_k3: those sequences"),
    ("rollout_rs_seq_mean_k2_masked_fraction", "RS by sequence mean k2: tokens rejected",
     "rollout_corr/rollout_rs_seq_mean_k2_masked_fraction",
     "rollout_rs=seq_mean_k2: tokens of sequences whose mean (log r)²/2 > 0.01"),
    ("rollout_rs_seq_mean_k2_seq_masked_fraction", "RS by sequence mean k2: sequences rejected",
     "rollout_corr/rollout_rs_seq_mean_k2_seq_masked_fraction", "rollout_rs=seq_mean_k2: those sequences"),
    ("rollout_rs_seq_mean_k3_masked_fraction", "RS by sequence mean k3: tokens rejected",
     "rollout_corr/rollout_rs_seq_mean_k3_masked_fraction",
     "rollout_rs=seq_mean_k3: tokens of sequences whose mean r − 1 − log r > 0.01"),
    ("rollout_rs_seq_mean_k3_seq_masked_fraction", "RS by sequence mean k3: sequences rejected",
     "rollout_corr/rollout_rs_seq_mean_k3_seq_masked_fraction", "rollout_rs=seq_mean_k3: those sequences"),
    ("rollout_rs_seq_max_k2_masked_fraction", "RS by sequence max k2: tokens rejected",
     "rollout_corr/rollout_rs_seq_max_k2_masked_fraction",
     "rollout_rs=seq_max_k2: tokens of sequences whose largest (log r)²/2 > 0.01"),
    ("rollout_rs_seq_max_k2_seq_masked_fraction", "RS by sequence max k2: sequences rejected",
     "rollout_corr/rollout_rs_seq_max_k2_seq_masked_fraction", "rollout_rs=seq_max_k2: those sequences"),
    ("rollout_rs_seq_max_k3_masked_fraction", "RS by sequence max k3: tokens rejected",
     "rollout_corr/rollout_rs_seq_max_k3_masked_fraction",
     "rollout_rs=seq_max_k3: tokens of sequences whose largest r − 1 − log r > 0.01"),
    ("rollout_rs_seq_max_k3_seq_masked_fraction", "RS by sequence max k3: sequences rejected",
     "rollout_corr/rollout_rs_seq_max_k3_seq_masked_fraction", "rollout_rs=seq_max_k3: those sequences"),
    ("rollout_rs_masked_fraction", "RS combined: tokens rejected", "rollout_corr/rollout_rs_masked_fraction",
     "rollout_rs=token_k1,seq_sum_k1,seq_mean_k1: tokens any of the three rejects"),
    ("rollout_rs_seq_masked_fraction", "RS combined: sequences hit", "rollout_corr/rollout_rs_seq_masked_fraction",
     "the same chain: sequences with a rejected token, over all sequences"),
    ("ratio_mean", "ratio mean", "", "importance ratio r = exp(lp_train − lp_infer)"),
    ("ratio_std", "ratio std", "", "standard deviation of r (N)"),
    ("ratio_min", "ratio min", "", "smallest r"),
    ("ratio_max", "ratio max", "", "largest r"),
    ("ratio_outside_band_0.2", "ratio outside 1 ± 0.2", "", "tokens with |r − 1| > 0.2 (either tail)"),
    ("ratio_outside_band_0.28", "ratio outside 1 ± 0.28", "", "tokens with |r − 1| > 0.28 (either tail)"),
    ("pg_clipfrac_adv_pos", "PPO clip, A > 0", "actor/pg_clipfrac", "tokens with r > 1.2: clipped if A > 0"),
    ("pg_clipfrac_adv_pos_dapo", "DAPO clip-higher, A > 0", "actor/pg_clipfrac",
     "tokens with r > 1.28: clipped if A > 0 (clip_ratio_high 0.28)"),
    ("pg_clipfrac_adv_neg", "PPO/DAPO clip, A < 0", "actor/pg_clipfrac", "tokens with r < 0.8: clipped if A < 0"),
    ("pg_clipfrac_lower_adv_neg", "dual-clip, A < 0", "actor/pg_clipfrac_lower",
     "tokens with r > 3: bounded if A < 0 (clip_ratio_c 3)"),
    ("ppo_kl", "PPO KL (k1, clamped)", "actor/ppo_kl",
     "bypass mode: mean of lp_infer − lp_train, each clamped to ±20"),
    ("argmax_flip_fraction", "argmax flips", "", "positions whose top-1 token differs"),
]

#: deprecated metric key -> the key it repeats; results keep both, renderers show the new one
METRIC_ALIASES = {"probs_pearson": "rollout_actor_probs_pearson_corr", "kl_k1": "kl", "kl_k3": "k3_kl",
                  "clip_fraction_0.2": "ratio_outside_band_0.2", "clip_fraction_0.28": "ratio_outside_band_0.28"}

# The subset the terminal summary shows.
KEY_METRICS = ["abs_diff_max", "abs_diff_mean", "bitwise_equal_fraction", "rollout_probs_diff_max",
               "rollout_probs_diff_mean", "rollout_actor_probs_pearson_corr", "kl", "k3_kl",
               "ratio_outside_band_0.2", "argmax_flip_fraction"]

FRACTION_METRICS = {"bitwise_equal_fraction", "argmax_flip_fraction", "ratio_outside_band_0.2",
                    "ratio_outside_band_0.28", "pg_clipfrac_adv_pos", "pg_clipfrac_adv_pos_dapo", "pg_clipfrac_adv_neg",
                    "pg_clipfrac_lower_adv_neg", "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low",
                    "rollout_is_sequence_ratio_fraction_high", "rollout_is_sequence_ratio_fraction_low",
                    "rollout_rs_token_k1_masked_fraction", "rollout_is_seq_fraction_high", "rollout_is_seq_fraction_low",
                    "rollout_is_sequence_seq_fraction_high", "rollout_is_sequence_seq_fraction_low",
                    "rollout_rs_token_k1_seq_masked_fraction", "rollout_rs_seq_sum_k1_masked_fraction",
                    "rollout_rs_seq_sum_k1_seq_masked_fraction", "rollout_rs_seq_mean_k1_masked_fraction",
                    "rollout_rs_seq_mean_k1_seq_masked_fraction",
                    "rollout_rs_token_k2_masked_fraction", "rollout_rs_token_k2_seq_masked_fraction",
                    "rollout_rs_token_k3_masked_fraction", "rollout_rs_token_k3_seq_masked_fraction",
                    "rollout_rs_seq_sum_k2_masked_fraction", "rollout_rs_seq_sum_k2_seq_masked_fraction",
                    "rollout_rs_seq_sum_k3_masked_fraction", "rollout_rs_seq_sum_k3_seq_masked_fraction",
                    "rollout_rs_seq_mean_k2_masked_fraction", "rollout_rs_seq_mean_k2_seq_masked_fraction",
                    "rollout_rs_seq_mean_k3_masked_fraction", "rollout_rs_seq_mean_k3_seq_masked_fraction",
                    "rollout_rs_seq_max_k2_masked_fraction", "rollout_rs_seq_max_k2_seq_masked_fraction",
                    "rollout_rs_seq_max_k3_masked_fraction", "rollout_rs_seq_max_k3_seq_masked_fraction",
                    "rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"}


def current_names(metrics: dict) -> dict:
    """A metrics dict under the current names: a result written before a rename gives its old keys' values."""
    out = {k: v for k, v in metrics.items() if k not in METRIC_ALIASES}
    for old, new in METRIC_ALIASES.items():
        if old in metrics and new not in out:
            out[new] = metrics[old]
    return out


VERDICT_TEXT = {
    "consistent": "consistent: the paths agree",
    "divergent": "divergent: the paths differ, cause not classified",
    "operator_path": "operator path: same contract, different kernels",
    "framework_difference": "framework difference: the paths compute different things",
    "mixed": "mixed: operator-path and framework differences",
    "unexplained": "unexplained: part of the gap enters after the last compared boundary, no cause identifies it",
}


# Characters a terminal (or a CI log) acts on: C0/C1 controls and DEL (ESC starts ANSI and OSC-8
# sequences, CR rewrites a line, LF starts one), line/paragraph separators and bidi overrides.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
MAX_DEPTH = 64


def safe_text(value: Any) -> str:
    """``str(value)`` with every control character shown as an escape (``\\x1b``, ``\\n``): one inert line."""
    text = str(value)
    if not _UNSAFE.search(text):
        return text
    return _UNSAFE.sub(lambda m: _NAMED.get(m.group(), f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                                          else f"\\u{ord(m.group()):04x}"), text)


def terminal_safe(value: Any, depth: int = 0) -> Any:
    """A copy of a result (or any JSON value) whose strings, keys included, are ``safe_text``."""
    if depth > MAX_DEPTH:
        return "…"
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, dict):
        return {safe_text(k) if isinstance(k, str) else k: terminal_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [terminal_safe(v, depth + 1) for v in value]
    return value


def is_number(value: Any) -> bool:
    """True for ints and floats, false for bools and everything else."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def fmt_num(value: Any) -> str:
    """A short, readable number: 0, 0.0412, 3.90e-03, 1.2e+05; '—' for missing."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if not isinstance(value, float):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.2e}"


def fmt_fraction(value: Any) -> str:
    """A fraction as a percentage: 0.0781 -> '7.81%'."""
    if not is_number(value) or not math.isfinite(value):
        return fmt_num(value)
    if value == 0:
        return "0%"
    pct = 100.0 * value
    return f"{pct:.3g}%" if abs(pct) >= 0.01 else f"{pct:.1e}%"


def fmt_metric(key: str, value: Any) -> str:
    """A metric value, formatted for its kind."""
    return fmt_fraction(value) if key in FRACTION_METRICS else fmt_num(value)


def fmt_value(value: Any) -> str:
    """A config or settings value exactly as JSON would spell it (floats keep full precision)."""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return fmt_num(value)
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def fmt_lens(lens: Any) -> str:
    """A list of lengths as 'N' when all equal, else 'min–max'."""
    if not isinstance(lens, list) or not lens or not all(is_number(x) for x in lens):
        return "—"
    lo, hi = min(lens), max(lens)
    return str(lo) if lo == hi else f"{lo}–{hi}"


def fmt_duration(seconds: Any) -> str:
    """A wall time: '0.4 s', '27 s', '2 min 31 s'."""
    if not is_number(seconds) or not math.isfinite(seconds):
        return "—"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


def fmt_bytes(n: Any) -> str:
    """A size in binary units: '812 MiB', '3.1 GiB'."""
    if not is_number(n) or n < 0:
        return "—"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            value = n / size
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{int(n)} B"


def cost_text(result: dict) -> str | None:
    """What a scan cost, in one line: its wall time, its three longest phases, the peak memory and the scratch
    its row stores wrote."""
    timings = result.get("timings")
    timings = {k: v for k, v in timings.items() if is_number(v)} if isinstance(timings, dict) else {}
    peak = result.get("peak_rss_bytes")
    parts = []
    if timings:
        longest = sorted(timings.items(), key=lambda kv: -kv[1])[:3]
        parts.append(f"took {fmt_duration(sum(timings.values()))} ("
                     + ", ".join(f"{k} {fmt_duration(v)}" for k, v in longest) + ")")
    if is_number(peak):
        parts.append(f"peak memory {fmt_bytes(peak)}")
    scratch = result.get("scratch_bytes")
    if is_number(scratch) and scratch > 0:
        parts.append(f"{fmt_bytes(scratch)} of scratch written")
    return " · ".join(parts) or None


def pair_label(pair: dict) -> str:
    """'hf vs vllm'."""
    return f"{pair.get('train', '?')} vs {pair.get('infer', '?')}"


def verdict_text(verdict: Any) -> str:
    """The verdict with a short explanation."""
    return VERDICT_TEXT.get(verdict, str(verdict))
