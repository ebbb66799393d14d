"""Rollout dumps: read what verl and OpenRLHF hold after a rollout, as logdiff sequences.

``--sequences FILE`` takes logdiff's own JSONL (``sequences.load_jsonl``) or a
rollout dump in a framework's own layout. The layout is detected from the
file: its suffix says how to read it (``.jsonl`` one object a line,
``.parquet`` one row a sequence through pandas/pyarrow, ``.pt`` a dict of
batched tensors through ``torch.load(weights_only=True)``, never a plain
unpickle), its column names say whose layout it is. Formats and their sources:
docs/rollout-dumps.md.

* ``verl``: the ``DataProto.batch`` an agent loop returns: ``prompts``
  left-padded, ``responses`` right-padded, ``attention_mask`` over both,
  optional ``response_mask`` (0 for tool/observation tokens and padding) and
  ``rollout_log_probs`` (padded with 0.0). ``input_ids`` may stand in for
  ``prompts``.
* ``openrlhf-agent``: the dict an OpenRLHF agent executor returns:
  ``observation_tokens``, ``action_ranges`` (``[start, end)`` of each model
  turn) and ``rollout_log_probs`` (one per observation token, 0.0 outside the
  actions).
* ``openrlhf-experience``: an ``Experience``: ``sequences`` and
  ``attention_mask`` over the tokens, ``action_mask`` and
  ``rollout_log_probs`` shifted by one (entry ``i`` is about token ``i + 1``).

Every layout becomes ``Sequence(prompt, response, rollout_logprobs,
response_mask)``: the response starts at the first model token and ends at
the last, the tokens between model turns are masked (replayed, not scored).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from logdiff.errors import InputError
from logdiff.records.sequences import Sequence, _int_list, _logprobs, _response_mask, load_jsonl
from logdiff.records.untrusted import regular_file

#: layout name -> the columns that identify it (the first layout whose columns are all present wins)
LAYOUTS = {
    "logdiff": ("prompt_ids", "response_ids"),
    "verl": ("responses", "attention_mask"),
    "openrlhf-agent": ("observation_tokens", "action_ranges"),
    "openrlhf-experience": ("sequences", "attention_mask", "action_mask"),
}
#: every column some layout reads; a dump's other columns (position_ids, routed_experts, ...) are never loaded
USED = {c for need in LAYOUTS.values() for c in need} | {
    "prompts", "input_ids", "response_mask", "rollout_log_probs", "rollout_logprobs"}  # fmt: skip
SUFFIXES = (".jsonl", ".parquet", ".pt")


def load(path: Path) -> tuple[list[Sequence], str]:
    """The sequences in ``path`` and the name of the layout they were read from."""
    path = regular_file(path, "sequences file")
    if path.suffix not in SUFFIXES:
        raise InputError(f"{path}: unknown sequences file type {path.suffix!r}; expected one of {', '.join(SUFFIXES)}")
    if path.suffix == ".jsonl" and _first_line_keys(path) >= set(LAYOUTS["logdiff"]):
        return load_jsonl(path), "logdiff"  # logdiff's own format keeps its line-numbered errors
    columns, rows, where = _rows(path)
    if not rows:
        raise InputError(f"{path}: no sequences in file")
    layout = next((name for name, need in LAYOUTS.items() if columns >= set(need)), None)
    if layout is None or (layout == "verl" and not columns & {"prompts", "input_ids"}):
        raise InputError(
            f"{path}: no known rollout layout in columns [{', '.join(sorted(columns))}]; expected logdiff "
            "(prompt_ids, response_ids), verl (prompts, responses, attention_mask) or OpenRLHF "
            "(observation_tokens, action_ranges | sequences, attention_mask, action_mask); see docs/rollout-dumps.md"
        )
    read = {"logdiff": _logdiff_row, "verl": _verl_row, "openrlhf-agent": _agent_row,
            "openrlhf-experience": _experience_row}[layout]  # fmt: skip
    seqs = []
    for i, row in enumerate(rows):
        missing = [c for c in LAYOUTS[layout] if c not in row]
        if layout == "verl" and "prompts" not in row and "input_ids" not in row:
            missing.append("prompts")
        if missing:  # a JSONL line may lack what the first line had
            raise InputError(f"{path}:{where(i)}: no {', '.join(missing)} (every {layout} row needs it)")
        seqs.append(read(row, f"{path}:{where(i)}"))
    return seqs, layout


def _first_line_keys(path: Path) -> set[str]:
    """The keys of a JSONL file's first object (logdiff's keys when the line is not JSON: its reader says why)."""
    with path.open() as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return set(LAYOUTS["logdiff"])  # let load_jsonl report the line
                return set(obj) if isinstance(obj, dict) else set()
    return set()


def _rows(path: Path) -> tuple[set[str], list[dict[str, Any]], Any]:
    """The file's columns, one dict of the ``USED`` ones per sequence (plain Python values), and row ``i``'s name."""
    if path.suffix == ".jsonl":
        rows, lines = [], []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise InputError(f"{path}:{lineno}: each line must be a JSON object")
            rows.append(obj), lines.append(lineno)
        return set(rows[0]) if rows else set(), rows, lambda i: lines[i]
    read = _parquet_rows if path.suffix == ".parquet" else _torch_rows
    return (*read(path), lambda i: f"row {i}")


def _plain(value: Any) -> Any:
    """numpy arrays and scalars (nested, as pandas gives list columns) as Python lists and numbers."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _parquet_rows(path: Path) -> tuple[set[str], list[dict[str, Any]]]:
    try:
        import pandas as pd
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        columns = set(pq.read_schema(path).names)
        frame = pd.read_parquet(path, columns=sorted(columns & USED))
    except Exception as e:  # noqa: BLE001 - pyarrow raises many types for a bad file
        raise InputError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    return columns, [{k: _plain(v) for k, v in row.items()} for row in frame.to_dict("records")]


