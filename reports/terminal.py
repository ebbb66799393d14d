"""The terminal summary of a result: the verdict first, then causes and key metrics.

It fits one screen at any model size: causes are shown as their groups (one row
per class, kind and op family, ``groups.py``), every table cell is at most two
lines, and the layout follows the console's width (the fix texts and verl names
get columns of their own from ``WIDE`` columns on).

The CLI owns the ``rich.console.Console`` (and so NO_COLOR, width and
redirection); this module only prints to it. Every string from the result is
wrapped in ``rich.text.Text``, so a model path such as ``[bold]x`` is shown as
typed rather than read as rich markup, and styles are named (``"bold red"``)
so rich drops them when colour is off: nothing here writes escape codes.
Control characters inside the result's strings (ESC, OSC-8, CR, LF) are
escaped first (``format.terminal_safe``), so a hostile result.json can neither
drive the terminal nor start a line of its own (a CI log's ``::error::``).
NaN/inf on a path (``non_finite``) is the first line printed, even when quiet.
"""

from __future__ import annotations

import textwrap
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import shares
from .groups import cause_groups
from .format import (KEY_METRICS, METRICS, cost_text, current_names, fmt_fraction, fmt_metric, fmt_num, is_number, pair_label,
                     safe_text, terminal_safe)

VERDICT_STYLE = {"consistent": "bold green", "divergent": "bold yellow", "operator_path": "bold blue",
                 "framework_difference": "bold red", "mixed": "bold magenta"}
CLASS_STYLE = {"operator_path": "blue", "framework_difference": "red"}
MAX_GROUPS = 8
WIDE = 120  # from this many columns on, the causes table has a fix column and the metrics their verl names


def verdict_line(result: dict) -> Text:
    """One line: verdict, the size of the gap, and where it starts (``result`` already terminal-safe)."""
    verdict = str(result.get("verdict", "unknown"))
    line = Text("logdiff: ")
    line.append(verdict, style=VERDICT_STYLE.get(verdict, "bold"))
    if result.get("complete") is False:
        line.append(" (incomplete)", style="bold red")
    lp = result.get("logprobs") if isinstance(result.get("logprobs"), dict) else {}
    line.append(f"  max|Δlogprob| {fmt_num(lp.get('abs_diff_max'))}"
                f"  mean {fmt_num(lp.get('abs_diff_mean'))}")
    pairs = result.get("pairs")
    if isinstance(pairs, list) and pairs and isinstance(pairs[0], dict):
        line.append(f" ({pair_label(pairs[0])})")
    fd = result.get("first_divergence")
    if isinstance(fd, dict):
        line.append(f"  first divergence {fd.get('boundary')} @ position {fd.get('position')}")
    causes = result.get("causes")
    if isinstance(causes, list) and causes:
        line.append(f"  {len(causes)} cause{'s' if len(causes) != 1 else ''}")
    return line


def print_summary(result: dict, console: Console, quiet: bool = False) -> None:
    """Print the verdict line, then (unless quiet) warnings, top causes and key metrics."""
    result = terminal_safe(result)
    non_finite = result.get("non_finite") if isinstance(result.get("non_finite"), dict) else None
    if non_finite:
        head = Text("warning: non-finite values (NaN/inf) on a path: ", style="bold red")
        console.print(head + Text(str(non_finite.get("summary") or "see non_finite in result.json")), soft_wrap=True)
    console.print(verdict_line(result), soft_wrap=True)
    if quiet:
        return
    console.print(_context_line(result), soft_wrap=True)
    cost = _cost_line(result)
    if cost is not None:
        console.print(cost, soft_wrap=True)
    if result.get("complete") is False:
        console.print(Text("The scan stopped early: this result is incomplete.", style="bold red"))
    for warning in result.get("warnings") or []:
        if non_finite and warning == non_finite.get("summary"):
            continue  # already the first line
        console.print(Text("warning: ", style="yellow") + Text(str(warning)), soft_wrap=True)

    replay = result.get("rollout_replay")
    if isinstance(replay, dict) and replay.get("summary"):
        style = "green" if replay.get("reproduced") is True else "yellow"
        console.print(Text("recorded rollout: ", style=f"bold {style}") + Text(str(replay["summary"])), soft_wrap=True)

    fd = result.get("first_divergence")
    if isinstance(fd, dict):
        eq = fd.get("inputs_equal")
        how = {True: "inputs bitwise equal", False: "inputs already differ"}.get(eq, "inputs not compared")
        console.print(Text("first divergence: ", style="bold")
                      + Text(f"{fd.get('boundary')} (layer {fd.get('layer')}, position {fd.get('position')}), "
                             f"max |Δ| {fmt_num(fd.get('max_abs_diff'))}, {how}"), soft_wrap=True)

    moe = moe_line(result.get("moe"))
    if moe is not None:
        console.print(Text("moe routing: ", style="bold") + Text(moe), soft_wrap=True)

    if cause_groups(result):
        table, fixes = _causes_table(result, console.width)
        console.print(table)
        for line in _share_lines(result, console.width):
            console.print(Text(line, style="dim"))
        for line in fixes:
            console.print(line, soft_wrap=True)
    metrics = _metrics_table(result, wide=console.width >= WIDE)
    if metrics is not None:
        console.print(metrics)


