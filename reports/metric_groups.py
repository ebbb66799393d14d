"""The order in which a report reads the ~60 logprob metrics: a few groups, each answering one question.

``format.METRICS`` gives every metric its label, verl name and meaning; this module only says
which metrics a reader needs first and in what order:

- ``gap``: how far apart the two paths' logprobs are;
- ``ratio``: what that does to PPO's importance ratio r and to its clipping;
- ``is_rs``: what verl's rollout correction would do at ``--is-threshold`` T (truncated importance
  sampling: weights capped at T; rejection sampling: k1 ratios outside [1/T, T]);
- ``rest``: everything else (perplexities, χ², the per-sequence IS statistics), which renderers fold.

A named group lists its keys in reading order. Every other key falls into the rest, in catalogue
order and then by name, so a metric added to the catalogue, or a key only a newer logdiff writes,
still shows up without an edit here. ``metrics_view`` lays the groups out for the HTML page: up
to ``MAX_PAIR_COLUMNS`` pairs side by side, more stacked in blocks of equal size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .format import METRICS, current_names, fmt_metric


@dataclass(frozen=True)
class MetricGroup:
    id: str
    title: str
    question: str
    keys: tuple[str, ...] = ()


GROUPS = (
    MetricGroup("gap", "The gap", "how far apart the two paths' logprobs are",
                ("num_tokens", "bitwise_equal_fraction", "abs_diff_max", "abs_diff_mean", "abs_diff_p99",
                 "argmax_flip_fraction", "rollout_probs_diff_max", "rollout_probs_diff_mean", "kl", "k3_kl",
                 "nonfinite_tokens")),
    MetricGroup("ratio", "Ratio and clipping", "what the gap does to PPO's importance ratio r and to its clipping",
                ("ratio_mean", "ratio_std", "ratio_min", "ratio_max", "ratio_outside_band_0.2",
                 "ratio_outside_band_0.28", "pg_clipfrac_adv_pos", "pg_clipfrac_adv_pos_dapo", "pg_clipfrac_adv_neg",
                 "pg_clipfrac_lower_adv_neg", "ppo_kl")),
    MetricGroup("is_rs", "IS and RS", "what verl's rollout correction would see at threshold T: importance-sampling "
                "(IS) weights and rejection sampling (RS)",
                ("rollout_is_mean", "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low",
                 "rollout_is_eff_sample_size", "rollout_is_sequence_ratio_fraction_high",
                 "rollout_is_sequence_ratio_fraction_low", "rollout_is_sequence_eff_sample_size",
                 "rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction",
                 "rollout_rs_token_k1_masked_fraction", "rollout_rs_seq_sum_k1_masked_fraction",
                 "rollout_rs_seq_mean_k1_masked_fraction")),
)
REST = MetricGroup("rest", "More metrics", "perplexities, χ², probability spread, IS and RS in detail")


@dataclass(frozen=True)
class MetricRow:
    key: str
    label: str
    verl: str
    meaning: str
    values: tuple[str, ...]     # one formatted value per column, "—" where a column lacks the key


def readable(key: str) -> str:
    """The label of a key the catalogue does not know (a newer logdiff's): its words, not its underscores."""
    return key.replace("_", " ").strip() or key


def group_metrics(columns: list[dict]) -> list[tuple[MetricGroup, list[MetricRow]]]:
    """Each group with one row per metric that any column (a pair's metrics, current names) has;
    the rest last; groups without a row left out."""
    catalogue = {key: (label, verl, meaning) for key, label, verl, meaning in METRICS}
    present = {key for m in columns for key in m}
    named = {key for g in GROUPS for key in g.keys}
    rest = [k for k in catalogue if k not in named] + sorted(present - set(catalogue) - named)
    out = []
    for group, keys in [(g, g.keys) for g in GROUPS] + [(REST, tuple(rest))]:
        rows = []
        for key in keys:
            if key not in present:
                continue
            label, verl, meaning = catalogue.get(key, (readable(key), "", ""))
            rows.append(MetricRow(key, label, verl, meaning,
                                  tuple(fmt_metric(key, m[key]) if key in m else "—" for m in columns)))
        if rows:
            out.append((group, rows))
    return out


#: at most this many pairs side by side in one metrics table; more are stacked in tables of equal size
MAX_PAIR_COLUMNS = 8


def metrics_view(pairs: list[dict], logprobs: Any) -> list[dict]:
    """The report's metrics: each group as one table per block of pairs (``MAX_PAIR_COLUMNS`` at most side by
    side), rows of label, verl name or key, meaning and one value per pair (``logprobs``: the one column when
    there are no pairs)."""

    def metrics(value: Any) -> dict:
        return current_names(value if isinstance(value, dict) else {})

    columns = [metrics(p.get("metrics")) for p in pairs] or [metrics(logprobs)]
    heads = [(str(p.get("train") or "?"), str(p.get("infer") or "?")) for p in pairs] or [("primary", "")]
    n_blocks = -(-len(columns) // MAX_PAIR_COLUMNS)
    size = -(-len(columns) // n_blocks)
    blocks = [range(start, min(start + size, len(columns))) for start in range(0, len(columns), size)]
    out = []
    for group, rows in group_metrics(columns):
        tables = [{"heads": [heads[i] for i in block],
                   "rows": [{"key": row.key, "label": row.label, "verl": row.verl, "meaning": row.meaning,
                             "cells": [row.values[i] for i in block]} for row in rows]} for block in blocks]
        out.append({"id": group.id, "title": group.title, "question": group.question, "folded": group is REST,
                    "count": len(rows), "tables": tables})
    return out
