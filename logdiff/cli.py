"""The ``logdiff`` command line's entry point (the console script ``logdiff`` runs ``main``).

A thin module: the typer app, its error handling and consoles live in
``logdiff.commands.cli_app``, and each command in a runner module under ``logdiff/commands/``
that registers it on the app when imported: ``cli_scan`` (scan, check), ``cli_files``
(compare, msprobe-config, report, explain) and ``cli_tools`` (kernels, demo-model, quantize, doctor),
imported here in the order ``--help`` lists them. ``app`` is re-exported for the tests and for
``typer.testing.CliRunner``.

Only the command line knows about terminals, exit codes and files on disk; every command
imports torch, transformers and vLLM lazily, so ``logdiff --help`` stays instant. Exit codes
are in docs/cli.md.
"""

from __future__ import annotations

import sys

from logdiff.commands.cli_app import app

# each runner registers its commands on app when imported: they are imported in the order --help lists them
# isort: off
from logdiff.commands import cli_scan, cli_files, cli_tools  # noqa: F401
# isort: on

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
