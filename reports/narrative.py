"""``logdiff explain``: a plain-language account of a result, for an RL engineer.

It reads only the result dict (docs/result-schema.md) and says, in order:
what diverged and by how much in the terms an RL run feels (importance ratio,
clip fraction), where the two engines first part, why (each group of causes, ``groups.py``,
with its class, sites, the evidence that decided it and its share, and what the fixes do together and alone:
``shares.py``), how sure the tool is (the causes counted by the kind of evidence they rest on:
``evidence.py``), and what to do next, in commands an installed logdiff can run. ``evidence=True``
(``logdiff explain --evidence``) shows every evidence line of each group instead of the deciding ones.
"""

from __future__ import annotations

from typing import Any

from . import evidence as proof
from . import positions, shares
from .format import current_names, terminal_safe
from .groups import cause_groups

VERDICT_LINE = {
    "consistent": "The training and inference paths agree bit for bit on every scored token.",
    "divergent": "The paths disagree, and the scan did not classify why (run with --depth modules; an op that "
    "no exact function could judge is listed as not judged).",
    "operator_path": "The paths compute the same function; they differ only in how kernels do the arithmetic.",
    "framework_difference": "The paths compute different functions: a setting, a weight or a semantic differs.",
    "mixed": "Both kinds of cause are present: a real semantic difference and kernel-level arithmetic differences.",
    "unexplained": "Part of the gap enters after the last compared boundary (the sampler, a logits processor, "
    "anything between the head and the returned logprobs), beyond what the ops before it can explain, and no cause "
    "identifies it (see closure).",
}


