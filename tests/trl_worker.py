"""The process behind ``trl_runs.TrlRunner``: runs ``examples/trl_grpo.py``'s configurations one after another.

Importing torch, vLLM, transformers and TRL costs about 10 s of a demo run's 17 s on a 2-core host, and the tests
run ten such configurations. Here each is the example's own ``main(argv)``, as a user's process runs it; only the
imports are shared. Two uninstrumented runs of one configuration give the same logs bit for bit here, whatever ran
between them (the instrumented-against-plain test reads that too), so a run does not inherit state from the last.

Protocol: one JSON request per line on stdin, ``{"argv": [...], "log": PATH}``. The run's fds 1 and 2 go to
``LOG``; its answer, on the original stdout, is one line ``TRL-WORKER ok`` or ``TRL-WORKER failed``. After a
failure (traceback in ``LOG``) the process exits, since the failed run may have left its engine half-built.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "trl_grpo.py"
ANSWER = "TRL-WORKER"


@contextlib.contextmanager
def _output_to(log: str) -> Iterator[None]:
    """fds 1 and 2 (the Python streams, C code and vLLM's logger alike) into ``log`` for the block."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.dup2(fd, 1), os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for each in (fd, *saved):
            os.close(each)


def main() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    example = None
    for line in sys.stdin:
        request = json.loads(line)
        with _output_to(request["log"]):
            try:
                if example is None:  # imported inside the first run, so that its output goes to that run's log
                    spec = importlib.util.spec_from_file_location("trl_grpo_example", EXAMPLE)
                    example = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(example)
                code = example.main(request["argv"])
            except BaseException:  # noqa: BLE001 - the run's own failure, SystemExit included, is the answer
                traceback.print_exc()
                code = 1
        answers.write(f"{ANSWER} {'ok' if code == 0 else 'failed'}\n")
        if code != 0:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
