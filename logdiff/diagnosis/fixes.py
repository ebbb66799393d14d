"""What to do about a cause: the fix text each cause kind carries, by the op it was found at.

An operator-path kind says what differs (the order of a sum, the precision of a step inside an op), and
the op says what to change: RoPE's intermediate precision is its cos/sin tables and rotation, an
activation's is the rounding between ``act(gate)`` and the product with ``up``, a norm's reduction order
is its sum of squares. ``fix_text`` picks the op's own text (``OP_FIX``) and falls back to the kind's
(``FIX``), so a cause never carries another family's fix. ``classify`` attaches it; framework
differences build theirs from what differs (``classify.classify_op``).
"""

from __future__ import annotations

FIX = {
    "reduction_order": "use one batch-invariant GEMM/reduction on both sides (logdiff.kernels.linear) "
    "or pin the same kernel library and tiling in trainer and engine",
    "online_softmax_block_size": "use one attention kernel with a fixed KV block size and fp32 online softmax "
    "for prefill and decode on both sides (logdiff.kernels.attention; vLLM/SGLang batch-invariant attention "
    "backends)",
    "fused_vs_unfused": "compute the residual add and the norm the same way on both sides: fuse both or "
    "neither, rounding the residual at the same point (logdiff.kernels.rms_norm with residual)",
    "intermediate_precision": "compute the op's internal steps in the same precision on both sides, rounding "
    "once at the end",
    "collective_order": "sum the row-parallel partial results in one fixed order whatever the world size "
    "(logdiff.kernels.collective.row_parallel_linear), or score at the same tensor-parallel size on both sides",
}

#: an operator-path kind's fix at one kind of op, where the op decides what to change (``fix_text``)
OP_FIX = {
    ("intermediate_precision", "rope"): "compute RoPE's cos/sin and the rotation in fp32 on both sides, rounding once "
    "at the end (logdiff.kernels.rope)",
    ("intermediate_precision", "act"): "compute the gated activation act(gate) * up in fp32 on both sides and round "
    "once, not after the activation and again after the product (logdiff.kernels.silu_and_mul; "
    "gelu_tanh_and_mul and swiglu_oai_and_mul for Gemma's and gpt-oss's)",
    ("intermediate_precision", "embed"): "look the rows up from the same table and apply any scale (Gemma's "
    "embed_scale) in the same precision on both sides, rounding once: an embedding sums nothing, so its rows differ "
    "only by how they are cast or scaled",
    ("reduction_order", "norm"): "sum the norm's squares in one fixed order, in fp32, on both sides whatever the "
    "batch (logdiff.kernels.rms_norm)",
    ("reduction_order", "add"): "add the residual in the same precision on both sides, rounding it at the same point "
    "(logdiff.kernels.rms_norm with residual)",
    ("reduction_order", "router"): "compute the router logits with one batch-invariant GEMM in fp32 on both sides "
    "(logdiff.kernels.linear; logdiff.kernels.moe_route for the choice)",
    ("reduction_order", "moe"): "sum the chosen experts' weighted outputs in one fixed order, in fp32, on both sides "
    "(logdiff.kernels.moe_combine)",
    ("reduction_order", "log_softmax"): "take the log-softmax's max and sum in one fixed order, in fp32, on both sides "
    "(logdiff.kernels.log_softmax)",
}


def fix_text(kind: str, op_kind: str) -> str:
    """The fix of an operator-path cause of ``kind`` at an op of ``op_kind``: the op's own text where the op decides
    what to change (RoPE's tables, the activation's product, the norm's sum), else the kind's (``FIX``)."""
    return OP_FIX.get((kind, op_kind), FIX[kind])


SEMANTIC_FIX = ("make the {side} side compute the function its contract names at this op: check its implementation "
                "and the settings it really applies (attention implementation, soft cap, window, scale, eps, RoPE "
                "table) against the other side's; no kernel change can close this gap")
