"""``logdiff.capture``: the HF engine's capture of the user's own model, on any rank, into a bundle.

The public face of ``logdiff.probes.capture.Capture`` (see there for what is
recorded and how each record's placement is read). What the HF engine adds: the
parallel layout read from the model itself, and the model's effective contract
(``contract.py``, as a scan reads it) in the bundle's metadata::

    with logdiff.capture(model, "bundles/train", role="train"):
        logits = model(input_ids).logits

It works on an HF model as it is, wrapped with FSDP2 (``fully_shard``: each rank
is data parallel, its records whole) or with DTensor tensor parallel
(``parallelize_module``: the ranks of the mesh are one ``tp`` group, each
recording its shards). The offline comparison of two bundles (``logdiff
compare``) and the vLLM worker plugin are not built yet (docs/capture.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def capture(model: Any, out_dir: str | Path, role: str = "train", layout: Any = None) -> Any:
    """A context manager recording every forward of ``model`` into the bundle at ``out_dir`` (this rank's part)."""
    from logdiff import __version__
    from logdiff.probes.capture import Capture

    layout = layout if layout is not None else layout_of_model(model)
    meta: dict[str, Any] = {"logdiff": __version__, "architecture": (getattr(model.config, "architectures", None) or [type(model).__name__])[0],
                            "model_type": getattr(model.config, "model_type", None),
                            "config": json.loads(model.config.to_json_string())}
    try:
        from logdiff.engines.hf.contract import hf_contract

        meta["contract"] = hf_contract(model, {})
    except Exception as e:  # noqa: BLE001 - a contract the reader cannot take from a wrapped model is noted, not fatal
        meta["contract_error"] = f"{type(e).__name__}: {e}"
    return Capture(model, out_dir, role, layout, meta)


def layout_of_model(model: Any) -> Any:
    """This rank's ``ParallelLayout``: FSDP2 is data parallel (each rank its own ``tp`` group of one); a model with
    DTensor parameters on a 1-D mesh is tensor parallel over it; anything else is one rank, or data parallel."""
    import torch.distributed as dist

    from logdiff.probes.layout import ParallelLayout, layout_of_mesh

    if not (dist.is_available() and dist.is_initialized()):
        return ParallelLayout()
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
        if mesh is not None:
            if mesh.ndim != 1:
                raise NotImplementedError(f"logdiff.capture: a {mesh.ndim}-D device mesh (only 1-D is read yet)")
            return layout_of_mesh(mesh)
    return ParallelLayout(rank, world, {"tp": (rank,), "dp": tuple(range(world))})
