"""Sampling semantics: are the tokens scored under the distribution they were drawn from?

In RL the behaviour policy is the distribution the sampler drew the tokens
from: the logits divided by its temperature, cut to its top-k / top-p support.
A trainer that scores them under another distribution computes a wrong
importance ratio, however close the kernels are. Two kinds of evidence, both
``framework_difference`` causes (docs/causes.md):

1. **The contract** (``contract_cause``). Each engine's contract reports the
   sampler's settings (``sampling_temperature``, ``sampling_top_k``,
   ``sampling_top_p``: the distribution it draws from, or, for a trainer, scores
   under) next to what its logprobs are of (``temperature``, ``logprobs_mode``).
   A difference is a ``sampling_semantics`` cause whatever the logprobs mode:
   raw rollout logprobs can match the trainer bit for bit while the tokens came
   from a sharper distribution.
2. **The numbers** (``analyse_pair`` and ``bos_finding``, pure numpy; a
   recorded rollout has no contract). In order, each a hypothesis tested against
   every pair that is not bitwise equal:

   * an off-by-one alignment: the logprobs match the trainer's shifted by one
     position (``token_alignment``);
   * a temperature on one side only: the training model's full-vocabulary
     log-probabilities at the scored positions (``reference_logprobs``,
     compressed by ``distribution.Reference``) predict any path's logprob of a token at any
     temperature, ``log_softmax(ref / T)[token]``; each path's T is fitted alone
     (least absolute error over a log grid, then golden-section), so a one-sided
     temperature shows as two different fits (``sampling_semantics``);
   * processed logprobs over a truncated support: what the fit leaves is a
     per-position offset ``-log(kept mass) >= 0``; ``truncation.identify``
     names the sampler and its parameters that reproduce it (top-k, top-p,
     min-p, top-k then top-p, typical-p), or reports a renormalisation over a
     support no sampler it knows describes ("sampler not identified", with the
     kept mass per token; not where the preflight found weights that differ,
     which shift the logprobs per position as well: a warning says so instead);
     a temperature and a truncation together are fitted
     jointly (``joint_temperature``), since each biases the other's fit alone
     (``sampling_semantics``);
   * a BOS on one side only: the trainer's model rescored with its BOS toggled
     matches the path (``tokens``).

Every hypothesis must leave at most ``EXPLAINS`` of the plain mean |diff|
unexplained; kernel noise never does, so a pure numerics gap gets no cause here
and is left to the operator-level diagnosis.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from logdiff.comparison.cause import Cause, Findings, framework_cause
from logdiff.diagnosis import truncation as support
from logdiff.diagnosis.distribution import Reference

if TYPE_CHECKING:
    from logdiff.comparison.result import ScanResult

#: the sampler's settings in each engine's contract (the distribution it draws tokens from)
SAMPLER_KEYS = ("sampling_temperature", "sampling_top_k", "sampling_top_p")
#: what each engine's logprobs are of
SCORING_KEYS = ("temperature", "logprobs_mode")
#: the synthetic boundary of the final log-probabilities (docs/result-schema.md)
BOUNDARY = "log_softmax"

#: a hypothesis is accepted when it leaves at most this fraction of the mean |diff| unexplained
EXPLAINS = 0.25
#: temperatures closer than this (in |log T|) count as equal
SAME_TEMPERATURE = 0.03
#: the temperature search range
T_MIN, T_MAX = 0.05, 20.0
#: at most this many scored positions feed the fits (the full-vocabulary reference is [positions, vocab])
MAX_FIT_POSITIONS = 256
#: the BOS test rescores the first sequences until this many positions: a BOS on one side only moves every
#: logprob far beyond kernel noise, so a few dozen positions decide it, and each rescored sequence is a forward
BOS_TEST_POSITIONS = 64
#: an offset below this many nats is no truncation (float32 log_softmax of a sharp distribution)
MIN_OFFSET = 1e-3
#: a truncation is named only from offsets at this many positions at least (one odd token is noise)
MIN_CUT_POSITIONS = 3
#: a truncation fitted jointly with a temperature replaces one at the given temperature where a sampler is
#: named only jointly, or where the closest sampler leaves at most this fraction of its error
JOINT_BETTER = 0.5


# ----------------------------------------------------------------------------- numpy core


def tempered(ref: np.ndarray, tokens: np.ndarray, temperature: float) -> np.ndarray:
    """``log_softmax(ref / T)[token]`` per row of ``ref`` ([N, V] logits or log-probabilities), exactly."""
    z = np.asarray(ref, np.float64) / temperature
    top = z.max(-1)
    lse = top + np.log(np.exp(z - top[:, None]).sum(-1))
    return z[np.arange(len(tokens)), tokens] - lse


def _mean_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))) if len(a) else 0.0


def fit_temperature(ref: Reference, observed: np.ndarray) -> tuple[float, float]:
    """(T, mean |observed - the reference's logprob at T|) at the best-fitting temperature."""

    def err(log_t: float) -> float:
        return _mean_abs(observed, ref.tempered(math.exp(log_t)))

    grid = np.linspace(math.log(T_MIN), math.log(T_MAX), 49)
    errs = [err(g) for g in grid]
    i = int(np.argmin(errs))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(30):  # golden-section search inside the best grid cell's neighbourhood
        c, d = hi - golden * (hi - lo), lo + golden * (hi - lo)
        if err(c) <= err(d):
            hi = d
        else:
            lo = c
    best = (lo + hi) / 2
    return math.exp(best), err(best)


def alignment_errors(
    train: Sequence[np.ndarray], other: Sequence[np.ndarray], masks: Sequence[Sequence[int] | None]
) -> dict[int, float]:
    """Mean |train[t + s] - other[t]| over scored positions, for shifts s = -1, 0, +1."""
    out = {}
    for s in (-1, 0, 1):
        diffs = []
        for a, b, m in zip(train, other, masks):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            n = len(b)
            keep = np.ones(n, bool) if m is None else np.asarray(m, bool)
            t = np.arange(max(0, -s), min(n, n - s))
            t = t[keep[t] & keep[t + s]]
            diffs.append(np.abs(a[t + s] - b[t]))
        d = np.concatenate(diffs) if diffs else np.zeros(0)
        out[s] = float(d.mean()) if len(d) else math.inf
    return out


def truncation(ref: Reference, observed: np.ndarray, temperature: float, plain: float) -> dict[str, Any] | None:
    """Processed logprobs over a truncated support at T, or None.

    Reported when a sampler reproduces the per-position offsets
    ``-log(kept mass) >= 0`` (``support.identify``: named with its parameters),
    or when they are a renormalisation over a support none of them describes
    (``sampler`` None), leaving at most ``EXPLAINS`` of the ``plain`` gap and of
    the gap at T without a truncation: an offset of the right sign alone is not
    enough. ``kept_mass``: per fitted position, ``exp(-offset)``.
    """
    rest = np.asarray(observed, np.float64) - ref.tempered(temperature)
    offset = np.maximum(rest, 0.0)
    if (offset > MIN_OFFSET).sum() < MIN_CUT_POSITIONS:
        return None
    found = support.identify(ref, observed, temperature, EXPLAINS * min(plain, float(np.mean(np.abs(rest)))))
    if found is None:  # better than this T without a truncation, too
        return None
    return {"positions": int((offset > MIN_OFFSET).sum()), "offset_max": float(offset.max()),
            "offset_mean": float(offset.mean()), "explained": found.error, "closest": found.closest,
            "sampler": found.sampler, **{k: found.params.get(k) for k in support.PARAMETERS}, "also": found.also,
            "kept_mass": np.exp(-offset)}  # fmt: skip


def joint_temperature(ref: Reference, observed: np.ndarray) -> tuple[float, float]:
    """(T, error) of the best temperature *with* its best truncation: both processed on one side."""

    def err(log_t: float) -> float:
        return support.cheapest_error(ref, observed, math.exp(log_t))

    grid = np.linspace(math.log(0.1), math.log(10.0), 41)
    errs = [err(g) for g in grid]
    i = int(np.argmin(errs))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(20):
        c, d = hi - golden * (hi - lo), lo + golden * (hi - lo)
        if err(c) <= err(d):
            hi = d
        else:
            lo = c
    best = (lo + hi) / 2
    return math.exp(best), err(best)


def analyse_pair(
    train: Sequence[np.ndarray],
    other: Sequence[np.ndarray],
    masks: Sequence[Sequence[int] | None],
    ref: Sequence[Reference] | None = None,
) -> dict[str, Any] | None:
    """The sampling finding for one (train, other) pair of per-token logprobs, or None.

    ``ref``: the training model's distribution at the response positions of
    the first sequences (``reference_logprobs``); without it only the
    alignment is tested.
    """
    align = alignment_errors(train, other, masks)
    as_is = align[0]
    if as_is == 0.0:
        return None
    shift = min((-1, 1), key=lambda s: align[s])
    if align[shift] <= EXPLAINS * as_is:
        return {"kind": "token_alignment", "shift": shift, "mean_abs_diff": {"as_is": as_is, "explained": align[shift]}}
    if not ref:
        return None
    n = len(ref)
    keep = [np.ones(len(r), bool) if m is None else np.asarray(m, bool) for r, m in zip(ref, masks[:n])]
    R = Reference.concat([r.rows(k) for r, k in zip(ref, keep)])
    a = np.concatenate([np.asarray(x, np.float64)[k] for x, k in zip(train[:n], keep)])
    b = np.concatenate([np.asarray(x, np.float64)[k] for x, k in zip(other[:n], keep)])
    t_train, _ = fit_temperature(R, a)
    t_train = 1.0 if abs(math.log(t_train)) < SAME_TEMPERATURE else t_train
    t_other, err_other = fit_temperature(R, b)
    t_other = 1.0 if abs(math.log(t_other)) < SAME_TEMPERATURE else t_other
    plain = _mean_abs(b, R.tempered(t_train))  # the other path under the trainer's temperature
    finding: dict[str, Any] = {"kind": "sampling_semantics", "positions": len(R), "temperature": None,
                               "truncation": None}  # fmt: skip
    if abs(math.log(t_other / t_train)) >= SAME_TEMPERATURE and err_other <= EXPLAINS * plain:
        finding["temperature"] = {"train": round(t_train, 3), "other": round(t_other, 3)}
        finding["mean_abs_diff"] = {"as_is": plain, "explained": err_other}
    cut = truncation(R, b, t_other if finding["temperature"] else t_train, plain)
    # A temperature and a truncation together bias the temperature-only fit, and a truncation can fit loosely at
    # a wrong T: fit both, and keep the joint fit where it alone names a sampler, or its closest sampler leaves at
    # most JOINT_BETTER of the error the closest one leaves at the T fitted alone.
    t_joint, err_joint = joint_temperature(R, b)
    t_joint = t_train if abs(math.log(t_joint / t_train)) < SAME_TEMPERATURE else t_joint
    if cut is None or t_joint != (t_other if finding["temperature"] else t_train):
        joint = truncation(R, b, t_joint, plain)
        better = joint is not None and (cut is None or (joint["sampler"] is not None and cut["sampler"] is None)
                                        or joint["closest"] <= JOINT_BETTER * cut["closest"])  # fmt: skip
        if better and (finding["temperature"] is None or err_joint <= EXPLAINS * err_other):
            cut = joint
            finding["temperature"] = {"train": round(t_train, 3), "other": round(t_joint, 3)} if t_joint != t_train else None
    if cut is not None and cut["top_k"] == 1 and cut["top_p"] is None:  # over one kept token every logprob is 0 whatever T
        finding["temperature"] = None
    if cut is not None:
        finding["truncation"] = cut
        finding["mean_abs_diff"] = {"as_is": plain, "explained": cut.pop("explained")}
        del cut["closest"]
        mass, at = cut.pop("kept_mass"), np.cumsum([0, *(int(k.sum()) for k in keep)])
        cut["kept_mass"] = [[None] * len(k) for k in keep]  # per fitted sequence and response token (null: unscored)
        for row, k, lo in zip(cut["kept_mass"], keep, at):
            for j, m in zip(np.flatnonzero(k), mass[lo:]):
                row[j] = round(float(m), 4)
    return finding if finding["temperature"] or finding["truncation"] else None


def bos_finding(
    other: Sequence[np.ndarray],
    masks: Sequence[Sequence[int] | None],
    ref: Sequence[Reference],
    toggled: Sequence[Reference],
    added: bool,
) -> dict[str, Any] | None:
    """A BOS on one side only: ``other`` matches the trainer's logprobs with the BOS toggled far better.

    ``ref``: the training model on the sequences as given (the rows its scoring pass
    kept, ``full_logprobs``); ``toggled``: with the BOS prepended (``added``) or removed,
    from an unpadded forward, for the first of those sequences (``BOS_TEST_POSITIONS``).
    Both differ from ``other`` by kernel rounding at most, far below what a BOS on one
    side only moves.
    """
    n = min(len(ref), len(toggled))
    keep = [np.ones(len(r), bool) if m is None else np.asarray(m, bool) for r, m in zip(ref[:n], masks[:n])]
    b = np.concatenate([np.asarray(x, np.float64)[k] for x, k in zip(other[:n], keep)])
    as_is = _mean_abs(b, np.concatenate([r.chosen[k] for r, k in zip(ref, keep)]))
    explained = _mean_abs(b, np.concatenate([r.chosen[k] for r, k in zip(toggled, keep)]))
    if as_is == 0.0 or explained > EXPLAINS * as_is:
        return None
    return {"kind": "tokens", "bos": "missing" if added else "extra", "positions": len(b),
            "mean_abs_diff": {"as_is": as_is, "explained": explained}}  # fmt: skip


# ----------------------------------------------------------------------------- the training model's distribution


def reference_logprobs(
    engine: Any, seqs: Sequence[Any], limit: int = MAX_FIT_POSITIONS, prompt: Callable[[list[int]], list[int]] = list
) -> list[Reference] | None:
    """The training engine's fp32 ``log_softmax`` at the response positions of the first sequences, compressed.

    The engine's ``full_logprobs`` (each prompt passed through ``prompt``: the
    BOS test toggles a BOS), until ``limit`` positions are covered. An engine
    without that capability gives None: the numbers are then tested for
    alignment only.
    """
    if "full_logprobs" not in engine.capabilities:
        return None
    full = engine.full_logprobs(list(seqs), limit, prompt)
    return [Reference.of(lp, np.asarray(s.response_ids)) for lp, s in zip(full, seqs)]


# ----------------------------------------------------------------------------- causes

_LABEL = {"sampling_temperature": "temperature", "sampling_top_k": "top-k", "sampling_top_p": "top-p"}


def _reports(contract: dict[str, Any]) -> str:
    """What one side's logprobs are of, from its contract."""
    if contract.get("logprobs_mode") == "processed_logprobs":
        return (f"processed logprobs (after temperature {contract.get('temperature'):g}, top-k "
                f"{contract.get('sampling_top_k') or 'off'}, top-p {contract.get('sampling_top_p', 1.0):g})")  # fmt: skip
    return "raw logprobs (log_softmax of the unscaled logits, full vocabulary)"


def contract_cause(contracts: dict[str, Any] | None) -> Cause | None:
    """The ``sampling_semantics`` cause of differing sampler or scoring settings, or None."""

    differs = [k for k in (*SAMPLER_KEYS, *SCORING_KEYS) if k in ((contracts or {}).get("differs") or [])]
    if not differs:
        return None
    train, infer = contracts["train"], contracts["infer"]
    evidence = [f"the sampler draws tokens with {_LABEL[k]} = {infer[k]!r}; the trainer scores them with "
                f"{_LABEL[k]} = {train[k]!r}" for k in differs if k in SAMPLER_KEYS]  # fmt: skip
    evidence += [f"contract differs: {k} = {train[k]!r} (train) vs {infer[k]!r} (infer)" for k in differs if k in SCORING_KEYS]
    evidence.append(f"logprobs reported: train {_reports(train)}; infer {_reports(infer)}")
    if any(k in SAMPLER_KEYS for k in differs):
        evidence.append("the behaviour policy is the distribution the tokens were drawn from: scored under another "
                        "one, the importance ratio is wrong whatever logprobs the engine reports")  # fmt: skip
        t = infer["sampling_temperature"]
        cut = infer["sampling_top_k"] != train.get("sampling_top_k") or infer["sampling_top_p"] != train.get("sampling_top_p")
        fix = (f"score with the sampler's distribution in the trainer: divide the logits by {t:g} before log_softmax"
               + (" and apply the same top-k/top-p" if cut else "")
               + ", and have the engine report that distribution's logprobs (vLLM logprobs_mode=processed_logprobs); "
               "or sample with the trainer's settings")  # fmt: skip
    else:
        fix = (f"report the sampled distribution's logprobs on both sides: vLLM logprobs_mode=processed_logprobs, "
               f"trainer logits divided by the sampler's temperature {infer.get('sampling_temperature', 1.0):g}")
    return framework_cause(BOUNDARY, "log_softmax", "sampling_semantics", evidence, fix, differs)


def _finding_lines(path: str, f: dict[str, Any]) -> tuple[list[str], str]:
    """(evidence, fix) of one path's numeric finding."""
    mad = f["mean_abs_diff"]
    if f["kind"] == "token_alignment":
        s = f["shift"]
        held = "the next response token's" if s == 1 else "the previous response token's"
        evidence = [f"the {path} logprobs match the trainer's shifted by {s:+d} position (mean |diff| {mad['explained']:.3g}) "
                    f"far better than as given ({mad['as_is']:.3g}): each holds {held} logprob"]  # fmt: skip
        drop = "is missing its first entry" if s == 1 else "has an extra leading entry (e.g. the prompt's last token)"
        fix = (f"align the recorded logprobs with the response tokens: logprob i must be that of response token i; "
               f"the {path} list {drop}")
        return evidence, fix
    if f["kind"] == "tokens":
        missing = f["bos"] == "missing"
        evidence = [f"the {path} logprobs match the trainer's with the BOS (id {f['bos_id']}) "
                    f"{'prepended' if missing else 'removed'} (mean |diff| {mad['explained']:.3g}) far better than as "
                    f"given ({mad['as_is']:.3g}): the {path} side {'saw a BOS the trainer' if missing else 'lacked the BOS the trainer'}"
                    f"{' lacks' if missing else ' has'}"]  # fmt: skip
        fix = ("tokenize the trainer's prompts exactly as the rollout did: "
               + ("add the BOS (add_special_tokens / the chat template)" if missing else "drop the extra BOS"))
        return evidence, fix
    evidence, fixes = [], []
    temp = f.get("temperature")
    if temp:
        tt, to = temp["train"], temp["other"]
        evidence.append(f"the {path} logprobs are the training model's at temperature {to:g} (fit over {f['positions']} "
                        f"positions: mean |diff| {mad['as_is']:.3g} at the trainer's temperature {tt:g}, "
                        f"{mad['explained']:.3g} at {to:g})")  # fmt: skip
        if tt == 1.0:
            evidence.append(f"logprobs reported: train raw (T = 1); {path} processed, after temperature {to:g}")
            fixes.append(f"divide the trainer's logits by the rollout temperature {to:g} before log_softmax (the "
                         "distribution the tokens were drawn from; verl applies rollout.temperature in the actor)")
        elif to == 1.0:
            evidence.append(f"logprobs reported: train at temperature {tt:g}; {path} raw (T = 1)")
            fixes.append(f"have the engine report processed logprobs (vLLM logprobs_mode=processed_logprobs) at the "
                         f"sampling temperature {tt:g} the trainer scores with")
        else:
            fixes.append(f"use one temperature on both sides (trainer {tt:g}, {path} {to:g})")
    cut = f.get("truncation")
    if cut:
        evidence.append(_truncation_line(path, cut))
        if cut.get("sampler", "named") is None:
            fixes.append("compare like with like: vLLM logprobs_mode=raw_logprobs against an untruncated trainer, or "
                         "apply the rollout's own truncation (its sampler settings and logits processors) in the trainer")
        else:
            fixes.append(f"compare like with like: vLLM logprobs_mode=raw_logprobs against an untruncated trainer, or "
                         f"apply the sampler's {_support_label(cut)} in the trainer")
    return evidence, "; ".join(fixes)


def _support_label(cut: dict[str, Any]) -> str:
    """``min-p = 0.1``, ``top-k = 20, then top-p = 0.9`` (results written before min-p name top-k or top-p)."""
    named = {k: cut[k] for k in support.PARAMETERS if cut.get(k) is not None}
    return support.Support(cut.get("sampler"), named, 0.0).label()


def _truncation_line(path: str, cut: dict[str, Any]) -> str:
    """The evidence of processed logprobs over a truncated support: the sampler, or the kept mass it left."""
    head = (f"the {path} logprobs exceed the trainer's by a per-position offset >= 0 at {cut['positions']} positions "
            f"(up to {cut['offset_max']:.3g} nats): processed logprobs ")  # fmt: skip
    mass = [m for row in cut.get("kept_mass") or [] for m in row if m is not None]
    kept = f"; kept mass per token: mean {np.mean(mass):.3g}, min {min(mass):.3g}, max {max(mass):.3g}" if mass else ""
    if cut.get("sampler", "named") is None:
        why = (f"{', '.join(cut['also'])} fit about equally, none closely" if cut.get("also") else
               "no top-k, top-p, min-p, top-k then top-p or typical-p reproduces the offsets")  # fmt: skip
        return head + f"renormalised over a truncated support, sampler not identified ({why})" + kept
    also = f" ({', '.join(cut['also'])} fits almost as well)" if cut.get("also") else ""
    return head + f"renormalised over a truncated support ({_support_label(cut)}){also}" + kept


def numeric_causes(findings: dict[str, dict[str, Any]]) -> list[Cause]:
    """One cause per finding kind, over the paths (pairs with the trainer) that show it."""

    out: list[Cause] = []
    for kind in ("sampling_semantics", "token_alignment", "tokens"):
        paths = {p: f for p, f in findings.items() if f["kind"] == kind}
        if not paths:
            continue
        evidence, fixes = [], []
        for path, f in paths.items():
            lines, fix = _finding_lines(path, f)
            evidence += lines
            fixes += [fix] if fix not in fixes else []
        cause = framework_cause(BOUNDARY, "log_softmax", kind, evidence, "; ".join(fixes))
        cause.paths, cause.sampling = list(paths), paths
        out.append(cause)
    return out


def _bos_test(run: Any, other: Sequence[np.ndarray], masks: list, ref: list[Reference], cache: dict) -> dict[str, Any] | None:
    """Rescore the first sequences with the model's BOS prepended (or removed where every prompt starts with it)
    and compare.

    The rescored references are computed once per scan (``cache``) and shared by every pair.
    """
    bos = getattr(run.train_engine.loaded_config(), "bos_token_id", None)
    if bos is None:
        return None
    added = not all(s.prompt_ids[:1] == [bos] and len(s.prompt_ids) > 1 for s in run.sequences)

    def toggle(prompt: list[int]) -> list[int]:
        return [bos, *prompt] if added else prompt[1:]

    if "toggled" not in cache:
        cache["toggled"] = reference_logprobs(run.train_engine, run.sequences, BOS_TEST_POSITIONS, toggle) or []
    toggled = cache["toggled"]
    f = bos_finding(other, masks, ref, toggled, added) if toggled else None
    if f is not None:
        f["bos_id"] = int(bos)
    return f


def _no_sampler_named(f: dict[str, Any]) -> bool:
    """A finding of a renormalisation alone, over a support no sampler describes (the least specific one)."""
    cut = f.get("truncation")
    return f["kind"] == "sampling_semantics" and not f["temperature"] and bool(cut) and cut["sampler"] is None


def diagnose(result: ScanResult, run: Any, infer: Any) -> Findings:
    """The sampling causes of a scan, from the contract and from the numbers of each differing pair.

    ``run`` is the scan's ``PathRun``, ``infer`` the primary pair's inference
    engine (its contract; the preflight's, when ``result.contracts`` holds one).
    """
    from logdiff.diagnosis.preflight import preflight

    contracts = result.contracts or preflight(run.train_engine, infer, weights=False)
    masks = [s.response_mask for s in run.sequences]
    differing = ((contracts or {}).get("weights") or {}).get("differs") or []
    found = Findings()
    fits: dict[str, dict[str, Any]] = {}
    ref: list[Reference] | None = None
    bos_cache: dict[str, Any] = {}
    for scores, pair in zip(run.infers, result.pairs):
        if pair.bitwise_equal:
            continue
        f = analyse_pair(run.train.logprobs, scores.logprobs, masks)
        if f is None:
            if ref is None:
                try:
                    ref = reference_logprobs(run.train_engine, run.sequences) or []
                except Exception as e:  # noqa: BLE001 - the alignment test and the contract still stand
                    found.warnings.append(f"sampling fit skipped ({type(e).__name__}: {e})")
                    ref = []
            f = analyse_pair(run.train.logprobs, scores.logprobs, masks, ref)
        if ref and (f is None or _no_sampler_named(f)):  # a BOS on one side is the more specific explanation
            f = _bos_test(run, scores.logprobs, masks, ref, bos_cache) or f
        if f is not None and _no_sampler_named(f) and differing:
            # other weights shift a token's logprob per position too, which truncation.py's NOISE_BELOW rule tells
            # apart only statistically: with weights known to differ, a support no sampler describes is no evidence
            found.warnings.append(f"{scores.path}: its logprobs exceed the trainer's by a per-position offset, as "
                                  f"over a truncated support no sampler describes, but {len(differing)} weight(s) "
                                  "differ, which shifts them as well: no truncation is reported")
            f = None
        if f is not None:
            fits[scores.path] = f
    found.causes = [c for c in [contract_cause(contracts)] if c is not None] + numeric_causes(fits)
    return found
