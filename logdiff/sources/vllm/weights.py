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

The preflight needs only fingerprints, and an identity GEMM per layer is the
costliest step of a scan's fixed cost on hosts that pack weights away (4.6 s of
a 0.5B module scan on an AMX host, 2026-12-02). So while the engine loads,
:func:`fingerprint_at_dispatch` wraps vLLM's dispatch and hashes each weight it
is about to pack, per part of a packed layer (``output_sizes``), before the
plain tensor goes: :func:`dispatched_fingerprints` answers from that record as
long as the layer still runs the GEMM built then (a reload builds another, and
the identity GEMM is back). It trusts the dispatch to pack the weight it was
handed, which the identity GEMM would check; consistent mode, which needs the
plain matrix itself, still recovers it.

MLA's ``kv_b_proj`` skips the CPU GEMM dispatch (``cpu_linear`` is plain
``F.linear``). On AMX hosts vLLM 0.32 runs MLA on ``AMXMLAImpl``
(``v1/attention/backends/mla/amx_mla.py``): its ``process_weights_after_loading``
splits the weight into ``W_UK``/``W_UV`` per head and VNNI-packs both
(``convert_weight_packed``) for ``bmm_cpu``, then ``MLAAttention`` replaces
``kv_b_proj.weight`` with an empty tensor. :func:`latent_up_weight` recovers the
plain ``[heads * (nope + v), kv_lora_rank]`` matrix the same way as the
experts': the impl's own ``process_weights_after_loading`` on a scratch copy
of the impl with a known pattern (two heads, checked to repeat head by head),
inverted; the recovered weight is packed again by that same method and must
give the live packed tensors bit for bit. Only a bf16/fp16 checkpoint's (no FP8
``_w_scale``); anything else raises ``NotImplementedError`` (unverified).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from logdiff.probes.contracts import fingerprint
from logdiff.sources.vllm.layout import discover_permutation, inverse_gather_index

_DENSE: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()
_MOE: weakref.WeakKeyDictionary[Any, tuple[Any, Any, Any]] = weakref.WeakKeyDictionary()
_LATENT: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()
_LATENT_GATHER: dict[tuple[Any, ...], Any] = {}  # AMX packing layout: one per shape, not per layer
_IDENTITY_CHUNK = 1024


@dataclass(frozen=True)
class Dispatched:
    """Fingerprints of the weight vLLM's CPU dispatch packed into ``gemm`` (``layer.cpu_linear`` then)."""

    gemm: Any
    dtype: Any
    whole: str | None  # of the whole weight, where it has one part
    parts: tuple[str, ...]  # of its ``output_sizes`` parts, in order


#: where the record of a dispatched weight is kept on its layer
DISPATCHED = "_logdiff_dispatched"


@contextlib.contextmanager
def fingerprint_at_dispatch() -> Iterator[None]:
    """While the block runs (an engine loading, a weight sync's reload), record the fingerprints of every weight
    the CPU dispatch removes (nothing on a build without it: its layers keep their plain weights)."""
    from vllm.model_executor.layers import utils

    if not hasattr(utils, "dispatch_cpu_unquantized_gemm"):
        yield
        return

    from logdiff.phases import timed
    from logdiff.probes.patching import Patches

    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: Any, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        sizes = list(getattr(layer, "output_sizes", None) or [])
        plain = remove_weight and weight is not None and weight.dim() == 2 and not weight.is_meta
        if plain:
            parts = weight.split(sizes, dim=0) if len(sizes) > 1 and sum(sizes) == weight.shape[0] else ()
            with timed("fingerprints (engine, at the sync)"):
                record = (weight.dtype, None if parts else fingerprint(weight), tuple(fingerprint(p) for p in parts))
        original(layer, remove_weight)
        if plain and layer.weight.numel() == 0:
            setattr(layer, DISPATCHED, Dispatched(layer.cpu_linear, *record))

    with Patches() as patches:
        patches.set(utils, "dispatch_cpu_unquantized_gemm", dispatch)
        yield


def dispatched_fingerprints(layer: Any) -> Dispatched | None:
    """The fingerprints recorded when ``layer``'s weight was packed away, while its GEMM is still that one."""
    record = getattr(layer, DISPATCHED, None)
    return record if record is not None and record.gemm is getattr(layer, "cpu_linear", None) else None


def dense_weight(layer: Any, owners: Iterable[Any] = ()) -> Any:
    """The ``[N, K]`` weight that ``layer.cpu_linear`` multiplies by, bit-exact.

    An MLA ``kv_b_proj`` whose weight the MLA backend released (AMX) is recovered from the
    packed copies of the ``MLAAttention`` among ``owners`` that reads it (:func:`latent_up_weight`).
    """
    import torch

    weight = layer.weight
    if weight.dim() == 2 and weight.numel() > 0:
        return weight.data
    if getattr(layer, "_cpu_skip_gemm_dispatch", False):  # MLA's kv_b_proj: cpu_linear is F.linear, no handle
        owner = next((m for m in owners if getattr(m, "kv_b_proj", None) is layer and hasattr(m, "impl")), None)
        if owner is None:
            raise NotImplementedError("MLA kv_b_proj without its weight and no MLA layer to recover it from")
        return latent_up_weight(owner)
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
        gather = _block_gather(source_of, per_expert, f"MoE {name}", "expert")
        out[name] = packed.reshape(num_experts, -1)[:, gather].reshape(num_experts, rows, cols).contiguous()
    _MOE[routed_experts] = (w13.data_ptr(), out["w13_weight"], out["w2_weight"])
    return out["w13_weight"], out["w2_weight"]


