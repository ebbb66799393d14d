"""The ``logdiff`` command line's shared parts: the typer app, the error handler, the consoles.

The command line is split by role. This module holds what every command shares; each command
lives in a runner module that registers it on ``app`` (``cli_scan``: scan and check, the live
runs; ``cli_files``: compare, msprobe-config, report and explain, which read or write files
and start no engine; ``cli_tools``: kernels, demo-model and doctor); ``logdiff/cli.py``, the
console script's entry point, imports the runners in the order ``--help`` lists them.

Only the command line knows about terminals, exit codes and files on disk. Every command
imports torch, transformers and vLLM lazily, inside its body, so that ``logdiff --help`` stays
instant: this module and the runners import at module level only the names the options list
(``tests/test_cli_docs.py`` holds it). Errors the user can fix print one line and exit with the
code documented in docs/cli.md (2 an input, 3 an engine, 4 an output that cannot be written:
every file goes through ``logdiff.commands.outputs``); anything else is an internal error
(exit 101), with the traceback only under ``LOGDIFF_DEBUG=1`` (``handle_errors``).

Every line a command prints on stderr comes from ``stderr_console()``, looked up here at each
call, so a test replaces that one function to see them (a terminal's progress rows included).
"""

from __future__ import annotations

import functools
import os
import traceback
import warnings
from collections.abc import Callable
from typing import Any, Literal

import typer
from rich.console import Console

from logdiff.commands.config import ATTRIBUTION_GAMES, DEPTHS
from logdiff.commands.usage import LogdiffGroup
from logdiff.errors import EXIT_ENGINE_UNAVAILABLE, EXIT_INTERNAL, LogdiffError
from logdiff.probes.arch import demos as demo_archs  # names only: no torch
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


def stderr_console() -> Console:
    """The console every line meant for stderr goes to (one per call: a test may replace this function)."""
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
            stderr_console().print(line, highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            stderr_console().print("logdiff: interrupted")
            raise typer.Exit(130) from None
        except Exception as e:  # noqa: BLE001 - the last line of defence
            missing = (e.name or "").split(".")[0] if isinstance(e, ModuleNotFoundError) else ""
            if missing in OPTIONAL_PACKAGES:  # a light machine: one line, exit 3, what to install
                command = fn.__name__.replace("_", "-")
                stderr_console().print(f"logdiff: error: {command} needs {OPTIONAL_PACKAGES[missing]}, which is not "
                                       f"installed here: {INSTALL_HINT}", highlight=False, markup=False, soft_wrap=True)
                raise typer.Exit(EXIT_ENGINE_UNAVAILABLE) from None
            if os.environ.get("LOGDIFF_DEBUG"):
                traceback.print_exc()
            from logdiff.reports.format import safe_text

            msg = safe_text(f"{type(e).__name__}: {e}".splitlines()[0] if str(e).strip() else type(e).__name__)
            stderr_console().print(
                f"logdiff: internal error: {msg} (set LOGDIFF_DEBUG=1 for the traceback)",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
            raise typer.Exit(EXIT_INTERNAL) from None

    return wrapper


def with_progress(run: Callable[[Any], Any], quiet: bool) -> dict[str, Any]:
    """``run(progress)``'s result as a dict, with a progress row per phase on stderr when it is a terminal."""
    from logdiff.phases import Phases, silent
    from logdiff.reports import PhaseProgress

    console = stderr_console()
    if quiet or not console.is_terminal:
        return run(silent).to_dict()
    with PhaseProgress(console) as shown:
        return run(Phases(shown)).to_dict()


def say(console: Console, text: str, **kwargs: Any) -> None:
    """Print one line built from result data: control characters escaped, never read as markup."""
    from logdiff.reports.format import safe_text

    console.print(safe_text(text), markup=False, highlight=False, soft_wrap=True, **kwargs)
