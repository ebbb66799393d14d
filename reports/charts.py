"""Chart geometry for the HTML report, computed in Python and drawn by the template.

The per-position line chart and the histogram become inline SVG: this module
computes only numbers (coordinates, tick positions) and short labels, and the
autoescaping template writes the markup, so no string from a result can reach
the page unescaped. The boundary × position heatmap is too large for SVG; it
is prepared here as compact JSON (values rounded to 3 significant digits,
max-pooled to at most ``MAX_HEATMAP_CELLS`` cells) and drawn on a canvas by
the page's script. Beyond ``COLLAPSE_LAYERS`` decoder layers the page starts
with every layer folded into one row (the max over its boundaries), except the
layer of the first divergence; a click on a layer's name unfolds it.
"""

from __future__ import annotations

import math
from typing import Any

from .format import fmt_num, is_number

MAX_HEATMAP_CELLS = 200_000
MAX_HEATMAP_ROWS = 2_000
MIN_HEATMAP_COLS = 64
MAX_LINE_POINTS = 1_000
MAX_HOVER_BANDS = 512
COLLAPSE_LAYERS = 8  # beyond this many decoder layers the heatmap starts with each layer folded into one row

# Plot area of the SVG charts, in SVG user units.
WIDTH, HEIGHT = 560, 230
LEFT, RIGHT, TOP, BOTTOM = 58, 14, 14, 38


def _finite(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


def _pool(values: list, start: int, stop: int) -> Any:
    """Max over values[start:stop]: NaN wins (it must stay visible), then inf, then the largest."""
    best = None
    for v in values[start:stop]:
        if not is_number(v):
            continue
        if math.isnan(v):
            return v
        if best is None or v > best:
            best = v
    return best


def _decades(lo: float, hi: float) -> list[int]:
    """Exponents of the powers of ten from lo to hi, thinned to at most 7 ticks."""
    exps = list(range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1))
    step = max(1, math.ceil(len(exps) / 7))
    return exps[::step]


def _nice_ticks(n: int, count: int = 6) -> list[int]:
    """About ``count`` round integer ticks in [0, n)."""
    if n <= 1:
        return [0]
    raw = (n - 1) / count
    mag = 10 ** math.floor(math.log10(raw)) if raw >= 1 else 1
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return list(range(0, n, int(step)))


def position_chart(per_position: Any) -> dict | None:
    """Log-scale line chart of per-position max and mean |Δ logprob|; None without data."""
    if not isinstance(per_position, dict):
        return None
    series = {k: per_position.get(k) for k in ("abs_diff_max", "abs_diff_mean")}
    series = {k: v for k, v in series.items() if isinstance(v, list) and v}
    if not series:
        return None
    n = max(len(v) for v in series.values())
    pool = max(1, math.ceil(n / MAX_LINE_POINTS))
    positives = [v for vals in series.values() for v in vals if _finite(v) and v > 0]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    zero_band = 20.0                     # a strip under the log axis where exact zeros sit
    if positives:
        lo_exp = math.floor(math.log10(min(positives)))
        hi_exp = math.ceil(math.log10(max(positives)))
        if hi_exp == lo_exp:
            hi_exp += 1
    else:
        lo_exp, hi_exp = -8, -7

    def x_of(pos: float) -> float:
        return LEFT + (plot_w * pos / (n - 1) if n > 1 else plot_w / 2)

    def y_of(value: float) -> float:
        if value <= 0:
            return TOP + plot_h
        frac = (math.log10(value) - lo_exp) / (hi_exp - lo_exp)
        return TOP + (plot_h - zero_band) * (1 - frac)

    lines = []
    for key, vals in series.items():
        points = []
        for start in range(0, len(vals), pool):
            v = _pool(vals, start, start + pool)
            if _finite(v):
                points.append(f"{x_of(start):.1f},{y_of(v):.1f}")
        lines.append({"key": key, "label": "max" if key == "abs_diff_max" else "mean",
                      "points": " ".join(points)})

    y_ticks = [{"y": round(y_of(10.0 ** e), 1), "label": f"1e{e}"}
               for e in _decades(10.0 ** lo_exp, 10.0 ** hi_exp)]
    y_ticks.append({"y": TOP + plot_h, "label": "0"})
    x_ticks = [{"x": round(x_of(p), 1), "label": str(p)} for p in _nice_ticks(n)]
    bands = []
    if n <= MAX_HOVER_BANDS:
        band_w = plot_w / n
        mx, mean = series.get("abs_diff_max", []), series.get("abs_diff_mean", [])
        for p in range(n):
            parts = [f"response position {p}"]
            if p < len(mx):
                parts.append(f"max {fmt_num(mx[p])}")
            if p < len(mean):
                parts.append(f"mean {fmt_num(mean[p])}")
            bands.append({"x": round(x_of(p) - band_w / 2, 1), "w": round(band_w, 2),
                          "title": ", ".join(parts)})
    return {"width": WIDTH, "height": HEIGHT, "left": LEFT, "right": WIDTH - RIGHT, "top": TOP,
            "bottom": TOP + plot_h, "zero_top": round(TOP + plot_h - zero_band * 0.45, 1), "lines": lines,
            "x_ticks": x_ticks, "y_ticks": y_ticks, "bands": bands, "n": n,
            "pooled": pool if pool > 1 else None, "all_zero": not positives}


