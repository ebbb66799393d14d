"""True on-policy GRPO on CPU: vLLM rollouts and HF training steps that compute the same logprobs.

Each step of a run:

1. the running, in-process vLLM samples ``group`` responses per prompt (rollout
   logprobs recorded while sampling);
2. a simple rule scores them (the share of response tokens from the lower half of
   the vocabulary) and GRPO normalises the rewards within each group;
3. the HF policy, in train mode with gradients, recomputes the logprobs of those
   tokens and takes a PPO-clipped policy-gradient step with the rollout logprobs
   as the old policy (bypass mode: the importance ratio is trainer vs rollout);
4. the new weights go into the running vLLM through its own ``load_weights``
   (``logdiff.sync_vllm_weights``), and the next step samples from them.

Two runs from the same checkpoint, prompts and seeds: ``consistent`` (vLLM under
``consistent_vllm``, the trainer under ``logdiff.consistent_training``, logprobs
by ``kernels.token_log_probs``) and ``stock`` (both engines' own kernels). Before
the update, consistent mode gives trainer == rollout bitwise: every ratio is
exactly 1.0 and nothing is clipped for mismatch; the stock run shows the gap an
RL trainer normally carries. After the last sync one more rollout checks that
the synced vLLM and the updated trainer still agree.

Usage (a demo model first: ``logdiff demo-model /tmp/qwen3``)::

    python examples/grpo_on_policy.py /tmp/qwen3 --steps 3 --json out.json

``--no-sync`` skips the weight sync: the negative control showing that the next
step's rollout then comes from stale weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # consistent mode reaches the engine's modules
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

RUNS = ("consistent", "stock")


def rewards_of(responses: list[list[int]], vocab_size: int) -> list[float]:
    """The rule: the share of a response's tokens whose id is in the lower half of the vocabulary."""
    return [sum(t < vocab_size // 2 for t in r) / len(r) for r in responses]


def group_advantages(rewards: list[float], group: int) -> list[float]:
    """GRPO: each reward minus its group's mean, over the group's std (+1e-6)."""
    out = []
    for start in range(0, len(rewards), group):
        chunk = rewards[start : start + group]
        mean = sum(chunk) / len(chunk)
        std = math.sqrt(sum((r - mean) ** 2 for r in chunk) / max(len(chunk) - 1, 1))
        out.extend((r - mean) / (std + 1e-6) for r in chunk)
    return out


def trainer_logprobs(policy: Any, prompts: list[list[int]], responses: list[list[int]], consistent: bool) -> Any:
    """``[B, R]`` fp32 logprobs of the responses, teacher-forced in one forward (autograd recording)."""
    import torch

    from logdiff import kernels

    ids = torch.tensor([p + r for p, r in zip(prompts, responses)])
    p, n = len(prompts[0]), len(responses[0])
    logits = policy(input_ids=ids).logits[:, p - 1 : p + n - 1].float()
    tokens = ids[:, p:]
    if consistent:
        return kernels.token_log_probs(logits, tokens)
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]


def rollout(engine: Any, prompts: list[list[int]], response_len: int, seed: int, consistent: bool) -> tuple:
    """Sampled responses and their rollout logprobs ``[B, R]`` from the running vLLM."""
    import torch

    from logdiff.sources.vllm.consistent import consistent_vllm

    with consistent_vllm(engine.llm) if consistent else contextlib.nullcontext():
        sampled = engine.sample(prompts, response_len, seed)
    return sampled.response_ids, torch.tensor(np.stack(sampled.scores[0].logprobs))


def run_one(mode: str, engine: Any, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``args.steps`` GRPO steps of one run (``consistent`` or ``stock``) from the checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    import logdiff

    consistent = mode == "consistent"
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).train()
    logdiff.sync_vllm_weights(engine.llm, policy)  # every run starts from the checkpoint
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    vocab = policy.config.vocab_size
    switch = logdiff.consistent_training(policy) if consistent else contextlib.nullcontext()
    steps, check = [], None
    with switch:
        for step in range(args.steps + 1):  # the extra pass checks the last sync; it trains nothing
            start = time.perf_counter()
            gen = torch.Generator().manual_seed(args.seed * 1000 + step)
            prompts = torch.randint(5, vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
            prompts = [p for p in prompts for _ in range(args.group)]
            responses, rollout_lp = rollout(engine, prompts, args.response_len, args.seed + step, consistent)
            lp = trainer_logprobs(policy, prompts, responses, consistent)
            diff = float((lp.detach() - rollout_lp).abs().max())
            if step == args.steps:
                check = diff
                break
            advantages = torch.tensor(group_advantages(rewards_of(responses, vocab), args.group))[:, None]
            ratio = torch.exp(lp - rollout_lp)  # old policy = the rollout (bypass mode)
            clipped = ratio.clamp(1 - args.clip_eps, 1 + args.clip_eps)
            loss = -torch.minimum(ratio * advantages, clipped * advantages).mean()
            loss.backward()
            before = [p.detach().clone() for p in policy.parameters()]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            changed = sum(int((p.detach() != b).sum()) for p, b in zip(policy.parameters(), before))
            if not args.no_sync:
                logdiff.sync_vllm_weights(engine.llm, policy)
            r = ratio.detach()
            steps.append(
                {
                    "step": step,
                    "max_abs_diff": diff,
                    "ratio_min": float(r.min()),
                    "ratio_max": float(r.max()),
                    # before the update every clip is caused by train/rollout mismatch alone (PPO clip at clip_eps)
                    "mismatch_clip_fraction": float(
                        (((advantages > 0) & (r > 1 + args.clip_eps)) | ((advantages < 0) & (r < 1 - args.clip_eps)))
                        .float()
                        .mean()
                    ),
                    "mismatch_fraction": float((r != 1.0).float().mean()),  # tokens whose ratio is not exactly 1
                    "mean_reward": float(sum(rewards_of(responses, vocab)) / len(responses)),
                    "loss": float(loss.detach()),
                    "params_changed": changed,
                    "wall_s": time.perf_counter() - start,
                }
            )
            print(_line(mode, steps[-1]), flush=True)
    print(f"{mode:>10}  after the last sync: trainer vs rollout max |diff| = {check:.3g}", flush=True)
    return {"steps": steps, "after_last_sync_max_abs_diff": check, "synced": not args.no_sync}


def _line(mode: str, s: dict[str, Any]) -> str:
    return (
        f"{mode:>10} step {s['step']}: max|lp_train - lp_rollout| {s['max_abs_diff']:.3g}  "
        f"ratio [{s['ratio_min']:.6f}, {s['ratio_max']:.6f}]  mismatch clip {s['mismatch_clip_fraction']:.3f}  "
        f"ratio != 1 on {s['mismatch_fraction']:.1%}  reward {s['mean_reward']:.3f}  {s['wall_s']:.1f} s"
    )


def open_engine(args: argparse.Namespace) -> Any:
    """The in-process vLLM engine for ``args`` (logdiff's engine layer: it evicts any other vLLM first)."""
    from logdiff.sources.base import EngineSpec
    from logdiff.sources.pool import acquire

    options = (("max_model_len", args.prompt_len + args.response_len + 8), ("max_num_seqs", args.prompts * args.group))
    return acquire("vllm", EngineSpec(str(args.model), "bfloat16", options=options, seed=args.seed))


def run(args: argparse.Namespace, engine: Any) -> dict[str, Any]:
    """Every run of ``args.runs`` on ``engine``; returns what ``--json`` writes."""
    import torch

    torch.manual_seed(args.seed)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"}
    runs = {mode: run_one(mode, engine, Path(args.model), args) for mode in args.runs}
    return {"model": str(args.model), "settings": settings, "runs": runs}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="an HF model directory (logdiff demo-model PATH builds a small Qwen3)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per run (default 3)")
    parser.add_argument("--json", type=Path, help="write every step's numbers for both runs here")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (default 4)")
    parser.add_argument("--group", type=int, default=4, help="responses sampled per prompt (default 4)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response-len", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--clip-eps", type=float, default=0.2, help="PPO clip epsilon (default 0.2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=lambda s: s.split(","), default=list(RUNS), help="consistent,stock (default both)")
    parser.add_argument("--no-sync", action="store_true", help="skip the weight sync (negative control)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.prompts < 1 or args.group < 2 or args.prompt_len < 1 or args.response_len < 1:
        parser.error("--steps, --prompts, --prompt-len and --response-len must be >= 1, --group >= 2")
    if not set(args.runs) <= set(RUNS):
        parser.error(f"--runs: choose from {', '.join(RUNS)}")
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"{args.model}: not an HF model directory (no config.json)")
    return args


def main(argv: list[str] | None = None, engine: Any = None) -> int:
    """The command line; ``engine`` reuses a loaded vLLM engine (tests), else one is loaded and released."""
    from logdiff.sources.pool import engine_pool

    args = parse_args(argv)
    if engine is None:
        with engine_pool():  # its own engine, released at the end (the runs change its weights)
            result = run(args, open_engine(args))
    else:
        result = run(args, engine)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print("\nside by side (before each update):")
    print(f"{'step':>4}  {'run':>10}  {'max |diff|':>10}  {'ratio min':>10}  {'ratio max':>10}  {'clip':>5}")
    for i in range(args.steps):
        for mode, r in result["runs"].items():
            s = r["steps"][i]
            print(
                f"{i:>4}  {mode:>10}  {s['max_abs_diff']:>10.3g}  {s['ratio_min']:>10.6f}  "
                f"{s['ratio_max']:>10.6f}  {s['mismatch_clip_fraction']:>5.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
