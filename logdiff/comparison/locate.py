"""Locate: where two paths' values first part, and which ops introduce error.

Input is one ``PairRecord`` from ``logdiff.probes.session.ProbeSession``: per
boundary, the streaming comparison of the training path against a stored
inference path (``summaries``) and, where the op could be replayed, the error
the training path's op makes on the inference path's own inputs (``local``).

* **First divergence**: the first boundary in *semantic execution order*
  (the architecture's correspondence map; the observed order for architectures
  without one) whose outputs are not bitwise equal (or differ by more than
  ``tolerance`` when one is given), and where it starts: the smallest absolute
  position at which any sequence differs there, and the first sequence that
  differs at that position. Where its difference is largest is ``worst``, apart.
  Every row is named the same way: sequence, absolute position, and the
  response index where the position holds a response token. Its input
  boundaries come with their own differences as evidence: ``inputs_equal`` is
  true when every input was bitwise equal (within the tolerance).
* **Introducing ops**: every boundary whose op computes differently from the
  other path's op on the same inputs. Where teacher-forced replay ran, that is
  a nonzero local error (``method: replay``); where it could not (vLLM's side
  of attention, token embeddings), a boundary whose inputs were bitwise equal
  but whose output differs (``method: equal_inputs``). A boundary with unequal
  inputs and no replay cannot be judged and is named in a warning.
* **Divergence table**: boundary x absolute position, the largest difference
  over sequences and hidden units, as a pandas DataFrame (rows in semantic
  order) and in the result's JSON form.
* **Op drill-down** (``--depth ops``): both paths' op traces of the module that
  produced the first divergence and the first op where they part.

``localize`` runs ``locate`` on every probed pair of a scan or of a comparison of bundles and puts the
findings on the result's ``Pair``s and ``Located``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from logdiff.probes.correspondence import layer_of
from logdiff.probes.ops import compare_traces, summarize


@dataclass
class Localization:
    """Everything locate found for one pair."""

    train: str
    infer: str
    first_divergence: dict[str, Any] | None
    introducing_ops: list[dict[str, Any]]
    boundaries: list[dict[str, Any]]
    table: Any  # pandas.DataFrame
    warnings: list[str] = field(default_factory=list)
    op_trace: dict[str, Any] | None = None
    first_nonfinite: dict[str, Any] | None = None
    #: diverged boundaries whose inputs differed and whose op could not be replayed (the diagnosis's
    #: conformance check can still tell whether a side computes another function there)
    unresolved: list[dict[str, Any]] = field(default_factory=list)

    def table_json(self) -> dict[str, Any] | None:
        """The ``divergence_table`` field of result.json."""
        return table_json(self.table)


def _order(pair: Any) -> list[str]:
    compared = pair.comparer.summaries
    if pair.cmap.mapped:
        return [n for n in pair.cmap.order if n in compared]
    return [n for n in pair.comparer.order if n in compared]


def _inputs(pair: Any, name: str, order: list[str]) -> list[str]:
    b = pair.cmap.get(name)
    if b is not None:
        return list(b.inputs)
    i = order.index(name)
    return order[i - 1 : i] if i > 0 else []


def _diverged(s: Any, tolerance: float) -> bool:
    if s.nonfinite:
        return True
    return s.max_abs_diff > tolerance if tolerance > 0 else not s.equal


def _input_evidence(pair: Any, name: str, order: list[str], tolerance: float) -> tuple[bool, float | None, list[str]]:
    """(inputs equal?, their largest difference, inputs that were not compared)."""
    names = _inputs(pair, name, order)
    if not names:
        return True, 0.0, []
    summaries = pair.comparer.summaries
    missing = [n for n in names if n not in summaries]
    present = [summaries[n] for n in names if n in summaries]
    worst = max((s.max_abs_diff for s in present), default=None)
    equal = not missing and all(not _diverged(s, tolerance) for s in present)
    return equal, worst, missing


#: boundaries named in the warning about unresolved ones (all of them are in the divergence table)
UNRESOLVED_NAMED = 8


def named(names: list[str], most: int) -> str:
    """The first ``most`` of ``names``, and how many more there are: a warning's list that stays one line."""
    rest = len(names) - most
    return ", ".join(names[:most]) + (f" and {rest} more" if rest > 0 else "")