def _torch_rows(path: Path) -> tuple[set[str], list[dict[str, Any]]]:
    """A ``torch.save``d dict of batched tensors (``DataProto.batch``, an ``Experience``'s fields), split in rows."""
    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a refused global or a corrupt file: either way not loadable safely
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(
            f"{path}: not a plain dict of tensors (torch.load with weights_only=True refused it: {reason}); "
            "save dict(batch.batch) instead of a pickled object, see docs/rollout-dumps.md"
        ) from None
    if not isinstance(data, dict) or not data or not all(isinstance(v, (torch.Tensor, list)) for v in data.values()):
        raise InputError(f"{path}: expected a dict of batched tensors (one row per sequence)")
    sizes = {k: len(v) for k, v in data.items()}
    if len(set(sizes.values())) != 1:
        raise InputError(f"{path}: the tensors hold different numbers of rows: {sizes}")
    used = {k: (v.long() if isinstance(v, torch.Tensor) and v.dtype == torch.bool else v)
            for k, v in data.items() if k in USED}  # fmt: skip
    return set(data), [{k: _plain(v[i]) for k, v in used.items()} for i in range(next(iter(sizes.values())))]


def _mask01(value: Any, what: str, n: int, where: str) -> list[int]:
    """A 0/1 list of length ``n`` (booleans from torch or parquet allowed)."""
    if not isinstance(value, list) or len(value) != n:
        got = f"{len(value)} values" if isinstance(value, list) else type(value).__name__
        raise InputError(f"{where}: '{what}' needs {n} values of 0 or 1, got {got}")
    bad = next((i for i, x in enumerate(value) if x not in (0, 1)), None)
    if bad is not None:
        raise InputError(f"{where}: {what} at position {bad} is {value[bad]!r}, not 0 or 1")
    return [int(x) for x in value]


def _floats(value: Any, n: int, where: str, what: str = "rollout_log_probs") -> list[Any]:
    """``value`` when it is a list of ``n`` entries (``sequences._logprobs`` checks the numbers)."""
    if not isinstance(value, list) or len(value) != n:
        got = f"{len(value)} values" if isinstance(value, list) else type(value).__name__
        raise InputError(f"{where}: '{what}' needs {n} values, one per token it covers, got {got}")
    return value


def _logdiff_row(row: dict[str, Any], where: str) -> Sequence:
    """logdiff's own columns (in a parquet or .pt file): the JSONL keys."""
    prompt = _int_list(row["prompt_ids"], "prompt_ids", where)
    response = _int_list(row["response_ids"], "response_ids", where)
    if not prompt or not response:
        raise InputError(f"{where}: 'prompt_ids' and 'response_ids' must not be empty")
    lps = row.get("rollout_logprobs")
    lps = _logprobs(_floats(lps, len(response), where, "rollout_logprobs"), where) if lps is not None else None
    mask = row.get("response_mask")
    return Sequence(prompt, response, lps, _response_mask(mask, len(response), where) if mask is not None else None)


