"""The ``logdiff`` command line.

Only this module knows about terminals, exit codes and files on disk. Every
command imports torch, transformers and vLLM lazily, inside its body, so that
``logdiff --help`` stays instant. Errors the user can fix print one line and
exit with the code documented in docs/cli.md; anything else is an internal
error (exit 101), with the traceback only under ``LOGDIFF_DEBUG=1``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from logdiff.errors import EXIT_INTERNAL, LogdiffError

app = typer.Typer(
    name="logdiff",
    help="Find where and why a trainer's logprobs and an inference engine's logprobs differ.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _stderr() -> Console:
    return Console(stderr=True)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn exceptions into a one-line message and the documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except LogdiffError as e:
            _stderr().print(f"[bold red]logdiff: error:[/] {e}", highlight=False, markup=True, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            _stderr().print("logdiff: interrupted")
            raise typer.Exit(130) from None
        except Exception as e:  # noqa: BLE001 - the last line of defence
            if os.environ.get("LOGDIFF_DEBUG"):
                traceback.print_exc()
            msg = f"{type(e).__name__}: {e}".splitlines()[0]
            _stderr().print(
                f"logdiff: internal error: {msg} (set LOGDIFF_DEBUG=1 for the traceback)",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
            raise typer.Exit(EXIT_INTERNAL) from None

    return wrapper


# Options shared by `scan` and `check`.
ModelArg = typer.Argument(..., help="Local HF model directory (config, tokenizer; weights unless CKPT is given).")
CkptArg = typer.Argument(None, help="Weights both paths load: HF dir, .safetensors/.pt state dict, or DCP dir.")


def _build_config(**kw: Any) -> Any:
    from logdiff.config import ScanConfig, parse_sets

    train_set, infer_set = parse_sets(kw.pop("set_") or [])
    infer = kw.pop("infer") or ["vllm"]
    return ScanConfig(train_set=train_set, infer_set=infer_set, infer=infer, **kw)


def _run_scan(cfg: Any, quiet: bool) -> dict[str, Any]:
    from logdiff.pipeline import scan as run

    console = _stderr()
    if quiet or not console.is_terminal:
        return run(cfg)
    with console.status("starting") as status:
        return run(cfg, progress=lambda msg: status.update(msg))


def _write_outputs(result: dict[str, Any], out: Optional[Path], json_path: Optional[Path]) -> None:
    from logdiff.reports import write_html

    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result, indent=2))
        write_html(result, out / "report.html")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))


@app.command()
@handle_errors
def scan(
    model: Path = ModelArg,
    ckpt: Optional[Path] = CkptArg,
    train: str = typer.Option("hf", help="Training path engine."),
    infer: Optional[list[str]] = typer.Option(None, help="Inference path engine(s): vllm, hf-decode, hf. Repeatable."),
    dtype: str = typer.Option("bfloat16", help="bfloat16, float16 or float32."),
    sequences: Optional[Path] = typer.Option(None, help="JSONL of prompt_ids, response_ids[, rollout_logprobs]."),
    prompts: Optional[Path] = typer.Option(None, help="Text prompts (one per line) or JSONL with prompt/messages."),
    num_sequences: int = typer.Option(8, help="Probe set: number of sequences."),
    prompt_len: int = typer.Option(16, help="Probe set: prompt length in tokens."),
    response_len: int = typer.Option(32, help="Tokens sampled per response."),
    seed: int = typer.Option(0, help="Seed for the probe prompts and sampling."),
    infer_ckpt: Optional[Path] = typer.Option(None, help="Different weights for the inference side (weight-sync bugs)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="train.KEY=VALUE or infer.KEY=VALUE. Repeatable."),
    depth: str = typer.Option("logprobs", help="logprobs, modules or ops."),
    consistent: bool = typer.Option(False, help="Install the reference consistent kernels on every path."),
    out: Optional[Path] = typer.Option(None, help="Write DIR/result.json and DIR/report.html."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write result.json here."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the verdict line."),
) -> None:
    """Replay the same tokens through a training and an inference path and compare logprobs."""
    from logdiff.reports import print_summary

    cfg = _build_config(
        model=model, ckpt=ckpt, train=train, infer=infer, dtype=dtype, sequences=sequences, prompts=prompts,
        num_sequences=num_sequences, prompt_len=prompt_len, response_len=response_len, seed=seed,
        infer_ckpt=infer_ckpt, set_=set_, depth=depth, consistent=consistent,
    )  # fmt: skip
    result = _run_scan(cfg, quiet)
    _write_outputs(result, out, json_path)
    print_summary(result, Console(), quiet=quiet)


@app.command()
@handle_errors
def report(
    result_json: Path = typer.Argument(..., help="A result.json written by scan or check."),
    out: Path = typer.Option(Path("report.html"), help="Where to write the HTML report."),
) -> None:
    """Render report.html from a saved result.json."""
    from logdiff.errors import InputError
    from logdiff.reports import validate_result, write_html

    if not result_json.is_file():
        raise InputError(f"result file not found: {result_json}")
    try:
        result = json.loads(result_json.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{result_json}: not valid JSON ({e.msg})") from None
    problems = validate_result(result)
    if problems:
        raise InputError(f"{result_json} is not a logdiff result: {problems[0]}")
    write_html(result, out)
    Console().print(f"wrote {out}")


@app.command("demo-model")
@handle_errors
def demo_model(
    path: Path = typer.Argument(..., help="Directory to create."),
    arch: str = typer.Option("qwen3", help="qwen3, llama or qwen3-moe."),
    seed: int = typer.Option(0, help="Seed for the weights and the training order."),
    train_seconds: float = typer.Option(90.0, help="Training budget in seconds (peaked distributions)."),
    max_steps: Optional[int] = typer.Option(None, help="Stop after this many steps (reproducible builds)."),
) -> None:
    """Build a small trained demo model (and tokenizer) from a transformers config."""
    from logdiff.demo import SUPPORTED_DEMO_ARCHS, build_demo_model
    from logdiff.errors import InputError

    if arch not in SUPPORTED_DEMO_ARCHS:
        raise InputError(f"unknown --arch {arch!r}; choose one of {', '.join(SUPPORTED_DEMO_ARCHS)}")
    console = _stderr()
    with console.status(f"building {arch} demo model") as status:
        built = build_demo_model(
            path, arch, seed=seed, train_seconds=train_seconds, max_steps=max_steps,
            progress=lambda msg: status.update(msg),
        )  # fmt: skip
    Console().print(f"wrote {built}")


@app.command()
@handle_errors
def doctor() -> None:
    """Versions, available engines, the device and the vLLM platform."""
    from logdiff.doctor import collect, render

    render(collect(), Console())


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
