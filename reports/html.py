"""Render a result dict as one self-contained, offline HTML page.

The page is ``templates/report.html`` rendered by Jinja2 with autoescaping on,
so every string from the model, the paths or the user is escaped by default.
``build_view`` first turns the result into a flat, defaulted view (formatted
numbers, chart geometry from ``charts``), so the template never meets a
missing key and optional fields (null at ``--depth logprobs``) simply drop
their section.

The only data the page's script reads is the heatmap, embedded as JSON in a
``<script type="application/json">`` block. ``embed_json`` escapes ``<``,
``>`` and ``&`` (and U+2028/2029) as ``\\uXXXX`` so a ``</script>`` inside a
boundary name cannot end the block. A Content-Security-Policy allows no
network access at all and only the page's own script (by hash), so even a
string that escaped escaping could neither load nor run anything.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any

from .charts import heatmap_data, histogram_chart, position_chart
from . import positions, shares
from .groups import cause_groups, kind_label
from .format import (cost_text, current_names, fmt_fraction, fmt_lens, fmt_num, fmt_value, is_number, pair_label,
                     verdict_text)
from .metric_groups import metrics_view

TEMPLATE_DIR = Path(__file__).with_name("templates")


@lru_cache(maxsize=1)
def _environment():
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = fmt_num
    env.filters["csp_hash"] = csp_hash
    env.filters["breakable"] = breakable
    env.filters["breakable_id"] = breakable_id
    return env


def render_html(result: dict) -> str:
    """The report page for ``result`` (a result.json dict) as one HTML string."""
    return _environment().get_template("report.html").render(v=build_view(result))


def embed_json(data: Any) -> str:
    """JSON safe to place inside a <script> element: no <, >, & or line separators in the text."""
    from markupsafe import Markup

    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                          ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return Markup(text)


def breakable(name: Any):
    """Escape a dotted name and allow line breaks after its dots (model.layers.0.<wbr>mlp)."""
    from markupsafe import Markup, escape

    return Markup(str(escape(name)).replace(".", ".<wbr>"))


def breakable_id(name: Any):
    """Escape a metric name and allow line breaks after its slashes and underscores (rollout_corr/<wbr>k3_<wbr>kl)."""
    from markupsafe import Markup, escape

    return Markup(str(escape(name)).replace("/", "/<wbr>").replace("_", "_<wbr>"))


def csp_hash(script: str) -> str:
    """The CSP source expression that allows exactly this inline script."""
    digest = hashlib.sha256(str(script).encode("utf-8")).digest()
    return "'sha256-" + base64.b64encode(digest).decode("ascii") + "'"


# ---------------------------------------------------------------- view model

def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _text(value: Any, missing: str = "—") -> str:
    return missing if value is None else str(value)


def build_view(result: dict) -> dict:
    """Everything the template shows, formatted and defaulted."""
    r = _dict(result)
    pairs = [p for p in _list(r.get("pairs")) if isinstance(p, dict)]
    settings = _dict(r.get("settings"))
    depth = settings.get("depth")
    heatmap = heatmap_data(r.get("divergence_table"), _first_cell(r))
    if heatmap is not None:
        heatmap["response_start"] = _uniform_prompt_len(r.get("sequences"))
    verdict = _text(r.get("verdict"), "unknown")
    stats = r.get("statistics") if isinstance(r.get("statistics"), dict) else None  # msprobe statistics only
    return {
        "verdict": verdict,
        "verdict_text": verdict_text(verdict),
        "complete": r.get("complete") is not False,
        "non_finite": _non_finite(r.get("non_finite")),
        "warnings": [str(w) for w in _list(r.get("warnings")) if w != _dict(r.get("non_finite")).get("summary")],
        "model": _text(r.get("model")),
        "checkpoint": _text(r.get("checkpoint"), "(the model's own weights)"),
        "infer_checkpoint": _text(r.get("infer_checkpoint"), "(same as training)"),
        "architecture": _text(r.get("architecture")),
        "dtype": _text(r.get("dtype")),
        "created": _format_created(r.get("created")),
        "tool_version": _text(_dict(r.get("tool")).get("version")),
        "schema_version": _text(r.get("schema_version")),
        "depth": _text(depth),
        "cost": cost_text(r),
        "headline": str(stats.get("summary")) if stats else _headline(r, pairs),
        "cards": _statistics_cards(stats) if stats else _cards(r),
        "settings": _settings_rows(settings, r.get("sequences")),
        "environment": [(k, fmt_value(v)) for k, v in _dict(r.get("environment")).items()],
        "paths": _paths(r.get("paths")),
        "metrics": metrics_view(pairs, r.get("logprobs")),
        "is_threshold": fmt_num(settings.get("is_threshold")) if is_number(settings.get("is_threshold")) else None,
        "pairs": [_pair_view(p, r) for p in pairs],
        "first_divergence": _first_divergence(r),
        "no_divergence_reason": _no_divergence_reason(r, depth),
        "introducing_ops": _introducing(r.get("introducing_ops")),
        "n_causes": len([c for c in _list(r.get("causes")) if isinstance(c, dict)]),
        "groups": _groups(r),
        "share_note": shares.note(r, negative=any(shares.is_negative(g.get("share")) for g in cause_groups(r))),
        "heatmap": heatmap,
        "heatmap_missing": _heatmap_missing(r, depth),
        "data_json": embed_json({"heatmap": heatmap}),
        "contracts": _contracts(r.get("contracts")),
        "moe": _moe(r.get("moe")),
        "batch_invariance": _pretty(r.get("batch_invariance")),
        "rollout_replay": _rollout_replay(r.get("rollout_replay")),
    }


def _rollout_replay(replay: Any) -> dict | None:
    """The recorded-rollout check: its one-line summary and one row per replaying path."""
    if not isinstance(replay, dict):
        return None
    rows = [{"path": _text(e.get("path")), "mode": _text(e.get("mode")), "tokens": _text(e.get("num_tokens")),
             "bitwise": fmt_fraction(e.get("bitwise_equal_fraction")), "max": fmt_num(e.get("abs_diff_max")),
             "mean": fmt_num(e.get("abs_diff_mean")), "reproduced": "yes" if e.get("reproduced") is True else "no"}
            for e in _list(replay.get("engines")) if isinstance(e, dict)]  # fmt: skip
    return {"summary": _text(replay.get("summary")), "format": _text(replay.get("format")), "rows": rows}


def _non_finite(found: Any) -> str | None:
    """The one-line summary of NaN/inf on a path, for the banner at the top."""
    if not found:
        return None
    return str(_dict(found).get("summary") or "NaN/inf found on a path (see non_finite in result.json)")


def _uniform_prompt_len(sequences: Any) -> int | None:
    """The absolute position where responses start, when every prompt has the same length."""
    lens = _dict(sequences).get("prompt_lens")
    if isinstance(lens, list) and lens and all(is_number(x) for x in lens) and len(set(lens)) == 1:
        return int(lens[0])
    return None


def _format_created(value: Any) -> str:
    if not isinstance(value, str):
        return "—"
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return value
    if when.tzinfo is not None:
        when = when.astimezone(timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def _headline(r: dict, pairs: list[dict]) -> str:
    """One sentence under the verdict: the size of the gap and where it starts."""
    lp = _dict(r.get("logprobs"))
    parts = []
    if pairs:
        n = lp.get("num_tokens")
        tokens = f" over {n} tokens" if is_number(n) else ""
        parts.append(f"max |Δ logprob| {fmt_num(lp.get('abs_diff_max'))}, "
                     f"mean {fmt_num(lp.get('abs_diff_mean'))} ({pair_label(pairs[0])}{tokens})")
    fd = r.get("first_divergence")
    if isinstance(fd, dict):
        where = positions.first_text(positions.first_divergence(r))
        parts.append(f"first divergence at {fd.get('boundary')}" + (f", {where}" if where else ""))
    causes, groups = _list(r.get("causes")), cause_groups(r)
    if causes:
        parts.append(f"{len(causes)} cause{'s' if len(causes) != 1 else ''} found in {len(groups)} "
                     f"famil{'ies' if len(groups) != 1 else 'y'}: " + ", ".join(str(g.get("family")) for g in groups[:4])
                     + (", …" if len(groups) > 4 else ""))
    return "; ".join(parts) + ("." if parts else "")


def _cards(r: dict) -> list[dict]:
    lp = current_names(_dict(r.get("logprobs")))
    fd = r.get("first_divergence")
    cards = [
        {"label": "max |Δ logprob|", "value": fmt_num(lp.get("abs_diff_max")), "sub": "primary pair"},
        {"label": "mean |Δ logprob|", "value": fmt_num(lp.get("abs_diff_mean")), "sub": "primary pair"},
    ]
    if "bitwise_equal_fraction" in lp:
        cards.append({"label": "bitwise-equal tokens",
                      "value": fmt_fraction(lp.get("bitwise_equal_fraction")),
                      "sub": f"of {fmt_num(lp.get('num_tokens'))} tokens"})
    if "k3_kl" in lp:
        cards.append({"label": "KL (k3)", "value": fmt_num(lp.get("k3_kl")), "sub": "rollout_corr/k3_kl"})
    if isinstance(fd, dict):
        layer = fd.get("layer")
        cards.append({"label": "first divergence", "value": _text(fd.get("boundary")), "mono": True,
                      "sub": ", ".join(x for x in (positions.first_text(positions.first_divergence(r)),
                                                   f"layer {layer}" if layer is not None else "") if x)})
    for card in cards:
        card.setdefault("mono", False)
    return cards


def _settings_rows(settings: dict, sequences: Any) -> list[tuple[str, str]]:
    rows = []
    for key, value in settings.items():
        if key == "overrides" and isinstance(value, dict):
            for side in ("train", "infer"):
                for k, v in _dict(value.get(side)).items():
                    rows.append((f"override ({side})", f"{k} = {fmt_value(v)}"))
            continue
        rows.append((str(key), fmt_value(value)))
    seqs = _dict(sequences)
    if seqs:
        rows.append(("sequences", f"{fmt_num(seqs.get('count'))} from {_text(seqs.get('source'))}, "
                                  f"prompt {fmt_lens(seqs.get('prompt_lens'))} + "
                                  f"response {fmt_lens(seqs.get('response_lens'))} tokens"))
    return rows


def _paths(paths: Any) -> list[dict]:
    out = []
    for p in _list(paths):
        if not isinstance(p, dict):
            continue
        settings = ", ".join(f"{k}={fmt_value(v)}" for k, v in _dict(p.get("settings")).items())
        out.append({"name": _text(p.get("name")), "role": _text(p.get("role")),
                    "engine": _text(p.get("engine")), "mode": _text(p.get("mode")),
                    "version": _text(p.get("version")), "settings": settings or "—"})
    return out


def _pair_view(pair: dict, result: dict) -> dict:
    worst = pair.get("worst")
    worst_view = None
    if isinstance(worst, dict):
        t, i = worst.get("train_logprob"), worst.get("infer_logprob")
        diff = abs(t - i) if is_number(t) and is_number(i) else None
        worst_view = {"where": positions.row_text(positions.token(result, worst)),
                      "token_id": _text(worst.get("token_id")),
                      "token_text": None if worst.get("token_text") is None else repr(str(worst["token_text"])),
                      "train": fmt_num(t), "infer": fmt_num(i), "diff": fmt_num(diff)}
    return {"label": pair_label(pair), "train": _text(pair.get("train")), "infer": _text(pair.get("infer")),
            "chart": position_chart(pair.get("per_position")),
            "histogram": histogram_chart(pair.get("histogram")), "worst": worst_view}


def _first_cell(r: dict) -> dict | None:
    """The heatmap's first-divergence cell: its boundary at the first position (none for a version 1 result,
    which did not record it)."""
    fd, rows = r.get("first_divergence"), positions.first_divergence(r)
    if not isinstance(fd, dict) or rows is None or rows["first"] is None:
        return None
    return {"boundary": fd.get("boundary"), "position": rows["first"]["position"]}


def _first_divergence(r: dict) -> dict | None:
    fd = r.get("first_divergence")
    if not isinstance(fd, dict):
        return None
    eq = fd.get("inputs_equal")
    rows = positions.first_divergence(r) or {}
    worst = rows.get("worst")
    return {"boundary": _text(fd.get("boundary")), "layer": _text(fd.get("layer"), "— (outside a layer)"),
            "position": positions.first_text(rows) or "not recorded (a version 1 result)",
            "worst": positions.row_text(worst) if worst is not None else "—",
            "max_abs_diff": fmt_num(fd.get("max_abs_diff")),
            "inputs_equal": eq is True, "inputs_known": isinstance(eq, bool),
            "input_max_abs_diff": fmt_num(fd.get("input_max_abs_diff"))}


def _statistics_cards(stats: dict) -> list[dict]:
    """A statistics-only comparison's cards: what was compared, and the first differing module with its bound."""
    first = _dict(stats.get("first_difference"))
    cards = [{"label": "statistics only", "value": f"{fmt_num(stats.get('different'))} of "
              f"{fmt_num(stats.get('compared'))}", "sub": f"tensor pairs differ (by {_text(stats.get('by'))})",
              "mono": False}]
    if first:
        cards.append({"label": "first differing module", "value": _text(first.get("boundary")), "mono": True,
                      "sub": f"step {_text(first.get('step'))}, forward {_text(first.get('forward'))}"})
        cards.append({"label": "max |Δ| at least", "value": fmt_num(first.get("max_abs_diff_lower_bound")),
                      "sub": f"from {_text(first.get('bound_from'), 'no statistic (0)')}", "mono": False})
    return cards


