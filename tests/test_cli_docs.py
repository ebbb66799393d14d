"""Help equals docs (issue 52, item 4): docs/cli.md against every command's options, and --help at 80 columns.

The options are read from the command objects typer builds (``typer.main.get_command(app)``), never listed
here: a new option, a renamed one, other choices or another default fail until docs/cli.md says the same.
docs/cli.md holds, under "## Options", one section per command, ``### `logdiff NAME ARGS```, whose heading
names its arguments and whose table has one row per option: its names, its value (the metavar, the choices
as `a` | `b`, or ``flag``), its default (`value`, `on`/`off` for a flag, ``required``, — for none) and what
it does. ``check``'s section documents only its own options and says it takes every option of ``scan``.

Negative controls: the checker finds a dropped row, another default, a missing choice, a renamed argument
and a missing command in planted edits of the page. At 80 columns every help line fits, nothing ends in
"…", and every option's help text is there whole; the control renders rich's panels (the old help) and
must see them cut.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from logdiff.cli import app

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
GROUP = get_command(app)
COMMANDS: dict[str, Any] = dict(GROUP.commands)  # type: ignore[attr-defined]
CELL = re.compile(r"(?<!\\)\|")


def _options(command: Any) -> list[Any]:
    return [p for p in command.params if p.param_type_name == "option"]


def _names(param: Any) -> frozenset[str]:
    return frozenset([*param.opts, *param.secondary_opts])


def _choices(param: Any) -> tuple[str, ...] | None:
    """An option's choices: typer 0.29 keeps them in its type descriptor, earlier ones in a click Choice."""
    desc = getattr(param, "type_descriptor", None)
    if desc is not None:
        return tuple(str(c) for c in desc.choices) if desc.is_choice else None
    choices = getattr(getattr(param, "type", None), "choices", None)
    return tuple(str(c) for c in choices) if choices is not None else None


def _is_flag(param: Any) -> bool:
    return bool(getattr(param, "is_flag", False))


def expected_value(param: Any) -> str:
    """What the value column must say: ``flag``, the choices, or the metavar."""
    if _is_flag(param):
        return "flag"
    choices = _choices(param)
    if choices is not None:
        return " | ".join(f"`{c}`" for c in choices)
    assert param.metavar, f"{sorted(_names(param))}: give the option a metavar (what its value is)"
    return param.metavar


def expected_default(param: Any) -> str:
    if param.required:
        return "required"
    default = param.default
    if _is_flag(param) and default is not None:
        return "`on`" if default else "`off`"
    if default is None:
        return "—"
    if isinstance(default, (list, tuple)):
        return ", ".join(f"`{d}`" for d in default)
    return f"`{default}`"


def expected_heading(name: str, command: Any) -> str:
    args = [p for p in command.params if p.param_type_name == "argument"]
    shown = [(p.metavar or p.name.upper()) if p.required else f"[{p.metavar or p.name.upper()}]" for p in args]
    return " ".join(["logdiff", name, *shown])


def sections(text: str) -> dict[str, tuple[str, str]]:
    """``### `logdiff NAME ...``` sections under "## Options": name -> (heading, body)."""
    options = text[text.index("\n## Options\n"):]
    options = options[: options.find("\n## ", 1) if options.find("\n## ", 1) > 0 else len(options)]
    found = {}
    for m in re.finditer(r"^### `(logdiff ([a-z-]+)[^`]*)`\n(.*?)(?=^### |\Z)", options, re.M | re.S):
        found[m.group(2)] = (m.group(1), m.group(3))
    return found


def rows(body: str) -> dict[frozenset[str], tuple[str, str]]:
    """The option table of a section: the option names of each row -> (value cell, default cell)."""
    out = {}
    for line in body.splitlines():
        if not line.startswith("| `-"):
            continue
        cells = [c.strip() for c in CELL.split(line.strip().strip("|"))]
        names = frozenset(re.findall(r"`(-[^`]+)`", cells[0]))
        out[names] = (cells[1].replace("\\|", "|"), cells[2])
    return out


