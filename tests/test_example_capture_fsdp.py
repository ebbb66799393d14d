"""examples/capture_fsdp.py as documented: torchrun, 2 ranks, FSDP2, a sequences file in, a bundle out (issue 22).

Five sequences dealt round robin (3 to rank 0, 2 to rank 1) in batches of 2: rank 0 runs two
forwards, rank 1 one, so the example must keep the ranks' FSDP collectives in step (an idle
forward after the capture) or the run hangs. The bundle then holds exactly the given sequences,
each on the rank it was dealt to, and each rank's rows carry every boundary; reading the bundle
back as ``--sequences`` gives the same sequences again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).parents[1] / "examples" / "capture_fsdp.py"
SEQS = [([5, 17, 3], [9, 42, 7]), ([8, 1], [30, 4, 6, 19]), ([2, 2, 2, 2], [11]), ([13, 14], [15, 16]),
        ([21], [22, 23, 24, 25, 26])]  # fmt: skip


def _torchrun(*args: object, timeout: int = 600) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
                           *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)  # fmt: skip


def test_capture_fsdp_example_records_each_ranks_sequences(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    from logdiff.records.bundle import Bundle

    seqs = tmp_path / "seqs.jsonl"
    seqs.write_text("".join(json.dumps({"prompt_ids": p, "response_ids": r}) + "\n" for p, r in SEQS))
    run = _torchrun(demo_model("qwen3"), "--sequences", seqs, "--out", tmp_path / "bundle", "--batch", 2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(line for line in run.stdout.splitlines() if line.startswith("rank ")) == [
        f"rank 0/2: captured 3 sequences into {tmp_path / 'bundle'}",
        f"rank 1/2: captured 2 sequences into {tmp_path / 'bundle'}"]  # fmt: skip
    bundle = Bundle(tmp_path / "bundle")
    dealt = [p + r for p, r in SEQS]
    assert bundle.world_size == 2 and bundle.sequences() == dealt[0::2] + dealt[1::2]
    assert [len(part.steps) for part in bundle.ranks] == [2, 1]  # the idle forward is not recorded
    assert all(part.meta["warnings"] == [] for part in bundle.ranks)
    assert "model.layers.0.self_attn.rope_q" in bundle.names(0) and "logits" in bundle.names(0)
    # a bundle is a sequences source too: scoring its sequences again captures the same ones
    again = _torchrun(demo_model("qwen3"), "--sequences", tmp_path / "bundle", "--out", tmp_path / "again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(Bundle(tmp_path / "again").sequences()) == sorted(dealt)
