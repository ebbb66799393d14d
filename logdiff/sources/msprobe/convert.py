"""An msprobe tensor-mode dump (one rank, HF or vLLM) -> a logdiff capture bundle (``probes.bundle``).

Each forward of the dump (a module's call count within an msprobe step) becomes one bundle step: its row
table (``rows.py``) and its records, mapped and split by ``names.py``, in a forward's order. What a dump cannot
give is said once, in the bundle's metadata: ``source: msprobe`` and ``missing`` (no contracts, placements,
sampled tokens, or weight fingerprints but those of an HF dump's kept parameters: ``weights.py``), with counts
of what was left out (``msprobe``: rows no sequence continued, tensors whose file was not kept, logits that
could not be placed).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from logdiff.errors import InputError
from logdiff.sources.msprobe.layout import ENTRY, RankDump, pick, read_dump
from logdiff.sources.msprobe.names import TABLES, boundary, order_key, split_sizes, template

_LAYER_ENTRY = re.compile(r"^Module\.model\.layers\.(\d+)\.")

#: what no msprobe dump holds, said in every converted bundle's metadata
MISSING = ["contracts (eps, RoPE, attention scale: not in a dump)", "weight fingerprints",
           "placements (one rank, read as unsharded)", "sampled tokens and sampler logprobs"]


def _forwards_with_ids(steps: list[RankDump]) -> Any:
    """Each forward of the dump's steps, in order: ``(rank, forward, its module calls, its token ids)``; a forward
    whose embedding input was not kept is an ``InputError`` (no token ids, no rows)."""
    for rank in steps:
        for f, calls in sorted(forwards(rank).items()):
            emb = calls.get("model.embed_tokens")
            ids = rank.load(pick(emb, "input", 0)) if emb else None
            if ids is None:
                raise InputError(f"{rank.dir}: forward {f} has no embedding input (token ids) kept")
            yield rank, f, calls, ids


def forwards(rank: RankDump) -> dict[int, dict[str, dict[str, Any]]]:
    """The step's module calls by forward and module path (``named_forwards`` without the entry names)."""
    return {f: {path: entry for path, (_, entry) in calls.items()} for f, calls in named_forwards(rank).items()}


def named_forwards(rank: RankDump) -> dict[int, dict[str, tuple[str, dict[str, Any]]]]:
    """The step's module calls by forward and module path, each with its entry name. A module shared by the
    layers (vLLM's one rotary embedding, named after layer 0) is given to the layer its parent call
    (construct.json) ran in, and to that call's forward."""
    out: dict[int, dict[str, tuple[str, dict[str, Any]]]] = {}
    for name, entry in rank.data.items():
        m = ENTRY.match(name)
        if not m:
            continue
        path, count = m.group("path"), int(m.group("count"))
        parent = rank.parents.get(name) or ""
        mine, theirs = _LAYER_ENTRY.match(name), _LAYER_ENTRY.match(parent)
        pm = ENTRY.match(parent)
        if mine and theirs and pm:  # the forward a layer's module ran in is its layer's call's
            path = re.sub(r"^model\.layers\.\d+\.", f"model.layers.{theirs.group(1)}.", path)
            count = int(pm.group("count"))
        out.setdefault(count, {})[path] = (name, entry)
    return out


def engine_of(steps: list[RankDump]) -> str:
    """``hf`` or ``vllm``, from the embedding's token ids: ``[B, L]`` (HF) or a flat ``[T]`` batch (vLLM)."""
    for rank in steps:
        for f in forwards(rank).values():
            emb = f.get("model.embed_tokens")
            ids = pick(emb, "input", 0) if emb else None
            if isinstance(ids, dict) and isinstance(ids.get("shape"), list):
                return "hf" if len(ids["shape"]) == 2 else "vllm"
    raise InputError("the msprobe dump holds no embedding call (model.embed_tokens): its token ids are needed to "
                     "align rows; dump it too (docs/msprobe.md)")


def dump_dtype(steps: list[RankDump]) -> str | None:
    """The dtype the dumped run computed in: its embedding output's."""
    for rank in steps:
        for f in forwards(rank).values():
            emb = f.get("model.embed_tokens")
            out = pick(emb, "output", 0) if emb else None
            if isinstance(out, dict) and out.get("dtype"):
                return str(out["dtype"]).replace("torch.", "")
    return None


