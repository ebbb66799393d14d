"""``logdiff.capture``: the HF engine's capture of the user's own model, on any rank, into a bundle.

The public face of ``logdiff.probes.capture.Capture`` (see there for what is
recorded and how each record's placement is read). What the HF engine adds: the
parallel layout read from the model itself, and the model's effective contract
(``contract.py``, as a scan reads it) and the fingerprints of the logical weights a scan compares
(a sharded model's gathered one at a time on entry), in the bundle's metadata; a model whose weights are
wider than bfloat16 (TRL's float32 trainer) also keeps them rounded to bfloat16 and float16
(``fingerprints_at``), so that ``logdiff compare`` can compare them with a bf16 engine's, as a scan does::

    with logdiff.capture(model, "bundles/train", role="train"):
        logits = model(input_ids).logits

It works on an HF model as it is, wrapped with FSDP2 (``fully_shard``: each rank
is data parallel, its records whole) or with DTensor tensor parallel
(``parallelize_module``: the ranks of the mesh are one ``tp`` group, each
recording its shards). ``logdiff compare`` compares two bundles offline
(``logdiff.commands.compare``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from logdiff.errors import InputError
from logdiff.phases import timed
from logdiff.sources.hf.taps import TAPS

#: the dtypes an engine may run a wider (float32) trainer's weights in: the capture hashes them rounded to each
NARROWER = ("bfloat16", "float16")


class ModelView:
    """The HF engine as the recorder asks it, for the user's own model: its module, the HF probes and taps, and a
    log_softmax (float32 ``log_softmax`` unless the trainer gives its own: a temperature, a consistent kernel)."""

    tap_mapping = TAPS
    listener: Any = None

    def __init__(self, model: Any, log_softmax: Callable[[Any], Any] | None = None):
        self._model = model
        self._log_softmax = log_softmax

    def module(self) -> Any:
        return self._model

    def probes(self) -> Any:
        from logdiff.sources.hf.probes import HFProbes

        return HFProbes(self)

    def _logprobs(self, logits: Any) -> Any:
        if self._log_softmax is not None:
            return self._log_softmax(logits)
        import torch

        return torch.log_softmax(logits.float(), dim=-1)


def capture(model: Any, out_dir: str | Path, role: str = "train", layout: Any = None, fingerprints: bool = True,
            log_softmax: Any = None, window: int | str | None = 2, wait: bool = True) -> Any:
    """A context manager recording every forward of ``model`` into the bundle at ``out_dir`` (this rank's part).

    ``window``: the records kept whole: those of the first ``window`` decoder layers and of no layer
    (embeddings, final norm, logits, log-softmax); every other record keeps one sketch per row (a digest and
    two magnitudes: ``logdiff/records/sketch.py``), so the bundle stays small on a real model. ``"all"`` keeps every
    record whole. ``fingerprints``: hash the logical weights into the bundle (a sharded model's are gathered
    one at a time, a collective every rank joins here; weights wider than bfloat16 are hashed rounded to
    bfloat16 and float16 too, ``fingerprints_at``); False skips it, and the comparison then names the
    weights unverified. ``log_softmax``: the trainer's own (a temperature, a consistent kernel) for
    ``Capture.logprobs``. ``wait``: leaving the block waits for the bundle to be written (records are sketched and
    written by a thread of the writer's, off the forward); False returns at once (``Capture.wait()`` later, or the
    process's exit, waits), so a training step is not held up by its capture's files.
    """
    from logdiff.probes.capture import Capture
    from logdiff.records.sketch import Window
    from logdiff.sources.base import package_version
    from logdiff.version import __version__

    try:
        kept = Window.parse(window)
    except ValueError as e:
        raise InputError(f"logdiff.capture: {e}") from None

    layout = layout if layout is not None else layout_of_model(model)
    config = model.config
    meta: dict[str, Any] = {"logdiff": __version__, "engine": "hf", "version": package_version("transformers"),
                            "architecture": (getattr(config, "architectures", None) or [type(model).__name__])[0],
                            "model_type": getattr(config, "model_type", None),
                            "config": json.loads(config.to_json_string())}
    try:
        from logdiff.sources.hf.contract import hf_contract

        with timed("contract (trainer)"):
            meta["contract"] = hf_contract(model, {})
    except Exception as e:  # noqa: BLE001 - a contract the reader cannot take from a wrapped model is noted, not fatal
        meta["contract_error"] = f"{type(e).__name__}: {e}"
    if fingerprints:
        from logdiff.sources.hf.contract import hf_fingerprint_sets

        # of the logical weights (a collective on a sharded model); a wide model's rounded too, in the same pass
        wide = next(model.parameters()).element_size() > 2
        narrow = NARROWER if wide else ()
        with timed("fingerprints (trainer)"):
            sets = hf_fingerprint_sets(model, (None, *narrow))
        meta["fingerprints"] = sets[None]
        if narrow:
            meta["fingerprints_at"] = {at: sets[at] for at in narrow}
    return Capture(model, ModelView(model, log_softmax), out_dir, role, layout, meta, kept, wait)


def layout_of_model(model: Any) -> Any:
    """This rank's ``ParallelLayout``, read from the mesh of the model's DTensor parameters.

    * FSDP2 alone (``fully_shard`` on a 1-D mesh): data parallel, each rank its own ``tp`` group of one;
    * DTensor tensor parallel alone (``parallelize_module`` on a 1-D mesh): the mesh is the ``tp`` group;
    * both (a 2-D mesh, torchtitan's ``dp_shard`` x ``tp``): the dimension named ``tp`` (else the inner one)
      is the ``tp`` group, the other the ``dp`` group;
    * no DTensor parameter: one rank, or each rank of a process group on its own data.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from logdiff.records.layout import ParallelLayout, layout_of_mesh

    if not (dist.is_available() and dist.is_initialized()):
        return ParallelLayout()
    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = [p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")]
    mesh = max(meshes, key=lambda m: m.ndim, default=None)  # under FSDP2 + TP, weights outside the plan are 1-D
    if mesh is None or (mesh.ndim == 1 and isinstance(model, FSDPModule)):
        group = tuple(dist.get_process_group_ranks(mesh.get_group(0))) if mesh is not None else tuple(range(world))
        return ParallelLayout(rank, world, {"tp": (rank,), "dp": group})
    if mesh.ndim == 1:
        return layout_of_mesh(mesh)
    if mesh.ndim != 2:
        raise NotImplementedError(f"logdiff.capture: a {mesh.ndim}-D device mesh (1-D and 2-D dp x tp are read)")
    names = list(mesh.mesh_dim_names or ())
    tp = names.index("tp") if "tp" in names else 1
    return layout_of_mesh(mesh, {"tp": tp, "dp": 1 - tp})