def locate(pair: Any, tolerance: float = 0.0) -> Localization:
    """First divergence, introducing ops and the divergence table of one pair."""
    summaries, local = pair.comparer.summaries, pair.comparer.local
    order = _order(pair)
    warnings: list[str] = []
    _alignment_warnings(pair, warnings)

    first = None
    for name in order:
        s = summaries[name]
        if not _diverged(s, tolerance):
            continue
        equal, worst, missing = _input_evidence(pair, name, order, tolerance)
        if missing:
            warnings.append(f"{name}: inputs {', '.join(missing)} were not compared; inputs_equal is unproven")
        first = {
            "boundary": name,
            "layer": _layer(pair, name),
            **_first_row(pair, s, tolerance),
            "max_abs_diff": s.max_abs_diff,
            "max_ulp": s.max_ulp,
            "bitwise_equal_fraction": s.bitwise_equal_fraction,
            "inputs_equal": bool(equal),
            "input_max_abs_diff": worst,
            "inputs": _inputs(pair, name, order),
            "tolerance": tolerance,
            "worst": {**_row(pair, s.worst_sequence, s.worst_position), "max_abs_diff": s.max_abs_diff},
            **({"sketched": True} if s.sketched else {}),  # compared by row sketches: max_abs_diff a lower bound
        }
        break

    introducing, unresolved = [], []
    for name in order:
        s = summaries[name]
        equal, _worst, _missing = _input_evidence(pair, name, order, tolerance)
        replayed = local.get(name)
        if replayed is not None and replayed.elements:
            evidence, method = replayed, "replay"  # the live op on the stored inputs vs the stored op
        elif equal:
            evidence, method = s, "equal_inputs"  # same inputs: the whole output difference is the op's
        else:
            if _diverged(s, tolerance):
                unresolved.append(name)
            continue
        if not _diverged(evidence, tolerance):
            continue
        introducing.append(
            {
                "boundary": name,
                "layer": _layer(pair, name),
                "kind": _kind(pair, name),
                "method": method,
                "local_max_abs_diff": evidence.max_abs_diff,
                "local_max_ulp": evidence.max_ulp,
                "local_rel": evidence.max_abs_diff / evidence.max_abs_ref if evidence.max_abs_ref else None,
                "local_bitwise_equal_fraction": evidence.bitwise_equal_fraction,
                "position": evidence.worst_position,
                "propagated_max_abs_diff": s.max_abs_diff,
                "inputs_equal": bool(equal),
                **({"sketched": True} if evidence.sketched else {}),
            }
        )
    if unresolved and not pair.comparer.wants_replay:
        warnings.append(f"{pair.infer}: the training path's ops were not replayed on this path's inputs (a scan "
                        "replays on its primary path's; --replay-all-paths replays on every path's): introducing ops "
                        f"from equal inputs only, {len(unresolved)} diverged boundaries not separated")
    elif unresolved:
        warnings.append(f"could not separate introduced from propagated error (inputs differ, op not replayable) "
                        f"at {len(unresolved)} boundaries: {named(unresolved, UNRESOLVED_NAMED)}")
    for n, why in pair.comparer.replay_skipped.items():
        warnings.append(f"{n}: replay skipped ({why})")
    sketched = [n for n in order if summaries[n].sketched]
    if sketched:
        warnings.append(f"{len(sketched)} boundaries were compared by row sketches only (kept outside a capture's "
                        "or the scan's --window): equality per row is exact, their max |Δ| a lower bound, and their "
                        "ops cannot be replayed")

    rows = []
    for name in order:
        s = summaries[name]
        row = {"boundary": name, "layer": _layer(pair, name), **s.to_dict()}
        if name in local:
            row["local"] = local[name].to_dict()
        rows.append(row)
    loc = Localization(pair.train, pair.infer, first, introducing, rows, divergence_frame(pair, order), warnings)
    loc.unresolved = [{"boundary": n, "layer": _layer(pair, n), "kind": _kind(pair, n)} for n in unresolved]
    loc.first_nonfinite = first_nonfinite(pair, order, warnings)
    if pair.tracer_train is not None or pair.tracer_infer is not None:
        loc.op_trace = op_drilldown(pair, first)
    return loc


def _row(pair: Any, sequence: int | None, position: int | None) -> dict[str, Any]:
    """A row of the result in the one position convention: its sequence, its absolute position (prompt +
    response) and, where the position holds a response token, its ``response_index`` (0: the first response
    token; null in the prompt, or where the pair's sequences are not known)."""
    seqs = getattr(pair, "seqs", None) or []
    response_index = None
    if sequence is not None and position is not None and 0 <= sequence < len(seqs):
        prompt = len(seqs[sequence].prompt_ids)
        response_index = position - prompt if position >= prompt else None
    return {"sequence": sequence, "position": position, "response_index": response_index}


