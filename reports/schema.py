"""Load a saved result.json and check it against the documented schema.

The contract lives in two places that must agree: ``docs/result-schema.md``
(for people) and ``result.schema.json`` next to this file (JSON Schema draft
2020-12, for machines). ``validate_result`` runs the JSON Schema and then the
few cross-field rules a JSON Schema cannot express (table shapes, histogram
edges, ``logprobs`` being the primary pair's metrics, attribution's shares
summing to ``attribution.closed``). It returns messages
rather than raising, so the CLI decides whether a bad result is fatal.

``jsonschema`` is a runtime dependency. Should it be missing anyway, the
structural check is skipped (``structure_checked()`` says so, and the CLI
prints a note) and only the cross-field rules run: a valid result is never
reported invalid because a checker is absent.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2
#: older versions this code still reads (docs/result-schema.md, *Versions*)
READ_VERSIONS = (1, 2)
SCHEMA_PATH = Path(__file__).with_name("result.schema.json")


@lru_cache(maxsize=1)
def load_schema() -> dict:
    """The JSON Schema of result.json (cached)."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def load_result(path: str | Path) -> dict:
    """Read a result.json; raises ValueError with a one-line reason when unusable."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        result = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    except RecursionError:
        raise ValueError(f"{path} is nested too deeply to be a logdiff result") from None
    if not isinstance(result, dict):
        raise ValueError(f"{path} does not hold a JSON object (found {type(result).__name__})")
    if _depth(result) > MAX_NESTING:
        raise ValueError(f"{path} is nested more than {MAX_NESTING} levels deep; not a logdiff result")
    return result


#: a result is a few levels deep; anything far deeper is not one (and would exhaust recursion downstream)
MAX_NESTING = 32


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in ``value`` (iteratively: any depth is safe)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_NESTING:
                return depth
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def validate_result(result: dict) -> list[str]:
    """Error messages for everything in ``result`` that breaks the schema; empty when valid."""
    if not isinstance(result, dict):
        return [f"$: expected a JSON object, found {type(result).__name__}"]
    errors = _schema_errors(result)
    errors.extend(_cross_field_errors(result))
    return errors


def structure_checked() -> bool:
    """Whether ``validate_result`` can check the structure (jsonschema importable)."""
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        return False
    return True


def _schema_errors(result: dict) -> list[str]:
    try:
        from jsonschema import Draft202012Validator
    except ImportError:
        return []  # structure_checked() is False: the caller says so; never a reason to reject
    validator = Draft202012Validator(load_schema())
    found = [leaf for e in validator.iter_errors(result) for leaf in _specific(e)]
    found.sort(key=lambda e: [str(p) for p in e.absolute_path])
    return list(dict.fromkeys(f"{_json_path(e.absolute_path)}: {e.message}" for e in found))


def _specific(error) -> list:
    """For "null or object" (oneOf) failures, the errors inside the object branch, not the vague summary."""
    if not error.context:
        return [error]
    inner = [e for e in error.context if not (e.validator == "type" and e.validator_value == "null")]
    return [leaf for e in inner for leaf in _specific(e)] or [error]


def _json_path(parts) -> str:
    out = "$"
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _cross_field_errors(result: dict) -> list[str]:
    """Rules between fields that JSON Schema cannot state. Each guards its own types."""
    errors: list[str] = []
    if result.get("complete") is False and not result.get("warnings"):
        errors.append("$.warnings: must say why when complete is false")

    seqs = result.get("sequences")
    if isinstance(seqs, dict) and isinstance(seqs.get("count"), int):
        for key in ("prompt_lens", "response_lens"):
            lens = seqs.get(key)
            if isinstance(lens, list) and len(lens) != seqs["count"]:
                errors.append(f"$.sequences.{key}: has {len(lens)} entries, count is {seqs['count']}")

    pairs = result.get("pairs")
    paths = result.get("paths")
    roles: dict = {}  # name -> the roles it has (the identity control uses one name for both)
    for p in paths if isinstance(paths, list) else []:
        if isinstance(p, dict):
            roles.setdefault(p.get("name"), set()).add(p.get("role"))
    if isinstance(pairs, list):
        for i, pair in enumerate(pairs):
            if isinstance(pair, dict):
                errors.extend(_pair_errors(f"$.pairs[{i}]", pair, roles))
        if pairs and isinstance(pairs[0], dict):
            errors.extend(_primary_metrics_errors(result.get("logprobs"), pairs[0].get("metrics")))
    errors.extend(_rollout_replay_errors(result.get("rollout_replay"), roles))

    table = result.get("divergence_table")
    if isinstance(table, dict):
        errors.extend(_table_errors(table))
    errors.extend(_null_metric_errors(result))
    errors.extend(_moe_errors(result.get("moe")))
    errors.extend(_attribution_errors(result))
    errors.extend(_statistics_errors(result.get("statistics")))
    errors.extend(_position_errors(result))
    return errors


def _position_errors(result: dict) -> list[str]:
    """Version 2's one position convention: a ``position`` is absolute (prompt + response) and its
    ``response_index`` is that position less the sequence's prompt length (null inside the prompt); a first
    divergence starts no later than its worst row."""
    if result.get("schema_version") != 2:
        return []
    prompts = _dict(result.get("sequences")).get("prompt_lens")
    prompts = prompts if isinstance(prompts, list) and all(_int(n) for n in prompts) else None

    def row(where: str, r: Any, scored: bool = False) -> list[str]:
        if not isinstance(r, dict) or not _int(r.get("sequence")) or not _int(r.get("position")) or prompts is None:
            return []
        if not 0 <= r["sequence"] < len(prompts):
            return [f"{where}.sequence: {r['sequence']} is not a sequence of this result"]
        offset = r["position"] - prompts[r["sequence"]]
        expect = offset if offset >= 0 else None
        if scored and expect is None:
            return [f"{where}.position: {r['position']} lies in sequence {r['sequence']}'s prompt"]
        if r.get("response_index") != expect:
            return [(f"{where}.response_index: {r.get('response_index')} for position {r['position']} of sequence "
                     f"{r['sequence']} (prompt of {prompts[r['sequence']]} tokens), expected {expect}")]
        return []

    errors = []
    pairs = result.get("pairs")
    for i, pair in enumerate(pairs if isinstance(pairs, list) else []):
        if isinstance(pair, dict):
            errors += row(f"$.pairs[{i}].worst", pair.get("worst"), scored=True)
    fd = result.get("first_divergence")
    if isinstance(fd, dict):
        errors += row("$.first_divergence", fd) + row("$.first_divergence.worst", fd.get("worst"))
        worst = fd.get("worst")
        if isinstance(worst, dict) and _int(fd.get("position")) and _int(worst.get("position")) \
                and worst["position"] < fd["position"]:
            errors.append(f"$.first_divergence.position: {fd['position']} comes after its worst row's position "
                          f"{worst['position']}: the first position at which it differs cannot")
    return errors


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _dict(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def _statistics_errors(stats: Any) -> list[str]:
    """A statistics-only comparison's counts add up, and its first difference is the first it lists."""
    if not isinstance(stats, dict) or not _numbers([stats.get(k) for k in ("compared", "equal", "different")]):
        return []
    errors = []
    if stats["equal"] + stats["different"] != stats["compared"]:
        errors.append(f"$.statistics: equal {stats['equal']} + different {stats['different']} is not compared "
                      f"{stats['compared']}")
    listed = stats.get("differences")
    if isinstance(listed, list) and (listed[:1] or [None])[0] != stats.get("first_difference"):
        errors.append("$.statistics.first_difference: must be the first of differences")
    return errors