def mismatches(text: str, commands: dict[str, Any]) -> list[str]:
    """Every way docs/cli.md and the commands part, one line each (none: they agree)."""
    problems = []
    synopsis = text[: text.index("\n## ")]
    documented = sections(text)
    for name in commands.keys() - documented.keys():
        problems.append(f"{name}: no section '### `logdiff {name} ...`' under ## Options")
    for name in documented.keys() - commands.keys():
        problems.append(f"{name}: documented, but there is no such command")
    for name, command in commands.items():
        if not re.search(rf"^logdiff {re.escape(name)}\b", synopsis, re.M):
            problems.append(f"{name}: missing from the synopsis at the top")
        if name not in documented:
            continue
        heading, body = documented[name]
        if heading != expected_heading(name, command):
            problems.append(f"{name}: heading '{heading}', expected '{expected_heading(name, command)}'")
        params = _options(command)
        if "Every option of `scan`" in body:  # check: scan's options, then its own
            inherited = {_names(p) for p in _options(commands["scan"])}
            if not inherited <= {_names(p) for p in params}:
                problems.append(f"{name}: says it takes every option of scan, but lacks some")
            params = [p for p in params if _names(p) not in inherited]
        table = rows(body)
        for param in params:
            key = _names(param)
            if key not in table:
                problems.append(f"{name}: option {' / '.join(sorted(key))} is not in its table")
                continue
            value, default = table[key]
            if value != expected_value(param):
                problems.append(f"{name} {param.opts[0]}: value '{value}', expected '{expected_value(param)}'")
            if default != expected_default(param):
                problems.append(f"{name} {param.opts[0]}: default '{default}', expected '{expected_default(param)}'")
        for key in table.keys() - {_names(p) for p in params}:
            problems.append(f"{name}: documents {' / '.join(sorted(key))}, which it does not take")
    return problems


def test_docs_cli_md_lists_every_option_as_the_commands_define_it() -> None:
    problems = mismatches(DOC.read_text(), COMMANDS)
    assert not problems, "docs/cli.md and the commands part:\n" + "\n".join(problems)


@pytest.mark.parametrize("old, new, problem", [
    ("| `--seed` | S | `0` | seed for the probe", "| `--seedling` | S | `0` | seed for the probe",
     "scan: option --seed is not in its table"),
    ("| `--prompt-len` | P | `16` |", "| `--prompt-len` | P | `12` |", "scan --prompt-len: default '`12`', expected '`16`'"),
    ("| `--level` | `L0` \\| `mix` |", "| `--level` | `L0` |", "msprobe-config --level: value '`L0`', expected"),
    ("### `logdiff report RESULT`", "### `logdiff report RESULT_JSON`", "report: heading 'logdiff report RESULT_JSON'"),
    ("### `logdiff kernels`", "### `logdiff kernel`", "kernels: no section"),
    ("| `--self-test` | flag | `off` |", "| `--self-test` | flag | `on` |", "kernels --self-test: default '`on`'"),
    ("| `--junit` | FILE | — |", "| `--junit` | PATH | — |", "check --junit: value 'PATH', expected 'FILE'"),
])  # fmt: skip
def test_the_checker_finds_a_planted_difference(old: str, new: str, problem: str) -> None:
    text = DOC.read_text()
    assert old in text
    found = mismatches(text.replace(old, new, 1), COMMANDS)
    assert any(p.startswith(problem) for p in found), found


def _flat(text: str) -> str:
    """Help text as one line: wrapped lines joined (a line broken after a hyphen joins without a space)."""
    out = ""
    for line in (line.strip() for line in text.splitlines()):
        if not line:
            continue
        out += ("" if re.search(r"\w-$", out) else " ") + line
    return re.sub(r"\s+", " ", out).strip()


def _help(*args: str, width: int = 80) -> str:
    res = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": str(width)}, prog_name="logdiff")
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("name", ["", *COMMANDS])
def test_help_at_80_columns_cuts_nothing(name: str) -> None:
    args = [name] if name else []
    text = _help(*args)
    too_long = [line for line in text.splitlines() if len(line) > 80]
    assert not too_long and "…" not in text, too_long
    flat = _flat(text)
    if not name:
        for command in COMMANDS.values():
            assert _flat(command.short_help) in flat, command.short_help
        return
    for param in COMMANDS[name].params:
        assert _flat(param.help or "") in flat, (param.name, param.help)
        choices = _choices(param)
        if choices is not None:  # the choices are shown: as the metavar, or in the help text
            assert f"<{'|'.join(choices)}>" in flat or all(c in _flat(param.help) for c in choices), param.name


def test_rich_help_would_cut_at_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: typer's rich panels (the help before issue 52) cut option values at 80 columns, and the
    checks above see it."""
    monkeypatch.setattr(app, "rich_markup_mode", "rich")
    text = _help("check")
    assert "…" in text and "framework_difference" not in _flat(text)
