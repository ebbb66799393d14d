"""Tensor parallel for an HF decoder: the colwise/rowwise plan, and consistent mode across its ranks.

``tp_plan(model, world)`` derives the Megatron-style plan from the model itself,
through its architecture adapter (``probes/arch``), for DTensor's
``parallelize_module``: in every decoder layer the attention's ``q/k/v_proj``
are column parallel and ``o_proj`` row parallel; the dense MLP's
``gate/up_proj`` column parallel and ``down_proj`` row parallel. Embeddings, norms
and ``lm_head`` stay whole. What the plan cannot shard is refused in one line
(``InputError``): MoE experts, latent attention (MLA), packed projections
(Phi-3's ``qkv_proj``/``gate_up_proj``), attention holding parameters of its own
(gpt-oss's sinks), and a world size that does not divide the heads, the KV
heads or the MLP width.

``consistent_tp(model, plan, mesh)`` is what consistent mode adds under tensor
parallel, inside ``consistent_hf`` (which routes every ``nn.Linear`` through
``kernels.linear`` and knows nothing of DTensor):

* column parallel: ``kernels.linear`` on this rank's rows of the weight. Its
  output columns come from fixed ``N_TILE``-column GEMMs that never mix columns
  (``kernels/matmul.py``), so they are the unsharded product's columns, bitwise;
* row parallel: ``kernels.collective.row_parallel_linear``, the reduction over K
  cut into fixed ``ROW_CHUNK``-wide chunks summed in one pairwise order whatever
  the world size. With one rank (``mesh`` None, or an unsharded model) the same
  modules run ``chunked_linear``, the same bits. A stock ``kernels.linear``
  reduces K in one GEMM, in the BLAS's own order, so an unsharded model
  compared bitwise with a TP run needs ``consistent_tp`` too:
  ``consistent_tp(model, fixed_order_plan(model, 1))`` inside its consistent mode.

The DTensor hooks ``parallelize_module`` registers stay in place: the
replacement forwards take the DTensor input they prepare and return a DTensor in
the placement their output hook expects.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from logdiff.errors import InputError

#: K-chunk of the fixed-order row-parallel reduction: a fixed width whatever the world size (each rank's K-slice
#: must be whole chunks: 128 divides the attention and MLP widths of every Qwen, Llama and Mistral config we know)
ROW_CHUNK = 128
COLWISE, ROWWISE = "colwise", "rowwise"
_ATTENTION = {"q_proj": COLWISE, "k_proj": COLWISE, "v_proj": COLWISE, "o_proj": ROWWISE}
_MLP = {0: COLWISE, 1: COLWISE, 2: ROWWISE}  # the adapter's mlp_parts (gate, up, down, act) by position


def tp_plan(model: Any, world: int) -> dict[str, str]:
    """``{module name: "colwise" | "rowwise"}`` for ``world`` ranks; InputError for what it cannot shard."""
    import torch.nn as nn

    from logdiff.probes.arch import adapter_of

    arch = adapter_of(model)
    config = model.config
    where = f"tensor_parallel_size={world}"
    if arch.moe:
        raise InputError(f"{where}: {arch.name} is a mixture of experts (the plan shards dense layers only)")
    if len(arch.mlp_parts) != 4:
        raise InputError(f"{where}: {arch.name} packs its MLP's gate and up projections (not in the plan)")
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None) or config.num_attention_heads
        if heads % world:
            raise InputError(f"{where} does not divide {key}={heads}")
    names = {id(m): n for n, m in model.named_modules()}
    plan: dict[str, str] = {}
    for layer in arch.layers(model):
        attention = arch.attention(layer)
        prefix = names[id(attention)]
        if arch.latent_attention(attention):
            raise InputError(f"{where}: {prefix} is latent attention (MLA; not in the plan)")
        own = [n for n, _ in attention.named_parameters(recurse=False)]
        if own:
            raise InputError(f"{where}: {prefix} holds parameters of its own ({', '.join(own)}; not in the plan)")
        mlp = getattr(layer, "mlp", None)
        parts = {p: _MLP[i] for i, p in enumerate(arch.mlp_parts[:3])}
        for owner, roles in ((attention, _ATTENTION), (mlp, parts)):
            for attr, role in roles.items():
                module = getattr(owner, attr, None)
                if not isinstance(module, nn.Linear):
                    raise InputError(f"{where}: {names.get(id(owner), prefix)} has no linear {attr} (not in the plan)")
                width = module.out_features if role == COLWISE else module.in_features
                if width % world:
                    raise InputError(f"{where} does not divide the width {width} of {names[id(module)]}")
                plan[names[id(module)]] = role
    return plan


def parallelize(model: Any, plan: dict[str, str], mesh: Any) -> None:
    """``parallelize_module`` with DTensor's own styles for ``plan``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel}
    parallelize_module(model, mesh, {name: styles[role]() for name, role in plan.items()})


def check_row_chunks(model: Any, plan: dict[str, str], world: int) -> None:
    """InputError unless each rank's K-slice of every row-parallel linear is whole ``ROW_CHUNK``s."""
    modules = dict(model.named_modules())
    for name, role in plan.items():
        k = modules[name].in_features
        if role == ROWWISE and (k // world) % ROW_CHUNK:
            raise InputError(f"tensor_parallel_size={world} with --consistent: {name}'s K-slice {k // world} is not "
                             f"a whole number of {ROW_CHUNK}-wide chunks (the fixed-order reduction's)")  # fmt: skip


def fixed_order_plan(model: Any, tp: int) -> dict[str, str]:
    """The plan whose row-parallel linears ``consistent_tp`` runs in the fixed order. At TP = 1 (an unsharded
    model), the plan TP = N would run, where the model has one with whole chunks (else none: plain consistent mode)."""
    if tp > 1:
        return tp_plan(model, tp)
    try:
        plan = tp_plan(model, 1)
        check_row_chunks(model, plan, 1)
    except InputError:
        return {}
    return plan


@contextlib.contextmanager
def consistent_tp(model: Any, plan: dict[str, str], mesh: Any = None) -> Iterator[None]:
    """Inside ``consistent_hf``: the plan's linears through the fixed-order kernels (module docstring)."""
    from logdiff.probes.patching import Patches

    modules = dict(model.named_modules())
    with Patches() as patches:
        for name, role in plan.items():
            module = modules[name]
            if role == ROWWISE:
                patches.set(module, "forward", _row_forward(module, mesh))
            elif mesh is not None:
                patches.set(module, "forward", _column_forward(module, mesh))
        yield


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _column_forward(module: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    from logdiff import kernels

    def forward(x: Any) -> Any:
        bias = None if module.bias is None else _local(module.bias)
        out = kernels.linear(_local(x), _local(module.weight), bias)
        return DTensor.from_local(out, mesh, (Shard(-1),), run_check=False)

    return forward


def _row_forward(module: Any, mesh: Any) -> Any:
    from logdiff.kernels.collective import chunked_linear, row_parallel_linear

    if mesh is None:
        return lambda x: chunked_linear(x, module.weight, module.bias, chunk=ROW_CHUNK)
    from torch.distributed.tensor import DTensor, Replicate

    group = mesh.get_group()

    def forward(x: Any) -> Any:
        bias = None if module.bias is None else _local(module.bias)
        out = row_parallel_linear(_local(x), _local(module.weight), bias, chunk=ROW_CHUNK, group=group)
        return DTensor.from_local(out, mesh, (Replicate(),), run_check=False)

    return forward
