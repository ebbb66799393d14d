"""Group per-op causes by family: one row per (class, kind, op family), and side for a ``semantic`` one.

A scan classifies every op that introduces error, so a 24-layer model yields
the same three or four kinds of cause at a hundred sites. People read them as
families ("RoPE precision at every layer"), so the terminal summary, the HTML
report and ``logdiff explain`` all show ``cause_groups``, and this module is
the one implementation of that grouping. It works on the plain result dict
(no import of ``logdiff/``): the pipeline calls ``group_causes`` to fill
``cause_groups`` in result.json, and the renderers call ``cause_groups`` which
reads that field, or groups ``causes`` for result files written before it.

``share`` is measured per lever (a kernel family, the weights or an
override; logdiff/diagnosis/attribute.py) and split equally among the causes
the lever neutralises, so a group's share is the sum of its members' shares:
the groups' shares, like the causes', add up to the fraction of the gap that
all levers together close (``attribution.closed``). A group is "necessary"
if any member is. Results written before Shapley attribution gave every
member its lever's whole share; grouped on the fly, they keep the largest.
"""

from __future__ import annotations

import re
from typing import Any

_LAYER = re.compile(r"^(?P<prefix>.*?\blayers)\.(?P<layer>\d+)\.(?P<rest>.+)$")


def _family(cause: dict[str, Any]) -> str:
    """The cause's op family; for results without ``family``, its boundary's op name without the layer."""
    family = cause.get("family")
    if isinstance(family, str) and family:
        return family
    m = _LAYER.match(str(cause.get("boundary", "")))
    return (m.group("rest") if m else str(cause.get("boundary", "model"))).rsplit(".", 1)[-1]


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 3, 5] -> '0–3, 5'."""
    out: list[str] = []
    run: list[int] = []
    for n in sorted(set(layers)):
        if run and n == run[-1] + 1:
            run.append(n)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}–{run[-1]}")
        run = [n]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}–{run[-1]}")
    return ", ".join(out)


def describe_sites(sites: list[str]) -> str:
    """A compact account of where a group's sites are: 'layers 0–3: rope_q, rope_k; model.norm'.

    Sites inside decoder layers are grouped by op name (the last part of the
    boundary), and op names present at the same layers share one entry;
    other sites are listed as they are.
    """
    by_op: dict[str, list[int]] = {}
    other: list[str] = []
    for site in sites:
        m = _LAYER.match(site)
        if m is None:
            if site not in other:
                other.append(site)
            continue
        by_op.setdefault(m.group("rest").rsplit(".", 1)[-1], []).append(int(m.group("layer")))
    by_layers: dict[str, list[str]] = {}
    for op, layers in by_op.items():
        by_layers.setdefault(_ranges(layers), []).append(op)
    parts = []
    for where, ops in by_layers.items():
        word = "layer" if "–" not in where and "," not in where else "layers"
        parts.append(f"{word} {where}: {', '.join(ops)}")
    return "; ".join(parts + other)


def _share(members: list[dict[str, Any]], total: bool) -> float | None:
    """The sum of the members' shares (``total``; else the largest), None when none was measured."""
    values = [c["share"] for c in members
              if isinstance(c.get("share"), (int, float)) and not isinstance(c.get("share"), bool)]
    return (sum(values) if total else max(values)) if values else None


def _necessity(members: list[dict[str, Any]]) -> bool | None:
    values = [c.get("necessity") for c in members if isinstance(c.get("necessity"), bool)]
    return any(values) if values else None


def group_causes(causes: list[dict[str, Any]], summed: bool = True) -> list[dict[str, Any]]:
    """``cause_groups`` for result.json: one group per (class, kind, family), most important first.

    Framework differences come first (they change the function, not its
    rounding), then larger shares; each group keeps its members' order.
    ``summed=False`` takes the largest member share (results before Shapley attribution).
    """
    groups: dict[tuple[str, str, str, tuple[str, ...]], list[dict[str, Any]]] = {}
    for c in causes:
        if isinstance(c, dict):
            side = tuple(str(p) for p in c.get("paths") or []) if c.get("kind") == "semantic" else ()
            groups.setdefault((str(c.get("class")), str(c.get("kind")), _family(c), side), []).append(c)
    out = []
    for (cls, kind, family, side), members in groups.items():
        sites = list(dict.fromkeys(str(c.get("boundary")) for c in members))
        fixes = list(dict.fromkeys(str(c.get("fix") or "") for c in members if c.get("fix")))
        out.append({
            "class": cls,
            "kind": kind,
            "family": family,
            "sites": sites,
            "layers": describe_sites(sites),
            "count": len(members),
            "share": _share(members, summed),
            "necessity": _necessity(members),
            "fix": " / ".join(fixes),
            "evidence": [str(e) for e in members[0].get("evidence") or [] if e],
            **({"paths": list(side)} if side else {}),
        })
    out.sort(key=lambda g: (g["class"] != "framework_difference",
                            -(g["share"] if g["share"] is not None else float("-inf"))))
    return out


def cause_groups(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The result's ``cause_groups``, or its ``causes`` grouped (results written before the field)."""
    groups = result.get("cause_groups")
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        return groups
    causes = result.get("causes")
    attribution = result.get("attribution")
    legacy = isinstance(attribution, dict) and "closed" not in attribution  # each cause: its lever's whole share
    return group_causes(causes, summed=not legacy) if isinstance(causes, list) else []


def kind_label(group: dict[str, Any]) -> str:
    """A group's kind, with the side that computes another function for a ``semantic`` one."""
    paths = group.get("paths")
    return str(group.get("kind")) + (f" ({', '.join(str(p) for p in paths)})" if paths else "")
