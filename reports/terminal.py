"""The terminal summary of a result: the verdict first, then causes and key metrics.

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

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .format import KEY_METRICS, METRICS, fmt_fraction, fmt_metric, fmt_num, is_number, pair_label, terminal_safe

VERDICT_STYLE = {"consistent": "bold green", "divergent": "bold yellow", "operator_path": "bold blue",
                 "framework_difference": "bold red", "mixed": "bold magenta"}
MAX_CAUSES = 5


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
    if result.get("complete") is False:
        console.print(Text("The scan stopped early: this result is incomplete.", style="bold red"))
    for warning in result.get("warnings") or []:
        if non_finite and warning == non_finite.get("summary"):
            continue  # already the first line
        console.print(Text("warning: ", style="yellow") + Text(str(warning)), soft_wrap=True)

    fd = result.get("first_divergence")
    if isinstance(fd, dict):
        eq = fd.get("inputs_equal")
        how = {True: "inputs bitwise equal", False: "inputs already differ"}.get(eq, "inputs not compared")
        console.print(Text("first divergence: ", style="bold")
                      + Text(f"{fd.get('boundary')} (layer {fd.get('layer')}, position {fd.get('position')}), "
                             f"max |Δ| {fmt_num(fd.get('max_abs_diff'))}, {how}"), soft_wrap=True)

    causes = [c for c in result.get("causes") or [] if isinstance(c, dict)]
    if causes:
        console.print(_causes_table(causes))
    metrics = _metrics_table(result)
    if metrics is not None:
        console.print(metrics)


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


def _causes_table(causes: list[dict]) -> Table:
    ranked = sorted(causes, key=lambda c: -(c["share"] if is_number(c.get("share")) else -1.0))
    shown = ranked[:MAX_CAUSES]
    title = "Top causes" if len(ranked) > MAX_CAUSES else "Causes"
    table = Table(title=title, title_justify="left", show_lines=False)
    for name, kwargs in (("class", {}), ("kind", {}), ("boundary", {"overflow": "fold"}),
                         ("share", {"justify": "right"}), ("necessary", {}), ("fix", {"overflow": "fold"})):
        table.add_column(name, **kwargs)
    for c in shown:
        share = c.get("share")
        necessity = {True: "yes", False: "no"}.get(c.get("necessity"), "—")
        table.add_row(Text(str(c.get("class"))), Text(str(c.get("kind"))), Text(str(c.get("boundary"))),
                      Text(fmt_fraction(share) if is_number(share) else "—"), Text(necessity),
                      Text(str(c.get("fix") or "")))
    if len(ranked) > MAX_CAUSES:
        table.caption = f"{len(ranked) - MAX_CAUSES} more in result.json / report.html"
    return table


def _metrics_table(result: dict) -> Table | None:
    pairs = [p for p in result.get("pairs") or [] if isinstance(p, dict)]
    columns = [(pair_label(p), p.get("metrics") if isinstance(p.get("metrics"), dict) else {}) for p in pairs]
    if not columns and isinstance(result.get("logprobs"), dict):
        columns = [("primary", result["logprobs"])]
    if not columns:
        return None
    labels = {key: (label, verl) for key, label, verl, _ in METRICS}
    table = Table(title="Key metrics", title_justify="left")
    table.add_column("metric")
    table.add_column("verl name", style="dim")
    for name, _ in columns:
        table.add_column(Text(name), justify="right")
    for key in KEY_METRICS:
        if not any(key in m for _, m in columns):
            continue
        label, verl = labels[key]
        table.add_row(Text(label), Text(verl or ""),
                      *[Text(fmt_metric(key, m[key]) if key in m else "—") for _, m in columns])
    return table


def scan_progress(console: Console, quiet: bool = False) -> Any:
    """A transient rich Progress for long scans (disabled when quiet or not a terminal)."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                    console=console, transient=True, disable=quiet or not console.is_terminal)
