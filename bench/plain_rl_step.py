"""The work an RL step does without logdiff: the baseline every scan is measured against.

vLLM samples the responses, vLLM scores prompt + response with ``prompt_logprobs``,
HF scores the same tokens in one teacher-forced forward. Same sequences and
settings as ``logdiff scan --num-sequences N --prompt-len P --response-len R``
(random prompt ids from the same seed; the sampled tokens may differ).

Usage::

    .venv/bin/python bench/plain_rl_step.py MODEL N P R
"""

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def main(model: str, n: int, p: int, r: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", seed=0, max_num_seqs=16)
    size = llm.llm_engine.model_config.get_vocab_size()
    prompts = torch.randint(5, size, (n, p), generator=gen).tolist()
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts], SamplingParams(max_tokens=r, logprobs=0, ignore_eos=True))
    full = [q + list(o.outputs[0].token_ids) for q, o in zip(prompts, outs)]
    llm.generate([{"prompt_token_ids": f} for f in full], SamplingParams(max_tokens=1, prompt_logprobs=1))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor(full)).logits.float()
        torch.log_softmax(logits[:, p - 1 : -1], -1).gather(-1, torch.tensor(full)[:, p:, None])


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:5]))