def _no_divergence_reason(r: dict, depth: Any) -> str:
    if isinstance(r.get("statistics"), dict):
        return "Statistics only: no tensors were dumped, so nothing is localized by position (see the headline)."
    if depth == "logprobs":
        return "Not localized: this scan ran at --depth logprobs. Rerun with --depth modules to find where the paths part."
    if r.get("verdict") == "consistent":
        return "Nothing diverged: every recorded boundary is bitwise equal."
    return "No boundary was found whose inputs agree and whose outputs differ."


def _heatmap_missing(r: dict, depth: Any) -> str:
    if depth == "logprobs":
        return "No boundary × position table: this scan ran at --depth logprobs (use --depth modules)."
    return "This result has no boundary × position table."


def _introducing(ops: Any) -> list[dict]:
    out = []
    for op in _list(ops):
        if isinstance(op, dict):
            out.append({"boundary": _text(op.get("boundary")), "layer": _text(op.get("layer")),
                        "local": fmt_num(op.get("local_max_abs_diff")),
                        "propagated": fmt_num(op.get("propagated_max_abs_diff")),
                        "method": _text(op.get("method")),
                        "inputs_equal": fmt_num(op.get("inputs_equal"))})
    return out


def _groups(r: dict) -> list[dict]:
    """One row per cause group (``groups.py``): class, kind, family, sites in brief, share, necessity, fix;
    each site with its own cause's evidence (folded away on the page)."""
    evidence: dict[tuple, list[str]] = {}
    for c in _list(r.get("causes")):
        if isinstance(c, dict):
            key = (c.get("class"), c.get("kind"), str(c.get("boundary")))
            evidence.setdefault(key, [str(e) for e in _list(c.get("evidence"))])
    out = []
    for g in cause_groups(r):
        share = g.get("share")
        width = min(100.0, max(0.0, 100.0 * share)) if is_number(share) and math.isfinite(share) else 0.0
        sites = [{"boundary": str(s), "evidence": evidence.get((g.get("class"), g.get("kind"), str(s)), [])}
                 for s in _list(g.get("sites"))]
        out.append({"cls": _text(g.get("class")), "kind": _text(kind_label(g)), "family": _text(g.get("family")),
                    "layers": _text(g.get("layers"), ""), "sites": sites, "count": g.get("count") or len(sites),
                    "fix": _text(g.get("fix"), ""), "evidence": [str(e) for e in _list(g.get("evidence"))],
                    "share": fmt_fraction(share) if is_number(share) else "not measured",
                    "share_width": f"{width:.1f}", "share_known": is_number(share),
                    "share_note": shares.NEGATIVE if shares.is_negative(share) else "",
                    "share_hint": shares.NEGATIVE_HINT,
                    "necessity": {True: "necessary", False: "not necessary alone"}.get(g.get("necessity"), "—")})
    return out


