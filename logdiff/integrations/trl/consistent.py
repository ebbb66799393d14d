"""logdiff = 0 inside TRL: ``consistent(trainer)`` puts logdiff's consistent mode into both sides of a run.

``with logdiff.integrations.trl.consistent(trainer): trainer.train()`` makes the trainer's logprobs equal
the colocated vLLM engine's bit for bit, so TRL's own ``sampling/sampling_logp_difference`` is 0 and its
importance-sampling ratios 1. Three things change while the block runs, each undone on exit:

* **the engine**: every ``generate`` of TRL's colocated vLLM runs inside ``consistent_vllm`` (entered per
  call, so that TRL's weight sync between calls, which vLLM's reload would undo, runs on the stock
  engine; the engine must be eager: build the trainer inside ``eager_vllm()``);
* **the trainer's model**: ``logdiff.consistent_training`` for the whole block, forward and backward;
* **the fused head**: TRL's chunked log-prob kernel (``trl/kernels/chunked_logprob.py``) sums its
  log-sum-exp in its own tiles, which no consistent kernel reproduces. While the block runs, a
  ``fused_lm_head=True`` forward is replaced by the consistent path: the logits through ``lm_head`` (a
  consistent linear) and ``kernels.token_log_probs``, the log-softmax vLLM's consistent sampler runs.
  Each sequence is fed as itself, its pads cut and its positions from 0 as vLLM feeds it: TRL
  left-pads its prompts without ``position_ids``, which would rotate RoPE by the pad count and tile
  attention differently. Batch-invariant kernels make the per-sequence forwards equal a batch's.
  TRL's autocast (``bf16=True`` by default) is off inside it: the kernels fix their own precisions.
  The outputs TRL reads keep its layout: ``log_probs`` and ``entropy`` ``[batch, length - 1]``, zero
  where the label is -100.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from logdiff.probes.patching import Patches


@contextlib.contextmanager
def consistent(trainer: Any) -> Iterator[None]:
    """The consistent kernels on both sides of ``trainer``'s run (a ``GRPOTrainer`` with vLLM colocated)."""
    from logdiff.sources.hf.training import consistent_training
    from logdiff.sources.vllm.consistent import consistent_vllm

    generation = trainer.vllm_generation
    model = trainer.accelerator.unwrap_model(trainer.model)
    generate = generation.generate
    temperature = float(getattr(trainer, "temperature", 1.0))

    def generate_consistently(*args: Any, **kwargs: Any) -> Any:
        with consistent_vllm(generation.llm):
            return generate(*args, **kwargs)

    with Patches() as patches, consistent_training(model):
        patches.set(generation, "generate", generate_consistently)
        patches.set(model, "forward", _consistent_head(model, model.forward, temperature))
        yield


def _consistent_head(model: Any, forward: Any, temperature: float) -> Any:
    """``model.forward`` with its ``fused_lm_head=True`` calls computed by the consistent path (module docstring)."""

    def consistent_forward(*args: Any, fused_lm_head: bool = False, labels: Any = None, **kwargs: Any) -> Any:
        import torch

        with torch.autocast(model.device.type, enabled=False):  # TRL's bf16=True autocast would recast the kernels
            if not fused_lm_head:
                return forward(*args, labels=labels, **kwargs) if labels is not None else forward(*args, **kwargs)
            ids = kwargs.pop("input_ids", args[0] if args else None)
            mask = kwargs.pop("attention_mask", None)
            return per_sequence_logprobs(model, ids, mask, labels, temperature)

    return consistent_forward


def per_sequence_logprobs(model: Any, ids: Any, mask: Any, labels: Any, temperature: float = 1.0) -> Any:
    """TRL's fused-head output (``log_probs``, ``entropy``: ``[batch, length - 1]``, column ``t`` for the token at
    ``t + 1``, zero where the label is -100) from one forward per sequence, unpadded, positions from 0."""
    import torch
    from trl.trainer.utils import FusedCausalLMOutput

    from logdiff import kernels

    batch, length = ids.shape
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    head = model.get_output_embeddings()
    rows_lp, rows_ent = [], []
    for b in range(batch):
        cols = mask[b].nonzero()[:, 0]
        tokens = ids[b, cols][None]
        hidden = model.base_model(input_ids=tokens, use_cache=False).last_hidden_state
        logits = head(hidden)[0, :-1].float()
        if temperature != 1.0:
            logits = logits / temperature
        lp = kernels.token_log_probs(logits, tokens[0, 1:])
        logs = kernels.log_softmax(logits)
        ent = -(logs.exp() * logs).sum(-1)
        # back into the padded layout: the token at column cols[j + 1] is scored in column cols[j + 1] - 1
        where = cols[1:] - 1
        rows_lp.append(torch.zeros(length - 1, dtype=lp.dtype, device=lp.device).index_put((where,), lp))
        rows_ent.append(torch.zeros(length - 1, dtype=ent.dtype, device=ent.device).index_put((where,), ent))
    scored = (labels[:, 1:] != -100) if labels is not None else mask[:, 1:]
    log_probs = torch.stack(rows_lp) * scored
    entropy = torch.stack(rows_ent) * scored
    return FusedCausalLMOutput(loss=None, log_probs=log_probs, entropy=entropy)
