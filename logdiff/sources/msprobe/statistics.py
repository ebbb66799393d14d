"""A statistics-only comparison of two msprobe dumps: what whole-tensor statistics and CRCs can still tell.

A ``"task": "statistics"`` dump writes no tensor, only each tensor's dtype, shape, ``Max``/``Min``/``Mean``/
``Norm`` and, with ``summary_mode: md5``, ``md5`` (a CRC-32 of its raw bytes). No row can be aligned, so
nothing is replayed, checked for conformance or classified. What remains (docs/msprobe.md):

1. each side's mapped tensors (``names.py``'s table, the same entries a tensor-mode dump is converted from)
   are keyed by (msprobe step, forward, the boundaries they hold); a packed tensor (vLLM's ``qkv_proj``)
   holds several and is never split: it pairs only with a tensor packed alike;
2. a pair is *comparable* when both have one dtype and one shape up to size-1 dimensions (the same values in
   the same order); anything else (a packed tensor against its parts, vLLM's flat rows against HF's padded
   batch, a boundary only one side dumped) is counted and named as not comparable, never guessed;
3. a comparable pair is *equal* when the CRCs are (where both sides have one), else when all four statistics
   are; else *different*, with a rigorous lower bound on its max |Δ| (``stat_bound.py``), which is 0 (and
   said so) where only the CRC or the rounded mean/norm differs;
4. the first different pair in forward order is the first differing module.

``compare`` returns the result's ``statistics`` section; ``result`` wraps it into a result.json dict of the
versioned schema (``logprobs`` of nulls, no pairs, no causes; docs/result-schema.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from logdiff.errors import InputError
from logdiff.records.untrusted import InputRoot
from logdiff.sources.msprobe.convert import named_forwards
from logdiff.sources.msprobe.layout import ENTRY, RankDump, dump_files, pick, read_dump
from logdiff.sources.msprobe.names import TABLES, boundary, order_key, template

STATS = ("Max", "Min", "Mean", "Norm")
TASKS = ("tensor", "statistics")
#: why a statistics-only result has no causes, said in it
NO_CAUSES = ("statistics only: no tensors were dumped, so no row is aligned, no op replayed and no side checked "
             "against its exact function; no cause is classified")
#: how many not-comparable pairs and differences are named in the result (the counts are whole)
NAMED = 50


@dataclass(frozen=True)
class Summary:
    """One dumped tensor as msprobe describes it."""

    dtype: str  # torch's name without ``torch.``
    shape: tuple[int, ...]
    stats: dict[str, float | None]
    crc: str | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def layout(self) -> tuple[str, tuple[int, ...]]:
        """dtype and shape without its size-1 dimensions: the values and their order."""
        return self.dtype, tuple(d for d in self.shape if d != 1)


@dataclass(frozen=True)
class Site:
    """A mapped tensor of one side: where it was dumped and what it holds."""

    entry: str  # the msprobe entry, ``Module.{path}.{class}.forward.{n}``
    field: str  # ``output.0``, ``input.0``, ``kwarg:NAME``
    module: str
    summary: Summary


def dump_task(path: Path) -> str | None:
    """The ``task`` of the first dump.json under ``path`` (``tensor``, ``statistics``), None where unreadable."""
    files = dump_files(Path(path)) if Path(path).is_dir() else []
    try:
        head = InputRoot(files[0].parent, "msprobe dump").read_json(files[0], "dump.json") if files else None
    except InputError:
        return None
    return head.get("task") if isinstance(head, dict) and isinstance(head.get("task"), str) else None


def _number(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def summary(desc: Any, where: str) -> Summary | None:
    """msprobe's description of a tensor (None: not a tensor); a one-line InputError where it is malformed."""
    if not isinstance(desc, dict) or "torch.Tensor" not in str(desc.get("type", "torch.Tensor")):
        return None
    dtype, shape, crc = desc.get("dtype"), desc.get("shape"), desc.get("md5")
    if not isinstance(dtype, str) or not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InputError(f"{where}: a tensor without a dtype and a shape (not msprobe's dump.json)")
    if crc is not None and not isinstance(crc, str):
        raise InputError(f"{where}: md5 is not a string")
    missing = [k for k in STATS if k not in desc]
    if missing and crc is None:
        raise InputError(f"{where}: a tensor without {'/'.join(missing)} nor md5 (not a statistics dump.json)")
    bad = [k for k in STATS if not _number(desc.get(k))]
    if bad:
        raise InputError(f"{where}: {bad[0]} is not a number")
    stats = {k: (None if desc.get(k) is None else float(desc[k])) for k in STATS}
    return Summary(dtype.removeprefix("torch."), tuple(shape), stats, crc)


def _engine(steps: list[RankDump]) -> str:
    for rank in steps:
        for calls in named_forwards(rank).values():
            emb = calls.get("model.embed_tokens")
            ids = pick(emb[1], "input", 0) if emb else None
            if isinstance(ids, dict) and isinstance(ids.get("shape"), list):
                return "hf" if len(ids["shape"]) == 2 else "vllm"
    raise InputError("the msprobe dump holds no embedding call (model.embed_tokens): its token ids' shape tells "
                     "HF's [B, L] from vLLM's flat batch; dump it too (docs/msprobe.md)")


