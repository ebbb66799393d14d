"""The ``logdiff`` command line's entry point (the console script ``logdiff`` runs ``main``).

A thin module: the typer app, its error handling and consoles live in
``logdiff.commands.cli_app``, and each command in a runner module under ``logdiff/commands/``
that registers it on the app when imported: ``cli_scan`` (scan, check), ``cli_files``
(compare, msprobe-config, report, explain) and ``cli_tools`` (kernels, demo-model, doctor),
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


# --- quantize (issue 51): one command, self-contained; kept apart so the cli.py split can move it whole ---
@app.command(short_help="Write a quantized (compressed-tensors) checkpoint of a bf16 model.")
@handle_errors
def quantize(
    model: Path = typer.Argument(..., metavar="MODEL", help="The bf16 HF model directory."),
    out: Path = typer.Argument(..., metavar="OUT", help="The directory to create (absent or empty)."),
    scheme: str = typer.Option("int8-w8a8", metavar="SCHEME", help="int8-w8a8 (weights per channel, activations "
                               "per token, dynamic), fp8-block or fp8-tensor (docs/capture.md#quantized-rollouts)."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Run the model's own code."),
) -> None:
    """Write a compressed-tensors checkpoint of MODEL that vLLM loads as a quantized rollout engine."""
    from logdiff.commands import outputs
    from logdiff.commands.quantize import quantize_checkpoint

    created = outputs.probe_demo_target(out)
    with outputs.removed_on_failure(created), _stderr().status(f"quantizing {model} ({scheme})"), \
            outputs.writing_tree(out):
        written = quantize_checkpoint(model, out, scheme, trust_remote_code)
    Console().print(f"wrote {written}")
# --- end quantize ---


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
