"""Runs ``logdiff compare`` cases for tests/test_fuzz_inputs.py, each in a forked child under a time limit.

Started once per test module (``python tests/fuzz_worker.py``, one torch thread), it first runs the cases
marked ``"warm"`` in its own process (a pristine comparison: every module it needs is imported and warm, so a
child starts at the case's own work), then forks a child for every other case. It reads one JSON case per
line on stdin and answers one JSON line per case on stdout:

    {"argv": [...], "watch": DIR, "allowed": [DIR, ...], "timeout": S}
 -> {"status": "exit" | "signal" | "hang", "code": N, "stderr": "...", "outside": [paths opened]}

The child installs an audit hook that records every file it opens whose real path lies under ``watch`` (the
case's directory) but under none of ``allowed`` (the inputs and the output directory): a read outside the
inputs. A child still running at ``timeout`` is killed: a hang.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time


def _child(case: dict, report: str) -> None:
    watch = os.path.realpath(case["watch"])
    allowed = [os.path.realpath(a) for a in case["allowed"]]
    outside: list[str] = []

    def under(path: str, root: str) -> bool:
        return path == root or path.startswith(root + os.sep)

    def hook(event: str, args: tuple) -> None:
        if event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        real = os.path.realpath(os.fsdecode(args[0]))
        if under(real, watch) and not any(under(real, a) for a in allowed):
            outside.append(real)

    def save() -> None:
        with open(report, "w") as f:  # the report file lies outside ``watch``
            json.dump(outside, f)

    sys.addaudithook(hook)
    code = 101
    try:
        from logdiff.cli import main

        sys.argv = ["logdiff", *case["argv"]]
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - anything that escapes the CLI is the defect this fuzzer looks for
        import traceback

        traceback.print_exc()
    finally:
        save()
        sys.stderr.flush()
        os._exit(code)


def _warm(case: dict) -> dict:
    """Run ``case`` in this process (its output discarded): the imports and first-call costs, paid once."""
    import contextlib
    import io

    from logdiff.cli import main

    sys.argv = ["logdiff", *case["argv"]]
    code = 0
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0
    return {"status": "exit", "code": code, "stderr": err.getvalue()[-2000:], "outside": []}


def main() -> None:
    import torch

    torch.set_num_threads(1)  # one thread: the children fork from a process whose pools are not shared
    scratch = tempfile.mkdtemp(prefix="logdiff-fuzz-")
    for line in sys.stdin:
        case = json.loads(line)
        if case.get("warm"):
            print(json.dumps(_warm(case)), flush=True)
            continue
        report, err = os.path.join(scratch, "outside.json"), os.path.join(scratch, "stderr.txt")
        for f in (report, err):
            if os.path.exists(f):
                os.unlink(f)
        pid = os.fork()
        if pid == 0:
            fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            _child(case, report)
        deadline = time.monotonic() + case["timeout"]
        status = None
        while status is None and time.monotonic() < deadline:
            done, found = os.waitpid(pid, os.WNOHANG)
            if done:
                status = found
            else:
                time.sleep(0.005)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            answer = {"status": "hang", "code": None}
        elif os.WIFSIGNALED(status):
            answer = {"status": "signal", "code": os.WTERMSIG(status)}
        else:
            answer = {"status": "exit", "code": os.WEXITSTATUS(status)}
        answer["stderr"] = open(err, errors="replace").read() if os.path.exists(err) else ""
        answer["outside"] = json.load(open(report)) if os.path.exists(report) else []
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