def moe_line(moe: Any) -> str | None:
    """One line on MoE routing: flips per layer, their class, and what routing replay closed."""
    if not isinstance(moe, dict) or not isinstance(moe.get("layers"), list):
        return None
    layers = [x for x in moe["layers"] if isinstance(x, dict)]
    flipped = [x for x in layers if x.get("flips")]
    if not flipped:
        line = f"no expert flips in {len(layers)} routers"
    else:
        worst = max(flipped, key=lambda x: x.get("flip_rate") or 0)
        line = (f"{len(flipped)} of {len(layers)} routers flip experts (worst {worst.get('boundary')}: "
                f"{fmt_fraction(worst.get('flip_rate'))}); {fmt_fraction(moe.get('tokens_flipped_any_layer'))} "
                "of tokens flip in some layer")
    if moe.get("class"):
        line += f"; {moe['class']} ({', '.join(str(k) for k in moe.get('kinds') or [])})"
    replay = moe.get("replay")
    if isinstance(replay, dict) and isinstance(replay.get("before"), dict) and isinstance(replay.get("after"), dict):
        line += (f"; routing replay: mean |Δ| {fmt_num(replay['before'].get('abs_diff_mean'))} → "
                 f"{fmt_num(replay['after'].get('abs_diff_mean'))}")
    return line


def _context_line(result: dict) -> Text:
    """What was compared: the model and each path with its engine version."""
    paths = [p for p in result.get("paths") or [] if isinstance(p, dict)]
    described = [f"{p.get('name')} ({p.get('engine')} {p.get('version') or '?'}, {p.get('mode')})" for p in paths]
    line = Text("model ", style="dim") + Text(str(result.get("model") or "—"))
    if result.get("dtype"):
        line += Text(f" · {result.get('dtype')}")
    if described:
        line += Text(" · ", style="dim") + Text(", ".join(described))
    return line


def clip(text: str, width: int, lines: int = 2) -> str:
    """``text`` wrapped at ``width`` into at most ``lines`` lines, the last cut with '…' when it overflows."""
    width = max(2, width)
    wrapped = textwrap.wrap(text, width, break_on_hyphens=False) or [""]
    if len(wrapped) <= lines:
        return "\n".join(wrapped)
    rest = " ".join(wrapped[lines - 1:])
    return "\n".join(wrapped[:lines - 1] + [rest[:width - 1].rstrip() + "…"])


def _cost_line(result: dict) -> Text | None:
    text = cost_text(result)
    return Text(text, style="dim") if text else None


def _causes_table(result: dict, width: int) -> tuple[Table, list[Text]]:
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
    cause_w = min(25, max(5, *(len(str(g.get(k))) for g in shown for k in ("family", "kind"))))
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
        cells = [Text(clip(str(g.get("family")), cause_w, 1) + "\n" + clip(str(g.get("kind")), cause_w, 1))]
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


def _share_lines(result: dict, width: int) -> list[str]:
    """What the share column means and what it sums to, wrapped at ``width`` (none for older results)."""
    shown = cause_groups(result)[:MAX_GROUPS]
    text = shares.note(result, negative=any(shares.is_negative(g.get("share")) for g in shown))
    return textwrap.wrap(text, max(20, width), break_on_hyphens=False) if text else []


def _metrics_table(result: dict, wide: bool = True) -> Table | None:
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


class PhaseProgress:
    """Rich progress on the CLI's stderr console: one row per scan phase, with its elapsed time, and a
    bar with step k of n and the time remaining in a counted phase (the attribution rescans).

    It is the listener of ``logdiff.phases.Phases``: called with each update (an object with
    ``phase``, ``message``, ``step``, ``total``). Transient: the rows vanish when the scan ends.
    """

    def __init__(self, console: Console) -> None:
        from rich.progress import (BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)
        from rich.table import Column

        def fixed(width: int) -> Column:
            return Column(width=width, no_wrap=True, overflow="ellipsis")

        # fixed widths for the phase, its bar and times; the message takes what is left and is cut, never wrapped
        self.progress = Progress(SpinnerColumn(finished_text="✓", table_column=fixed(1)),
                                 TextColumn("{task.fields[phase]}", table_column=fixed(15)),
                                 BarColumn(bar_width=12, table_column=fixed(12)),
                                 TextColumn("{task.fields[count]}", justify="right", table_column=fixed(5)),
                                 TimeElapsedColumn(table_column=fixed(7)), TimeRemainingColumn(table_column=fixed(7)),
                                 TextColumn("{task.description}",
                                            table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
                                 console=console, transient=True, expand=True)
        self._task: Any = None
        self._phase: Any = None

    def __enter__(self) -> "PhaseProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._finish()
        self.progress.stop()

    def _finish(self) -> None:
        if self._task is not None:
            task = self.progress.tasks[-1]
            self.progress.update(self._task, total=task.total or 1, completed=task.total or 1)

    def __call__(self, update: Any) -> None:
        if update.phase != self._phase:
            self._finish()
            self._phase = update.phase
            self._task = self.progress.add_task("", total=None, phase=str(update.phase), count="")
        step, total = update.step, update.total
        counted = isinstance(step, int) and isinstance(total, int) and total > 0
        self.progress.update(self._task, description=safe_text(update.message),
                             total=total if counted else None, completed=step - 1 if counted else 0,
                             count=f"{step}/{total}" if counted else "")
