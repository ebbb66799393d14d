"""Real TRL GRPO runs for the tests: ``examples/trl_grpo.py``'s configurations, run one after another in one
process of their own (``TrlRunner``, the session fixture ``trl_runner`` in tests/conftest.py), and the one run in
which each step samples under another of the settings TRL's ``GRPOConfig`` forwards to vLLM (``SAMPLING_STEPS``;
the session fixture ``trl_sampled`` makes it once)."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trl_worker import ANSWER

WORKER = Path(__file__).parent / "trl_worker.py"
TRL_GAP = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")

#: (what step N sets, the one-sided setting logdiff should name with its value, or None: no sampling cause)
SAMPLING_STEPS = [({"temperature": 0.7}, None), ({"top_p": 0.8}, ("top_p", 0.8)), ({"top_k": 5}, ("top_k", 5)),
                  ({"min_p": 0.1}, ("min_p", 0.1)), ({"repetition_penalty": 1.3}, ("repetition_penalty", 1.3)),
                  ({"generation_kwargs": {"presence_penalty": 1.0}}, ("presence_penalty", 1.0)), ({}, None)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TrlRunner:
    """Runs the example's configurations one after another in one process of its own (tests/trl_worker.py), which
    is started at the first run, started again after a failed one, and stopped by ``close``. TRL builds its vLLM
    engine in-process, with its own distributed environment, so the runs stay out of pytest's process; sharing
    one process saves each run the imports (about 10 s of a demo run's 17 s here)."""

    def __init__(self, timeout_s: float = 1200.0) -> None:
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen[str] | None = None

    def _worker(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            # a free MASTER_PORT: TRL's fixed candidates (29500, 23456, ...) collide with another run on the machine
            env = {"MASTER_PORT": str(_free_port()), **os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                   "TOKENIZERS_PARALLELISM": "false"}
            self._proc = subprocess.Popen([sys.executable, str(WORKER)], env=env, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True)
        return self._proc

    def run(self, model: Path, out: Path, *flags: str, alone: bool = False) -> dict[str, Any]:
        """The example's run (see ``_read_run``), or an assertion error with the run's last output. ``alone``: in a
        process of its own, for a run that leaves process-wide state behind (a compiled engine: after TRL's
        compiled vLLM had run, a later eager run in that process logged other numbers than in a fresh one)."""
        if alone:
            single = TrlRunner(self.timeout_s)
            try:
                return single.run(model, out, *flags)
            finally:
                single.close()
        out.mkdir(parents=True, exist_ok=True)
        log = out / "run.log"
        proc = self._worker()
        argv = [str(model), "--out", str(out), "--json", str(out / "run.json"), *flags]
        proc.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        proc.stdin.flush()
        answer = self._answer(proc)
        output = log.read_text() if log.exists() else ""
        assert answer == f"{ANSWER} ok", f"{answer or 'the TRL worker died'}: {' '.join(flags)}\n{output[-4000:]}"
        return _read_run(out, output)

    def _answer(self, proc: subprocess.Popen[str]) -> str:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            line = proc.stdout.readline()
            if not line:  # the process ended
                return ""
            if line.startswith(ANSWER):
                return line.strip()
        self.close()
        return f"no answer within {self.timeout_s:.0f} s"

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None


def _read_run(out: Path, output: str) -> dict[str, Any]:
    """TRL's log history (``steps``: the logged steps), logdiff's whole results in step order (``results``), the
    output directory (``out``: ``step-NNNNNN/`` per captured step) and the run's output (``stderr``)."""
    run = json.loads((out / "run.json").read_text())
    run["steps"] = [h for h in run["log_history"] if TRL_GAP[0] in h]
    # each captured step's whole result.json (the log's ``logdiff`` holds summaries: logdiff.integrations.trl.summarize)
    found = [out / f"step-{int(k):06d}" / "result.json" for k in sorted(run["logdiff"], key=int)]
    run["results"] = [json.loads(p.read_text()) for p in found if p.exists()]  # none where only captured
    run["out"], run["stderr"] = out, output
    return run


def sampled_run(runner: TrlRunner, model: Path, out: Path) -> dict[str, Any]:
    """The one run of ``SAMPLING_STEPS``: a bf16 trainer, 6 tokens per completion, every step captured."""
    return runner.run(model, out, "--dtype", "bfloat16", "--max-tokens", "6", "--steps", str(len(SAMPLING_STEPS)),
                       "--sampling-per-step", json.dumps([s for s, _ in SAMPLING_STEPS]))
