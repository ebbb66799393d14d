"""The ``logdiff`` command line.

Only this module knows about terminals, exit codes and files on disk. Every
command imports torch, transformers and vLLM lazily, inside its body, so that
``logdiff --help`` stays instant. Errors the user can fix print one line and
exit with the code documented in docs/cli.md (2 an input, 3 an engine, 4 an
output that cannot be written: every file goes through ``logdiff.commands.outputs``);
anything else is an internal error (exit 101), with the traceback only under
``LOGDIFF_DEBUG=1``.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Optional

import typer
from rich.console import Console

from logdiff.commands.check import FAIL_ON_CLASSES
from logdiff.commands.config import ATTRIBUTION_GAMES, DEPTHS
from logdiff.commands.usage import LogdiffGroup
from logdiff.errors import EXIT_ENGINE_UNAVAILABLE, EXIT_INTERNAL, LogdiffError
from logdiff.probes.arch import demos as demo_archs  # names only: no torch
from logdiff.sources import DEFAULT_INFER, DEFAULT_TRAIN
from logdiff.sources.base import DTYPES
from logdiff.sources.msprobe.config import LEVELS, SIDES

app = typer.Typer(
    name="logdiff",
    help="Find where and why a trainer's logprobs and an inference engine's logprobs differ.",
    cls=LogdiffGroup,  # a usage error is one line (logdiff/commands/usage.py)
    rich_markup_mode=None,  # click's help: wrapped at word boundaries, never cut (logdiff/commands/usage.py)
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# The options with a closed set of values are typed by it: --help lists the choices, and click refuses
# any other value in one line, exit 2, before anything runs (docs/cli.md).
Dtype = Literal[DTYPES]  # type: ignore[valid-type]
Depth = Literal[DEPTHS]  # type: ignore[valid-type]
Game = Literal[ATTRIBUTION_GAMES]  # type: ignore[valid-type]
Side = Literal[SIDES]  # type: ignore[valid-type]
Level = Literal[LEVELS]  # type: ignore[valid-type]
DemoArch = Literal[tuple(demo_archs())]  # type: ignore[valid-type]


def _stderr() -> Console:
    return Console(stderr=True)


#: the packages a command may need that ``pip install logdiff`` does not bring (torch's build depends on the machine:
#: a CPU wheel, a CUDA one or torch_npu; so it stays an extra), and what each is for
OPTIONAL_PACKAGES = {"torch": "PyTorch (replays and exact functions run in it)", "transformers": "transformers",
                     "vllm": "vLLM", "pyarrow": "pyarrow (parquet tables and rollout dumps)"}
INSTALL_HINT = "pip install 'logdiff[cpu]' (CPU) or 'logdiff[vllm]' (CUDA), or scripts/install.sh (docs/cli.md)"


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn exceptions into a one-line message and the documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with warnings.catch_warnings():
                if not os.environ.get("LOGDIFF_DEBUG"):
                    warnings.simplefilter("ignore")  # engines' deprecation chatter is not ours to show
                if os.environ.get("LOGDIFF_EMULATE_ISA"):  # run as a smaller CPU (logdiff/isa.py)
                    from logdiff.isa import apply_emulation

                    apply_emulation()
                return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except LogdiffError as e:
            from rich.text import Text

            from logdiff.reports.format import safe_text

            line = Text("logdiff: error: ", style="bold red") + Text(safe_text(e))  # one inert line
            _stderr().print(line, highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            _stderr().print("logdiff: interrupted")
            raise typer.Exit(130) from None
        except Exception as e:  # noqa: BLE001 - the last line of defence
            missing = (e.name or "").split(".")[0] if isinstance(e, ModuleNotFoundError) else ""
            if missing in OPTIONAL_PACKAGES:  # a light machine: one line, exit 3, what to install
                _stderr().print(f"logdiff: error: {fn.__name__.replace('_', '-')} needs {OPTIONAL_PACKAGES[missing]}, "
                                f"which is not installed here: {INSTALL_HINT}", highlight=False, markup=False,
                                soft_wrap=True)
                raise typer.Exit(EXIT_ENGINE_UNAVAILABLE) from None
            if os.environ.get("LOGDIFF_DEBUG"):
                traceback.print_exc()
            from logdiff.reports.format import safe_text

            msg = safe_text(f"{type(e).__name__}: {e}".splitlines()[0] if str(e).strip() else type(e).__name__)
            _stderr().print(
                f"logdiff: internal error: {msg} (set LOGDIFF_DEBUG=1 for the traceback)",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
            raise typer.Exit(EXIT_INTERNAL) from None

    return wrapper


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

    return _with_progress(lambda progress: run(cfg, progress=progress, tables=tables), quiet)


def _with_progress(run: Callable[[Any], Any], quiet: bool) -> dict[str, Any]:
    """``run(progress)``'s result as a dict, with a progress row per phase on stderr when it is a terminal."""
    from logdiff.phases import Phases, silent
    from logdiff.reports import PhaseProgress

    console = _stderr()
    if quiet or not console.is_terminal:
        return run(silent).to_dict()
    with PhaseProgress(console) as shown:
        return run(Phases(shown)).to_dict()


