"""GitHub Actions output for ``logdiff check``: annotations and a step summary.

* ``annotations`` gives one ``::error`` workflow command per failed gate (up
  to GitHub's 10 per step), and ``warnings`` a ``::warning`` per note; GitHub
  shows both on the run page and the pull request.
  Messages are escaped as the runner expects (``%``, CR and LF in the message;
  also ``:`` and ``,`` in properties), so a value can never end the command early.
* ``step_summary`` is a short markdown section for ``$GITHUB_STEP_SUMMARY``:
  the outcome, the notes (verdict, top cause) and a table of gates, failed
  first. GitHub rejects a step summary over 1 MiB; this one stops listing
  gates after ``MAX_ROWS`` and is cut to ``MAX_SUMMARY_BYTES`` regardless.

Gates are plain dicts (``name``, ``passed``, ``value``, ``threshold``,
``message``); this module imports nothing else of logdiff.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .format import safe_text

MAX_ROWS = 50
MAX_ANNOTATIONS = 10  # GitHub shows at most 10 error annotations per step
MAX_SUMMARY_BYTES = 64 * 1024
_MAX_CELL = 200


_CONTROL = re.compile("[\x00-\x09\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def escape_data(text: str) -> str:
    """Escape a workflow command's message: ``%``, CR and LF as GitHub documents (``%25``, ``%0D``,
    ``%0A``); any other control character (ESC...) as ``%XX`` too, which the runner shows as typed."""
    text = str(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return _CONTROL.sub(lambda m: f"%{ord(m.group()):02X}", text)


def escape_property(text: str) -> str:
    """Escape a workflow command's property value (``title=...``)."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def annotations(gates: list[dict[str, Any]], notes: Sequence[str] = (), *, title: str = "logdiff check") -> list[str]:
    """One ``::error`` line per failed gate: its message, then the notes (verdict, top cause).

    GitHub keeps at most 10 error annotations per step, so past ``MAX_ANNOTATIONS``
    failed gates the last line counts the rest instead of being silently dropped.
    """
    context = "".join(f"\n{n}" for n in notes)
    failed = [g for g in gates if not g.get("passed")]
    shown = failed if len(failed) <= MAX_ANNOTATIONS else failed[: MAX_ANNOTATIONS - 1]
    lines = []
    for gate in shown:
        name = escape_property(f"{title}: {gate.get('name')}")
        lines.append(f"::error title={name}::{escape_data(str(gate.get('message')) + context)}")
    if len(shown) < len(failed):
        rest = len(failed) - len(shown)
        msg = f"{rest} more gates failed; the step summary and the job log list them all{context}"
        lines.append(f"::error title={escape_property(title)}::{escape_data(msg)}")
    return lines


def warnings(messages: Sequence[str], *, title: str = "logdiff check") -> list[str]:
    """``::warning`` lines, for things a reviewer should see that do not fail the check."""
    return [f"::warning title={escape_property(title)}::{escape_data(m)}" for m in messages]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.6g}"
    text = str(value)
    if len(text) > _MAX_CELL:
        text = text[: _MAX_CELL - 1] + "…"
    for old, new in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("|", "\\|"), ("\r", " "), ("\n", " ")):
        text = text.replace(old, new)
    return safe_text(text)


def step_summary(gates: list[dict[str, Any]], notes: Sequence[str] = (), *, title: str = "logdiff check") -> str:
    """Markdown: a heading with the outcome, the notes, and the gates table (failed gates first)."""
    failed = [g for g in gates if not g.get("passed")]
    outcome = f"❌ {len(failed)} of {len(gates)} gates failed" if failed else f"✅ all {len(gates)} gates passed"
    out = [f"### {_cell(title)}: {outcome}", ""]
    out += [f"- {_cell(n)}" for n in notes]
    out += ["", "| gate | value | threshold | result |", "|---|---|---|---|"]
    ordered = failed + [g for g in gates if g.get("passed")]
    for g in ordered[:MAX_ROWS]:
        result = "pass" if g.get("passed") else "**FAIL**"
        out.append(f"| {_cell(g.get('name'))} | {_cell(g.get('value'))} | {_cell(g.get('threshold'))} | {result} |")
    if len(ordered) > MAX_ROWS:
        out.append(f"\n… and {len(ordered) - MAX_ROWS} more gates (see the JUnit report or the job log).")
    text = "\n".join(out) + "\n\n"
    encoded = text.encode("utf-8")
    if len(encoded) > MAX_SUMMARY_BYTES:
        text = encoded[: MAX_SUMMARY_BYTES - 64].decode("utf-8", "ignore") + "\n\n… (summary truncated)\n\n"
    return text


def append_step_summary(text: str, path: str | Path | None = None) -> Path | None:
    """Append to ``path`` or ``$GITHUB_STEP_SUMMARY``; None when neither is set."""
    target = path or os.environ.get("GITHUB_STEP_SUMMARY")
    if not target:
        return None
    with open(target, "a", encoding="utf-8") as f:
        f.write(text)
    return Path(target)
