"""Sample rollouts in vLLM as an RL step would, captured inside vLLM's workers by logdiff's plugin.

    LOGDIFF_CAPTURE=DIR python examples/capture_vllm.py MODEL [--prompts N --prompt-len L --max-tokens T
                                                               --seed S --tensor-parallel-size K --window W]

The prompts are ``N`` random token-id sequences of length ``L`` (seeded); vLLM
samples ``T`` tokens for each (temperature 1, the engine's seed, ``logprobs=0``
as a rollout asks for the sampled tokens' logprobs) through ``LLM.generate``.
Nothing here calls logdiff: the plugin logdiff registers with vLLM sees
``LOGDIFF_CAPTURE`` and records every forward of every worker into the bundle
at ``DIR`` (``--out DIR`` sets it for you). Each rollout is printed as one JSON
line (``prompt_ids``, ``response_ids``, ``logprobs``): a sequences file
``logdiff scan --sequences`` and examples/capture_fsdp.py read.

For ``--tensor-parallel-size 2`` on vLLM's CPU build, ``VLLM_CPU_OMP_THREADS_BIND``
defaults to one core per worker (``0|1``) when not set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path


def random_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids, seeded; ids 0..9 are left out (special tokens sit low)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--out", type=Path, help="the bundle directory (default: $LOGDIFF_CAPTURE)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--window", help="decoder layers whose records are kept whole, or 'all' (sets "
                        "LOGDIFF_CAPTURE_WINDOW; default 2: the rest as row sketches)")
    args = parser.parse_args()

    config_file = args.model / "config.json"
    if not config_file.is_file():
        print(f"capture_vllm: {args.model} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    if args.out is not None:
        os.environ["LOGDIFF_CAPTURE"] = str(args.out.resolve())  # before vLLM starts: its workers inherit it
    if args.window is not None:
        os.environ["LOGDIFF_CAPTURE_WINDOW"] = args.window
    if not os.environ.get("LOGDIFF_CAPTURE"):
        print("capture_vllm: set LOGDIFF_CAPTURE=DIR (or --out DIR): where the bundle goes", file=sys.stderr)
        return 2
    if args.tensor_parallel_size > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(args.tensor_parallel_size))))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams

    prompts = random_prompts(int(json.loads(config_file.read_text())["vocab_size"]), args.prompts,
                             args.prompt_len, args.seed)  # fmt: skip
    llm = LLM(model=str(args.model), skip_tokenizer_init=True, enforce_eager=True, seed=args.seed,
              tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.prompt_len + args.max_tokens + 16,
              max_num_seqs=max(args.prompts, 1))  # fmt: skip
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        sample = out.outputs[0]
        logprobs = [entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids)]
        print(json.dumps({"prompt_ids": prompt, "response_ids": list(sample.token_ids), "logprobs": logprobs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