def _verl_row(row: dict[str, Any], where: str) -> Sequence:
    """verl: left-padded ``prompts``, right-padded ``responses``, ``attention_mask`` over both."""
    responses = _int_list(row["responses"], "responses", where)
    width = len(responses)
    if row.get("prompts") is not None:
        prompts = _int_list(row["prompts"], "prompts", where)
    else:
        ids = _int_list(row["input_ids"], "input_ids", where)
        if len(ids) <= width:
            raise InputError(f"{where}: 'input_ids' ({len(ids)}) must be longer than 'responses' ({width})")
        prompts = ids[: len(ids) - width]
    attention = _mask01(row["attention_mask"], "attention_mask", len(prompts) + width, where)
    prompt = [t for t, keep in zip(prompts, attention) if keep]
    on = attention[len(prompts) :]
    n = sum(on)
    if on != [1] * n + [0] * (width - n):
        raise InputError(f"{where}: the responses are not right-padded (attention_mask over them is not 1s then 0s)")
    if not prompt or n == 0:
        raise InputError(f"{where}: an empty {'prompt' if not prompt else 'response'} (attention_mask is all 0 there)")
    mask = row.get("response_mask")
    if mask is not None:
        mask = _response_mask(_mask01(mask, "response_mask", width, where)[:n], n, where)
    lps = row.get("rollout_log_probs")
    if lps is not None:
        lps = _logprobs(_floats(lps, width, where)[:n], where)
    return Sequence(prompt, responses[:n], lps, None if mask is None or all(mask) else mask)


def _agent_row(row: dict[str, Any], where: str) -> Sequence:
    """OpenRLHF agent output: ``observation_tokens``, ``action_ranges``, per-token ``rollout_log_probs``."""
    tokens = _int_list(row["observation_tokens"], "observation_tokens", where)
    ranges = row["action_ranges"]
    flags = [0] * len(tokens)
    if not isinstance(ranges, list) or not ranges:
        raise InputError(f"{where}: 'action_ranges' must be a non-empty list of [start, end) pairs")
    for r in ranges:
        ok = isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
        if not ok or not 0 <= r[0] < r[1] <= len(tokens):
            raise InputError(f"{where}: action range {r!r} is not a [start, end) inside the {len(tokens)} tokens")
        flags[r[0] : r[1]] = [1] * (r[1] - r[0])
    lps = row.get("rollout_log_probs")
    return _from_flags(tokens, flags, None if lps is None else _floats(lps, len(tokens), where), where)


def _experience_row(row: dict[str, Any], where: str) -> Sequence:
    """OpenRLHF ``Experience``: ``action_mask``/``rollout_log_probs`` entry ``i`` is about token ``i + 1``."""
    seq = _int_list(row["sequences"], "sequences", where)
    attention = _mask01(row["attention_mask"], "attention_mask", len(seq), where)
    action = _mask01(row["action_mask"], "action_mask", len(seq) - 1, where)
    lps = row.get("rollout_log_probs")
    lps = None if lps is None else _floats(lps, len(seq) - 1, where)
    keep = [i for i, a in enumerate(attention) if a]
    if not keep or keep != list(range(keep[0], keep[-1] + 1)):
        raise InputError(f"{where}: attention_mask must mark one contiguous run of tokens (padding on either side)")
    flags = [action[i - 1] if i else 0 for i in keep]
    return _from_flags([seq[i] for i in keep], flags, None if lps is None else [lps[i - 1] if i else 0.0 for i in keep],
                       where)  # fmt: skip


def _from_flags(tokens: list[int], flags: list[int], lps: list[Any] | None, where: str) -> Sequence:
    """Prompt up to the first model token, response up to the last; the tokens between are masked."""
    model = [i for i, f in enumerate(flags) if f]
    if not model:
        raise InputError(f"{where}: no model-generated token (the action mask is all 0)")
    start, end = model[0], model[-1] + 1
    if start == 0:
        raise InputError(f"{where}: the first token is marked as generated; a rollout needs a prompt before it")
    mask = flags[start:end]
    rollout = _logprobs(lps[start:end], where) if lps is not None else None
    return Sequence(tokens[:start], tokens[start:end], rollout, None if all(mask) else mask)
