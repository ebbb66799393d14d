"""Batch-invariant log_softmax over the vocabulary, in fp32.

``log_softmax(x) = (x - m) - log(sum(exp(x - m)))`` with ``m`` the row max.

Why it is invariant: the max is exact whatever its order; ``exp`` and ``log``
are the position-independent :mod:`fixed_order` functions; the row sum is a
:func:`halving_sum` whose order depends only on the vocabulary size. A stock
``torch.logsumexp``/``sum`` may split one long row across threads when few
rows share the call (decode) and not when many do (prefill).

Rows are processed in chunks of at most :data:`CHUNK_ELEMENTS` elements (at
least one row); rows are independent, so chunking never changes a bit. The
chunk bounds memory and keeps the dozen-odd elementwise passes of the fixed-order
``exp`` near the cache: 2^20 elements (4 MiB of fp32) took 223 ms for 512 rows
of a 32,768-token vocabulary and 421 ms for 256 rows of 151,936, against 524 ms
and 1,250 ms with 2^22 (``bench/bench_logsoftmax_chunks.py``, 2-core AVX2 EPYC:
bench/results/logsoftmax-chunks-avx2-2026-12-06.txt).
:func:`token_log_probs` returns only the chosen tokens' values, bitwise equal
to ``log_softmax(logits).gather(-1, tokens)``.

Precision policy: logits widened to fp32 (exact), all arithmetic in fp32,
fp32 output.
"""

from __future__ import annotations

import torch

from .differentiable import needs_grad
from .fixed_order import exp, halving_sum, log

CHUNK_ELEMENTS = 1 << 20


def _rows(logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    v = logits.shape[-1]
    return logits.reshape(-1, v), max(1, CHUNK_ELEMENTS // max(1, v))


def _shifted_and_log_norm(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = rows.float()
    shifted = x - x.amax(-1, keepdim=True)
    return shifted, log(halving_sum(exp(shifted), -1))


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-probabilities over the last dim of ``logits``."""
    if needs_grad(logits):
        return _LogSoftmax.apply(logits)
    return _log_softmax(logits)


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    rows, per_chunk = _rows(logits)
    out = torch.empty(rows.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, rows.shape[0], per_chunk):
        shifted, log_norm = _shifted_and_log_norm(rows[start : start + per_chunk])
        out[start : start + per_chunk] = shifted - log_norm.unsqueeze(-1)
    return out.view(logits.shape)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 log-probability of ``tokens`` (shape ``logits.shape[:-1]``) under ``logits``."""
    if needs_grad(logits):
        return _TokenLogProbs.apply(logits, tokens)
    return _token_log_probs(logits, tokens)


def _token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    rows, per_chunk = _rows(logits)
    flat_tokens = tokens.reshape(-1, 1).long()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, rows.shape[0], per_chunk):
        shifted, log_norm = _shifted_and_log_norm(rows[start : start + per_chunk])
        picked = shifted.gather(-1, flat_tokens[start : start + per_chunk]).squeeze(-1)
        out[start : start + per_chunk] = picked - log_norm
    return out.view(tokens.shape)


def _grad_rows(dy: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """``dy - softmax * sum(dy)`` per row: position-independent ``exp``, ``halving_sum`` over the vocabulary."""
    return dy - exp(log_p) * halving_sum(dy, -1).unsqueeze(-1)


class _LogSoftmax(torch.autograd.Function):
    """Row-local backward ``dx = dy - p * sum(dy)``, chunked like the forward."""

    @staticmethod
    def forward(ctx, logits):  # noqa: ANN001, ANN205
        out = _log_softmax(logits)
        ctx.save_for_backward(out)
        ctx.dtype = logits.dtype
        return out

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        (out,) = ctx.saved_tensors
        log_p, per_chunk = _rows(out)
        d_rows = dy.reshape(log_p.shape).float()
        dx = torch.empty(log_p.shape, dtype=ctx.dtype, device=out.device)
        for start in range(0, log_p.shape[0], per_chunk):
            part = slice(start, start + per_chunk)
            dx[part] = _grad_rows(d_rows[part], log_p[part])
        return dx.view(out.shape)


class _TokenLogProbs(torch.autograd.Function):
    """Backward ``dx = onehot(token) * dy - p * dy``; the log-probabilities are recomputed chunk by chunk."""

    @staticmethod
    def forward(ctx, logits, tokens):  # noqa: ANN001, ANN205
        ctx.save_for_backward(logits, tokens)
        return _token_log_probs(logits, tokens)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        logits, tokens = ctx.saved_tensors
        rows, per_chunk = _rows(logits)
        flat_tokens = tokens.reshape(-1, 1).long()
        d_flat = dy.reshape(-1, 1).float()
        dx = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device)
        for start in range(0, rows.shape[0], per_chunk):
            part = slice(start, start + per_chunk)
            shifted, log_norm = _shifted_and_log_norm(rows[part])
            d_rows = torch.zeros_like(shifted).scatter_(-1, flat_tokens[part], d_flat[part])
            dx[part] = _grad_rows(d_rows, shifted - log_norm.unsqueeze(-1))
        return dx.view(logits.shape), None


def log_softmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """``torch.log_softmax`` in fp32 (fp64 for fp64 input)."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.log_softmax(logits.to(dtype), dim=-1)