class _Converter:
    def __init__(self, writer: Any, engine: str, config: dict[str, Any], placer: Any = None):
        self.writer, self.engine, self.config = writer, engine, config
        self.placer, self.descs = placer, {}  # a TP rank's placements (placements.py), from each record's desc
        self.table = TABLES[engine]
        self.n_layers = int(config.get("num_hidden_layers") or 0)
        self.counts = {"forwards": 0, "records": 0, "not_kept": 0, "unmatched_rows": 0, "logits_unplaced": 0,
                       "other_shape": 0}
        self.owners: dict[str, str] = {}
        self.boundaries: set[str] = set()

    def records(self, rank: RankDump, calls: dict[str, dict[str, Any]], rows: int,
                keep: np.ndarray | None) -> list[tuple[str, Any, str]]:
        """(boundary, ``[rows, width]`` tensor, module) of one forward's calls, rows flattened (``keep``: the
        real ones)."""
        out = []
        for path, entry in calls.items():
            key, layer = template(path)
            for where, index, names, split in self.table.get(key, []):
                desc = pick(entry, where, index)
                t = rank.load(desc)
                if t is None:
                    self.counts["not_kept"] += isinstance(desc, dict) and bool(desc.get("data_name"))
                    continue
                if path == "logits_processor":  # vLLM: the sampling rows only (placed by the caller)
                    out.append(("logits", t.reshape(t.shape[0], -1), path))
                    continue
                if t.numel() % rows:
                    self.counts["other_shape"] += 1
                    continue
                flat = t.reshape(rows, -1)
                if keep is not None:
                    flat = flat[np.flatnonzero(keep)]
                parts = [flat] if split is None else list(flat.split(split_sizes(split, flat.shape[1], self.config),
                                                                     dim=-1))
                for name, part in zip(names, parts):
                    b = boundary(name, layer, self.n_layers)
                    if b is not None:
                        out.append((b, part.contiguous(), path))
                        self.descs[b] = desc
        return out

    def write(self, records: list[tuple[str, Any, str]], logits_rows: Any = None, valid_rows: Any = None) -> None:
        from logdiff.records.layout import Placement

        for name, t, module in sorted(records, key=lambda r: order_key(r[0])):
            rows = logits_rows if name == "logits" else valid_rows
            if name == "logits" and logits_rows is None:
                self.counts["logits_unplaced"] += 1
                continue
            placement = Placement() if self.placer is None else self.placer.place(name, int(t.shape[-1]), module,
                                                                                  self.descs.get(name))
            if placement is None:  # not knowable from the dump: said once in the metadata (placements.py)
                continue
            self.writer.record(name, t, placement, rows=rows)
            self.owners.setdefault(name, module)
            self.boundaries.add(name)
            self.counts["records"] += 1

    def hf(self, steps: list[RankDump]) -> None:
        from logdiff.sources.msprobe.rows import hf_rows

        seen = 0
        for rank, f, calls, ids in _forwards_with_ids(steps):
            layer = next((calls[p] for p in sorted(calls) if re.fullmatch(r"model\.layers\.\d+", p)), None)
            mask = rank.load(pick(layer, "kwarg:attention_mask", 0)) if layer else None
            position_ids = rank.load(pick(layer, "kwarg:position_ids", 0)) if layer else None
            if layer is None:
                self.counts.setdefault("no_mask_forwards", 0)
                self.counts["no_mask_forwards"] += 1
            tokens, positions, valid = hf_rows(ids, mask, position_ids)
            B, L = ids.shape
            sequences = np.repeat(np.arange(B), L) + seen
            seen += B
            self.writer.begin_step(tokens, positions, sequences, valid.astype(np.int64))
            kept = np.flatnonzero(valid)
            recs = self.records(rank, calls, B * L, valid) + self._mix_rope(rank, f, B, L, valid)
            self.write(recs, logits_rows=kept, valid_rows=kept)
            self.counts["forwards"] += 1

    def _mix_rope(self, rank: RankDump, f: int, B: int, L: int, valid: np.ndarray) -> list[tuple[str, Any, str]]:
        """At level mix: HF's RoPE is plain tensor code, so rope_q/rope_k are the last two ``Tensor.__add__``
        calls under a layer's attention module before its attention function (``q * cos + rotate_half(q) * sin``),
        ``[B, H, L, D]``."""
        adds: dict[str, list[str]] = {}
        done: set[str] = set()
        for name in rank.data:
            m = re.match(rf"^Module\.model\.layers\.(\d+)\.self_attn\.\w+\.forward\.{f}$", rank.parents.get(name) or "")
            if not m or m.group(1) in done:
                continue
            if name.startswith("Functional.scaled_dot_product_attention") or "attention" in name.lower():
                done.add(m.group(1))
            elif name.startswith("Tensor.__add__."):
                adds.setdefault(m.group(1), []).append(name)
        out = []
        for n, names in adds.items():
            for which, name in zip(("rope_q", "rope_k"), names[-2:] if len(names) >= 2 else []):
                t = rank.load(pick(rank.data[name], "output", 0))
                if t is not None and t.dim() == 4 and t.shape[0] == B and t.shape[2] == L:
                    rows = t.transpose(1, 2).reshape(B * L, -1)[np.flatnonzero(valid)]
                    attn = f"model.layers.{n}.self_attn"
                    out.append((f"{attn}.{which}", rows.contiguous(), attn))
        return out

    def vllm(self, steps: list[RankDump]) -> dict[str, int]:
        from logdiff.sources.msprobe.rows import VllmSequences, segments

        state = VllmSequences()
        for rank, f, calls, ids in _forwards_with_ids(steps):
            positions = self._vllm_positions(rank, calls, len(ids))
            tokens = ids.reshape(-1).long().numpy()
            lp = calls.get("logits_processor")
            logits_desc = pick(lp, "output", 0) if lp else None
            shape = logits_desc.get("shape") if isinstance(logits_desc, dict) else None
            n_logits = int(shape[0]) if shape else None
            runs = segments(positions, n_logits)
            seq = state.assign(tokens, positions, runs)
            valid = seq >= 0
            self.writer.begin_step(tokens, positions, np.where(valid, seq, 0), valid.astype(np.int64))
            recs = self.records(rank, calls, len(tokens), None)
            last = np.asarray([b - 1 for _, b in runs], dtype=np.int64)
            placed = last if n_logits == len(last) else None
            self.write(recs, logits_rows=placed)
            if placed is not None:
                logits = next((t for name, t, _ in recs if name == "logits"), None)
                if logits is not None:
                    for row, best in zip(placed.tolist(), logits.float().argmax(dim=-1).tolist()):
                        if seq[row] >= 0:
                            state.predicted[int(seq[row])] = int(best)
            self.counts["forwards"] += 1
        self.counts["unmatched_rows"] = state.unmatched_rows
        return {str(s): n for s, n in state.prompt_lens.items()}

    def _vllm_positions(self, rank: RankDump, calls: dict[str, dict[str, Any]], T: int) -> np.ndarray:
        """A forward's positions: a decoder layer's first input, an attention's ``positions``, a rotary's input."""
        for path in sorted(calls):
            entry = calls[path]
            for where in ("input", "kwarg:positions"):
                if not (re.fullmatch(r"model\.layers\.\d+(\.self_attn(\.rotary_emb)?)?", path)):
                    continue
                desc = pick(entry, where, 0)
                if isinstance(desc, dict) and "int" in str(desc.get("dtype")) and desc.get("shape") == [T]:
                    t = rank.load(desc)
                    if t is not None:
                        return t.long().numpy()
        raise InputError(f"{rank.dir}: no positions kept for a forward of {T} rows (a decoder layer's or an "
                         "attention's); dump at least one decoder layer (docs/msprobe.md)")