def _attribution_errors(result: dict) -> list[str]:
    """Shapley shares add up: the levers' shares, and the causes', sum to ``attribution.closed``."""
    attribution = result.get("attribution")
    closed = attribution.get("closed") if isinstance(attribution, dict) else None
    if not _is_number(closed):
        return []
    errors = []
    for where, items in (("$.attribution.levers", attribution.get("levers")), ("$.causes", result.get("causes"))):
        shares = [x.get("share") for x in items if isinstance(x, dict)] if isinstance(items, list) else []
        shares = [v for v in shares if _is_number(v)]
        if shares and not math.isclose(sum(shares), closed, rel_tol=1e-6, abs_tol=1e-9):
            errors.append(f"{where}: the shares sum to {sum(shares):.6g}, attribution.closed is {closed:.6g}")
    return errors


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _moe_errors(moe: Any) -> list[str]:
    """``moe.layers`` and ``moe.router_flip_rate`` describe the same routers with the same rates."""
    if not isinstance(moe, dict) or not isinstance(moe.get("layers"), list):
        return []
    rates = moe.get("router_flip_rate") if isinstance(moe.get("router_flip_rate"), dict) else {}
    errors = []
    for i, layer in enumerate(moe["layers"]):
        if not isinstance(layer, dict):
            continue
        if layer.get("boundary") not in rates or rates[layer.get("boundary")] != layer.get("flip_rate"):
            errors.append(f"$.moe.layers[{i}]: flip_rate must equal router_flip_rate[{layer.get('boundary')!r}]")
        flips, tokens = layer.get("flips"), layer.get("tokens")
        if isinstance(flips, int) and isinstance(tokens, int) and flips > tokens:
            errors.append(f"$.moe.layers[{i}]: {flips} flips among {tokens} tokens")
    return errors