def histogram_chart(histogram: Any) -> dict | None:
    """Bar chart of the |Δ logprob| histogram (log10 bins); None when malformed."""
    if not isinstance(histogram, dict):
        return None
    edges, counts = histogram.get("edges"), histogram.get("counts")
    if not (isinstance(edges, list) and isinstance(counts, list) and counts
            and len(edges) == len(counts) + 1 and all(is_number(c) for c in counts)):
        return None
    total = sum(counts) or 1
    top = max(counts) or 1
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / len(counts)
    bars = []
    for i, count in enumerate(counts):
        lo, hi = edges[i], edges[i + 1]
        if i == 0 and lo == 0:
            label, title = "0", f"|Δ| < {fmt_num(hi)} (incl. exactly equal)"
        else:
            label, title = _edge_label(lo), f"{fmt_num(lo)} ≤ |Δ| < {fmt_num(hi)}"
        h = plot_h * count / top
        bars.append({"x": round(LEFT + i * slot + slot * 0.12, 1), "w": round(slot * 0.76, 1),
                     "y": round(TOP + plot_h - h, 1), "h": round(h, 1),
                     "label_x": round(LEFT + i * slot + slot / 2, 1), "label": label,
                     "count": count, "title": f"{title}: {count} tokens ({100 * count / total:.1f}%)"})
    return {"width": WIDTH, "height": HEIGHT, "left": LEFT, "right": WIDTH - RIGHT, "top": TOP,
            "bottom": TOP + plot_h, "bars": bars, "total": sum(counts)}


def _edge_label(value: Any) -> str:
    if _finite(value) and value > 0:
        exp = math.log10(value)
        if abs(exp - round(exp)) < 1e-9:
            return f"1e{round(exp)}"
    return fmt_num(value)


def _round3(value: Any) -> Any:
    """3 significant digits for the page; non-finite values become strings JSON can carry."""
    if not is_number(value):
        return None
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return float(f"{value:.3g}")


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def heatmap_data(table: Any, first_divergence: Any) -> dict | None:
    """The divergence table ready for the canvas: pooled, rounded, with the first divergence cell."""
    if not isinstance(table, dict):
        return None
    names, positions, values = table.get("boundaries"), table.get("positions"), table.get("max_abs_diff")
    if not (isinstance(names, list) and isinstance(positions, list) and isinstance(values, list)
            and names and positions):
        return None
    n_rows, n_cols = len(names), len(positions)
    row_pool = max(1, math.ceil(n_rows / MAX_HEATMAP_ROWS))
    shown_rows = math.ceil(n_rows / row_pool)
    max_cols = max(MIN_HEATMAP_COLS, MAX_HEATMAP_CELLS // shown_rows)
    col_pool = max(1, math.ceil(n_cols / max_cols))

    rows, labels, layers = [], [], []
    for r0 in range(0, n_rows, row_pool):
        r1 = min(n_rows, r0 + row_pool)
        group = [values[r] if r < len(values) and isinstance(values[r], list) else [] for r in range(r0, r1)]
        row = []
        for c0 in range(0, n_cols, col_pool):
            cells = [_pool(g, c0, c0 + col_pool) for g in group]
            row.append(_round3(_pool(cells, 0, len(cells))))
        rows.append(row)
        first, last = str(names[r0]), str(names[r1 - 1])
        labels.append(first if r1 - r0 == 1 else f"{first} … {last} ({r1 - r0} rows)")
        layer = _layer_of(first)
        layers.append(-1 if layer is None else layer)

    cols = []
    for c0 in range(0, n_cols, col_pool):
        c1 = min(n_cols, c0 + col_pool)
        cols.append([positions[c0], positions[c1 - 1]])

    first_cell = None
    if isinstance(first_divergence, dict):
        boundary, pos = first_divergence.get("boundary"), first_divergence.get("position")
        if boundary in names and pos in positions:
            first_cell = {"row": names.index(boundary) // row_pool,
                          "col": positions.index(pos) // col_pool}

    notes = []
    if row_pool > 1:
        notes.append(f"each row is the max over up to {row_pool} consecutive boundaries")
    if col_pool > 1:
        notes.append(f"each column is the max over up to {col_pool} consecutive positions")
    note = None
    if notes:
        note = (f"Downsampled for display ({len(rows)} × {len(cols)} shown of {n_rows} × {n_cols}): "
                + "; ".join(notes) + ". result.json holds the full table.")
    n_layers = len({layer for layer in layers if layer >= 0})
    return {"labels": labels, "layers": layers, "cols": cols, "values": rows, "first": first_cell,
            "metric": str(table.get("metric") or "max_abs_diff"), "note": note,
            "shape": [n_rows, n_cols], "n_layers": n_layers, "collapse": n_layers > COLLAPSE_LAYERS}