def _first_row(pair: Any, s: Any, tolerance: float) -> dict[str, Any]:
    """Where boundary summary ``s`` first diverges: the smallest absolute position at which any sequence
    differs, and the first (smallest) sequence that differs there. Under a tolerance, the smallest position
    whose largest difference exceeds it (``per_position``); which sequence it is there is not tracked (null)."""
    if tolerance > 0 and not s.nonfinite:
        over = np.flatnonzero(np.nan_to_num(s.per_position, nan=0.0) > tolerance)
        if len(over):
            return _row(pair, None, int(over[0]))
    if s.first_position is not None:
        return _row(pair, s.first_sequence, s.first_position)
    # unreachable for a summary that diverged (its unequal rows set first_position); kept for safety
    return _row(pair, s.worst_sequence, s.worst_position if s.worst_position is not None else 0)


#: the boundaries a sampler's processing writes: a -inf there is a mask (top-k, top-p, min-p, a banned or
#: disallowed token, a -inf logit bias), which processed logprobs keep, not an overflow
SAMPLER_KINDS = ("logits", "log_softmax")


def first_nonfinite(pair: Any, order: list[str], warnings: list[str] | None = None) -> dict[str, Any] | None:
    """The first boundary (semantic order) where either path holds a NaN or inf, and on which side. At a sampler's
    boundary (``SAMPLER_KINDS``) -inf elements are the sampler's mask and no finding: one line in ``warnings`` says
    so (a response token scored at -inf is still one: ``diagnosis/nonfinite.py`` counts the token logprobs)."""
    for name in order:
        s = pair.comparer.summaries[name]
        masks = _kind(pair, name) in SAMPLER_KINDS
        bad_ref = s.nonfinite_ref - (s.neginf_ref if masks else 0)
        bad_other = s.nonfinite_other - (s.neginf_other if masks else 0)
        if masks and (s.neginf_ref or s.neginf_other) and warnings is not None:
            held = ", ".join(f"{p} {n}" for p, n in ((pair.train, s.neginf_other), (pair.infer, s.neginf_ref)) if n)
            warnings.append(f"{name} holds -inf elements ({held}): a sampler's mask (top-k, top-p, min-p, a banned "
                            "token or a -inf logit bias, which processed logprobs keep), not an overflow")
        if not (bad_ref or bad_other):
            continue
        # the stored (reference) side is the inference path, the live side the training path
        sides = [p for p, n in ((pair.train, bad_other), (pair.infer, bad_ref)) if n]
        seq, pos = s.nonfinite_at or (None, None)
        return {"boundary": name, "layer": _layer(pair, name), "kind": _kind(pair, name),
                "paths": sides, "sequence": seq, "position": pos, "inputs": _inputs(pair, name, order)}  # fmt: skip
    return None


def _kind(pair: Any, name: str) -> str | None:
    b = pair.cmap.get(name)
    return b.kind if b is not None else None


def _layer(pair: Any, name: str) -> int | None:
    b = pair.cmap.get(name)
    return b.layer if b is not None else layer_of(name)


def _alignment_warnings(pair: Any, warnings: list[str]) -> None:
    compared = set(pair.comparer.summaries)
    train_only = sorted(pair.comparer.not_stored)
    infer_only = sorted(n for n in pair.store.order if n not in compared and n not in pair.comparer._seen)
    if pair.cmap.mapped:
        expected = [n for n in pair.cmap.order if n not in compared]
        if expected:
            warnings.append(
                f"{pair.train} vs {pair.infer}: {len(expected)} mapped boundaries were not compared "
                f"(recorded on one side only or not at all): {', '.join(expected[:12])}"
                + (" ..." if len(expected) > 12 else "")
            )
    else:
        if train_only or infer_only:
            warnings.append(
                f"{pair.train} vs {pair.infer}: could not align {len(train_only) + len(infer_only)} boundaries "
                f"without a correspondence map; only on {pair.train}: {', '.join(train_only[:12]) or 'none'}; "
                f"only on {pair.infer}: {', '.join(infer_only[:12]) or 'none'}"
            )


def divergence_frame(pair: Any, order: list[str] | None = None) -> Any:
    """Boundary x absolute position DataFrame of the largest absolute difference (NaN: not compared)."""
    import pandas as pd

    order = order if order is not None else _order(pair)
    summaries = pair.comparer.summaries
    if not order:
        return pd.DataFrame(dtype=np.float32)
    data = np.stack([summaries[n].per_position for n in order])
    seen = ~np.all(np.isnan(data), axis=0)
    positions = np.nonzero(seen)[0]
    frame = pd.DataFrame(data[:, positions], index=pd.Index(order, name="boundary"), columns=positions.tolist())
    frame.columns.name = "position"
    return frame


