"""The INT8 W8A8 scheme of a compressed-tensors checkpoint: what a quantized rollout engine computes.

One definition of the scheme, shared by everything that must agree on it bit for bit: the checkpoint
writer (``logdiff quantize``), the weight check through quantization (the trainer's bf16 weight quantized
here must equal the engine's int8 weight and scale), the exact function a quantized linear is judged
against, and the consistent fake-quantized linear.

The scheme (compressed-tensors ``int-quantized``, symmetric, as llm-compressor writes it):

* **weights**: int8, one fp32 scale per output channel, ``scale = amax(|w|) / 127.5`` over the row
  (``(q_max - q_min) / 2`` with ``q_min, q_max = -128, 127``), ``q = clamp(round(w / scale), -128, 127)``,
  rounding half to even; computed in fp32 from the weight as stored (bf16 -> fp32 is exact);
* **activations**: dynamic, one scale per token, computed by the engine at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Q_MIN, Q_MAX = -128, 127
#: the weight scale's divisor: half the int8 range (compressed-tensors' symmetric min-max observer)
WEIGHT_HALF_RANGE = (Q_MAX - Q_MIN) / 2


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> (int8 [out, in], fp32 scale [out, 1]), per output channel, symmetric.

    A row of zeros gets scale 1 (every value quantizes to 0 whatever the scale; a zero scale would divide
    by zero when dequantized)."""
    import torch

    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / WEIGHT_HALF_RANGE, torch.ones_like(amax))
    q = torch.clamp(torch.round(w / scale), Q_MIN, Q_MAX).to(torch.int8)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight an int8 weight and its per-channel scale stand for."""
    import torch

    return q.to(torch.float32) * scale.to(torch.float32)
