"""How to read the causes' shares: the words every renderer shows beside them.

Attribution (logdiff/diagnosis/attribute.py, docs/causes.md) gives each lever
a Shapley share of the mean |Δ logprob| gap and splits it equally among the
causes the lever neutralises; a group's share is the sum of its causes'. The
shares add up to ``attribution.closed``, the fraction of the gap that every
fix applied together closes. A negative share is easy to misread, so the
terminal summary, the HTML report and ``logdiff explain`` all say in words
what one means wherever it appears (``NEGATIVE``), and all show what the
shares sum to (``note``).

Shares are not a plan, so ``action`` says what to do in plain words: what the
fixes close together, and what each does alone (``alone``: the mean and the max
|Δ logprob| with only that lever applied), naming the ones that alone make the
gap worse. Where one does, fixing one family at a time would look like a
regression, and ``worse_alone`` lets ``logdiff explain`` suggest them together.

Results written before Shapley attribution (no ``attribution.closed``) keep
their old meaning, the fraction of the max |Δ logprob| one lever alone
removes: ``shapley`` is None for them and the renderers keep their old words.
"""

from __future__ import annotations

from typing import Any

from .format import fmt_fraction, fmt_num, is_number

#: what a negative share means, said beside one
NEGATIVE = "negative: on average, fixing it widens the gap; it interacts with the others"
#: the same in a table cell, where the bar of a positive share is (NEGATIVE in full is its tooltip)
NEGATIVE_HINT = "widens the gap"


def shapley(result: dict[str, Any]) -> dict[str, Any] | None:
    """The result's attribution when it holds Shapley shares (``closed``), else None."""
    attribution = result.get("attribution")
    if isinstance(attribution, dict) and is_number(attribution.get("closed")):
        return attribution
    return None


def is_negative(share: Any) -> bool:
    return is_number(share) and share < 0


def note(result: dict[str, Any], negative: bool | None = None, detail: bool = True) -> str | None:
    """What the shares are and what they sum to, and what to do (None for a result without Shapley shares).

    ``negative``: whether a negative share is shown (default: any cause's share is negative). ``detail``: say
    what each fix does alone (the terminal, short of lines, names only the ones that widen the gap).
    """
    attribution = shapley(result)
    if attribution is None:
        return None
    closed = attribution["closed"]
    how = (f", estimated from {attribution.get('permutations')} sampled orders"
           if attribution.get("method") == "sampled" else "")
    text = (f"Share: a Shapley part of the mean |Δ logprob| gap{how}; the shares sum to "
            f"{fmt_fraction(closed)}, what all fixes together close{_max_together(attribution)}.")
    plan = action(result, together=False, detail=detail)
    if plan:
        text += " " + plan
    if negative is None:
        negative = any(is_negative(c.get("share")) for c in result.get("causes") or [] if isinstance(c, dict))
    if negative:
        text += " A negative share: on average, fixing that cause widens the gap; it interacts with the others."
    return text


#: a relative change smaller than this reads as "unchanged" (the numbers are exact, but 0.01% moves nothing)
UNCHANGED = 5e-4


def lever_name(lever: Any) -> str:
    """What a lever fixes, in a word: ``kernel:rope`` -> ``rope``, ``config:rms_norm_eps`` -> ``rms_norm_eps``,
    ``weights`` -> ``the weights``."""
    name = str(lever)
    return "the weights" if name == "weights" else name.split(":", 1)[-1]