def _num(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _impact(result: dict[str, Any]) -> list[str]:
    m = result["logprobs"]
    pair = result["pairs"][0]
    lines = [
        f"Between {pair['train']} (training) and {pair['infer']} (inference), over {m.get('num_tokens', '?')} "
        f"response tokens: max |Δ logprob| {_num(m['abs_diff_max'])}, mean {_num(m['abs_diff_mean'])}, "
        f"{100 * (m.get('bitwise_equal_fraction') or 0):.0f}% of tokens bitwise equal."
    ]
    if "ratio_min" in m:
        m = current_names(m)
        lines.append(
            f"In PPO terms the importance ratio ranges {_num(m['ratio_min'])}–{_num(m['ratio_max'])}; "
            f"{100 * (m.get('ratio_outside_band_0.2') or 0):.1f}% of tokens leave 1 ± 0.2 from this gap alone, "
            f"where PPO clips them for one sign of the advantage (k3 KL {_num(m.get('k3_kl'))})."
        )
    return lines


def _rollout(result: dict[str, Any]) -> list[str]:
    """Whether today's inference engine reproduces the recorded rollout logprobs (docs/rollout-dumps.md)."""
    replay = result.get("rollout_replay")
    if not isinstance(replay, dict) or not replay.get("summary"):
        return []
    return [f"Recorded rollout: {replay['summary']}."]


def _where(result: dict[str, Any]) -> list[str]:
    fd = result.get("first_divergence")
    if not fd:
        if result["settings"].get("depth") == "logprobs" and result["verdict"] != "consistent":
            return ["Where: not probed. Rerun with --depth modules to find the first op where the engines part."]
        return []
    inputs = ("its inputs were bitwise equal, so the error starts there" if fd.get("inputs_equal") else
              "its inputs already differed")
    rows = positions.first_divergence(result)
    largest = positions.worst_text(rows, _num) or f"max |Δ| {_num(fd.get('max_abs_diff'))}"
    first = positions.first_text(rows) or "a version 1 result does not record the first position"
    return [f"Where: the values first part at {fd['boundary']} ({first}; {largest}); {inputs}."]


def _why(result: dict[str, Any], every: bool = False) -> list[str]:
    groups = cause_groups(result)
    if not groups:
        return []
    lines = ["Why:"]
    shapley = shares.shapley(result) is not None
    for g in groups:
        share = g.get("share")
        share_text = ""
        if isinstance(share, (int, float)) and not isinstance(share, bool) and shapley:
            share_text = f"; its share of the mean gap is {100 * share:.0f}%" + (
                f" ({shares.NEGATIVE})" if share < 0 else "")
        elif isinstance(share, (int, float)) and not isinstance(share, bool):  # a result before Shapley shares
            share_text = (f"; neutralising it alone removes {100 * share:.0f}% of the gap" if share >= 0 else
                          f"; neutralising it alone makes the gap {-100 * share:.0f}% larger (the causes interact)")
        necessary = " It must be fixed to reach logdiff = 0." if g.get("necessity") else ""
        count = g.get("count") or len(g.get("sites") or [])
        sites = f"{count} sites, " if count > 1 else ""
        lines.append(f"  - {str(g['class']).replace('_', ' ')} ({str(g['kind']).replace('_', ' ')}, "
                     f"{g.get('family')}) at {sites}{g.get('layers')}{share_text}.{necessary}")
        shown = [str(e) for e in g.get("evidence") or []] if every else proof.decisive(result, g)
        lines += [f"      evidence: {e}" for e in shown]
        hidden = len([e for e in g.get("evidence") or [] if str(e) not in shown])
        if hidden:
            lines.append(f"      ({hidden} more evidence line{'s' if hidden != 1 else ''}: logdiff explain --evidence)")
        lines.append(f"      fix: {g.get('fix')}")
    note = shares.note(result, negative=any(shares.is_negative(g.get("share")) for g in groups))
    return lines + ([f"  {note}"] if note else [])


def _confidence(result: dict[str, Any]) -> list[str]:
    lines = proof.how_sure(result)
    residual = (result.get("attribution") or {}).get("residual_abs_diff_max")
    if residual is not None and "levers were left out" in str((result.get("attribution") or {}).get("fallback")):
        lines.append(f"With the causes attribution could neutralise fixed the gap is {_num(residual)}; the kernel "
                     "causes could not be rescanned on this engine (see attribution.fallback), so their part is "
                     "not measured.")
    elif residual is not None:
        lines.append(
            "With every cause neutralised the gap is "
            + ("exactly 0: the causes found explain all of it." if residual == 0 else f"{_num(residual)}: something is still unexplained.")
        )
    if not result.get("complete", True) or result.get("warnings"):
        lines += [f"Caveat: {w}" for w in result.get("warnings", [])[:3]]
    return lines


def _next(result: dict[str, Any]) -> list[str]:
    v = result["verdict"]
    if v == "consistent":
        return ["Next: nothing to fix. Guard it in CI with `logdiff check ... --max-abs-diff 0`."]
    if v == "divergent":
        return ["Next: rerun with --depth modules to localize and classify the divergence."]
    steps = []
    if v == "unexplained":
        closure = result.get("closure") or {}
        steps.append(f"find what one side applies after {closure.get('enters_after') or 'the last compared boundary'} "
                     "and the other does not (a logits processor, the sampler's processed logprobs, a transform of "
                     f"the returned logprobs): it moves the logprobs by up to {closure.get('unexplained_max', 0):.3g} "
                     "beyond what every op before it can; no kernel fix closes that")
    if v in ("framework_difference", "mixed"):
        steps.append("fix the framework differences first (they change the function, not just its rounding)")
    if v in ("operator_path", "mixed"):
        worse = shares.worse_alone(result)
        families = [x["family"] for x in shares.alone(result) if x["family"]]
        if worse:  # one family at a time would look like a regression here: the fixes go together
            buys = (f"`--consistent-kernels {','.join(families)}` applies these fixes together (alone, "
                    f"{shares.listed(worse)} widen{'s' if len(worse) == 1 else ''} the mean or the max gap, so do not "
                    "try them one family at a time)" if families else "apply the fixes together, not one at a time")
        else:
            buys = "`--consistent-kernels FAMILY` which kernel family buys what"
        steps.append(("then " if steps else "") + "decide whether the operator-path gap matters: `logdiff scan MODEL "
                     f"--consistent` shows logdiff = 0 is reachable, {buys}, and `logdiff kernels --self-test` checks "
                     "the reference kernels on this machine; otherwise importance-sampling correction absorbs it")
    steps.append("keep it fixed with `logdiff check` and a baseline")
    return ["Next: " + "; ".join(steps) + "."]


def _non_finite(result: dict[str, Any]) -> list[str]:
    found = result.get("non_finite")
    if not isinstance(found, dict):
        return []
    return [f"Warning: non-finite values (NaN/inf) on a path. {found.get('summary', '')}".rstrip(),
            "The metrics that read them are not numbers; fix the cause below before reading anything else."]


def explain(result: dict[str, Any], evidence: bool = False) -> str:
    """The account as plain text (one paragraph per part); control characters in the result are escaped.
    ``evidence``: every evidence line of each cause group, not only the ones that decided its class."""
    result = terminal_safe(result)
    stats = result.get("statistics")
    if isinstance(stats, dict):  # an msprobe statistics-only comparison: no logprobs, pairs or causes
        return "\n\n".join([f"Verdict: {result['verdict']} (statistics only).", str(stats.get("summary")),
                              str(stats.get("causes_not_classified") or "No cause is classified."),
                              ("Next: dump both sides in tensor mode (docs/msprobe.md) to localize and classify "
                               "the difference.")]) + "\n"
    parts = [
        _non_finite(result),
        [f"Verdict: {result['verdict']}. {VERDICT_LINE.get(result['verdict'], '')}"],
        _impact(result),
        _rollout(result),
        _where(result),
        _why(result, every=evidence),
        _confidence(result),
        _next(result),
    ]
    return "\n\n".join("\n".join(p) for p in parts if p) + "\n"