def _contracts(contracts: Any) -> dict | None:
    if not isinstance(contracts, dict):
        return None
    train, infer = _dict(contracts.get("train")), _dict(contracts.get("infer"))
    declared = {str(k) for k in _list(contracts.get("differs"))}
    rows = []
    for key in list(train) + [k for k in infer if k not in train]:
        tv, iv = train.get(key, _MISSING), infer.get(key, _MISSING)
        differs = key in declared or tv != iv
        rows.append({"key": str(key), "train": "(absent)" if tv is _MISSING else fmt_value(tv),
                     "infer": "(absent)" if iv is _MISSING else fmt_value(iv), "differs": differs})
    rows.sort(key=lambda row: not row["differs"])          # differing values first, order kept otherwise
    weights = contracts.get("weights")
    weights_view = None
    if isinstance(weights, dict):
        ft, fi = weights.get("fingerprint_train"), weights.get("fingerprint_infer")
        differing = [str(w) for w in _list(weights.get("differs"))]
        unverified = [str(w) for w in _list(weights.get("unverified"))]
        weights_view = {"train": _text(ft), "infer": _text(fi), "differs": differing[:200],
                        "more": max(0, len(differing) - 200),
                        "unverified": unverified[:50], "unverified_more": max(0, len(unverified) - 50),
                        "mismatch": bool(differing) or (ft is not None and fi is not None and ft != fi)}
    return {"rows": rows, "differ_count": sum(r["differs"] for r in rows), "weights": weights_view}


