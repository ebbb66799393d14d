"""The ``scan`` and ``check`` commands: the live runs, which share every one of scan's options.

``scan`` builds a ``ScanConfig`` from its options and runs the scan (``_run_scan``, the one
place both commands start it, so a test can replace the run); ``check`` takes all of scan's
options (``_with_scan_options``) plus its gates, runs the same scan and reports each gate
(``logdiff.commands.check`` evaluates them; this module only parses, prints and exits).
Registered on the shared app (``cli_app``); ``logdiff/cli.py`` imports this module first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from logdiff.commands.check import FAIL_ON_CLASSES
from logdiff.commands.cli_app import Depth, Dtype, Game, app, handle_errors, say, stderr_console, with_progress
from logdiff.sources import DEFAULT_INFER, DEFAULT_TRAIN

# `scan` answers where and why by default; `check` gates CI on the logprobs alone unless a gate needs the
# causes (--fail-on operator_path|framework_difference) or --depth says otherwise (docs/ci.md).
SCAN_DEPTH, CHECK_DEPTH = "modules", "logprobs"

# Options shared by `scan` and `check`.
ModelArg = typer.Argument(..., metavar="MODEL",
                          help="Local HF model directory (config, tokenizer; weights unless CKPT is given).")
CkptArg = typer.Argument(None, metavar="CKPT",
                         help="Weights both paths load: HF dir, .safetensors/.pt state dict, or DCP dir.")


def _build_config(**kw: Any) -> Any:
    from logdiff.commands.config import ScanConfig, parse_sets
    from logdiff.errors import InputError

    train_set, infer_set = parse_sets(kw.pop("set_") or [])
    infer = kw.pop("infer") or [DEFAULT_INFER]
    sizes = kw.pop("batch_compositions", None)
    if sizes:
        try:
            kw["batch_sizes"] = tuple(int(x) for x in sizes.split(","))
        except ValueError:
            raise InputError(f"--batch-compositions expects comma-separated integers, got {sizes!r}") from None
    window = kw.pop("window", "all")
    if window != "all":
        try:
            kw["window"] = int(window)
        except ValueError:
            raise InputError(f"--window expects 'all' or a number of layers, got {window!r}") from None
    families = kw.pop("consistent_kernels", None)
    kw["consistent_kernels"] = tuple(f.strip() for f in families.split(",") if f.strip()) if families else None
    return ScanConfig(train_set=train_set, infer_set=infer_set, infer=infer, **kw)


def _run_scan(cfg: Any, quiet: bool, tables: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Run the scan, with a progress row per phase on stderr unless quiet or stderr is not a terminal."""
    from logdiff.commands.scan import scan as run

    return with_progress(lambda progress: run(cfg, progress=progress, tables=tables), quiet)