def convert(dump_dir: str | Path, out_dir: str | Path, role: str, config: dict[str, Any],
            model: str | None = None, rank: Any = None) -> Path:
    """Write the bundle of the msprobe dump at ``dump_dir`` (one rank, tensor mode) into ``out_dir``, as ``role``'s
    side, for the model of ``config`` (its config.json: the dump holds none). Returns ``out_dir``."""
    from logdiff.records.bundle_writer import BundleWriter
    from logdiff.records.layout import ParallelLayout
    from logdiff.version import __version__

    steps = read_dump(Path(dump_dir)) if rank is None else rank.steps  # rank: one of several (ranks.RankView)
    engine = engine_of(steps)
    missing = list(MISSING)
    meta: dict[str, Any] = {
        "logdiff": __version__, "engine": engine, "source": "msprobe", "dump": str(dump_dir),
        "architecture": (config.get("architectures") or ["?"])[0], "model_type": config.get("model_type"),
        "config": config, "fingerprints_error": "an msprobe dump: its weights are not hashed",
        "contract_error": "an msprobe dump holds no contract", "missing": missing,
    }
    if engine == "vllm":
        meta.update({"mode": "decode", "fuses_add_norm": True})
    from logdiff.sources.msprobe.contracts import declared_contract

    declared = declared_contract(config, dump_dtype(steps))  # what conformance judges under (never the preflight)
    if declared:
        meta["declared_contract"] = declared
        missing[0] = "contracts (eps, RoPE, attention scale: not in a dump; ops judged under the config's)"
    if engine == "hf":
        from logdiff.sources.msprobe.weights import hf_fingerprints

        fingerprints, rounded = hf_fingerprints(steps) if rank is None else rank.fingerprints  # where kept
        if fingerprints:
            meta.pop("fingerprints_error")
            meta["fingerprints"] = fingerprints
            if rounded:
                meta["fingerprints_at"] = rounded
            missing[missing.index("weight fingerprints")] = "weight fingerprints of the modules not dumped"
    if model:
        meta["model"] = str(model)
    existed = Path(out_dir).exists()
    writer = BundleWriter(out_dir, role, ParallelLayout() if rank is None else rank.layout, meta)
    conv = _Converter(writer, engine, config if rank is None else rank.split_config,
                      None if rank is None else rank.placer)
    try:
        prompt_lens = conv.hf(steps) if engine == "hf" else conv.vllm(steps)
        if not conv.counts["records"]:
            raise InputError(f"{dump_dir}: no tensor of a known module was kept (a {engine} dump of other modules, "
                             "or one whose tensor files are gone)")
    except BaseException:
        if not existed:  # no half-written bundle left behind
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    if engine == "hf" and not any(b.endswith(".rope_q") for b in conv.boundaries):
        missing.append("RoPE (HF applies it in plain code: only a mix-level dump holds it)")
    if rank is not None:
        missing[missing.index(MISSING[2])] = rank.placer.summary()
    meta_update: dict[str, Any] = {"owners": conv.owners, "missing": missing,
                                   "msprobe": {"steps": [r.step for r in steps], **conv.counts}}
    if prompt_lens:
        meta_update["prompt_lens"] = prompt_lens
    writer.meta_update(meta_update)
    writer.close()
    return Path(out_dir)
