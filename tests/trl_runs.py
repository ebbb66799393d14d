"""Real TRL GRPO runs for the tests: ``examples/trl_grpo.py`` in a process of its own (TRL builds its vLLM
engine in-process, with its own distributed environment), and the one run in which each step samples under
another of the settings TRL's ``GRPOConfig`` forwards to vLLM (``SAMPLING_STEPS``; the session fixture
``trl_sampled`` in tests/conftest.py makes it once)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).parents[1] / "examples" / "trl_grpo.py"
TRL_GAP = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")

#: (what step N sets, the one-sided setting logdiff should name with its value, or None: no sampling cause)
SAMPLING_STEPS = [({"temperature": 0.7}, None), ({"top_p": 0.8}, ("top_p", 0.8)), ({"top_k": 5}, ("top_k", 5)),
                  ({"min_p": 0.1}, ("min_p", 0.1)), ({"repetition_penalty": 1.3}, ("repetition_penalty", 1.3)),
                  ({"generation_kwargs": {"presence_penalty": 1.0}}, ("presence_penalty", 1.0)), ({}, None)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_example(model: Path, out: Path, *flags: str) -> dict[str, Any]:
    """The example's run: TRL's log history (``steps``: the logged steps), logdiff's whole results in step order
    (``results``), the output directory (``out``: ``step-NNNNNN/`` per captured step) and the stderr."""
    # a free MASTER_PORT: TRL's fixed candidates (29500, 23456, ...) collide with another run on the machine
    env = {"MASTER_PORT": str(_free_port()), **os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(EXAMPLE), str(model), "--out", str(out), "--json",
                           str(out / "run.json"), *flags], env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = json.loads((out / "run.json").read_text())
    run["steps"] = [h for h in run["log_history"] if TRL_GAP[0] in h]
    # each captured step's whole result.json (the log's ``logdiff`` holds summaries: logdiff.integrations.trl.summarize)
    found = [out / f"step-{int(k):06d}" / "result.json" for k in sorted(run["logdiff"], key=int)]
    run["results"] = [json.loads(p.read_text()) for p in found if p.exists()]  # none where only captured
    run["out"], run["stderr"] = out, proc.stderr
    return run


def sampled_run(model: Path, out: Path) -> dict[str, Any]:
    """The one run of ``SAMPLING_STEPS``: a bf16 trainer, 6 tokens per completion, every step captured."""
    return run_example(model, out, "--dtype", "bfloat16", "--max-tokens", "6", "--steps", str(len(SAMPLING_STEPS)),
                       "--sampling-per-step", json.dumps([s for s, _ in SAMPLING_STEPS]))