@app.command(short_help="Where and why a training and an inference path differ.")
@handle_errors
def scan(
    model: Path = ModelArg,
    ckpt: Optional[Path] = CkptArg,
    train: str = typer.Option(DEFAULT_TRAIN, metavar="ENGINE", help="Training path engine: hf (or a registered "
                              "one, docs/engines.md)."),
    infer: list[str] = typer.Option(
        [DEFAULT_INFER], metavar="ENGINE", help="Inference path engine: vllm, hf-decode, hf, vllm-ascend (or a "
        "registered one). Repeatable: each one given is a path.",
    ),  # fmt: skip
    dtype: Dtype = typer.Option("bfloat16", help="The dtype both paths compute in."),
    device: str = typer.Option(
        "auto", "--device", metavar="DEVICE", help="Where the HF paths compute: auto (the accelerator torch sees, "
        "else cpu), cpu, cuda, cuda:1, npu. vLLM computes on its own platform's device.",
    ),  # fmt: skip
    sequences: Optional[Path] = typer.Option(
        None, metavar="FILE", help="Token ids to replay: JSONL of prompt_ids, response_ids[, rollout_logprobs, "
        "response_mask], or a verl/OpenRLHF rollout dump (.jsonl, .parquet, .pt; docs/rollout-dumps.md).",
    ),  # fmt: skip
    prompts: Optional[Path] = typer.Option(None, metavar="FILE",
                                           help="Text prompts (one per line) or JSONL with prompt/messages."),
    num_sequences: int = typer.Option(8, metavar="N", help="Probe set: number of sequences."),
    prompt_len: int = typer.Option(16, metavar="P", help="Probe set: prompt length in tokens."),
    response_len: int = typer.Option(32, metavar="R", help="Tokens sampled per response."),
    seed: int = typer.Option(0, metavar="S", help="Seed for the probe prompts and sampling."),
    infer_ckpt: Optional[Path] = typer.Option(None, metavar="PATH",
                                              help="Different weights for the inference side (weight-sync bugs)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", metavar="SIDE.KEY=VALUE",
                                             help="train.KEY=VALUE or infer.KEY=VALUE. Repeatable."),
    depth: Optional[Depth] = typer.Option(
        None, help="logprobs (the quick screen), modules (hooks, first divergence, causes, attribution) or ops "
        "(plus an aten-op trace). Default: modules for scan, logprobs for check.",
    ),  # fmt: skip
    consistent: bool = typer.Option(False, help="Install the reference consistent kernels on every path."),
    consistent_kernels: Optional[str] = typer.Option(
        None, metavar="FAMILIES", help="With --consistent, only these op families (comma-separated): "
        "linear, rms_norm, rope, attention, silu_and_mul, moe, log_softmax.",
    ),  # fmt: skip
    attribute: bool = typer.Option(True, help="At --depth modules|ops, measure each cause's share (--attribution)."),
    attribution: Game = typer.Option(
        "patched", help="How the shares are measured: patched (one training forward per set of "
        "levers, its ops moved to the error the inference side's recorded ops introduced; one rescan confirms; "
        "falls back to rescan where the records cannot) or rescan (end-to-end rescans of every set).",
    ),  # fmt: skip
    replay_all_paths: bool = typer.Option(
        False, "--replay-all-paths", help="At --depth modules|ops, replay the training path's ops on every "
        "inference path's inputs (default: the primary path's only; each more path costs one training forward).",
    ),  # fmt: skip
    window: str = typer.Option(
        "all", metavar="all|LAYERS", help="At --depth modules|ops, keep whole rows of the first LAYERS decoder layers "
        "only (and of the embeddings, final norm and logits); compare the others by row sketches (bitwise equality "
        "per row, differences as lower bounds, no replay), fetching what the diagnosis needs there in a second "
        "pass. all: every boundary whole.",
    ),  # fmt: skip
    batch_compositions: Optional[str] = typer.Option(
        None, metavar="SIZES", help="Batch-invariance probe: score the sequences on the inference engine in "
        "batches of each size (e.g. 1,4,8) and compare them with the first.",
    ),  # fmt: skip
    drill: Optional[str] = typer.Option(
        None, metavar="MODULE", help="At --depth ops, trace this module's aten ops (default: the first divergent one)."
    ),
    trust_remote_code: bool = typer.Option(
        False, "--trust-remote-code", help="Let transformers and vLLM run Python code shipped with MODEL (auto_map)."
    ),
    is_threshold: float = typer.Option(
        2.0, metavar="T", help="T of the rollout_is_* metrics (IS weights truncated to at most T) and the ratio "
        "bounds [1/T, T] of the k1 rollout_rs_* ones (verl's rollout_is_threshold).",
    ),  # fmt: skip
    out: Optional[Path] = typer.Option(None, metavar="DIR", help="Write DIR/result.json, DIR/report.html and, "
                                       "at --depth modules|ops, the divergence table."),
    json_path: Optional[Path] = typer.Option(None, "--json", metavar="FILE", help="Write result.json as FILE."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the verdict line."),
) -> None:
    """Replay the same tokens through a training and an inference path: where and why their logprobs differ.

    By default (--depth modules) both engines are hooked, the first divergence is located, every
    op that introduces error is classified and attributed; --depth logprobs only measures the gap.
    """
    from logdiff.commands import outputs
    from logdiff.reports import print_summary

    cfg = _build_config(
        model=model, ckpt=ckpt, train=train, infer=infer, dtype=dtype, sequences=sequences, prompts=prompts,
        num_sequences=num_sequences, prompt_len=prompt_len, response_len=response_len, seed=seed,
        infer_ckpt=infer_ckpt, set_=set_, depth=depth or SCAN_DEPTH, consistent=consistent,
        consistent_kernels=consistent_kernels, attribute=attribute, attribution=attribution,
        replay_all_paths=replay_all_paths, drill=drill, batch_compositions=batch_compositions,
        trust_remote_code=trust_remote_code, device=device, is_threshold=is_threshold, window=window,
    )  # fmt: skip
    tables: dict[str, Any] = {}
    with outputs.prepared(out, json_path):
        result = _run_scan(cfg, quiet, tables)
        outputs.write_result(result, out, json_path, tables)
    print_summary(result, Console(), quiet=quiet)


def _with_scan_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give a command all of ``scan``'s arguments and options, followed by its own.

    typer reads a command's parameters from ``inspect.signature``, so the command
    declares only its own options plus ``**scan_options``, and this sets a
    ``__signature__`` (and the matching annotations) with scan's parameters in
    front. The command receives scan's values in ``scan_options``.
    """
    import inspect

    base = inspect.unwrap(scan)
    own = inspect.signature(fn)
    params = [*inspect.signature(base).parameters.values()]
    params += [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    fn.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
    fn.__annotations__ = {**base.__annotations__, **fn.__annotations__}
    return fn


@app.command(short_help="A scan as a CI gate: exit 1 when a gate fails.")
@handle_errors
@_with_scan_options
def check(
    max_abs_diff: Optional[float] = typer.Option(None, min=0.0, metavar="X",
                                                 help="Fail above this max |Δ logprob| (any pair)."),
    max_mean_diff: Optional[float] = typer.Option(None, min=0.0, metavar="X",
                                                  help="Fail above this mean |Δ logprob| (any pair)."),
    max_kl: Optional[float] = typer.Option(None, min=0.0, metavar="X",
                                           help="Fail above this k3 KL estimate (any pair)."),
    max_clip_fraction: Optional[float] = typer.Option(
        None, min=0.0, max=1.0, metavar="X",
        help="Fail above this fraction of tokens with |ratio - 1| > 0.2 (any pair).",
    ),
    fail_on: Optional[list[str]] = typer.Option(
        None, "--fail-on", metavar="CLASS",
        help=f"Fail when the verdict or a cause is this class: {', '.join(FAIL_ON_CLASSES)}. Repeatable or "
        "comma-separated.",
    ),  # fmt: skip
    baseline: Optional[Path] = typer.Option(
        None, metavar="FILE", help="Compare with this baseline JSON; '{hw}' in the path becomes the hardware key."
    ),
    tolerance: Optional[str] = typer.Option(
        None, metavar="REL[,ABS]",
        help="Baseline tolerance: |value - baseline| <= REL*|baseline| + ABS; a baseline of exactly 0 allows "
        "only 0. Default: the baseline's own, else 0.1,1e-6.",
    ),  # fmt: skip
    update_baseline: bool = typer.Option(False, help="Write (or refresh) --baseline from this run."),
    junit: Optional[Path] = typer.Option(None, metavar="FILE", help="Write JUnit XML: one test case per gate."),
    github: Optional[bool] = typer.Option(
        None, "--github/--no-github",
        help="Print GitHub Actions annotations and append to $GITHUB_STEP_SUMMARY (default: when GITHUB_ACTIONS=true).",
    ),  # fmt: skip
    **scan_options: Any,
) -> None:
    """Run a scan and fail (exit 1) when a gate fails: thresholds, --fail-on classes, a baseline.

    Takes every option of `scan`. Under GitHub Actions (GITHUB_ACTIONS=true) it also
    prints ::error annotations and appends a table to $GITHUB_STEP_SUMMARY.
    """
    import dataclasses

    from logdiff.commands import baselines, outputs
    from logdiff.commands import check as gating
    from logdiff.commands.config import ScanConfig
    from logdiff.errors import EXIT_GATE_FAILED, InputError
    from logdiff.reports import print_summary

    config_keys = {f.name for f in dataclasses.fields(ScanConfig)} | {"set_", "batch_compositions"}
    classes = gating.parse_fail_on(fail_on or [])
    # a --fail-on class other than `divergent` reads the classified causes: only modules depth has them
    classify = any(c in ("operator_path", "framework_difference", "not_judged", "unexplained") for c in classes)
    scan_options["depth"] = scan_options.get("depth") or (SCAN_DEPTH if classify else CHECK_DEPTH)
    cfg = _build_config(**{k: v for k, v in scan_options.items() if k in config_keys})
    quiet = bool(scan_options.get("quiet"))
    thresholds = {"max_abs_diff": max_abs_diff, "max_mean_diff": max_mean_diff, "max_kl": max_kl,
                  "max_clip_fraction": max_clip_fraction}  # fmt: skip
    tol = gating.Tolerance.parse(tolerance) if tolerance is not None else None
    if update_baseline and baseline is None:
        raise InputError("--update-baseline needs --baseline FILE")
    if baseline is None and not classes and all(v is None for v in thresholds.values()):
        raise InputError(
            "check needs a gate: --max-abs-diff, --max-mean-diff, --max-kl, --max-clip-fraction, --fail-on "
            "or --baseline"
        )
    hardware = baselines.current_hardware() if baseline is not None and "{hw}" in str(baseline) else None
    base_path = baselines.resolve_baseline_path(baseline, hardware) if baseline is not None else None
    if hardware is not None:  # say which per-hardware baseline this machine reads (docs/portability.md)
        stderr_console().print(f"baseline for hardware key {hardware}: {base_path}", markup=False, highlight=False,
                        soft_wrap=True)
    old = None
    if base_path is not None:
        old = (baselines.load_baseline(base_path, hardware) if not update_baseline
               else baselines.try_load_baseline(base_path))
    out, json_path = scan_options.get("out"), scan_options.get("json_path")
    tables: dict[str, Any] = {}
    with outputs.prepared(out, json_path, junit, base_path if update_baseline else None):
        result = _run_scan(cfg, quiet, tables)
        outputs.write_result(result, out, json_path, tables)
    console = Console()
    print_summary(result, console, quiet=quiet)

    notes: list[str] = []  # shown, never failing: model renamed, overrides, versions changed
    gates = [gating.completeness_gate(result), gating.finite_gate(result), *gating.threshold_gates(result, thresholds)]
    gates += gating.fail_on_gates(result, classes)
    if base_path is not None and not update_baseline:
        notes += baselines.check_applicable(result, old, base_path)
        gates += baselines.baseline_gates(result, old, tol or baselines.baseline_tolerance(old))
        notes += [f"changed since the baseline: {c}" for c in baselines.environment_changes(result, old)]
    asked = gating.asked_gates(result, thresholds, classes, None if update_baseline else old)
    gates += gating.coverage_gates(gates, asked)
    if update_baseline:
        _refresh_baseline(result, old, base_path, tol, gates[:2], console)
    if github is None:
        github = os.environ.get("GITHUB_ACTIONS") == "true"
    _report_gates(result, gates, notes, console, junit=junit, baseline=base_path, github=github)
    if any(not g.passed for g in gates):
        raise typer.Exit(EXIT_GATE_FAILED)


def _refresh_baseline(result: dict[str, Any], old: Optional[dict[str, Any]], path: Path, tol: Any,
                      basics: list[Any], console: Console) -> None:  # fmt: skip
    """Write ``--update-baseline``'s file, unless the run is incomplete or not finite (a gate that can pass nothing)."""
    from logdiff.commands import baselines
    from logdiff.commands import check as gating

    if not all(g.passed for g in basics):
        say(console, f"baseline not written: {'; '.join(g.message for g in basics if not g.passed)}")
        return
    keep = tol or (baselines.baseline_tolerance(old) if old else gating.Tolerance())
    for line in baselines.refresh_changes(result, old):
        say(console, f"baseline change: {line}")
    baselines.write_baseline(path, baselines.make_baseline(result, keep))
    say(console, f"{'refreshed' if old else 'wrote'} baseline {path} ({keep.describe()})")


def _report_gates(
    result: dict[str, Any], gates: list[Any], notes: list[str], console: Console, *,
    junit: Optional[Path], baseline: Optional[Path], github: bool,
) -> None:  # fmt: skip
    """The CI log lines (every gate evaluated, passed or not), JUnit XML and GitHub Actions output.

    Only the GitHub path emits workflow commands (``::error``), with their data escaped;
    every other line is printed with its control characters escaped.
    """
    from logdiff.commands import baselines, outputs
    from logdiff.commands import check as gating
    from logdiff.reports import github as gh
    from logdiff.reports.junit import junit_xml

    failed = [g for g in gates if not g.passed]
    for g in gates:
        say(console, f"{'PASS' if g.passed else 'FAIL'} {g.message}")
    for note in notes:
        say(console, f"note: {note}")
    explanation = gating.explain(result)
    if failed:
        say(console, f"logdiff check: {len(failed)} of {len(gates)} gates failed", style="bold red")
        for line in explanation:
            say(console, f"  {line}")
    else:
        say(console, f"logdiff check: all {len(gates)} gates passed", style="bold green")
    dicts = [g.as_dict() for g in gates]
    if junit is not None:
        props = {"verdict": result.get("verdict"), "model": result.get("model"), "dtype": result.get("dtype"),
                 "hardware": baselines.hardware_key(result.get("environment") or {}),
                 "baseline": baseline or "", "logdiff": (result.get("tool") or {}).get("version")}  # fmt: skip
        outputs.write_text(junit, junit_xml(dicts, properties=props), "--junit")
    if github:
        for line in gh.annotations(dicts, explanation) + gh.warnings(notes):
            typer.echo(line)
        summary = os.environ.get("GITHUB_STEP_SUMMARY") or "$GITHUB_STEP_SUMMARY"
        with outputs.writing(Path(summary), "$GITHUB_STEP_SUMMARY"):  # appended to, so not atomic
            gh.append_step_summary(gh.step_summary(dicts, explanation + notes))
