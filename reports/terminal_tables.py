"""The terminal summary's tables: the causes (one row per group) and the key metrics, laid out to a width.

The causes table shows ``groups.cause_groups`` (at most ``MAX_GROUPS`` rows, the rest named in
its caption), every cell at most two lines (``fitting.clip``), with column widths that add up
to the console's width: narrow consoles get the fixes as lines under the table, and from
``WIDE`` columns on they are a column of their own (as the verl names are in the metrics
table). ``share_lines`` says what the share column means and sums to. Every cell is a
``rich.text.Text`` of terminal-safe strings (``terminal.print_summary`` escapes the result
first), never markup.
"""

from __future__ import annotations

import textwrap

from rich import box
from rich.table import Table
from rich.text import Text

from . import shares
from .fitting import clip
from .format import KEY_METRICS, METRICS, current_names, fmt_fraction, fmt_metric, is_number, pair_label
from .groups import cause_groups, kind_label

CLASS_STYLE = {"operator_path": "blue", "framework_difference": "red", "not_judged": "yellow"}
MAX_GROUPS = 8
WIDE = 120  # from this many columns on, the causes table has a fix column and the metrics their verl names


def causes_table(result: dict, width: int) -> tuple[Table, list[Text]]:
    """The causes, one row per (class, kind, family) group, laid out to fit ``width`` columns.

    Every cell is at most two lines. Narrow terminals get the fixes as lines under
    the table (two lines each); from ``WIDE`` columns on they are a column of their own.
    """
    groups = cause_groups(result)
    shown = groups[:MAX_GROUPS]
    n_ops = sum(g.get("count") or len(g.get("sites") or []) or 1 for g in groups)
    wide = width >= WIDE
    shares = [fmt_fraction(g.get("share")) if is_number(g.get("share")) else "—" for g in shown]
    necessity = [{True: "yes", False: "no"}.get(g.get("necessity"), "—") for g in shown]
    cause_w = min(25, max(5, *(len(x) for g in shown for x in (str(g.get("family")), kind_label(g)))))
    classes = {str(g.get("class")) for g in groups}
    class_w = 20 if wide else 0 if len(classes) == 1 else 10   # narrow: one class goes in the title
    share_w = max(5, *(len(x) for x in shares))
    nec_w = 9 if wide else 4
    fixed = cause_w + class_w + share_w + nec_w
    n_cols = 6 if wide else 5 if class_w else 4
    free = max(12, width - fixed - 3 * n_cols)           # each column costs its padding and a rule
    longest = max(len(str(g.get("layers"))) for g in shown)
    where_w = min(max(24, longest // 2 + 2), free // 2) if wide else free
    fix_w = max(12, free - where_w)
    title = f"Causes: {n_ops} op{'s' if n_ops != 1 else ''} in {len(groups)} group{'s' if len(groups) != 1 else ''}"
    if not class_w:
        title += f", all {classes.pop()}"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  padding=(0, 1))
    table.add_column("family / kind", width=cause_w, no_wrap=True)
    if class_w:
        table.add_column("class", width=class_w, no_wrap=True)
    table.add_column("where", width=where_w, no_wrap=True)
    table.add_column("share", width=share_w, justify="right", no_wrap=True)
    table.add_column("necessary" if wide else "nec.", width=nec_w, no_wrap=True)
    if wide:
        table.add_column("fix", width=fix_w, no_wrap=True)
    fixes: list[Text] = []
    for g, share, nec in zip(shown, shares, necessity):
        cls = str(g.get("class"))
        cells = [Text(clip(str(g.get("family")), cause_w, 1) + "\n" + clip(kind_label(g), cause_w, 1))]
        if class_w:
            cells.append(Text(clip(cls if wide else cls.replace("_", " "), class_w), style=CLASS_STYLE.get(cls, "")))
        cells += [Text(clip(str(g.get("layers")), where_w)), Text(share), Text(nec)]
        if wide:
            cells.append(Text(clip(str(g.get("fix") or ""), fix_w)))
        else:
            head = f"fix {g.get('family')}: "
            body = clip(head + str(g.get("fix") or ""), width - 2)
            fixes.append(Text(body.replace("\n", "\n  "), style=""))
        table.add_row(*cells)
    if len(groups) > MAX_GROUPS:
        table.caption = f"{len(groups) - MAX_GROUPS} more groups: logdiff explain RESULT.json, or report.html"
    return table, fixes


def share_lines(result: dict, width: int) -> list[str]:
    """What the share column means and what it sums to, wrapped at ``width`` (none for older results)."""
    shown = cause_groups(result)[:MAX_GROUPS]
    text = shares.note(result, negative=any(shares.is_negative(g.get("share")) for g in shown), detail=False)
    return textwrap.wrap(text, max(20, width), break_on_hyphens=False) if text else []


def metrics_table(result: dict, wide: bool = True) -> Table | None:
    pairs = [p for p in result.get("pairs") or [] if isinstance(p, dict)]
    columns = [(pair_label(p), current_names(p["metrics"]) if isinstance(p.get("metrics"), dict) else {})
               for p in pairs]
    if not columns and isinstance(result.get("logprobs"), dict):
        columns = [("primary", current_names(result["logprobs"]))]
    if not columns:
        return None
    labels = {key: (label, verl) for key, label, verl, _ in METRICS}
    table = Table(title="Key metrics", title_justify="left")
    table.add_column("metric")
    if wide:
        table.add_column("verl name", style="dim")
    for name, _ in columns:
        table.add_column(Text(name), justify="right")
    for key in KEY_METRICS:
        if not any(key in m for _, m in columns):
            continue
        label, verl = labels[key]
        names = [Text(label), Text(verl or "")] if wide else [Text(label)]
        table.add_row(*names, *[Text(fmt_metric(key, m[key]) if key in m else "—") for _, m in columns])
    return table
