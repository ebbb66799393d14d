"""One position convention for every renderer, read from a result of either schema version.

A row of a result is named by its sequence, its absolute position (prompt + response, the
position a model sees) and, where that position holds a response token, its response index
(0: the first response token). Schema version 2 writes them so everywhere; a first divergence
names where its boundary *starts* to differ (``position``, ``sequence``) and where that
difference is largest (``worst``) apart.

Version 1 results wrote ``first_divergence.position`` and ``.sequence`` where the difference
was largest (the first position was not recorded) and ``pairs[].worst.position`` as a
response index. ``first_divergence`` and ``token`` turn both versions into the same rows, so
the terminal summary, the HTML report and ``logdiff explain`` never show a version 1 worst
row as a first one. Pure functions on the plain result dict (no import of ``logdiff/``).
"""

from __future__ import annotations

from typing import Any

Row = dict[str, Any]  # {"sequence", "position", "response_index"}, any of them None where unknown


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _prompt_len(result: dict[str, Any], sequence: int | None) -> int | None:
    seqs = result.get("sequences")
    lens = seqs.get("prompt_lens") if isinstance(seqs, dict) else None
    if sequence is None or not isinstance(lens, list) or not 0 <= sequence < len(lens):
        return None
    return _int(lens[sequence])


def _row(result: dict[str, Any], sequence: Any, position: Any, response_index: Any = None) -> Row:
    sequence, position, response_index = _int(sequence), _int(position), _int(response_index)
    prompt = _prompt_len(result, sequence)
    if response_index is None and position is not None and prompt is not None and position >= prompt:
        response_index = position - prompt
    return {"sequence": sequence, "position": position, "response_index": response_index}


def version(result: dict[str, Any]) -> int:
    v = _int(result.get("schema_version"))
    return v if v is not None else 1


def first_divergence(result: dict[str, Any]) -> dict[str, Any] | None:
    """``{"first": Row | None, "worst": Row | None, "max_abs_diff": ...}`` of the result's first divergence
    (None without one). ``first`` is None for a version 1 result, which did not record it; ``worst`` carries
    the boundary's largest difference as ``max_abs_diff``."""
    fd = result.get("first_divergence")
    if not isinstance(fd, dict):
        return None
    if version(result) < 2:  # its position and sequence were the worst row's
        worst = {**_row(result, fd.get("sequence"), fd.get("position")), "max_abs_diff": fd.get("max_abs_diff")}
        return {"first": None, "worst": worst}
    first = _row(result, fd.get("sequence"), fd.get("position"), fd.get("response_index"))
    w = fd.get("worst") if isinstance(fd.get("worst"), dict) else {}
    worst = {**_row(result, w.get("sequence"), w.get("position"), w.get("response_index")),
             "max_abs_diff": w.get("max_abs_diff", fd.get("max_abs_diff"))}
    return {"first": first, "worst": worst if worst["position"] is not None else None}


def token(result: dict[str, Any], worst: Any) -> Row | None:
    """A pair's ``worst`` token as a Row (version 1 wrote its response index as ``position``)."""
    if not isinstance(worst, dict):
        return None
    if version(result) < 2:
        index = _int(worst.get("position"))
        prompt = _prompt_len(result, _int(worst.get("sequence")))
        position = prompt + index if prompt is not None and index is not None else None
        return {"sequence": _int(worst.get("sequence")), "position": position, "response_index": index}
    return _row(result, worst.get("sequence"), worst.get("position"), worst.get("response_index"))


def row_text(row: Row | None) -> str:
    """'position 22 (response token 6), sequence 3'; 'position 1, sequence 0' in the prompt."""
    if not row or row.get("position") is None:
        return "position unknown"
    text = f"position {row['position']}"
    if row.get("response_index") is not None:
        text += f" (response token {row['response_index']})"
    if row.get("sequence") is not None:
        text += f", sequence {row['sequence']}"
    return text


def first_text(where: dict[str, Any] | None) -> str:
    """Where a first divergence starts, for one line: 'position 1, sequence 0'; empty for a version 1 result,
    which did not record it (its renderers show only where the difference is largest)."""
    if where is None or where["first"] is None:
        return ""
    return row_text(where["first"])


def worst_text(where: dict[str, Any] | None, fmt: Any = str) -> str:
    """Where its difference is largest: 'largest |Δ| 0.0156 at position 22 (response token 6), sequence 3'
    (``fmt`` formats the number)."""
    if where is None or where["worst"] is None:
        return ""
    w = where["worst"]
    size = f" {fmt(w['max_abs_diff'])}" if w.get("max_abs_diff") is not None else ""
    return f"largest |Δ|{size} at {row_text(w)}"