def read_side(path: Path, n_layers: int | None = None) -> tuple[str, dict[tuple[int, int, tuple[str, ...]], Site]]:
    """One dump's engine and its mapped tensors keyed by (step, forward, boundaries)."""
    steps = read_dump(Path(path), TASKS)
    engine = _engine(steps)
    if n_layers is None:  # no --model: the layers the dump holds
        n_layers = 1 + max((template(m.group("path"))[1] or 0 for r in steps for n in r.data
                            if (m := ENTRY.match(n))), default=0)
    sites: dict[tuple[int, int, tuple[str, ...]], Site] = {}
    for i, rank in enumerate(steps):  # steps pair by their order (DUMP/step0 against DUMP/step2: both the first)
        where = rank.dir / "dump.json"
        for f, calls in sorted(named_forwards(rank).items()):
            for module, (name, entry) in calls.items():
                key, layer = template(module)
                for field, index, names, _split in TABLES[engine].get(key, []):
                    got = summary(pick(entry, field, index), f"{where}: entry {name!r}")
                    bounds = tuple(boundary(b, layer, n_layers) for b in names)
                    if got is None or None in bounds:
                        continue
                    label = field if field.startswith("kwarg:") else f"{field}.{index}"
                    sites[(i, f, bounds)] = Site(name, label, module, got)  # type: ignore[arg-type]
    return engine, sites


def _label(bounds: tuple[str, ...]) -> str:
    """A record's name: its boundary, or a packed tensor's boundaries (``…self_attn.q_proj+k_proj+v_proj``)."""
    if len(bounds) == 1:
        return bounds[0]
    head = bounds[0].rsplit(".", 1)[0]
    return head + "." + "+".join(b.rsplit(".", 1)[1] for b in bounds)


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else None


def _order(key: tuple[int, int, tuple[str, ...]]) -> tuple[Any, ...]:
    step, f, bounds = key
    return step, f, order_key(bounds[0])


def _brief(s: Summary) -> dict[str, Any]:
    return {"dtype": s.dtype, "shape": list(s.shape)}


def compare_sites(train: dict, infer: dict) -> dict[str, Any]:
    """The ``statistics`` section of two sides' mapped tensors (``read_side``)."""
    from logdiff.sources.msprobe.stat_bound import lower_bound

    by_boundary = {side: {(k[0], k[1], b): k for k in sites for b in k[2]} for side, sites in
                   (("train", train), ("infer", infer))}
    seen: set[tuple[Any, ...]] = set()
    compared, equal, differences, not_comparable, one_side = 0, 0, [], [], {"train": 0, "infer": 0}
    crcs = 0
    for spot in sorted({*by_boundary["train"], *by_boundary["infer"]}, key=lambda s: (s[0], s[1], order_key(s[2]))):
        kt, ki = by_boundary["train"].get(spot), by_boundary["infer"].get(spot)
        if kt is None or ki is None:
            one_side["train" if ki is None else "infer"] += (kt or ki) not in seen
            seen.add(kt or ki)
            continue
        if (kt, ki) in seen:
            continue
        seen.update({(kt, ki), kt, ki})
        a, b = train[kt].summary, infer[ki].summary
        where = {"boundary": _label(kt[2]) if kt == ki else spot[2], "layer": _layer(spot[2]), "step": spot[0],
                 "forward": spot[1], "train_entry": f"{train[kt].entry} {train[kt].field}",
                 "infer_entry": f"{infer[ki].entry} {infer[ki].field}"}
        why = ("packed with other boundaries on one side" if kt[2] != ki[2] else
               "dtypes differ" if a.dtype != b.dtype else "shapes differ" if a.layout != b.layout else None)
        if why:
            not_comparable.append({**where, "why": why, "train": _brief(a), "infer": _brief(b)})
            continue
        compared += 1
        by_crc = a.crc is not None and b.crc is not None and len(a.crc) == len(b.crc)
        crcs += by_crc
        stats_equal = all(a.stats[k] == b.stats[k] for k in STATS)
        if (a.crc == b.crc) if by_crc else stats_equal:
            equal += 1
            continue
        bound, by = lower_bound(a.stats, b.stats, a.numel, a.dtype)
        differs = [k for k in STATS if a.stats[k] != b.stats[k]]
        note = ("the CRCs differ but all four statistics are equal: the lower bound is 0" if by_crc and stats_equal
                else None if bound > 0 else
                f"{'/'.join(differs)} differ{'s' if len(differs) == 1 else ''} only within "
                f"{'its' if len(differs) == 1 else 'their'} own rounding: the lower bound is 0")
        differences.append({**where, "by": "crc" if by_crc else "statistics", "differs": differs,
                            "max_abs_diff_lower_bound": bound, "bound_from": by, "proven": by_crc or bound > 0,
                            "note": note, "dtype": a.dtype, "shape": list(a.shape),
                            "train_statistics": a.stats, "infer_statistics": b.stats})
    if not compared:
        named = ", ".join(f"{x['boundary']} ({x['why']})" for x in not_comparable[:3])
        raise InputError("no tensor of the two dumps can be compared by its statistics (none shares a boundary, "
                         f"dtype and shape{': ' + named if named else ''}); dump both sides at the same modules "
                         "and batch, or in tensor mode (docs/msprobe.md)")
    first = differences[0] if differences else None
    return {
        "summary": _summary(compared, equal, differences, not_comparable, one_side, crcs),
        "by": "crc" if crcs == compared else "statistics" if not crcs else "crc and statistics",
        "compared": compared, "equal": equal, "different": len(differences),
        "not_comparable": len(not_comparable), "only_one_side": one_side,
        "first_difference": first, "differences": differences[:NAMED],
        "not_comparable_pairs": not_comparable[:NAMED], "causes_not_classified": NO_CAUSES,
    }


