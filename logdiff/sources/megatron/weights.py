"""Megatron <-> HF weights: the name and layout mapping, gathering a rank's shards, fingerprints.

The mapping (Megatron-Bridge's ``QKVMapping``/``GatedMLPMapping``, verl's weight converter):

* ``linear_qkv.weight`` ``[groups * (q_per_group + 2) * head_dim, hidden]`` is, per query group,
  ``[q heads of the group; k; v]``: from HF's ``q_proj``/``k_proj``/``v_proj`` group by group;
* ``linear_fc1.weight`` is ``[gate; up]`` (``gate_proj``, ``up_proj``);
* ``linear_proj`` = ``o_proj``, ``linear_fc2`` = ``down_proj``, ``input_layernorm`` = ``input_layernorm``,
  ``pre_mlp_layernorm`` = ``post_attention_layernorm``, ``q_layernorm``/``k_layernorm`` =
  ``q_norm``/``k_norm``, ``embedding.word_embeddings`` = ``model.embed_tokens``,
  ``decoder.final_layernorm`` = ``model.norm``, ``output_layer`` = ``lm_head``;
* MoE: ``mlp.router.weight`` = ``mlp.gate.weight``; expert ``e``'s ``linear_fc1``/``linear_fc2``
  (``mlp.experts.local_experts.{i}``, global ``e = ep_rank * local_count + i``) are row ``e`` of HF's
  fused ``mlp.experts.gate_up_proj`` / ``down_proj``.

A rank holds a slice of each tensor-parallel weight: ``partition_dim`` says along which dimension,
``partition_stride`` how many interleaved pieces each rank's slice is (``linear_fc1``: 2, each rank
``[gate_i; up_i]``). ``gather`` rebuilds the logical tensor from the group's slices (an all-gather,
a collective every rank of the group joins); ``shard_of`` is its inverse (how a loader slices a
logical tensor for a rank). Expert weights (``allreduce`` False) are whole per expert; each rank
holds its own experts, and ``logical_state`` gathers them over the expert-parallel group.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from logdiff.sources.megatron.names import Geometry
from logdiff.sources.megatron.te import TE_LAYER_PARAMS, grouped_expert_name

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

#: per-layer Megatron parameter -> HF parameter (the layer prefix aside), where one maps to one
LAYER_PARAMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
TOP_PARAMS = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def shard_of(tensor: Any, dim: int, stride: int, rank: int, size: int) -> Any:
    """Rank ``rank``'s slice (of ``size``) of a logical tensor split along ``dim`` in ``stride`` interleaved
    pieces: each of the ``stride`` equal blocks is cut in ``size`` and the rank's cuts are stacked."""
    import torch

    blocks = tensor.chunk(stride, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def unstride(pieces: list[Any], dim: int, stride: int) -> Any:
    """The logical tensor from the ranks' slices in rank order (``shard_of``'s inverse)."""
    import torch

    cut = [p.chunk(stride, dim=dim) for p in pieces]
    return torch.cat([torch.cat([c[j] for c in cut], dim=dim) for j in range(stride)], dim=dim)


def gather(param: Any, group: Any) -> Any:
    """A tensor-parallel parameter's logical tensor (an all-gather over ``group``); others as they are."""
    import torch
    import torch.distributed as dist

    if not getattr(param, "tensor_model_parallel", False) or group is None or dist.get_world_size(group) == 1:
        return param.detach()
    pieces = [torch.empty_like(param) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, param.detach().contiguous(), group=group)
    return unstride(pieces, int(param.partition_dim), int(getattr(param, "partition_stride", 1)))


def hf_to_megatron(hf: dict[str, Any], geo: Geometry, num_layers: int) -> dict[str, Any]:
    """Logical Megatron tensors (experts under their global index) from an HF state dict."""
    import torch

    out = {m: hf[h] for m, h in TOP_PARAMS.items() if h in hf}
    for n in range(num_layers):
        p, d = f"model.layers.{n}.", f"decoder.layers.{n}."
        for m, h in LAYER_PARAMS.items():
            if p + h in hf:
                out[d + m] = hf[p + h]
        q, k, v = (hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv")
        hidden = q.shape[-1]
        parts = (q.reshape(geo.groups, -1, hidden), k.reshape(geo.groups, -1, hidden), v.reshape(geo.groups, -1, hidden))
        out[d + "self_attention.linear_qkv.weight"] = torch.cat(parts, dim=1).reshape(-1, hidden)
        if p + "mlp.gate_proj.weight" in hf:
            out[d + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        gate_up = hf.get(p + "mlp.experts.gate_up_proj")
        if gate_up is not None:  # transformers 5's fused experts: [E, 2I, H] and [E, H, I]
            for e in range(gate_up.shape[0]):
                x = f"{d}mlp.experts.local_experts.{e}."
                out[x + "linear_fc1.weight"] = gate_up[e]
                out[x + "linear_fc2.weight"] = hf[p + "mlp.experts.down_proj"][e]
    return out


def megatron_to_hf(meg: dict[str, Any], geo: Geometry) -> dict[str, Any]:
    """HF-named tensors from logical Megatron tensors (``hf_to_megatron``'s inverse)."""
    import torch

    out: dict[str, Any] = {}
    experts: dict[str, dict[int, dict[str, Any]]] = {}
    for name, t in meg.items():
        if name in TOP_PARAMS:
            out[TOP_PARAMS[name]] = t
            continue
        m = _LAYER.match(name)
        if m is None:
            continue
        p, rest = f"model.layers.{m.group(1)}.", grouped_expert_name(m.group(2))
        if rest in LAYER_PARAMS:
            out[p + LAYER_PARAMS[rest]] = t
        elif rest in TE_LAYER_PARAMS:  # the TE spec's norms, fused into the next linear (coded, not run)
            out[p + TE_LAYER_PARAMS[rest]] = t
        elif rest == "self_attention.linear_qkv.weight":
            grouped = t.reshape(geo.groups, -1, t.shape[-1])
            qw = geo.q_per_group * geo.head_dim
            out[p + "self_attn.q_proj.weight"] = grouped[:, :qw].reshape(-1, t.shape[-1])
            out[p + "self_attn.k_proj.weight"] = grouped[:, qw : qw + geo.head_dim].reshape(-1, t.shape[-1])
            out[p + "self_attn.v_proj.weight"] = grouped[:, qw + geo.head_dim :].reshape(-1, t.shape[-1])
        elif rest == "mlp.linear_fc1.weight":
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = t.chunk(2)
        elif (e := _EXPERT.match(rest)) is not None:
            experts.setdefault(p, {}).setdefault(int(e.group(1)), {})[e.group(2)] = t
    for p, by_index in experts.items():
        order = sorted(by_index)
        out[p + "mlp.experts.gate_up_proj"] = torch.stack([by_index[e]["linear_fc1"] for e in order])
        out[p + "mlp.experts.down_proj"] = torch.stack([by_index[e]["linear_fc2"] for e in order])
    return out


def expert_offset(ep_rank: int, local_count: int) -> int:
    """The global index of a rank's first local expert."""
    return ep_rank * local_count


def logical_state(model: Any, tp_group: Any = None, ep_group: Any = None,
                  global_layer: Callable[[int], int] | None = None, expert_tp_group: Any = None) -> dict[str, Any]:
    """Every parameter of a rank's ``GPTModel`` as a logical Megatron tensor under a global name: tensor-parallel
    slices gathered over ``tp_group``, local experts renamed to their global index and gathered over
    ``ep_group`` (their tensor-parallel slices over ``expert_tp_group``: Megatron's expert-tensor-parallel
    group, not run with more than one rank), layers renamed to their global number (``global_layer``: local
    index -> global, for a pipeline stage). A collective every rank of both groups joins, one parameter at a time."""
    import torch
    import torch.distributed as dist

    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    params = list(model.named_parameters())
    counts: dict[str, int] = {}  # local experts per MoE block (by its local name)
    params = [(_grouped(name), param) for name, param in params]
    for name, _ in params:
        if ".local_experts." in name and name.endswith("linear_fc1.weight"):
            block = name.split(".local_experts.")[0]
            counts[block] = counts.get(block, 0) + 1
    out: dict[str, Any] = {}
    for name, param in params:
        expert = getattr(param, "allreduce", True) is False
        t = gather(param, expert_tp_group if expert else tp_group)
        block = name.split(".local_experts.")[0]
        m = _LAYER.match(name)
        if m is not None and global_layer is not None:
            name = f"decoder.layers.{global_layer(int(m.group(1)))}.{m.group(2)}"
            m = _LAYER.match(name)
        e = _EXPERT.match(m.group(2)) if m is not None else None
        if e is None:
            out[name] = t
            continue
        pieces = [t]
        if ep > 1:
            pieces = [torch.empty_like(t) for _ in range(ep)]
            dist.all_gather(pieces, t.contiguous(), group=ep_group)
        prefix = name.split(".local_experts.")[0]
        for r, piece in enumerate(pieces):
            index = expert_offset(r, counts[block]) + int(e.group(1))
            out[f"{prefix}.local_experts.{index}.{e.group(2)}.weight"] = piece
    return out


def _grouped(name: str) -> str:
    """A TE grouped-GEMM expert parameter under the local spec's per-expert name (``te.grouped_expert_name``)."""
    m = _LAYER.match(name)
    return f"decoder.layers.{m.group(1)}.{grouped_expert_name(m.group(2))}" if m else name


def hf_fingerprints(logical_hf: dict[str, Any], ats: tuple[str | None, ...]) -> dict[str | None, dict[str, str]]:
    """The fingerprints of HF-named logical tensors at each of ``ats`` (None: their own dtype), as the HF capture
    hashes them (``logdiff.sources.hf.contract.hf_fingerprint_sets``), so the two bundles verify each other."""
    import torch

    from logdiff.probes.contracts import fingerprint

    out: dict[str | None, dict[str, str]] = {at: {} for at in ats}
    for name, t in sorted(logical_hf.items()):
        for at in ats:
            to = getattr(torch, at) if at else None
            wide = to is not None and t.is_floating_point() and t.element_size() > to.itemsize
            out[at][name] = fingerprint(t.detach().to(to) if wide else t.detach().contiguous())
    return out
