"""An RL step captured on both sides as documented, then diagnosed offline (issue 22's two examples).

1. ``LOGDIFF_CAPTURE=DIR python examples/capture_vllm.py MODEL``: vLLM samples rollouts, its worker
   plugin captures them (in-process engine here, the cheapest; tests/test_capture_vllm.py runs the
   multi-process engine and TP = 2);
2. ``torchrun --nproc-per-node 2 examples/capture_fsdp.py MODEL --sequences DIR --out DIR2``: the
   FSDP2-wrapped HF model scores exactly those tokens on 2 gloo ranks, captured;
3. ``logdiff compare DIR2 DIR --model MODEL``: the diagnosis, offline.

It must agree with ``scan`` on the same tokens (the rollouts as a sequences file, vLLM replaying
them): the same first divergence, the same causes (boundary, class, kind), the same logprob gap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
PYTHON = Path(sys.executable)


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    run = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT,
                         env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def rl_step(demo_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    model = demo_model("qwen3")
    root = tmp_path_factory.mktemp("rl-step")
    infer, train = root / "infer", root / "train"
    # every layer whole (--window all), for the same causes as scan: the default keeps two (test_capture_window.py)
    sampled = _run([str(PYTHON), "examples/capture_vllm.py", str(model), "--prompts", "3", "--prompt-len", "12",
                    "--max-tokens", "12", "--window", "all"], LOGDIFF_CAPTURE=str(infer),
                   VLLM_ENABLE_V1_MULTIPROCESSING="0")
    rollouts = [json.loads(line) for line in sampled.stdout.splitlines() if line.startswith("{")]
    seqs = root / "rollouts.jsonl"
    seqs.write_text("".join(json.dumps({"prompt_ids": r["prompt_ids"], "response_ids": r["response_ids"]}) + "\n"
                            for r in rollouts))
    _run([str(PYTHON.parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "examples/capture_fsdp.py",
          str(model), "--sequences", str(infer), "--out", str(train), "--window", "all"])
    return {"model": model, "infer": infer, "train": train, "sequences": seqs}


def _thread_count_invariant(model: Path, sequences: Path) -> bool:
    """Whether the stock HF forward of the rollouts gives every layer's hidden states the same bits on one thread
    as on this process's threads (the ranks run one thread each, the scan's HF path the default)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16).eval()
    rows = [json.loads(line) for line in sequences.read_text().splitlines()]

    def states() -> list:
        with torch.no_grad():
            return [h for r in rows for h in hf(torch.tensor([r["prompt_ids"] + r["response_ids"]]),
                                                 output_hidden_states=True).hidden_states]

    threads = torch.get_num_threads()
    default = states()
    torch.set_num_threads(1)
    try:
        single = states()
    finally:
        torch.set_num_threads(threads)
    return all(torch.equal(a, b) for a, b in zip(default, single))


def _causes(result: dict) -> list[tuple[str, str, str]]:
    return sorted((c["boundary"], c["class"], c["kind"]) for c in result["causes"])


def test_compare_of_the_captured_rl_step_agrees_with_scan_on_the_same_tokens(rl_step, tmp_path: Path) -> None:
    from logdiff.commands.config import ScanConfig
    from logdiff.commands.scan import scan

    out = tmp_path / "compare"
    _run([str(PYTHON.parent / "logdiff"), "compare", str(rl_step["train"]), str(rl_step["infer"]), "--model",
          str(rl_step["model"]), "--out", str(out), "--quiet"])
    offline = json.loads((out / "result.json").read_text())
    if not _thread_count_invariant(rl_step["model"], rl_step["sequences"]):
        pytest.skip("this CPU's stock HF forward gives other bits on one thread (the FSDP2 ranks) than on the "
                    "scan's threads, so the two training sides are not the same computation here")
    live = scan(ScanConfig(model=rl_step["model"], sequences=rl_step["sequences"], infer=["vllm"],
                           depth="modules", attribute=False)).to_dict()
    assert offline["sequences"]["count"] == live["sequences"]["count"] == 3
    assert offline["logprobs"]["num_tokens"] == live["logprobs"]["num_tokens"]  # the rollouts' response tokens
    assert offline["first_divergence"]["boundary"] == live["first_divergence"]["boundary"]
    assert offline["first_divergence"]["position"] == live["first_divergence"]["position"]
    assert offline["causes"] and _causes(offline) == _causes(live)
    assert offline["logprobs"]["abs_diff_max"] == pytest.approx(live["logprobs"]["abs_diff_max"], rel=1e-6)
    # the FSDP2 side's weights, gathered whole on entry, are the ones vLLM loaded
    assert offline["contracts"]["weights"]["differs"] == [] and offline["contracts"]["weights"]["verified"] > 0
    assert not any("could not separate" in w for w in offline["warnings"])  # replayed with --model
