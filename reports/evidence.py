"""What each cause rests on, counted by kind, and the evidence line that decided a group's class.

A cause's class is decided by one of a few kinds of evidence (docs/causes.md, *How logdiff decides*),
and ``logdiff explain`` says which, read from the result's own fields where they exist:

* ``conformance``: each side's recorded output checked against the exact fp64 function its contract
  names, on that side's own inputs (``cause.conformance`` with both sides): both within their rounding
  bounds is the same function computed two ways, a side outside computes another one;
* ``contract``: a contract value or a weight that the op reads differs between the loaded engines
  (``cause.differs``; a ``non_finite`` cause's ``differs`` are the weights holding NaN/inf instead);
* ``rerun``: both engines rerun with the reference kernels (an evidence line saying whether the
  divergence vanished, persisted or remained: results before conformance were decided so);
* ``sampling``: a sampler fitted to the logprobs (``cause.sampling``); ``values``: NaN/inf found in the
  values (kind ``non_finite``); ``not_judged``: none of these could decide.

A cause may rest on several kinds, so ``how_sure`` counts each kind over the causes. ``decisive``
picks a group's lines for the brief account: its first evidence line (what was measured), then the
line of each kind that decided it; ``--evidence`` shows every line. Pure functions on the result dict.
"""

from __future__ import annotations

import re
from typing import Any

from .format import fmt_num

#: an evidence line that reports the reference-kernel rerun's outcome (not its absence)
RERUN = re.compile(r"\b(vanishes|persists|remains) with the reference\b")


def _checked(conformance: Any) -> dict[str, dict[str, Any]] | None:
    """Both sides' checks (side -> {error, bound, rows, function}), or None where a side was not checked."""
    if not isinstance(conformance, dict):
        return None
    sides = {s: conformance.get(s) for s in ("train", "infer")}
    return sides if all(isinstance(v, dict) and isinstance(v.get("error"), (int, float))
                        and isinstance(v.get("bound"), (int, float)) for v in sides.values()) else None


def kinds(cause: dict[str, Any]) -> list[str]:
    """The kinds of evidence a cause rests on (module docstring), in that order."""
    out = []
    if _checked(cause.get("conformance")):
        out.append("conformance")
    if cause.get("differs") and cause.get("kind") != "non_finite":
        out.append("contract")
    if any(RERUN.search(str(e)) for e in cause.get("evidence") or []):
        out.append("rerun")
    if isinstance(cause.get("sampling"), dict):
        out.append("sampling")
    if cause.get("kind") == "non_finite":
        out.append("values")
    if cause.get("class") == "not_judged":
        out.append("not_judged")
    return out


def _outside(cause: dict[str, Any]) -> bool:
    sides = _checked(cause.get("conformance")) or {}
    return any(v["error"] > v["bound"] for v in sides.values())


def how_sure(result: dict[str, Any]) -> list[str]:
    """'How sure': the causes counted by each kind of evidence they rest on."""
    causes = [c for c in result.get("causes") or [] if isinstance(c, dict)]
    if not causes:
        return []
    counted = {k: [c for c in causes if k in kinds(c)] for k in
               ("conformance", "contract", "rerun", "sampling", "values", "not_judged")}
    checked = counted["conformance"]
    outside = sum(_outside(c) for c in checked)
    n = len(causes)
    within = "with both sides within their rounding bounds (the same function computed two ways)"
    split = ("" if not checked else f", all {within}" if not outside else
             f": {len(checked) - outside} {within}, {outside} with a side outside its bound (another function)")
    lines = [f"How sure: what each of the {n} cause{'s' if n != 1 else ''} rests on (a cause can rest on several):",
             ("  - checked against the exact function (each side's recorded output against the fp64 function its "
              f"contract names, on that side's own inputs): {len(checked)}{split}"),
             f"  - a contract or weight difference read from the loaded engines: {len(counted['contract'])}",
             f"  - rerunning both engines with the reference kernels: {len(counted['rerun'])}"]
    more = {"sampling": "a sampler fitted to the logprobs, or the samplers' recorded settings replayed on the "
                        "recorded logits (logdiff compare)", "values": "NaN/inf found in the values",
            "not_judged": "not judged (no exact function measured them and nothing they read differs)"}
    lines += [f"  - {words}: {len(counted[k])}" for k, words in more.items() if counted[k]]
    return lines


def members(result: dict[str, Any], group: dict[str, Any]) -> list[dict[str, Any]]:
    """The causes of a cause group (its sites, with its class and kind)."""
    sites = set(group.get("sites") or [])
    return [c for c in result.get("causes") or [] if isinstance(c, dict) and c.get("boundary") in sites
            and c.get("class") == group.get("class") and c.get("kind") == group.get("kind")]


def _conformance_line(result: dict[str, Any], causes: list[dict[str, Any]]) -> str | None:
    """'conformance: both sides within their rounding bounds at 8 of 8 sites (first: hf 1.11, vllm 0.808 units of
    the dtype's spacing from the exact rope(...), bounds 4, 4)'."""
    checked = [c for c in causes if _checked(c.get("conformance"))]
    if not checked:
        return None
    pairs = result.get("pairs") or [{}]
    names = {"train": pairs[0].get("train", "train"), "infer": pairs[0].get("infer", "infer")}
    inside = sum(not _outside(c) for c in checked)
    sides = _checked(checked[0]["conformance"])
    first = ", ".join(f"{names[s]} {fmt_num(v['error'])}" for s, v in sides.items())
    bounds = " and ".join(dict.fromkeys(fmt_num(v["bound"]) for v in sides.values()))
    where = f"at {inside} of {len(causes)} site{'s' if len(causes) != 1 else ''}"
    verdict = (f"both sides within their rounding bounds {where}" if inside == len(checked) else
               f"a side outside its rounding bound at {len(checked) - inside} of {len(causes)} sites")
    return (f"conformance: {verdict} (first site: {first} units of the dtype's spacing from the exact "
            f"{sides['train'].get('function')}, bound {bounds})")


def decisive(result: dict[str, Any], group: dict[str, Any]) -> list[str]:
    """A group's brief evidence: its first line (what was measured), then the line of each kind that decided its
    class (conformance from the causes' own checks; the differing contract or weight; the rerun's outcome)."""
    lines = [str(e) for e in group.get("evidence") or []]
    out = lines[:1]
    causes = members(result, group) or []
    conformance = _conformance_line(result, causes)
    if conformance:
        out.append(conformance)
    differs = sorted({str(d) for c in causes if "contract" in kinds(c) for d in c.get("differs") or []})
    if differs:
        out.append(f"differs between the loaded engines: {', '.join(differs)}")
    out += [e for e in lines[1:] if RERUN.search(e)][:1]
    if not conformance and not differs and len(out) < 2:  # nothing structured: the next line, as before
        out += lines[1:2]
    return list(dict.fromkeys(out))