def _say(console: Console, text: str, **kwargs: Any) -> None:
    """Print one line built from result data: control characters escaped, never read as markup."""
    from logdiff.reports.format import safe_text

    console.print(safe_text(text), markup=False, highlight=False, soft_wrap=True, **kwargs)


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

    from logdiff.commands import check as gating
    from logdiff.commands import outputs
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
    hardware = gating.current_hardware() if baseline is not None and "{hw}" in str(baseline) else None
    base_path = gating.resolve_baseline_path(baseline, hardware) if baseline is not None else None
    if hardware is not None:  # say which per-hardware baseline this machine reads (docs/portability.md)
        _stderr().print(f"baseline for hardware key {hardware}: {base_path}", markup=False, highlight=False,
                        soft_wrap=True)
    old = None
    if base_path is not None:
        old = gating.load_baseline(base_path, hardware) if not update_baseline else gating.try_load_baseline(base_path)
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
        notes += gating.check_applicable(result, old, base_path)
        gates += gating.baseline_gates(result, old, tol or gating.baseline_tolerance(old))
        notes += [f"changed since the baseline: {c}" for c in gating.environment_changes(result, old)]
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
    from logdiff.commands import check as gating

    if not all(g.passed for g in basics):
        _say(console, f"baseline not written: {'; '.join(g.message for g in basics if not g.passed)}")
        return
    keep = tol or (gating.baseline_tolerance(old) if old else gating.Tolerance())
    for line in gating.refresh_changes(result, old):
        _say(console, f"baseline change: {line}")
    gating.write_baseline(path, gating.make_baseline(result, keep))
    _say(console, f"{'refreshed' if old else 'wrote'} baseline {path} ({keep.describe()})")


def _report_gates(
    result: dict[str, Any], gates: list[Any], notes: list[str], console: Console, *,
    junit: Optional[Path], baseline: Optional[Path], github: bool,
) -> None:  # fmt: skip
    """The CI log lines (every gate evaluated, passed or not), JUnit XML and GitHub Actions output.

    Only the GitHub path emits workflow commands (``::error``), with their data escaped;
    every other line is printed with its control characters escaped.
    """
    from logdiff.commands import check as gating
    from logdiff.commands import outputs
    from logdiff.reports import github as gh
    from logdiff.reports.junit import junit_xml

    failed = [g for g in gates if not g.passed]
    for g in gates:
        _say(console, f"{'PASS' if g.passed else 'FAIL'} {g.message}")
    for note in notes:
        _say(console, f"note: {note}")
    explanation = gating.explain(result)
    if failed:
        _say(console, f"logdiff check: {len(failed)} of {len(gates)} gates failed", style="bold red")
        for line in explanation:
            _say(console, f"  {line}")
    else:
        _say(console, f"logdiff check: all {len(gates)} gates passed", style="bold green")
    dicts = [g.as_dict() for g in gates]
    if junit is not None:
        props = {"verdict": result.get("verdict"), "model": result.get("model"), "dtype": result.get("dtype"),
                 "hardware": gating.hardware_key(result.get("environment") or {}),
                 "baseline": baseline or "", "logdiff": (result.get("tool") or {}).get("version")}  # fmt: skip
        outputs.write_text(junit, junit_xml(dicts, properties=props), "--junit")
    if github:
        for line in gh.annotations(dicts, explanation) + gh.warnings(notes):
            typer.echo(line)
        summary = os.environ.get("GITHUB_STEP_SUMMARY") or "$GITHUB_STEP_SUMMARY"
        with outputs.writing(Path(summary), "$GITHUB_STEP_SUMMARY"):  # appended to, so not atomic
            gh.append_step_summary(gh.step_summary(dicts, explanation + notes))


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
        _say(_stderr(), "note: jsonschema is not installed, so only part of the result's structure was checked")
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
            result = _with_progress(
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
    _say(Console(), usage(side, str(path)))


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
        _say(_stderr(), f"logdiff: note: {note}")
    outputs.write_text(path, render_html(result), what)
    print_summary(result, Console(), quiet=quiet)
    _say(_stderr(), f"wrote {path}")


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
    console = _stderr()
    with outputs.removed_on_failure(created), console.status(f"building {arch} demo model") as status, \
            outputs.writing_tree(path):
        built = build_demo_model(
            path, arch, seed=seed, train_seconds=train_seconds, max_steps=max_steps,
            progress=lambda msg: status.update(msg),
        )  # fmt: skip
    Console().print(f"wrote {built}")


@app.command(short_help="Versions, engines, the device and the vLLM platform.")
@handle_errors
def doctor() -> None:
    """Versions, the engines installed and not, the device and the vLLM platform."""
    from logdiff.commands.doctor import collect, render

    render(collect(), Console())


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