# Metrics that are null by design (a constant path; a path without top-1 tokens; the N-1 std of one token),
# not from NaN/inf.
_NULL_BY_DESIGN = {"probs_pearson", "rollout_actor_probs_pearson_corr", "argmax_flip_fraction",
                   "rollout_probs_diff_std"}


def _null_metric_errors(result: dict) -> list[str]:
    """A metric that is null because it is not a number must come with the ``non_finite`` finding."""
    if result.get("non_finite"):
        return []
    pairs = result.get("pairs")
    for i, pair in enumerate(pairs if isinstance(pairs, list) else []):
        metrics = pair.get("metrics") if isinstance(pair, dict) else None
        if isinstance(metrics, dict):
            for key, value in metrics.items():
                if value is None and key not in _NULL_BY_DESIGN:
                    return [f"$.pairs[{i}].metrics.{key}: null (not a finite number) without a non_finite finding"]
    return []


def _pair_errors(where: str, pair: dict, roles: dict) -> list[str]:
    errors = []
    for side in ("train", "infer"):
        name = pair.get(side)
        if roles and isinstance(name, str) and side not in roles.get(name, ()):
            errors.append(f"{where}.{side}: {name!r} is not a path with role {side!r} in $.paths")
    per_pos = pair.get("per_position")
    if isinstance(per_pos, dict):
        mean, mx = per_pos.get("abs_diff_mean"), per_pos.get("abs_diff_max")
        if isinstance(mean, list) and isinstance(mx, list) and len(mean) != len(mx):
            errors.append(f"{where}.per_position: abs_diff_mean has {len(mean)} entries, "
                          f"abs_diff_max has {len(mx)}")
    hist = pair.get("histogram")
    if isinstance(hist, dict):
        edges, counts = hist.get("edges"), hist.get("counts")
        if isinstance(edges, list) and isinstance(counts, list):
            if len(edges) != len(counts) + 1:
                errors.append(f"{where}.histogram: edges has {len(edges)} entries, "
                              f"expected len(counts) + 1 = {len(counts) + 1}")
            if edges and edges[0] != 0:
                errors.append(f"{where}.histogram.edges[0]: must be 0 (exactly-equal tokens)")
            if _numbers(edges) and any(b <= a for a, b in zip(edges, edges[1:])):
                errors.append(f"{where}.histogram.edges: must be strictly increasing")
    return errors


def _primary_metrics_errors(logprobs: Any, primary: Any) -> list[str]:
    if not (isinstance(logprobs, dict) and isinstance(primary, dict)):
        return []
    errors = []
    for key in ("abs_diff_max", "abs_diff_mean"):
        a, b = logprobs.get(key), primary.get(key)
        if _numbers([a, b]) and not (a == b or (math.isnan(a) and math.isnan(b))):
            errors.append(f"$.logprobs.{key}: {a!r} differs from the primary pair's "
                          f"$.pairs[0].metrics.{key} {b!r}")
    return errors


def _table_errors(table: dict) -> list[str]:
    bounds, positions, values = table.get("boundaries"), table.get("positions"), table.get("max_abs_diff")
    if not (isinstance(bounds, list) and isinstance(positions, list) and isinstance(values, list)):
        return []
    errors = []
    if len(values) != len(bounds):
        errors.append(f"$.divergence_table.max_abs_diff: has {len(values)} rows, "
                      f"boundaries has {len(bounds)}")
    for i, row in enumerate(values):
        if isinstance(row, list) and len(row) != len(positions):
            errors.append(f"$.divergence_table.max_abs_diff[{i}]: has {len(row)} columns, "
                          f"positions has {len(positions)}")
            break
    if len(set(bounds)) != len(bounds):
        errors.append("$.divergence_table.boundaries: names must be unique")
    return errors


def _rollout_replay_errors(replay: Any, roles: dict) -> list[str]:
    """``rollout_replay`` names inference paths, and ``reproduced`` means bitwise on every scored token."""
    if not isinstance(replay, dict):
        return []
    errors = []
    if "infer" not in roles.get(replay.get("recorded"), set()):
        errors.append(f"$.rollout_replay.recorded: {replay.get('recorded')!r} is not an inference path")
    engines = [e for e in replay.get("engines") or [] if isinstance(e, dict)]
    for i, e in enumerate(engines):
        if "infer" not in roles.get(e.get("path"), set()):
            errors.append(f"$.rollout_replay.engines[{i}].path: {e.get('path')!r} is not an inference path")
        if e.get("reproduced") is not (e.get("bitwise_equal_fraction") == 1):
            errors.append(f"$.rollout_replay.engines[{i}]: reproduced must say whether bitwise_equal_fraction is 1")
    if engines and replay.get("reproduced") is not engines[0].get("reproduced"):
        errors.append("$.rollout_replay.reproduced: must be the first engine's")
    return errors


def _numbers(values: list) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
