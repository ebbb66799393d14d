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

Every line fits the console's width (the one exception is ``--quiet``'s ``verdict_line``, one
long line meant for logs and grep). The summary is split by role: this module builds the
one-line texts as fields (``_verdict_fields``, ``_context_fields``, ``_divergence_fields``,
``moe_line``) and prints them in order (``print_summary``); ``fitting`` packs fields into lines
and shortens names, ``terminal_tables`` lays out the causes and key-metrics tables, and
``progress`` is the live progress display a scan shows on stderr.
"""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

from . import positions
from .fitting import INDENT, Field, joined, middle, print_fitted, shortened
from .format import cost_text, fmt_fraction, fmt_num, pair_label, terminal_safe
from .groups import cause_groups
from .terminal_tables import WIDE, causes_table, metrics_table, share_lines

VERDICT_STYLE = {"consistent": "bold green", "divergent": "bold yellow", "operator_path": "bold blue",
                 "framework_difference": "bold red", "mixed": "bold magenta",
                 "unexplained": "bold red"}


def verdict_line(result: dict) -> Text:
    """One line: verdict, the size of the gap, and where it starts (``result`` already terminal-safe).

    This is the ``--quiet`` output, the one line meant for logs and grep: never wrapped or shortened,
    so it can be longer than the console. The summary fits the same fields to the console's width.
    """
    return joined(_verdict_fields(result))


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
        fields.append(("  ", Text(f"first differing module {shortened(str(first.get('boundary')), room, 23)}")))
    causes = result.get("causes")
    count = f"{len(causes)} cause{'s' if len(causes) != 1 else ''}" if isinstance(causes, list) and causes else ""
    fd = result.get("first_divergence")
    if isinstance(fd, dict):
        first = (positions.first_divergence(result) or {}).get("first")
        where = f" @ position {first['position']}" if first is not None else ""  # version 1: not recorded
        used = len("first divergence ") + cell_len(where) + (len("  ") + len(count) if count else 0)
        name = shortened(str(fd.get("boundary")), room, used)         # leaves room for the count after it
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
            print_fitted(console, [("", line)])
    if quiet:
        console.print(verdict_line(result), soft_wrap=True)
        return
    print_fitted(console, _verdict_fields(result, width))
    print_fitted(console, _context_fields(result, width))
    cost = cost_text(result)
    if cost:                                              # breaks between its parts, then between its phases
        print_fitted(console, [(" · " if i and j == 0 else ", " if j else "", Text(phase, style="dim"))
                                for i, part in enumerate(cost.split(" · "))
                                for j, phase in enumerate(part.split(", "))])
    if result.get("complete") is False:
        print_fitted(console, [("", Text("The scan stopped early: this result is incomplete.", style="bold red"))])
    for warning in result.get("warnings") or []:
        if non_finite and warning == non_finite.get("summary"):
            continue  # already the first line
        print_fitted(console, [("", Text("warning: ", style="yellow") + Text(str(warning)))])

    replay = result.get("rollout_replay")
    if isinstance(replay, dict) and replay.get("summary"):
        style = "green" if replay.get("reproduced") is True else "yellow"
        print_fitted(console, [("", Text("recorded rollout: ", style=f"bold {style}") + Text(str(replay["summary"])))])

    fd = result.get("first_divergence")
    if isinstance(fd, dict):
        print_fitted(console, _divergence_fields(result, width))
    stats = result.get("statistics")
    if isinstance(stats, dict):  # a statistics-only comparison: its summary instead of logprob metrics
        print_fitted(console, [("", Text(str(stats.get("summary")), style="bold"))])
        return

    moe = moe_line(result.get("moe"))
    if moe is not None:
        parts = moe.split("; ")
        print_fitted(console, [("", Text("moe routing: ", style="bold") + Text(parts[0]))]
                      + [("; ", Text(part)) for part in parts[1:]])

    if cause_groups(result):
        table, fixes = causes_table(result, console.width)
        console.print(table)
        for line in share_lines(result, console.width):
            console.print(Text(line, style="dim"))
        for line in fixes:
            console.print(line, soft_wrap=True)
    metrics = metrics_table(result, wide=console.width >= WIDE)
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
    model = shortened(str(result.get("model") or "—"), width, len("model ") + cell_len(dtype))
    fields: list[Field] = [("", Text("model ", style="dim") + Text(model) + Text(dtype))]
    room = None if width is None else width - len(INDENT)
    for i, p in enumerate(p for p in result.get("paths") or [] if isinstance(p, dict)):
        engine = " ".join(str(x) for x in (p.get("engine"), p.get("version")) if x)  # a bundle may hold no version
        how = f" ({engine or '?'}, {p.get('mode')})"
        name = shortened(str(p.get("name")), room, cell_len(how) + 1)          # 1: the ',' ending a line
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
    name = shortened(str(fd.get("boundary")), width, len(head) + cell_len(layer) + 1)
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