def _summary(compared: int, equal: int, differences: list, not_comparable: list, one_side: dict,
             crcs: int) -> str:
    how = "CRC" if crcs == compared else "statistics" if not crcs else "CRC or statistics"
    text = f"statistics only: {compared} tensor pairs compared by {how}, {equal} equal, {len(differences)} different"
    if differences:
        d = differences[0]
        bound = d["max_abs_diff_lower_bound"]
        text += (f"; first differing module {d['boundary']} (step {d['step']}, forward {d['forward']}), "
                 + (f"max |Δ| >= {bound:.3g} (from {d['bound_from']})" if bound > 0 else "max |Δ| > 0 (no lower "
                    "bound above 0: " + str(d["note"]).split(":")[0] + ")"))
    if not_comparable:
        text += f"; {len(not_comparable)} pairs not comparable (different layouts)"
    if one_side["train"] or one_side["infer"]:
        text += (f"; {one_side['train']} tensors only in the training dump, {one_side['infer']} only in the "
                 "inference one")
    return text


def compare(train: Path, infer: Path, config: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str], dict]:
    """The ``statistics`` section comparing two msprobe dumps, the warnings to give with it, and each side's
    ``{engine, task, dtype}``."""
    n_layers = int(config["num_hidden_layers"]) if config and config.get("num_hidden_layers") else None
    sides, warnings = {}, []
    for role, path in (("train", train), ("infer", infer)):
        engine, sites = read_side(path, n_layers)
        emb = next((s for k, s in sorted(sites.items(), key=lambda kv: _order(kv[0]))
                    if k[2] == ("model.embed_tokens",)), None)
        sides[role] = {"engine": engine, "task": dump_task(path), "dtype": emb.summary.dtype if emb else None,
                       "sites": sites}
        if sides[role]["task"] == "tensor":
            warnings.append(f"the {role} dump is a tensor dump compared against a statistics dump: only its "
                            "statistics were read, not its tensors")
    section = compare_sites(sides["train"]["sites"], sides["infer"]["sites"])
    info = {role: {k: v for k, v in side.items() if k != "sites"} for role, side in sides.items()}
    return section, warnings, info


def result(train: Path, infer: Path, model: Path | None, config: dict[str, Any] | None,
           environment: dict[str, Any]) -> dict[str, Any]:
    """A result.json dict of a statistics-only comparison (docs/result-schema.md, ``statistics``)."""
    import datetime as dt
    from importlib import metadata

    from logdiff.reports.schema import SCHEMA_VERSION

    section, warnings, info = compare(train, infer, config)
    dtype = info["train"]["dtype"] or info["infer"]["dtype"]
    paths = [{"name": role, "role": role,  # named by role, as every comparison of two records (compare.py)
              "engine": info[role]["engine"], "mode": "recorded", "version": None,
              "settings": {"dump": str(p), "task": info[role]["task"]}}
             for role, p in (("train", train), ("infer", infer))]
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "logdiff", "version": metadata.version("logdiff")},
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "complete": True,
        "warnings": [*warnings, NO_CAUSES],
        "model": str(model) if model else str(train),
        "checkpoint": None,
        "infer_checkpoint": None,
        "architecture": str(((config or {}).get("architectures") or ["unknown"])[0]),
        "dtype": dtype if dtype in ("bfloat16", "float16", "float32") else "float32",
        "settings": {"seed": 0, "depth": "modules", "consistent": False, "overrides": {"train": {}, "infer": {}},
                     "sequence_source": "bundle", "trust_remote_code": False, "statistics_only": True},
        "environment": environment,
        "paths": paths,
        "sequences": {"count": 0, "source": "bundle", "format": None, "prompt_lens": [], "response_lens": []},
        "pairs": [],
        "logprobs": {"abs_diff_max": None, "abs_diff_mean": None, "num_tokens": 0},
        "first_divergence": None,
        "introducing_ops": [],
        "causes": [],
        "verdict": "divergent" if section["different"] else "consistent",
        "non_finite": None,
        "divergence_table": None,
        "contracts": None,
        "moe": None,
        "batch_invariance": None,
        "rollout_replay": None,
        "statistics": section,
        "cause_groups": [],
    }