_MISSING = object()


def _moe(moe: Any) -> dict | None:
    """One row per router (flip rate bar, flips, largest margin, replay share, class) and the replay line."""
    rates = _dict(_dict(moe).get("router_flip_rate"))
    if not rates:
        return None
    finite = [v for v in rates.values() if is_number(v) and math.isfinite(v)]
    top = max(finite, default=0.0) or 1.0          # bars are relative to the largest rate
    layers = {str(x.get("boundary")): x for x in _list(_dict(moe).get("layers")) if isinstance(x, dict)}
    rows = []
    for k, v in rates.items():
        layer = layers.get(str(k), {})
        cls = f"{_text(layer.get('class'))} / {_text(layer.get('kind'))}" if layer.get("class") else "—"
        rows.append({"boundary": str(k), "rate": fmt_fraction(v),
                     "width": f"{min(100.0, max(0.0, 100.0 * v / top)):.1f}" if is_number(v) and math.isfinite(v) else "0",
                     "flips": _text(layer.get("flips", "—")), "margin": fmt_num(layer.get("margin_max")),
                     "share": fmt_fraction(layer.get("replay_share")), "cls": cls})  # fmt: skip
    replay = _dict(_dict(moe).get("replay"))
    line = None
    if replay:
        before, after = _dict(replay.get("before")), _dict(replay.get("after"))
        line = (f"Routing replay ({_text(replay.get('forced_tokens'))} flipped tokens forced to the inference "
                f"path's experts): mean |Δ logprob| {fmt_num(before.get('abs_diff_mean'))} → "
                f"{fmt_num(after.get('abs_diff_mean'))}, max {fmt_num(before.get('abs_diff_max'))} → "
                f"{fmt_num(after.get('abs_diff_max'))}; the flips explain {fmt_fraction(replay.get('share'))} of the gap.")
    return {"rows": rows, "replay": line}


def _flatten(value: Any, prefix: str = "", depth: int = 0) -> list[tuple[str, str]]:
    """Nested dicts as ('a.b.c', value) rows; lists and deeper levels stay inline JSON."""
    if isinstance(value, dict) and value and depth < 4:
        rows = []
        for key, inner in value.items():
            rows.extend(_flatten(inner, f"{prefix}.{key}" if prefix else str(key), depth + 1))
        return rows
    return [(prefix or "value", fmt_value(value))]


def _pretty(value: Any) -> list[tuple[str, str]] | None:
    if value is None or value == {}:
        return None
    return _flatten(value)[:500]
