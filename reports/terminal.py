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

Every line fits the console's width, so nothing is soft-wrapped mid-word by the
terminal. The one-line texts (the verdict, what was compared, the cost, the
first divergence, MoE routing, warnings) are built as *fields*, each with the
separator that joins it to the one before, and ``fit`` packs them greedily
into lines: a field that does not fit starts an indented continuation line, so
lines break between fields (at 80 columns the verdict becomes "verdict + gap"
and "first divergence + causes"); wider consoles keep more on a line and lose
nothing that fits. Long names (a model path, a boundary, a path's name) are
shortened to the room their field leaves, keeping their head and tail around
'…' (``middle``: ``model.layers…attn.rope_q``), and prose too long for a line
is wrapped at its spaces. The tables get column widths that add up to the
console's width, and rich fits the metrics table. The exception is ``--quiet``:
its verdict line (``verdict_line``) is the one long line, never wrapped, meant
for logs and grep.
"""

from __future__ import annotations

import re
import textwrap
from collections import deque
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import positions, shares
from .groups import cause_groups, kind_label
from .format import (KEY_METRICS, METRICS, cost_text, current_names, fmt_fraction, fmt_metric, fmt_num, is_number, pair_label,
                     safe_text, terminal_safe)

VERDICT_STYLE = {"consistent": "bold green", "divergent": "bold yellow", "operator_path": "bold blue",
                 "framework_difference": "bold red", "mixed": "bold magenta",
                 "unexplained": "bold red"}
CLASS_STYLE = {"operator_path": "blue", "framework_difference": "red", "not_judged": "yellow"}
MAX_GROUPS = 8
WIDE = 120  # from this many columns on, the causes table has a fix column and the metrics their verl names


INDENT = "  "                 # the start of a continuation line
ELLIPSIS = "…"
_CUT_AFTER = frozenset("./_-: ")  # ``middle`` cuts a name just after one of these where it can
Field = tuple[str, Text]      # a field of a one-line text, and the separator joining it to the one before
_COMMANDS = ("::", "##")      # how a CI log's commands start (``::error::``, ``##[error]``), leading spaces aside


def middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells: itself when it fits, else its head and its tail around '…'.

    The tail, the most specific part of a dotted or slashed name (``rope_q``, ``global_step_100/actor``),
    gets the larger share, then the head what the tail leaves, then the tail what the head leaves; each
    is cut at a word's edge (next to a '.', '/', '_', '-', ':' or space) where that keeps at least half
    of its room, so ``model.layers.0.self_attn.rope_q`` becomes ``model.layers…rope_q`` in 19 cells.
    """
    head, tail = _middle_cut(text, width)
    return text if tail < 0 else text[:head] + ELLIPSIS + text[len(text) - tail:]


def _middle_cut(text: str, width: int) -> tuple[int, int]:
    """How many characters of ``text`` ``middle`` keeps from its head and its tail; (len, -1) when it fits."""
    if cell_len(text) <= width:
        return len(text), -1
    width = max(width, 3)
    tail = _word_cut(text[::-1], (width - 1) * 3 // 5, tail=True)
    head = _word_cut(text, width - 1 - cell_len(text[len(text) - tail:]))
    return head, _word_cut(text[::-1], width - 1 - cell_len(text[:head]), tail=True)


def _word_cut(text: str, width: int, tail: bool = False) -> int:
    """How many leading characters of ``text`` to keep in ``width`` cells: up to a word's edge when that
    keeps at least half of them. ``text`` reversed for a tail, which starts a word rather than a separator."""
    used, n = 0, len(text)
    for i, ch in enumerate(text):
        used += cell_len(ch)
        if used > width:
            n = i
            break

    def edge(i: int) -> bool:
        return i == len(text) or text[i] in _CUT_AFTER or (not tail and i > 0 and text[i - 1] in _CUT_AFTER)

    if edge(n):
        return n
    cut = next((i for i in range(n - 1, 0, -1) if edge(i)), 0)
    return cut if 2 * cell_len(text[:cut]) >= cell_len(text[:n]) else n


def _middle_text(text: Text, width: int) -> Text:
    """``middle`` for a styled ``Text``: the kept head and tail keep their styles."""
    head, tail = _middle_cut(text.plain, width)
    if tail < 0:
        return text
    return text[:head] + Text(ELLIPSIS) + text[len(text) - tail:]


def fit(fields: list[Field], width: int) -> list[Text]:
    """``fields`` packed into lines of at most ``width`` cells.

    A field joins the current line after its separator when it fits there, else it starts the next
    line, indented by ``INDENT``; a ',' or ';' separator stays at the end of the line it breaks. A
    field longer than a line of its own goes in as its words (prose wraps at its spaces), and a word
    longer than a line keeps its head and tail (``middle``). Names are best shortened by the caller,
    which knows the room a field leaves them. A field or word that starts like a CI log command
    (``::error::``) stays joined to the one before it, so wrapping never gives it a line of its own.
    """
    width = max(width, len(INDENT) + 8)
    room = width - len(INDENT)
    queue = deque(_glued(fields))
    lines: list[Text] = []
    line: Text | None = None
    while queue:
        sep, field = queue.popleft()
        if field.cell_len > (width if line is None and not lines else room):
            words = _glued([(sep if i == 0 else " ", field[m.start():m.end()])
                            for i, m in enumerate(re.finditer(r"\S+", field.plain))])
            queue.extendleft(reversed([(s, _middle_text(word, room)) for s, word in words]))
            continue
        if line is not None and line.cell_len + cell_len(sep) + field.cell_len <= width:
            line.append(sep)
            line.append_text(field)
            continue
        if line is not None:
            end = sep.strip()
            if end in (",", ";") and line.cell_len + len(end) <= width:
                line.append(end)
            lines.append(line)
        line = Text(INDENT if lines else "")
        line.append_text(field)
    if line is not None:
        lines.append(line)
    return lines


def _glued(fields: list[Field]) -> list[Field]:
    """``fields`` with each one that starts like a CI log command joined to the one before it."""
    out: list[Field] = []
    for sep, field in fields:
        if out and field.plain.lstrip().startswith(_COMMANDS):
            before_sep, before = out[-1]
            out[-1] = (before_sep, before + Text(sep) + field)
        else:
            out.append((sep, field))
    return out


def _print_fitted(console: Console, fields: list[Field]) -> None:
    for line in fit(fields, console.width):
        console.print(line, soft_wrap=True)  # already fits: printed as built


def _joined(fields: list[Field]) -> Text:
    line = Text()
    for sep, field in fields:
        line.append(sep)
        line.append_text(field)
    return line


def _shortened(name: str, width: int | None, used: int) -> str:
    """``name`` shortened to what a line of ``width`` cells leaves after ``used`` cells (unchanged without a width)."""
    return name if width is None else middle(name, width - used)


def verdict_line(result: dict) -> Text:
    """One line: verdict, the size of the gap, and where it starts (``result`` already terminal-safe).

    This is the ``--quiet`` output, the one line meant for logs and grep: never wrapped or shortened,
    so it can be longer than the console. The summary fits the same fields to the console's width.
    """
    return _joined(_verdict_fields(result))


def _verdict_fields(result: dict, width: int | None = None) -> list[Field]:
    """The verdict line's fields: the verdict, the gap with its pair, the first divergence and the number
    of causes. With a ``width``, names are shortened to fit a continuation line of that many cells."""
    room = None if width is None else width - len(INDENT)
    verdict = str(result.get("verdict", "unknown"))
    head = Text("logdiff: ")
    head.append(verdict, style=VERDICT_STYLE.get(verdict, "bold"))
    if result.get("complete") is False:
        head.append(" (incomplete)", style="bold red")
    fields: list[Field] = [("", head)]
    lp = result.get("logprobs") if isinstance(result.get("logprobs"), dict) else {}
    gap = f"max|Δlogprob| {fmt_num(lp.get('abs_diff_max'))}  mean {fmt_num(lp.get('abs_diff_mean'))}"
    if isinstance(result.get("statistics"), dict):  # an msprobe statistics-only comparison: no logprobs
        gap = "statistics only (no tensors, no logprobs)"
    pairs = result.get("pairs")
    if isinstance(pairs, list) and pairs and isinstance(pairs[0], dict):
        gap += f" ({_pair_label(pairs[0], None if room is None else room - cell_len(gap) - 3)})"
    fields.append(("  ", Text(gap)))
    first = result["statistics"].get("first_difference") if isinstance(result.get("statistics"), dict) else None
    if isinstance(first, dict):
        fields.append(("  ", Text(f"first differing module {_shortened(str(first.get('boundary')), room, 23)}")))
    causes = result.get("causes")
    count = f"{len(causes)} cause{'s' if len(causes) != 1 else ''}" if isinstance(causes, list) and causes else ""
    fd = result.get("first_divergence")
    if isinstance(fd, dict):
        first = (positions.first_divergence(result) or {}).get("first")
        where = f" @ position {first['position']}" if first is not None else ""  # version 1: not recorded
        used = len("first divergence ") + cell_len(where) + (len("  ") + len(count) if count else 0)
        name = _shortened(str(fd.get("boundary")), room, used)         # leaves room for the count after it
        fields.append(("  ", Text(f"first divergence {name}{where}")))
    if count:
        fields.append(("  ", Text(count)))
    return fields


def _pair_label(pair: dict, width: int | None) -> str:
    """``pair_label`` in ``width`` cells, its two path names shortened alike when it does not fit."""
    label = pair_label(pair)
    if width is None or cell_len(label) <= width:
        return label
    each = (width - len(" vs ")) // 2
    return f"{middle(str(pair.get('train', '?')), each)} vs {middle(str(pair.get('infer', '?')), each)}"


def print_summary(result: dict, console: Console, quiet: bool = False) -> None:
    """Print the verdict, then (unless quiet) warnings, top causes and key metrics, every line within
    the console's width. Quiet prints the verdict as one line (``verdict_line``), for logs and grep."""
    result = terminal_safe(result)
    width = console.width
    non_finite = result.get("non_finite") if isinstance(result.get("non_finite"), dict) else None
    if non_finite:
        head = Text("warning: non-finite values (NaN/inf) on a path: ", style="bold red")
        line = head + Text(str(non_finite.get("summary") or "see non_finite in result.json"))
        if quiet:
            console.print(line, soft_wrap=True)
        else:
            _print_fitted(console, [("", line)])
    if quiet:
        console.print(verdict_line(result), soft_wrap=True)
        return
    _print_fitted(console, _verdict_fields(result, width))
    _print_fitted(console, _context_fields(result, width))
    cost = cost_text(result)
    if cost:                                              # breaks between its parts, then between its phases
        _print_fitted(console, [(" · " if i and j == 0 else ", " if j else "", Text(phase, style="dim"))
                                for i, part in enumerate(cost.split(" · "))
                                for j, phase in enumerate(part.split(", "))])
    if result.get("complete") is False:
        _print_fitted(console, [("", Text("The scan stopped early: this result is incomplete.", style="bold red"))])
    for warning in result.get("warnings") or []:
        if non_finite and warning == non_finite.get("summary"):
            continue  # already the first line
        _print_fitted(console, [("", Text("warning: ", style="yellow") + Text(str(warning)))])

    replay = result.get("rollout_replay")
    if isinstance(replay, dict) and replay.get("summary"):
        style = "green" if replay.get("reproduced") is True else "yellow"
        _print_fitted(console, [("", Text("recorded rollout: ", style=f"bold {style}") + Text(str(replay["summary"])))])

    fd = result.get("first_divergence")
    if isinstance(fd, dict):
        _print_fitted(console, _divergence_fields(result, width))
    stats = result.get("statistics")
    if isinstance(stats, dict):  # a statistics-only comparison: its summary instead of logprob metrics
        _print_fitted(console, [("", Text(str(stats.get("summary")), style="bold"))])
        return

    moe = moe_line(result.get("moe"))
    if moe is not None:
        parts = moe.split("; ")
        _print_fitted(console, [("", Text("moe routing: ", style="bold") + Text(parts[0]))]
                      + [("; ", Text(part)) for part in parts[1:]])

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


def _context_fields(result: dict, width: int | None = None) -> list[Field]:
    """What was compared: the model with its dtype, then each path with its engine version. With a
    ``width``, the model path keeps to the first line and a path's name to a continuation line."""
    dtype = f" · {result.get('dtype')}" if result.get("dtype") else ""
    model = _shortened(str(result.get("model") or "—"), width, len("model ") + cell_len(dtype))
    fields: list[Field] = [("", Text("model ", style="dim") + Text(model) + Text(dtype))]
    room = None if width is None else width - len(INDENT)
    for i, p in enumerate(p for p in result.get("paths") or [] if isinstance(p, dict)):
        engine = " ".join(str(x) for x in (p.get("engine"), p.get("version")) if x)  # a bundle may hold no version
        how = f" ({engine or '?'}, {p.get('mode')})"
        name = _shortened(str(p.get("name")), room, cell_len(how) + 1)          # 1: the ',' ending a line
        fields.append((" · " if i == 0 else ", ", Text(name + how)))
    return fields


def _divergence_fields(result: dict, width: int | None = None) -> list[Field]:
    """The first divergence: the boundary with its layer and where it starts, where its difference is largest
    and how large, whether its inputs agree."""
    fd = result["first_divergence"]
    rows = positions.first_divergence(result)
    how = {True: "inputs bitwise equal", False: "inputs already differ"}.get(fd.get("inputs_equal"),
                                                                             "inputs not compared")
    first = positions.first_text(rows)                      # empty for a version 1 result: not recorded
    head, layer = "first divergence: ", f" (layer {fd.get('layer')}){'' if first else ':'}"
    name = _shortened(str(fd.get("boundary")), width, len(head) + cell_len(layer) + 1)
    # the rest is prose in phrases that never break inside ("position 22 (response token 6),"): it fills lines
    phrases = ["starts at", *_phrases(first)] if first else []
    largest = positions.worst_text(rows, fmt_num)
    if largest:
        size, where = largest.split(" at ", 1)
        phrases += [size, "at " + _phrases(where)[0], *_phrases(where)[1:]]
    else:
        phrases.append(f"max |Δ| {fmt_num(fd.get('max_abs_diff'))};")
    return [("", Text(head, style="bold") + Text(name + layer)), *((" ", Text(p)) for p in phrases + [how])]


def _phrases(row_text: str) -> list[str]:
    """'position 22 (response token 6), sequence 1' -> ['position 22 (response token 6),', 'sequence 1;']."""
    parts = row_text.split(", ")
    return [part + ("," if i < len(parts) - 1 else ";") for i, part in enumerate(parts)]


def clip(text: str, width: int, lines: int = 2) -> str:
    """``text`` wrapped at ``width`` into at most ``lines`` lines, the last cut with '…' when it overflows."""
    width = max(2, width)
    wrapped = textwrap.wrap(text, width, break_on_hyphens=False) or [""]
    if len(wrapped) <= lines:
        return "\n".join(wrapped)
    rest = " ".join(wrapped[lines - 1:])
    return "\n".join(wrapped[:lines - 1] + [rest[:width - 1].rstrip() + "…"])


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


def _share_lines(result: dict, width: int) -> list[str]:
    """What the share column means and what it sums to, wrapped at ``width`` (none for older results)."""
    shown = cause_groups(result)[:MAX_GROUPS]
    text = shares.note(result, negative=any(shares.is_negative(g.get("share")) for g in shown), detail=False)
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