def latent_up_weight(mla: Any) -> Any:
    """The plain ``kv_b_proj`` weight ``[heads * (nope + v), kv_lora_rank]`` of a vLLM ``MLAAttention``.

    The live weight where the layer still holds it; on ``AMXMLAImpl`` (which released it) the inverse of
    the impl's own VNNI packing of ``_w_uk_packed`` ``[heads, rank, nope]`` and ``_w_uv_packed``
    ``[heads, v, rank]``, verified by packing the recovery again.
    """
    import copy

    import torch

    kv_b = mla.kv_b_proj
    if kv_b.weight.dim() == 2 and kv_b.weight.numel() > 0:
        return dense_weight(kv_b)
    impl = mla.impl
    uk, uv = getattr(impl, "_w_uk_packed", None), getattr(impl, "_w_uv_packed", None)
    if uk is None or uv is None:
        raise NotImplementedError(f"MLA kv_b_proj released by {type(impl).__name__} without packed W_UK/W_UV")
    if getattr(impl, "_w_scale", None) is not None or uk.dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError("MLA kv_b_proj packed as FP8 (a re-quantized copy, not the checkpoint)")
    cached = _LATENT.get(impl)
    if cached is not None and cached[0] == uk.data_ptr():
        return cached[1]
    heads, rank = int(impl.num_heads), int(impl.kv_lora_rank)
    nope, v_dim = int(impl.qk_nope_head_dim), int(impl.v_head_dim)
    per_head = (nope + v_dim) * rank
    if uk.shape != (heads, rank, nope) or uv.shape != (heads, v_dim, rank):
        raise NotImplementedError(f"MLA packed W_UK {tuple(uk.shape)} / W_UV {tuple(uv.shape)}: unexpected shapes")

    def pack(weight: Any, n_heads: int) -> tuple[Any, Any]:
        """``impl``'s own ``process_weights_after_loading`` on a scratch copy holding ``weight``."""
        scratch = copy.copy(impl)  # its own attribute dict: the live impl keeps its packed tensors
        scratch.kv_b_proj = torch.nn.Module()
        scratch.kv_b_proj.register_parameter("weight", torch.nn.Parameter(weight, requires_grad=False))
        scratch.kv_b_proj.quant_method = None  # plain weights (get_and_maybe_dequant_weights returns them as is)
        scratch.num_heads = n_heads
        type(impl).process_weights_after_loading(scratch, weight.dtype)
        if scratch._w_scale is not None:
            raise NotImplementedError("MLA packing of a plain weight gave a quantization scale")
        return scratch._w_uk_packed, scratch._w_uv_packed

    key = (type(impl), heads, rank, nope, v_dim, uk.dtype)
    if key not in _LATENT_GATHER:
        probe = min(heads, 2)
        source_of = discover_permutation(
            lambda src: torch.cat([t.reshape(probe, -1) for t in pack(src, probe)], dim=1),
            (probe * (nope + v_dim), rank),
            uk.dtype,
        )
        _LATENT_GATHER[key] = _block_gather(source_of, per_head, "MLA W_UK/W_UV", "head")
    gather = _LATENT_GATHER[key]
    with torch.no_grad():
        packed = torch.cat([uk.reshape(heads, -1), uv.reshape(heads, -1)], dim=1)  # per head, as probed
        recovered = packed[:, gather].reshape(heads * (nope + v_dim), rank).contiguous()
        again = pack(recovered.clone(), heads)
        if not (torch.equal(again[0], uk) and torch.equal(again[1], uv)):
            raise NotImplementedError("MLA kv_b_proj recovered from W_UK/W_UV does not pack back to them")
    _LATENT[impl] = (uk.data_ptr(), recovered)
    return recovered


def _block_gather(source_of: Any, per_block: int, what: str, block: str) -> Any:
    """The gather index that unpacks one ``block`` (an expert, a head) of a packing learnt on the first blocks.

    ``source_of`` is ``discover_permutation``'s answer with one row per probed block; every later row must be
    the first shifted by one block's elements (the packing repeats block by block), and the first must hold
    each of its block's elements once, else ``NotImplementedError`` (the weight stays unverified).
    """
    import torch

    first = source_of[0]
    for i, row in enumerate(source_of[1:], start=1):
        if not torch.equal(row, torch.where(first >= 0, first + i * per_block, first)):
            raise NotImplementedError(f"{what}: the packing does not repeat {block} by {block}")
    if int((first >= 0).sum()) != per_block:
        raise NotImplementedError(f"{what}: the packing does not hold each {block}'s weight once")
    return inverse_gather_index(first, per_block)
