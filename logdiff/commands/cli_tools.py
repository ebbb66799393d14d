"""The commands about logdiff itself, its models and its machine: ``kernels``, ``demo-model``, ``quantize``,
``doctor``.

``kernels`` lists or self-tests the reference consistent kernels, ``demo-model`` builds a small
trained demo model, ``quantize`` writes a quantized (compressed-tensors) checkpoint of a model for a
quantized rollout engine, ``doctor`` reports versions, engines and the device. Registered on the
shared app (``cli_app``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from logdiff.commands.cli_app import DemoArch, app, demo_archs, handle_errors, stderr_console


@app.command(short_help="List or self-test the reference consistent kernels.")
@handle_errors
def kernels(
    self_test: bool = typer.Option(False, "--self-test", help="Check each kernel's invariance and fp64 agreement."),
) -> None:
    """List the reference consistent kernels, or self-test them (exit 1 if one fails)."""
    from rich.table import Table

    from logdiff.kernels import KERNELS
    from logdiff.kernels import self_test as run_self_test

    console = Console()
    if not self_test:
        table = Table(title="logdiff consistent kernels")
        for col in ("kernel", "what it computes", "precision policy"):
            table.add_column(col)
        for k in KERNELS:
            table.add_row(k.name, k.description, k.precision)
        console.print(table)
        return
    table = Table(title="consistent kernel self-test")
    for col in ("kernel", "batch-invariant", "max rel. error vs fp64", "bound", "detail"):
        table.add_column(col)
    results = run_self_test()
    for r in results:
        table.add_row(
            r.name, "yes" if r.invariant else "NO", f"{r.max_error:.2e}", f"{r.bound:.0e}", r.detail,
            style=None if r.ok else "bold red",
        )  # fmt: skip
    console.print(table)
    if not all(r.ok for r in results):
        raise typer.Exit(1)


@app.command("demo-model", short_help="Build a small trained demo model.")
@handle_errors
def demo_model(
    path: Path = typer.Argument(..., metavar="PATH", help="Directory to create."),
    arch: DemoArch = typer.Option("qwen3", "--arch", metavar="ARCH", help=f"One of {', '.join(demo_archs())} "
                                  "(docs/architectures.md)."),
    seed: int = typer.Option(0, metavar="S", help="Seed for the weights and the training order."),
    train_seconds: float = typer.Option(90.0, metavar="SECONDS",
                                        help="Training budget in seconds (peaked distributions)."),
    max_steps: Optional[int] = typer.Option(None, metavar="N",
                                            help="Stop after this many steps (reproducible builds)."),
) -> None:
    """Build a small trained demo model (and tokenizer) from a transformers config."""
    from logdiff.commands import outputs
    from logdiff.demo import build_demo_model

    created = outputs.probe_demo_target(path)  # before the training, not after it
    console = stderr_console()
    with outputs.removed_on_failure(created), console.status(f"building {arch} demo model") as status, \
            outputs.writing_tree(path):
        built = build_demo_model(
            path, arch, seed=seed, train_seconds=train_seconds, max_steps=max_steps,
            progress=lambda msg: status.update(msg),
        )  # fmt: skip
    Console().print(f"wrote {built}")


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
    with outputs.removed_on_failure(created), stderr_console().status(f"quantizing {model} ({scheme})"), \
            outputs.writing_tree(out):
        written = quantize_checkpoint(model, out, scheme, trust_remote_code)
    Console().print(f"wrote {written}")


@app.command(short_help="Versions, engines, the device and the vLLM platform.")
@handle_errors
def doctor() -> None:
    """Versions, the engines installed and not, the device and the vLLM platform."""
    from logdiff.commands.doctor import collect, render

    render(collect(), Console())
