"""Train a tiny causal LM for a minute or two on CPU, deterministically.

Why train at all: freshly initialised weights give a nearly uniform
next-token distribution (logprob about -8.4 on a 4096-token vocabulary), so
every engine difference looks tiny. A short training run gives peaked,
structured distributions like a real language model's.

How, and why it is reproducible:
- fp32 weights and compute, AdamW, next-token cross-entropy on fixed-length
  chunks of the tokenized corpus; gradient clipping at 1.0.
- Data order: the chunks are shuffled once per epoch by a ``torch.Generator``
  seeded from ``seed``; weights are initialised under ``seed`` too.
- The learning-rate schedule depends only on the step number (linear warm-up,
  then inverse-square-root decay), never on the total number of steps. The run
  is therefore *prefix-consistent*: the weights after N steps are the same
  whether the run stopped at ``max_steps=N`` or because ``train_seconds`` ran
  out after N steps. A time-limited build records N, and rebuilding with
  ``max_steps=N`` reproduces it (on the same machine, software and thread
  count: BLAS reductions depend on those).
- ``torch.use_deterministic_algorithms(True)`` is on while training.
- One torch thread by default (``TrainSettings.threads``). Measured on the
  2-core dev machines: an idle machine runs a step about 1.7x faster with two
  threads, but with other jobs running, two threads spin-wait on each other and
  a 90 s budget reached 17 steps instead of 181 with one thread. One thread
  also makes the bits independent of the core count: after 6 steps the
  Qwen3-MoE weights differed between one and two threads (the dense models
  did not).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TrainSettings:
    """Optimiser and batch settings of a demo-model training run."""

    seq_len: int = 128
    batch_size: int = 8
    peak_lr: float = 3e-3
    warmup_steps: int = 20
    decay_start: int = 150  # inverse-sqrt decay begins here: lr ~ sqrt(decay_start / step)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_sequences: int = 32
    threads: int | None = 1  # torch intra-op threads while building (None: torch's default); see above

    def lr_at(self, step: int) -> float:
        """Learning rate of 0-based ``step``: warm-up, then inverse-sqrt decay (no total needed)."""
        s = step + 1
        return self.peak_lr * min(1.0, s / self.warmup_steps) * min(1.0, math.sqrt(self.decay_start / s))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EvalStats:
    """Next-token statistics on held-out text (fp32 compute)."""

    loss: float  # mean cross-entropy, nats per token
    mean_max_prob: float  # mean probability of the argmax token
    median_max_prob: float
    frac_max_prob_over_half: float  # share of positions whose argmax has p > 0.5
    mean_entropy: float  # nats
    top1_accuracy: float  # argmax == actual next token
    tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass
class TrainResult:
    """What a training run did: steps, why it stopped, the loss curve, eval before/after."""

    steps: int
    stopped_by: str  # "max_steps" or "time"
    seconds: float
    cpu_seconds: float = 0.0  # process CPU time (all threads); wall time can be inflated by other load
    losses: list[float] = field(default_factory=list)
    eval_before: EvalStats | None = None
    eval_after: EvalStats | None = None


def chunk_stream(ids: list[int], seq_len: int):
    """Cut a token stream into a ``[n, seq_len]`` LongTensor of non-overlapping chunks."""
    import torch

    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"need at least {seq_len} tokens, got {len(ids)}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def spread_rows(chunks, count: int):
    """``count`` rows spread evenly over ``chunks`` (all rows if there are fewer)."""
    import torch

    n = chunks.shape[0]
    if n <= count:
        return chunks
    idx = torch.linspace(0, n - 1, count).round().long()
    return chunks[idx]


def evaluate(model, chunks) -> EvalStats:
    """Held-out next-token statistics of ``model`` on ``chunks`` ([n, T] ids), in fp32."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=chunks).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            target = chunks[:, 1:]
            nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            probs = logp.exp()
            max_prob, argmax = probs.max(dim=-1)
            entropy = -(probs * logp).sum(-1)
            return EvalStats(
                loss=nll.mean().item(),
                mean_max_prob=max_prob.mean().item(),
                median_max_prob=max_prob.median().item(),
                frac_max_prob_over_half=(max_prob > 0.5).float().mean().item(),
                mean_entropy=entropy.mean().item(),
                top1_accuracy=(argmax == target).float().mean().item(),
                tokens=int(target.numel()),
            )
    finally:
        model.train(was_training)


def batch_order(num_chunks: int, batch_size: int, seed: int):
    """Yield batches of chunk indices forever: a fresh seeded permutation each epoch."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(num_chunks, generator=generator)
        for start in range(0, num_chunks - batch_size + 1, batch_size):
            yield perm[start : start + batch_size]


def _adamw_impl() -> dict[str, bool]:
    """Fused AdamW where this torch has it on CPU (one kernel per step; element-wise, so deterministic)."""
    import inspect

    import torch

    if "fused" in inspect.signature(torch.optim.AdamW).parameters:
        return {"fused": True}
    return {"foreach": True}


def train(
    model,
    train_chunks,
    *,
    seed: int,
    settings: TrainSettings,
    train_seconds: float | None,
    max_steps: int | None,
    moe_aux_loss: bool = False,
    progress: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train ``model`` in place on ``train_chunks`` ([n, T] ids) until max_steps or the time budget.

    ``max_steps``, when given, fixes the step count exactly and the time budget
    does not apply (a reproducible build). Otherwise the run stops after the
    first step that ends past ``train_seconds``.
    """
    import torch

    if max_steps is None and train_seconds is None:
        raise ValueError("give max_steps or train_seconds")
    if train_chunks.shape[0] < settings.batch_size:
        raise ValueError("fewer training chunks than one batch")
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr_at(0), betas=(settings.beta1, settings.beta2), **_adamw_impl(),
    )
    result = TrainResult(steps=0, stopped_by="max_steps", seconds=0.0)
    batches = batch_order(train_chunks.shape[0], settings.batch_size, seed)
    extra = {"output_router_logits": True} if moe_aux_loss else {}
    model.train()
    start = time.monotonic()
    cpu_start = time.process_time()
    last_report = start
    step = 0
    while True:
        if max_steps is not None and step >= max_steps:
            result.stopped_by = "max_steps"
            break
        if max_steps is None and time.monotonic() - start >= train_seconds:
            result.stopped_by = "time"
            break
        for group in optimizer.param_groups:
            group["lr"] = settings.lr_at(step)
        batch = train_chunks[next(batches)]
        out = model(input_ids=batch, labels=batch, **extra)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        lm_loss = out.loss.detach()
        if getattr(out, "aux_loss", None) is not None:  # report next-token loss only
            lm_loss = lm_loss - model.config.router_aux_loss_coef * out.aux_loss.detach()
        result.losses.append(round(lm_loss.item(), 5))
        now = time.monotonic()
        if progress is not None and (now - last_report >= 10.0 or step == max_steps):
            last_report = now
            progress(f"step {step}: loss {lm_loss.item():.3f} ({now - start:.0f} s)")
    result.steps = step
    result.seconds = time.monotonic() - start
    result.cpu_seconds = time.process_time() - cpu_start
    model.eval()
    return result
