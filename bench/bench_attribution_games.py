"""Attribution's two games side by side: today's end-to-end rescans against the patched training forward.

For each model, one ``logdiff.scan`` per game on the same sequences against the
real vLLM (``--depth modules``, the engines pooled, so the second scan measures
the same gap): each lever's Shapley share under both games, what all levers
close (the patched game's own ``closed`` and its confirming rescan's, which is
the rescan game's "every lever applied"), the configurations each measured and
the attribution phase's wall time. The games need not agree where levers
interact strongly (``attribute_patched.py`` says why); this is where to read how
far apart they are on real architectures, against how far each game moves by itself
when the sampled sequences change (``--seeds``: the spread of a lever's share over
the seeds, per game).

Usage::

    .venv/bin/python bench/bench_attribution_games.py DIR [DIR ...] [--sequences 4] [--tokens 32] [--seeds 0,1,2] \
        [--json PATH]

``DIR``: model directories (``logdiff demo-model DIR --arch ARCH`` builds the demo architectures).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

GAMES = ("rescan", "patched")


def one(model: Path, game: str, sequences: int, tokens: int, seed: int) -> dict[str, Any]:
    import logdiff

    start = time.perf_counter()
    r = logdiff.scan(model, infer=["vllm"], depth="modules", attribution=game, num_sequences=sequences,
                     prompt_len=tokens, response_len=tokens, seed=seed)
    wall = time.perf_counter() - start
    a = r.get("attribution") or {}
    return {"verdict": r["verdict"], "game": a.get("game"), "fallback": a.get("fallback"),
            "configurations": a.get("configurations"), "baseline": a.get("baseline"), "closed": a.get("closed"),
            "confirmed_closed": (a.get("confirmed") or {}).get("closed"),
            "shares": {lv["lever"]: lv["share"] for lv in a.get("levers", [])},
            "attribute_s": (r.get("timings") or {}).get("attribute"), "scan_s": round(wall, 1)}


def compare(model: Path, sequences: int, tokens: int, seed: int) -> dict[str, Any]:
    runs = {game: one(model, game, sequences, tokens, seed) for game in GAMES}
    r, p = runs["rescan"]["shares"], runs["patched"]["shares"]
    common = sorted(set(r) & set(p))
    out: dict[str, Any] = {"model": model.name, "seed": seed, **runs}
    if common:
        out["max_share_difference"] = max(abs(r[k] - p[k]) for k in common)
        out["same_largest"] = max(common, key=r.get) == max(common, key=p.get)
    return out


def spread(rows: list[dict[str, Any]], game: str) -> float | None:
    """The largest range (max - min) of one lever's share under ``game`` over the seeds of one model."""
    levers = {k for row in rows for k in row[game]["shares"]}
    ranges = [max(v) - min(v) for k in levers
              if len(v := [row[game]["shares"][k] for row in rows if k in row[game]["shares"]]) > 1]
    return max(ranges) if ranges else None


def show(row: dict[str, Any]) -> None:
    for game in GAMES:
        g = row[game]
        shares = ", ".join(f"{k} {v:.1%}" for k, v in sorted(g["shares"].items()))
        print(f"{row['model'][:20]:20s} seed {row['seed']} {game:8s} closed {g['closed']} (confirmed "
              f"{g['confirmed_closed']}) configs {g['configurations']} attribute {g['attribute_s']} s: {shares}"
              + (f"  [fallback: {g['fallback']}]" if g["fallback"] else ""), flush=True)
    if "max_share_difference" in row:
        print(f"{'':28s} games apart by at most {row['max_share_difference']:.1%} of the gap, "
              f"same largest lever: {row['same_largest']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32, help="prompt and response tokens each")
    ap.add_argument("--seeds", default="0", help="comma-separated sampling seeds, each scanned by both games")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows, spreads = [], {}
    for model in args.models:
        mine = [compare(model, args.sequences, args.tokens, int(seed)) for seed in args.seeds.split(",")]
        for row in mine:
            show(row)
        rows += mine
        spreads[model.name] = {game: spread(mine, game) for game in GAMES}
        if len(mine) > 1:
            print(f"{'':28s} over the seeds a share moves by at most: "
                  + ", ".join(f"{g} {v:.1%}" for g, v in spreads[model.name].items() if v is not None), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "sequences": args.sequences,
                                         "tokens": args.tokens, "seeds": args.seeds, "models": rows,
                                         "spread_over_seeds": spreads}, indent=1) + "\n")


if __name__ == "__main__":
    main()
