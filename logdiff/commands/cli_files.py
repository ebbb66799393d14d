"""The commands that work on files and start no engine: ``compare``, ``msprobe-config``, ``report``, ``explain``.

``compare`` compares two capture bundles (or msprobe dumps) offline, as scan compares its
paths; ``msprobe-config`` writes the msprobe config for a dump logdiff can read; ``report``
and ``explain`` render a saved result.json, which ``_load_valid_result`` reads and validates
first (an unusable file is one InputError line). Registered on the shared app (``cli_app``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from logdiff.commands.cli_app import Level, Side, app, handle_errors, say, stderr_console, with_progress


def _load_valid_result(path: Path) -> dict[str, Any]:
    """A saved result.json, or a one-line InputError saying why it is unusable."""
    from logdiff.errors import InputError
    from logdiff.reports import load_result, validate_result
    from logdiff.reports.schema import structure_checked

    try:
        result = load_result(path)
    except ValueError as e:
        raise InputError(str(e)) from None
    problems = validate_result(result)
    if problems:
        raise InputError(f"{path} is not a valid logdiff result: {problems[0]}")
    if not structure_checked():
        say(stderr_console(), "note: jsonschema is not installed, so only part of the result's structure was checked")
    return result


@app.command("compare", short_help="Compare two capture bundles (or msprobe dumps) offline.")
@handle_errors
def compare_bundles(
    train_bundle: Path = typer.Argument(
        ..., metavar="TRAIN_BUNDLE", help="The training side's capture bundle (logdiff.capture, role train), or an "
        "msprobe tensor dump directory (docs/msprobe.md; needs --model), or a statistics dump (a statistics-only "
        "comparison).",
    ),
    infer_bundle: Path = typer.Argument(
        ..., metavar="INFER_BUNDLE", help="The inference side's capture bundle (LOGDIFF_CAPTURE in vLLM, or "
        "logdiff.capture, role infer), or an msprobe tensor dump directory."
    ),
    model: Optional[Path] = typer.Option(
        None, "--model", metavar="MODEL", help="The HF model directory both sides ran: with its weights each op "
        "that introduces error is measured against its exact function (the conformance check). An msprobe dump needs "
        "its config.json.",
    ),  # fmt: skip
    is_threshold: float = typer.Option(2.0, metavar="T", help="T of the rollout_is_* and k1 rollout_rs_* metrics."),
    out: Optional[Path] = typer.Option(None, metavar="DIR", help="Write DIR/result.json, DIR/report.html and "
                                       "the divergence table."),
    json_path: Optional[Path] = typer.Option(None, "--json", metavar="FILE", help="Write result.json as FILE."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the verdict line."),
    tp: Optional[int] = typer.Option(None, "--tp", metavar="N", help="The tensor-parallel size of an msprobe dump "
                                     "with several ranks per step (docs/msprobe.md); same as --parallel tp=N."),
    parallel: Optional[str] = typer.Option(None, "--parallel", metavar="tp=N[,pp=M]", help="The parallel sizes of a "
                                           "multi-rank msprobe dump (msprobe writes none); only tp is un-sharded yet."),
) -> None:
    """Compare two capture bundles offline, as scan compares its paths: un-shard, align by token ids, locate, classify.

    No engine is imported; what needs the live engines (reference rerun, attribution) is named in the warnings.
    """
    from logdiff.commands import outputs
    from logdiff.commands.compare import compare_bundles as run
    from logdiff.errors import InputError
    from logdiff.reports import print_summary

    if isinstance(is_threshold, bool) or not 1.0 < is_threshold < float("inf"):
        raise InputError(f"--is-threshold must be a finite number > 1 (bounds [1/T, T]), not {is_threshold!r}")
    import tempfile

    from logdiff.sources.msprobe.source import as_bundle, live_model, statistics_only, statistics_result

    if statistics_only(train_bundle, infer_bundle):  # an msprobe statistics dump: no tensors (docs/msprobe.md)
        from logdiff.comparison.environment import environment

        if tp is not None or parallel is not None:
            raise InputError("--tp/--parallel: a statistics-only comparison reads one rank per dump (docs/msprobe.md)")
        result = statistics_result(train_bundle, infer_bundle, model, environment())
        with outputs.prepared(out, json_path):
            outputs.write_result(result, out, json_path)
        print_summary(result, Console(), quiet=quiet)
        return
    tables: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="logdiff-msprobe-") as scratch:  # an msprobe dump's bundle, then gone
        from logdiff.sources.msprobe.ranks import parse_parallel

        sizes = parse_parallel(parallel, tp)
        train, infer = (as_bundle(p, role, model, Path(scratch), sizes) for p, role in ((train_bundle, "train"),
                                                                                (infer_bundle, "infer")))
        with outputs.prepared(out, json_path):
            weights = live_model(model, (train, infer), (train_bundle, infer_bundle))
            result = with_progress(
                lambda progress: run(train, infer, model=weights, is_threshold=is_threshold, progress=progress,
                                     tables=tables), quiet)  # fmt: skip
            outputs.write_result(result, out, json_path, tables)
    print_summary(result, Console(), quiet=quiet)


@app.command("msprobe-config", short_help="Write the msprobe config for a dump logdiff can read.")
@handle_errors
def msprobe_config(
    path: Path = typer.Argument(..., metavar="PATH", help="The msprobe config JSON file to write."),
    side: Side = typer.Option(..., help="hf (transformers, the training side) or vllm (in-process, enforce_eager)."),
    dump_path: Path = typer.Option(..., metavar="DIR", help="The directory msprobe writes the dump into."),
    layers: Optional[str] = typer.Option(None, metavar="N[,N...]",
                                         help="Decoder layers to dump, e.g. 0,3 (default: every layer)."),
    steps: Optional[str] = typer.Option(None, metavar="N[,N...]",
                                        help="msprobe steps to dump, e.g. 0,1 (default: every step)."),
    level: Level = typer.Option("L0", help="L0 (module boundaries) or mix (HF only: also the tensor ops inside "
                                "modules, which hold HF's RoPE)."),
    statistics: bool = typer.Option(False, "--statistics", help="Task statistics (summary_mode md5) instead of "
                                    "tensor: a same-or-not gate, no rows to align."),
) -> None:
    """Write the msprobe config logdiff needs for a usable dump (docs/msprobe.md)."""
    import json

    from logdiff.commands import outputs
    from logdiff.sources.msprobe.config import msprobe_config as build
    from logdiff.sources.msprobe.config import parse_ints, usage

    config = build(side, str(dump_path), layers=parse_ints(layers, "--layers"), steps=parse_ints(steps, "--steps"),
                   statistics=statistics, level=level)
    outputs.write_text(path, json.dumps(config, indent=1) + "\n", "the config")
    say(Console(), usage(side, str(path)))


@app.command(short_help="Render report.html from a saved result.json.")
@handle_errors
def report(
    result_json: Path = typer.Argument(..., metavar="RESULT", help="A result.json written by scan, check or "
                                       "compare."),
    out: Optional[Path] = typer.Option(None, metavar="DIR", help="Write DIR/report.html (default: report.html "
                                       "beside RESULT). An --out ending in .html is read as --html (deprecated)."),
    html: Optional[Path] = typer.Option(None, metavar="FILE", help="Write the HTML as FILE."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the verdict line."),
) -> None:
    """Render report.html (and the terminal summary) from a saved result.json."""
    from logdiff.commands import outputs
    from logdiff.reports import print_summary, render_html

    result = _load_valid_result(result_json)
    path, what, note = outputs.report_target(result_json, out, html)
    if note:
        say(stderr_console(), f"logdiff: note: {note}")
    outputs.write_text(path, render_html(result), what)
    print_summary(result, Console(), quiet=quiet)
    say(stderr_console(), f"wrote {path}")


@app.command(short_help="Explain a result: what diverged, why, what to do next.")
@handle_errors
def explain(
    result_json: Path = typer.Argument(..., metavar="RESULT", help="A result.json written by scan, check or compare."),
    evidence: bool = typer.Option(False, "--evidence", help="Show every evidence line of each cause group, not only "
                                  "the ones that decided its class."),
) -> None:
    """Explain a result in plain language: what diverged, why, how sure, what to do next."""
    from logdiff.reports import explain as account

    sys.stdout.write(account(_load_valid_result(result_json), evidence=evidence))
