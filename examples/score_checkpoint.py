"""Prompt logprobs of token ids from a fresh vLLM engine on a checkpoint: the reference a weight sync must equal.

    python examples/score_checkpoint.py CHECKPOINT '[[ids of prompt 1], [ids of prompt 2], ...]'

prints one JSON line: per prompt, the logprob of each of its tokens after the first (vLLM's ``prompt_logprobs``),
each prompt scored alone (one prefill each, so the GEMM shapes are those of any engine scoring it alone). The
engine is built as TRL builds its colocated one where that changes the numbers (bf16, ``processed_logprobs``),
in eager mode. ``examples/trl_grpo.py --verify-sync`` runs it in a process of its own.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def score(checkpoint: str, prompts: list[list[int]]) -> list[list[float]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=checkpoint, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=256,
              max_num_seqs=8, seed=0, logprobs_mode="processed_logprobs")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    return [[next(iter(pos.values())).logprob for pos in llm.generate([{"prompt_token_ids": ids}], params,
                                                                      use_tqdm=False)[0].prompt_logprobs[1:]]
            for ids in prompts]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: score_checkpoint.py CHECKPOINT PROMPTS_JSON\n")
        return 2
    sys.stdout.write(json.dumps(score(argv[0], json.loads(argv[1]))) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
