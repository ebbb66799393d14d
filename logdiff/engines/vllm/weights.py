"""Recover plain weight matrices from vLLM's CPU layers, which may no longer hold them.

On CPU, ``UnquantizedLinearMethod.process_weights_after_loading`` calls
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer,
remove_weight=True)``: the weight goes into a oneDNN (or sgl / zentorch)
handle captured by ``layer.cpu_linear``, and ``layer.weight`` becomes an empty
tensor. A consistent kernel needs the plain ``[N, K]`` matrix, so we ask the
layer's own GEMM for it: ``cpu_linear(I_K) = W^T``. Every output element is one
product ``1 * w`` plus exact zeros, so the recovered matrix is bit-exact; a
second call on random rows checks the recovery against the stock GEMM. The
cost is one ``K x K x N`` GEMM per layer, paid once per engine (cached by the
identity of ``cpu_linear``, which vLLM rebuilds when it reloads weights).

The MoE experts' ``w13_weight``/``w2_weight`` are prepacked in place into a
grouped-GEMM tiling (``experts/cpu_moe.py``: zero-pad the intermediate size,
then ``cpu_prepack_moe_weight``). We run the experts object's own
``process_weights_after_loading`` on a scratch layer holding a known pattern
(``layout``) and invert the permutation it applies.
"""

from __future__ import annotations

import weakref
from typing import Any

from logdiff.engines.vllm.layout import discover_permutation, inverse_gather_index

_DENSE: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()
_MOE: weakref.WeakKeyDictionary[Any, tuple[Any, Any, Any]] = weakref.WeakKeyDictionary()
_IDENTITY_CHUNK = 1024


def dense_weight(layer: Any) -> Any:
    """The ``[N, K]`` weight that ``layer.cpu_linear`` multiplies by, bit-exact."""
    import torch

    weight = layer.weight
    if weight.dim() == 2 and weight.numel() > 0:
        return weight.data
    gemm = layer.cpu_linear
    cached = _DENSE.get(layer)
    if cached is not None and cached[0] is gemm:
        return cached[1]
    k = _input_size(layer)
    dtype = weight.dtype
    rows = []
    with torch.no_grad():
        for start in range(0, k, _IDENTITY_CHUNK):
            stop = min(k, start + _IDENTITY_CHUNK)
            probe = torch.zeros(stop - start, k, dtype=dtype)
            probe[:, start:stop] = torch.eye(stop - start, dtype=dtype)
            rows.append(gemm(probe, weight, None))
        recovered = torch.cat(rows).t().contiguous()
        x = torch.randn(8, k, generator=torch.Generator().manual_seed(0)).to(dtype)
        stock = gemm(x, weight, None).float()
        mine = torch.nn.functional.linear(x.float(), recovered.float())
        tol = 1e-2 * (mine.abs().max().item() + 1.0)
        if not torch.isfinite(recovered).all() or (stock - mine).abs().max().item() > tol:
            raise RuntimeError(f"could not recover the weight of {type(layer).__name__} from its CPU GEMM")
    _DENSE[layer] = (gemm, recovered)
    return recovered


def _input_size(layer: Any) -> int:
    for name in ("input_size_per_partition", "input_size", "embedding_dim"):
        value = getattr(layer, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise NotImplementedError(f"cannot tell the input size of {type(layer).__name__}")


def moe_runner_weights(runner: Any) -> tuple[Any, Any]:
    """Plain ``w13``/``w2`` of a vLLM MoE block's experts, whichever CPU MoE kernel packed them.

    ``runner`` is the module at the HF experts module's position: vLLM 0.32's
    ``MoERunner`` (experts under ``routed_experts``) or an older ``FusedMoE``
    that holds ``w13_weight`` itself.
    """
    experts = getattr(runner, "routed_experts", runner)
    fused = experts.quant_method.moe_kernel.fused_experts
    return moe_expert_weights(experts, fused, runner.moe_config.intermediate_size_per_partition_unpadded)


def moe_expert_weights(routed_experts: Any, fused_experts: Any, intermediate_size: int) -> tuple[Any, Any]:
    """Plain ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]`` of a CPU MoE layer."""
    import torch

    w13, w2 = routed_experts.w13_weight, routed_experts.w2_weight
    cached = _MOE.get(routed_experts)
    if cached is not None and cached[0] == w13.data_ptr():
        return cached[1], cached[2]
    num_experts, hidden = w13.shape[0], w2.shape[1]
    plain_shapes = {"w13_weight": (2 * intermediate_size, hidden), "w2_weight": (hidden, intermediate_size)}
    out = {}
    probe_experts = min(num_experts, 2)
    for name, (rows, cols) in plain_shapes.items():
        packed = getattr(routed_experts, name).data
        other = "w2_weight" if name == "w13_weight" else "w13_weight"
        other_shape = (probe_experts, *plain_shapes[other])

        def transform(src: Any, name: str = name, other: str = other, other_shape: Any = other_shape) -> Any:
            scratch = torch.nn.Module()
            scratch.register_parameter(name, torch.nn.Parameter(src, requires_grad=False))
            scratch.register_parameter(
                other, torch.nn.Parameter(torch.zeros(other_shape, dtype=src.dtype), requires_grad=False)
            )
            scratch.moe_config = getattr(routed_experts, "moe_config", None)
            saved = dict(vars(fused_experts))
            try:
                fused_experts.process_weights_after_loading(scratch)
            finally:
                vars(fused_experts).clear()
                vars(fused_experts).update(saved)
            return getattr(scratch, name).data

        source_of = discover_permutation(transform, (probe_experts, rows, cols), packed.dtype)
        source_of = source_of.reshape(probe_experts, -1)
        per_expert = rows * cols
        if source_of.shape[1] * num_experts != packed.numel():
            raise NotImplementedError(f"MoE {name}: packed size differs from the scratch pack")
        if probe_experts == 2:
            first = source_of[0]
            if not torch.equal(source_of[1], torch.where(first >= 0, first + per_expert, first)):
                raise NotImplementedError(f"MoE {name}: the packing does not repeat expert by expert")
        gather = inverse_gather_index(source_of[0], per_expert)
        out[name] = packed.reshape(num_experts, -1)[:, gather].reshape(num_experts, rows, cols).contiguous()
    _MOE[routed_experts] = (w13.data_ptr(), out["w13_weight"], out["w2_weight"])
    return out["w13_weight"], out["w2_weight"]
