"""Join a pipeline-parallel capture's stages into one bundle, as ``logdiff compare`` reads it.

Each pipeline stage records the layers it runs, under their global names (``names.layer_prefix``), into its
own rank directory; its ``tp`` group holds only its stage's records, so a reader that takes each ``tp``
group for a data-parallel replica would see each stage as a model of its own. ``join_stages(bundle, out)``
writes the same records as one bundle without pipeline ranks: every pipeline group (``pp`` in the layout)
becomes the rank of its first stage, whose tensor-parallel peers map likewise; each step's records are the
stages' records of that step in stage order (their row tables must agree: every stage is given the step's
tokens), and the metadata's ``fingerprints`` the union of the stages' (each stage hashes its own weights).
numpy and safetensors only: it runs wherever the bundle is read. ``logdiff compare`` (``offline.compare_bundles``)
joins a bundle with pipeline stages itself (``has_stages``), into a scratch directory that lives as long as the
comparison; the result names the bundle given.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from logdiff.errors import InputError


def has_stages(bundle_dir: str | Path | Any) -> bool:
    """Whether the bundle at ``bundle_dir`` (or that ``Bundle``, open) was recorded with pipeline stages (a ``pp``
    group of several ranks)."""
    from logdiff.records.bundle import Bundle

    bundle = bundle_dir if isinstance(bundle_dir, Bundle) else Bundle(bundle_dir)
    return any(len(p.layout.group("pp")) > 1 for p in bundle.ranks)


def join_stages(bundle_dir: str | Path | Any, out_dir: str | Path) -> Path:
    """The bundle at ``bundle_dir`` (or that ``Bundle``, open) with its pipeline stages joined, written to ``out_dir``;
    returns ``out_dir``."""
    from safetensors.numpy import save_file

    from logdiff.records.bundle import Bundle
    from logdiff.records.bundle_writer import write_json

    bundle = bundle_dir if isinstance(bundle_dir, Bundle) else Bundle(bundle_dir)
    out = Path(out_dir)
    parts = {p.layout.rank: p for p in bundle.ranks}
    firsts = sorted({p.layout.group("pp")[0] for p in bundle.ranks})
    renumber = {r: i for i, r in enumerate(firsts)}
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for first in firsts:
        stages = [parts[r] for r in parts[first].layout.group("pp")]
        head = stages[0]
        groups = {k: [renumber[r] for r in v if r in renumber]
                  for k, v in head.layout.to_json()["groups"].items() if k != "pp"}
        layout = {"rank": renumber[first], "world_size": len(firsts), "groups": groups}
        meta = dict(head.meta)
        meta["fingerprints"] = {k: v for s in stages for k, v in (s.meta.get("fingerprints") or {}).items()}
        if all("fingerprints_at" in s.meta for s in stages):
            meta["fingerprints_at"] = {at: {k: v for s in stages for k, v in s.meta["fingerprints_at"][at].items()}
                                       for at in head.meta["fingerprints_at"]}
        meta.pop("fingerprints_scope", None)
        meta["pipeline_stages_joined"] = len(stages)
        meta["joined_from"] = str(bundle.root)
        rank_dir = out / f"rank-{renumber[first]:05d}"
        rank_dir.mkdir()
        steps = []
        for step in range(min(len(s.steps) for s in stages)):
            arrays: dict[str, Any] = dict(head.table(step))
            records: dict[str, Any] = {}
            for s in stages:
                table = s.table(step)
                if any(not np.array_equal(table[k], arrays[k]) for k in table):
                    raise InputError(f"{bundle.root}: pipeline stages of rank {first} fed step {step} different rows")
                entries = s.steps[step]["records"]
                names = [n for n in entries] + [f"{n}#rows" for n in entries if f"{n}#rows" in s.names(step)]
                arrays.update(s.load(step, names) if names else {})
                records.update(entries)
            file = f"step-{step:06d}.safetensors"
            save_file(arrays, str(rank_dir / file))
            steps.append({**{k: v for k, v in head.steps[step].items() if k != "records"}, "file": file,
                          "records": records})
        (rank_dir / "manifest.json").write_text(json.dumps({"layout": layout, "meta": meta, "steps": steps}, indent=1))
    write_json(out / "bundle.json", {"format": "logdiff-capture", "version": 1, "role": bundle.role,
                                      "world_size": len(firsts)})
    return out