def alone(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each lever applied alone: ``name``, ``family`` (a kernel lever's), ``mean`` (the relative change of the
    mean |Δ logprob|: +0.14 is 14% wider) and ``max`` (the same of the max), None where not measured."""
    attribution = shapley(result)
    if attribution is None:
        return []
    base, top = attribution.get("baseline"), attribution.get("baseline_abs_diff_max")
    out = []
    for lever in attribution.get("levers") or []:
        if not isinstance(lever, dict):
            continue
        mean, peak = lever.get("alone_abs_diff_mean"), lever.get("alone")
        name = str(lever.get("lever"))
        out.append({"name": lever_name(name),
                    "family": name.split(":", 1)[1] if name.startswith("kernel:") else None,
                    "mean": mean / base - 1 if is_number(mean) and is_number(base) and base > 0 else None,
                    "max": peak / top - 1 if is_number(peak) and is_number(top) and top > 0 else None})
    return out


def worse_alone(result: dict[str, Any]) -> list[str]:
    """The levers that, applied alone, widen the mean or the max |Δ logprob| (none for one lever: alone is all)."""
    levers = alone(result)
    if len(levers) < 2:
        return []
    return [x["name"] for x in levers if any(is_number(x[k]) and x[k] > UNCHANGED for k in ("mean", "max"))]


def _pct(x: float) -> str:
    """A relative change for prose, two digits: 0.1402 -> '14%', 0.0116 -> '1.2%'."""
    return f"{100 * x:.2g}%"


def _effect(change: Any, what: str) -> tuple[int, str] | None:
    """(direction, words) of a relative change of ``what``: (1, 'widens the mean gap by 14%')."""
    if not is_number(change):
        return None
    if abs(change) <= UNCHANGED:
        return 0, f"leaves {what} as it is"
    verb = "widens" if change > 0 else "narrows"
    return (1 if change > 0 else -1), f"{verb} {what} by {_pct(abs(change))}"


def _max_together(attribution: dict[str, Any]) -> str:
    """' (max |Δ logprob| 0.0305 → 0)': the max with no lever and with all, where both were measured."""
    top, rest = attribution.get("baseline_abs_diff_max"), attribution.get("residual_abs_diff_max")
    return f" (max |Δ logprob| {fmt_num(top)} → {fmt_num(rest)})" if is_number(top) and is_number(rest) else ""


def _alone_words(lever: dict[str, Any]) -> str:
    """'rope widens the mean gap by 3.65% and the max by 85.4%'; 'but' where the two move apart."""
    mean, peak = _effect(lever["mean"], "the mean gap"), _effect(lever["max"], "the max")
    if mean is None or peak is None:
        return f"{lever['name']} " + (mean or peak or (0, "was not measured alone"))[1]
    if peak[0] == 0:
        return f"{lever['name']} {mean[1]}"
    if mean[0] == peak[0]:  # the same verb: say it once
        return f"{lever['name']} {mean[1]} and the max by {peak[1].rsplit(' by ', 1)[1]}"
    return f"{lever['name']} {mean[1]} but {peak[1]}"


def action(result: dict[str, Any], together: bool = True, detail: bool = True) -> str | None:
    """What to do, in plain words: what all fixes close together (``together``), what each does alone
    (``detail``), and, where one alone makes the gap worse, to apply them together (None without Shapley
    attribution or levers)."""
    attribution = shapley(result)
    levers = alone(result)
    if attribution is None or not levers:
        return None
    closed, n = attribution["closed"], len(levers)
    parts = []
    if together:
        subject, s = (f"Together, the {n} fixes", "") if n > 1 else ("The fix", "s")
        does = (f"close{s} {fmt_fraction(closed)} of the mean gap" if closed >= 0 else
                f"widen{s} the mean gap by {fmt_fraction(-closed)}")
        parts.append(f"{subject} {does}{_max_together(attribution)}.")
    if n > 1:
        if detail:
            parts.append("Fixed alone, " + "; ".join(_alone_words(x) for x in levers) + ".")
        worse = worse_alone(result)
        if len(worse) == n:
            parts.append("Alone, each widens the mean or the max gap: apply the fixes together, not one at a time.")
        elif worse:
            parts.append(f"Alone, {listed(worse)} widen{'s' if len(worse) == 1 else ''} the mean or the max gap: "
                         "apply the fixes together, not one at a time.")
        else:
            parts.append("Each narrows the gap on its own.")
    return " ".join(parts)


def listed(names: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]

