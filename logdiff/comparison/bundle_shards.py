"""Which rank's piece of a differing weight differs: a sharded capture's weight pieces against ``--model``.

A sharded capture whose source knows each rank's piece of a logical weight writes it into the rank's
metadata (``shards``: for an HF-named weight, that the rank holds the ``index``-th of ``of`` equal pieces along
``dim``, and the piece's fingerprint; the Megatron capture does). Where the preflight finds a weight differing
and ``--model`` is loaded, each rank's piece is hashed against the same piece of ``--model``'s weight, in the
dtype both were loaded in. Only where some piece equals ``--model``'s (so the pieces are laid out as stated) and
some does not are the differing ranks and their slices named, in the weight's cause; otherwise nothing is said.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from logdiff.records.bundle import Bundle


def shard_lines(bundle: Bundle, weights: list[str], state: Mapping[str, Any]) -> dict[str, str]:
    """``{weight: evidence line}`` for each of ``weights`` whose pieces in ``bundle`` differ from ``state``'s
    (``--model``'s state dict) on some ranks and equal it on others."""
    from logdiff.probes.contracts import fingerprint

    out: dict[str, str] = {}
    for name in weights:
        whole = state.get(name)
        pieces = {p.layout.rank: s for p in bundle.ranks if (s := (p.meta.get("shards") or {}).get(name))}
        if whole is None or not pieces or any(whole.shape[s["dim"]] % s["of"] for s in pieces.values()):
            continue
        differ = [r for r, s in pieces.items()
                  if fingerprint(whole.chunk(s["of"], s["dim"])[s["index"]]) != s["fingerprint"]]
        if not differ or len(differ) == len(pieces):
            continue
        named = []
        for r in differ:
            s = pieces[r]
            size = whole.shape[s["dim"]] // s["of"]
            what = "rows" if s["dim"] == 0 else f"dim {s['dim']}"
            named.append(f"rank {r}'s piece ({what} {s['index'] * size}:{(s['index'] + 1) * size}, "
                         f"{s['index'] + 1} of {s['of']})")
        out[name] = (f"{name}: {', '.join(named)} differs from --model's; the other ranks' pieces equal it "
                     f"({bundle.role} bundle)")
    return out


def add_shard_evidence(causes: list[Any], weights: list[str], bundles: list[Bundle], state: Mapping[str, Any]) -> None:
    """Each weights cause whose evidence names a weight with a differing piece gets that piece's line."""
    lines = {k: v for b in bundles for k, v in shard_lines(b, weights, state).items()}
    for cause in causes:
        if cause.kind != "weights":
            continue
        for name, line in lines.items():
            if any(name in e for e in cause.evidence) and line not in cause.evidence:
                cause.evidence.append(line)
