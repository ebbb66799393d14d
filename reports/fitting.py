"""Text fitted to a console's width: fields packed into lines, names shortened around '…', cells clipped.

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

Used by the terminal summary (``terminal``) and its tables (``terminal_tables``); nothing here
reads a result.
"""

from __future__ import annotations

import re
import textwrap
from collections import deque

from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

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


def print_fitted(console: Console, fields: list[Field]) -> None:
    for line in fit(fields, console.width):
        console.print(line, soft_wrap=True)  # already fits: printed as built


def joined(fields: list[Field]) -> Text:
    line = Text()
    for sep, field in fields:
        line.append(sep)
        line.append_text(field)
    return line


def shortened(name: str, width: int | None, used: int) -> str:
    """``name`` shortened to what a line of ``width`` cells leaves after ``used`` cells (unchanged without a width)."""
    return name if width is None else middle(name, width - used)



def clip(text: str, width: int, lines: int = 2) -> str:
    """``text`` wrapped at ``width`` into at most ``lines`` lines, the last cut with '…' when it overflows."""
    width = max(2, width)
    wrapped = textwrap.wrap(text, width, break_on_hyphens=False) or [""]
    if len(wrapped) <= lines:
        return "\n".join(wrapped)
    rest = " ".join(wrapped[lines - 1:])
    return "\n".join(wrapped[:lines - 1] + [rest[:width - 1].rstrip() + "…"])