def table_json(frame: Any) -> dict[str, Any] | None:
    """The JSON form of a divergence DataFrame (null cells where nothing was compared)."""
    if frame is None or frame.empty:
        return None
    values = [[None if np.isnan(v) else float(v) for v in row] for row in frame.to_numpy()]
    return {
        "boundaries": [str(b) for b in frame.index],
        "positions": [int(p) for p in frame.columns],
        "max_abs_diff": values,
        "metric": "max_abs_diff",
    }


def write_table(frame: Any, out_dir: Path, stem: str = "divergence_table") -> Path:
    """Save a divergence DataFrame beside result.json: parquet when pyarrow is installed, else CSV.

    An OSError while writing (a full disk, a directory that cannot be created) is an
    ``OutputError`` naming the file. It writes in place: ``logdiff.commands.outputs.write_result``
    calls it on a temporary directory and renames the files into place.
    """
    from logdiff.errors import OutputError

    out_dir = Path(out_dir)
    frame = frame.copy()
    frame.columns = [str(c) for c in frame.columns]
    try:
        import pyarrow  # noqa: F401

        path, write = out_dir / f"{stem}.parquet", frame.to_parquet
    except ImportError:
        path, write = out_dir / f"{stem}.csv", frame.to_csv
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write(path)
    except OSError as e:
        raise OutputError.from_os(path, e) from e
    return path


def write_tables(tables: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write every DataFrame ``scan`` returned in ``tables`` (name -> DataFrame)."""
    return [write_table(frame, out_dir, name) for name, frame in tables.items() if frame is not None]


def op_drilldown(pair: Any, first: dict[str, Any] | None, limit: int = 64) -> dict[str, Any] | None:
    """Both paths' op traces of the module behind the first divergence, and where they part."""
    if first is None:
        return None
    name = first["boundary"]
    owner_t = pair.owners_train.get(name)
    owner_i = pair.owners_infer.get(name)
    calls_t = pair.tracer_train.calls(owner_t) if pair.tracer_train is not None and owner_t else []
    calls_i = pair.tracer_infer.calls(owner_i) if pair.tracer_infer is not None and owner_i else []
    out: dict[str, Any] = {
        "boundary": name,
        "train": {"path": pair.train, "module": owner_t, "calls": [summarize(c, limit) for c in calls_t]},
        "infer": {"path": pair.infer, "module": owner_i, "calls": [summarize(c, limit) for c in calls_i]},
        "first_difference": None,
    }
    if calls_t and calls_i:
        t = calls_t[0]
        decode = [c for c in calls_i if c.step == "decode"]
        prefill = [c for c in calls_i if c.step == "prefill"]
        # a divergence at a response position comes from the infer path's decode steps when it has them
        response_pos = first.get("sequence") is not None and _is_response(pair, first)
        i = (decode or prefill)[0] if response_pos else (prefill or decode)[0]
        out["compared_calls"] = {"train": t.step, "infer": i.step}
        out["first_difference"] = compare_traces(t.ops, i.ops)
    return out


def _is_response(pair: Any, first: dict[str, Any]) -> bool:
    if not getattr(pair, "seqs", None):
        return True
    return first.get("response_index") is not None


def localize(pairs: list[Any], probes: Any, progress: Any, tables: dict[str, Any]) -> Any:
    """Run ``locate`` on every probed pair of ``pairs`` (the result's ``Pair``s, onto each pair) from the
    ``ProbeSession`` ``probes``; the primary pair's findings are returned (the result's ``Located``) and
    each pair's divergence table goes into ``tables``."""
    from logdiff.comparison.result import Located

    found = {(p.train, p.infer): p for p in probes.pairs()}
    out = Located()
    for i, pair in enumerate(pairs):
        record = found.get((pair.train, pair.infer))
        if record is None:
            if i == 0:
                out.warnings.append(f"no operator probes for path {pair.infer}; nothing to localize")
            continue
        progress(f"locating the divergence between {pair.train} and {pair.infer}", phase="locate")
        loc = locate(record)
        pair.first_divergence, pair.introducing_ops, pair.boundaries = (
            loc.first_divergence, loc.introducing_ops, loc.boundaries)  # fmt: skip
        out.warnings += [w for w in loc.warnings if w not in out.warnings]
        if out.first_nonfinite is None:
            out.first_nonfinite = loc.first_nonfinite
        tables["divergence_table" if i == 0 else f"divergence_table_{pair.infer}"] = loc.table
        if i == 0:
            out.first_divergence, out.introducing_ops = loc.first_divergence, loc.introducing_ops
            out.divergence_table, out.op_trace = loc.table_json(), loc.op_trace
            out.unresolved = loc.unresolved
    out.warnings += [w for w in probes.warnings if w not in out.warnings]
    return out
