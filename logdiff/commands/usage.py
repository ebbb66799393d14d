"""How the command line shows its help and its usage errors.

Help is click's plain formatter, not typer's rich panels (``rich_markup_mode=None``):
rich lays the options out as a table whose columns cut what does not fit with "…"
(at 80 columns it cut ``framework_difference`` and ``$GITHUB_STEP_SUMMARY``), and no
typer setting changes that. Click's formatter wraps at word boundaries to the
terminal's width (at most 80 columns) and never cuts a word, so every help text
reads whole on any terminal (tests/test_cli_docs.py checks each command at 80).

A usage error that click finds while parsing (an unknown option, a missing argument,
a value that is not one of an option's choices or not a number) is one line on
stderr, ``logdiff: error: ...``, and exit 2, as every other input error is
(docs/cli.md, "Exit codes"): not click's usage block and ``Error:`` line.
``LogdiffGroup`` turns click's ``UsageError`` into ``OneLineUsageError`` where the
group parses its own arguments and where it hands a command its own; the help
shown for no arguments at all (``NoArgsIsHelpError``) stays as it is.
"""

from __future__ import annotations

from typing import IO, Any

import typer
from typer.core import TyperGroup

try:  # typer vendors click as typer._click in its recent releases (0.27 and 0.29 do)
    from typer import _click
except ImportError:  # pragma: no cover - an older typer runs on click itself
    import click as _click

UsageError = _click.exceptions.UsageError
#: the help shown for no arguments (click >= 8.2); nothing to keep apart on an older click
NoArgsIsHelpError: Any = getattr(_click.exceptions, "NoArgsIsHelpError", ())


class OneLineUsageError(UsageError):
    """A click usage error shown as one line, ``logdiff: error: MESSAGE (see COMMAND --help)``."""

    def __init__(self, error: UsageError) -> None:
        super().__init__(error.message, error.ctx)
        self.original = error

    def format_message(self) -> str:
        # typer words a choice or a number it could not read as a validation error ("Value error, 'x' is not
        # one of ..."): the value and the choices are the message
        return self.original.format_message().replace(": Value error, ", ": ")

    def show(self, file: IO[Any] | None = None) -> None:
        from logdiff.reports.format import safe_text

        where = f" (see {self.ctx.command_path} --help)" if self.ctx is not None else ""
        typer.echo(safe_text(f"logdiff: error: {self.format_message().rstrip('.')}{where}"), err=True, file=file)


class LogdiffGroup(TyperGroup):
    """The ``logdiff`` group: its own and each command's usage errors are one line."""

    def parse_args(self, ctx: _click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except NoArgsIsHelpError:
            raise
        except UsageError as e:
            raise OneLineUsageError(e) from None

    def invoke(self, ctx: _click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (NoArgsIsHelpError, OneLineUsageError):
            raise
        except UsageError as e:  # the command's name, then its own arguments (cmd.make_context)
            raise OneLineUsageError(e) from None
