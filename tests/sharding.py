"""What a stock tensor-parallel run against an unsharded one must show, on any CPU.

TP = 2 splits the column-parallel products (q/k/v, gate/up) and everything per head (q/k norms, RoPE, the
attention core, the activation) across ranks, and sums each row-parallel product (o_proj, down_proj) over
them. Only the last is a different order of the same sum everywhere; whether a slice of the others gets
the whole op's bits is a property of the CPU's stock kernels (tile choices, thread counts). So: where a
sliced op differs, the test skips naming it; otherwise the first divergence and every cause must be a
row-parallel sum, ``collective_order``.
"""

from __future__ import annotations

import pytest

ROW_PARALLEL = ("o_proj", "down_proj")
SLICED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_norm", "k_norm", "rope_q", "rope_k", "attn_core",
          "act_mul")


def _op(boundary: str) -> str:
    return boundary.rsplit(".", 1)[-1]


def expect_collective_order_only(result: dict) -> None:
    first = result["first_divergence"]
    assert first is not None and first["inputs_equal"], first
    sliced = [b for b in [first["boundary"], *(c["boundary"] for c in result["causes"])] if _op(b) in SLICED]
    if sliced:
        pytest.skip(f"this CPU's stock kernels give a tensor-parallel slice of {sliced[0]} other bits than the "
                    "whole op, so the row-parallel sum is not the only difference here")
    assert _op(first["boundary"]) in ROW_PARALLEL, first
    assert result["causes"], result["warnings"]
    for cause in result["causes"]:
        assert _op(cause["boundary"]) in ROW_PARALLEL, cause
        assert (cause["class"], cause["kind"]) == ("operator_path", "collective_order"), cause
