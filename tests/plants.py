"""Planted faults that work on every CPU and device: each checks that it changes this machine's bits.

A plant swaps one module's forward on a loaded engine for a computation of the
same math in another order (operator path). Whether a naive plant changes any
bits is a property of the machine's kernels (on AVX2, torch's bf16 GEMM already
accumulates in fp32, so an fp32 split-K rounds to the same bits), so every plant
here rounds partial sums to the output dtype, and is checked on the module's own
device before it is used: where it changes nothing, the test is skipped with
the ISA and device named. ``stale_checkpoint`` plants a framework difference
instead: one tensor of the weights changed, for one side to load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from logdiff.isa import cpu_isa


def _machine(weight: torch.Tensor) -> str:
    return cpu_isa() if weight.device.type == "cpu" else str(weight.device)


@contextlib.contextmanager
def split_k(module: torch.nn.Module) -> Iterator[None]:
    """Plant a reduction-order change: split-K with each half's partial sum rounded to the output dtype.

    The same sum in another order, with one more rounding: operator path. (Summing
    both halves in fp32 and rounding once is not a plant on every CPU: on AVX2,
    torch's bf16 GEMM accumulates in fp32 too and rounds to the same bits.) The
    plant is checked to change this CPU's output bits before it is used.
    """
    weight = module.weight

    def forward(x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1] // 2
        lo = torch.nn.functional.linear(x[..., :k], weight[:, :k])
        hi = torch.nn.functional.linear(x[..., k:], weight[:, k:])
        return hi + lo

    probe = torch.randn(64, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
    with torch.no_grad():
        if torch.equal(forward(probe), module(probe)):
            pytest.skip(f"the split-K plant changes no output bits here ({_machine(weight)})")
    module.forward = forward
    try:
        yield
    finally:
        del module.forward


@contextlib.contextmanager
def batch_dependent(module: torch.nn.Module) -> Iterator[list[int]]:
    """Plant batch-dependent tiling: with more than one row in the batch, split K and round each half.

    Whether a *stock* op varies with the batch size depends on the CPU's kernels
    (fp32 SDPA decode does on some, not on others), so the probe's negative
    control is planted, and checked to change this CPU's output bits first.
    """
    weight = module.weight
    batch_sizes: list[int] = []  # what the engine ran through the plant

    def forward(x: torch.Tensor) -> torch.Tensor:
        batch_sizes.append(x.shape[0])
        if x.shape[0] == 1:
            return F.linear(x, weight)
        k = x.shape[-1] // 2
        halves = (F.linear(x[..., :k], weight[:, :k]), F.linear(x[..., k:], weight[:, k:]))
        return sum(h.to(torch.bfloat16) for h in halves).to(x.dtype)

    probe = torch.randn(4, 1, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
    with torch.no_grad():
        if torch.equal(forward(probe)[:1], forward(probe[:1])):
            pytest.skip(f"the planted batch dependence changes no bits here ({_machine(weight)})")
    batch_sizes.clear()
    module.forward = forward
    try:
        yield batch_sizes
    finally:
        del module.forward


def stale_checkpoint(model: Path, out_dir: Path, name: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Path:
    """MODEL's weights with tensor ``name`` replaced by ``change(it)`` (in fp32, stored back in its dtype), saved
    as one ``.safetensors`` file in ``out_dir``: a stale weight sync for ``--infer-ckpt``."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(model / "model.safetensors"))
    sd[name] = change(sd[name].float()).to(sd[name].dtype).contiguous()
    ckpt = out_dir / "stale.safetensors"
    save_file(sd, str(ckpt))
    return ckpt



def assert_closes(result: dict) -> None:
    """A plant before the logits is within what the ops up to the logits can explain: the closure figure is 1
    (every token's |Δ logprob| inside its bound), nothing enters after the boundary, and the verdict is not
    ``unexplained`` (docs/causes.md, *Closure*)."""
    c = result["closure"]
    assert c is not None and c["closure"] == 1.0, c
    if c["gap_max"] == 0.0:  # equal logprobs (a control on a machine whose stock paths agree): nothing to bound
        return
    assert c["boundary"] in ("logits", "model.norm") and c["tokens_bounded"] == c["tokens"] > 0, c
    assert c["beyond_tokens"] == 0 and c["unexplained"] == 0.0 and c["enters_after"] is None, c
    assert c["gap_max"] <= c["bound_max"] + 1e-4, c
    assert result["verdict"] != "unexplained"
