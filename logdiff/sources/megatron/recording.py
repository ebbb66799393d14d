"""``capture``: record a megatron-core ``GPTModel``'s boundaries on this rank into a logdiff bundle.

Every forward of the model inside the block is a step. Hooks on Megatron's own modules (``names.py``)
record each boundary as this rank's local rows under logdiff's HF-style names, so the bundle reads like
one from ``logdiff.capture`` on the HF model, and ``logdiff compare`` takes either against the other:

* Megatron's activations are ``[s, b, ...]``; each record is turned into rows ``b * S + s`` (the step's row
  table is the batch's ``input_ids`` row by row, each batch row one capture sequence, position from
  ``position_ids``). Under sequence parallel the records between the row-parallel layers hold ``S / tp``
  positions per rank: they are written as ``shard(-2)`` (``placements.py``) with the index of the whole;
* each tensor is copied at hook time: eval-mode ``bias_dropout_add`` adds the residual into
  ``linear_proj``'s and ``linear_fc2``'s outputs in place after their hooks ran;
* RoPE is read where Megatron's ``apply_rotary_pos_emb`` has been applied: the query and key
  ``core_attention`` receives (``rope_q``, ``rope_k``); the MoE router's logits by wrapping the router
  instance's ``gating`` for the block's duration (restored on exit); nothing of Megatron is patched;
* layers are named by their global number (``TransformerLayer.layer_number``), so a pipeline stage's
  records carry the whole model's names; a stage records only what it runs.

The rank's metadata holds the HF config the model was converted from (``hf_config``: a dict, a
``PretrainedConfig`` or a path to ``config.json``; the architecture it names picks the adapter), the
contract (``contract.py``) and the fingerprints of the logical weights under HF names (``weights.py``:
gathered over the tensor- and expert-parallel groups on entry, a collective every rank joins).

Not covered: padded or packed batches (every row of ``input_ids`` is one whole sequence), context
parallel, a model under ``torch.compile`` or CUDA graphs (hooks do not fire), sketching of
sequence-split records (they are kept whole).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from logdiff.errors import InputError
from logdiff.sources.megatron.names import (
    LAYER_INPUTS,
    LAYER_OUTPUTS,
    Geometry,
    layer_prefix,
    split_fc1,
    split_qkv,
)
from logdiff.sources.megatron.te import TE_LAYER_INPUTS, fused_norm

NARROWER = ("bfloat16", "float16")


def _hf_config(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, (str, Path)):
        path = Path(hf_config)
        path = path / "config.json" if path.is_dir() else path
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"logdiff.sources.megatron.capture: cannot read the HF config {path}: {e}") from None
    if hasattr(hf_config, "to_dict"):
        return dict(hf_config.to_dict())
    if isinstance(hf_config, dict):
        return dict(hf_config)
    raise InputError(f"logdiff.sources.megatron.capture: hf_config is a {type(hf_config).__name__} "
                     "(a dict, a PretrainedConfig or a path to config.json)")


def _check_shapes(cfg: Any, hf: dict[str, Any]) -> None:
    """The Megatron model must be the HF config's model: hidden size, layers, heads."""
    pairs = {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
             "num_attention_heads": cfg.num_attention_heads,
             "num_key_value_heads": cfg.num_query_groups or cfg.num_attention_heads}
    for key, value in pairs.items():
        if key in hf and int(hf[key]) != int(value):
            raise InputError(f"logdiff.sources.megatron.capture: the Megatron model has {key} = {value}, "
                             f"the HF config {hf[key]}")


class MegatronCapture:
    """``with MegatronCapture(model, out_dir, hf_config): model(ids, pos, mask)`` records every forward."""

    def __init__(self, model: Any, out_dir: str | Path, hf_config: Any, role: str = "train", layout: Any = None,
                 fingerprints: bool = True, window: int | str | None = 2):
        from logdiff.records.bundle_writer import BundleWriter
        from logdiff.records.sketch import Window
        from logdiff.sources.base import package_version
        from logdiff.sources.megatron.placements import layout_of_megatron
        from logdiff.version import __version__

        try:
            self.window = Window.parse(window)
        except ValueError as e:
            raise InputError(f"logdiff.sources.megatron.capture: {e}") from None
        self.model = model
        self.hf = _hf_config(hf_config)
        cfg = model.config
        _check_shapes(cfg, self.hf)
        self.layout = layout if layout is not None else layout_of_megatron()
        self.tp = len(self.layout.group("tp"))
        self.tp_index = self.layout.index_in("tp")
        self.sp = bool(getattr(cfg, "sequence_parallel", False)) and self.tp > 1
        self.geo = Geometry.of(cfg, self.tp)
        self.vocab = int(self.hf.get("vocab_size") or 0) or None
        meta: dict[str, Any] = {"logdiff": __version__, "engine": "megatron",
                                "version": package_version("megatron-core", "megatron_core"),
                                "architecture": (self.hf.get("architectures") or ["?"])[0],
                                "model_type": self.hf.get("model_type"), "config": self.hf,
                                "megatron": {"tp": self.tp, "sequence_parallel": self.sp,
                                             "pp": len(self.layout.group("pp")), "ep": len(self.layout.group("ep"))}}
        try:
            from logdiff.sources.megatron.contract import megatron_contract

            meta["contract"] = megatron_contract(model, self.vocab or 0)
        except Exception as e:  # noqa: BLE001 - a contract the reader cannot take is noted, not fatal
            meta["contract_error"] = f"{type(e).__name__}: {e}"
        if fingerprints:
            meta.update(self._fingerprints())
        self.writer = BundleWriter(out_dir, role, self.layout, meta, background=True)
        self._handles: list[Any] = []
        self._wrapped: list[Any] = []
        self._step: tuple[int, int] | None = None  # (batch, length) of the running forward
        self._sequences = 0

    # ---- metadata -------------------------------------------------------------------------------

    def _fingerprints(self) -> dict[str, Any]:
        from logdiff.sources.megatron.placements import (
            ep_group,
            expert_tp_group,
            tp_group,
        )
        from logdiff.sources.megatron.weights import (
            hf_fingerprints,
            logical_state,
            megatron_to_hf,
        )

        layers = [m for m in self.model.modules() if type(m).__name__ == "TransformerLayer"]
        offset = {i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}
        state = logical_state(self.model, tp_group() if self.tp > 1 else None,
                              ep_group() if len(self.layout.group("ep")) > 1 else None, offset.get,
                              expert_tp_group() if self.tp > 1 else None)
        hf = megatron_to_hf(state, Geometry.of(self.model.config, 1))
        wide = next(self.model.parameters()).element_size() > 2
        sets = hf_fingerprints(hf, (None, *(NARROWER if wide else ())))
        out: dict[str, Any] = {"fingerprints": sets[None]}
        if self.tp > 1:
            out["shards"] = self._shards(hf, offset)
        if wide:
            out["fingerprints_at"] = {at: sets[at] for at in NARROWER}
        if len(self.layout.group("pp")) > 1:
            out["fingerprints_scope"] = "this pipeline stage's weights only"
        return out

    def _shards(self, whole: dict[str, Any], offset: dict[int, int]) -> dict[str, Any]:
        """This rank's piece of each tensor-parallel HF-named weight (not the experts'): which of the ``tp`` equal
        pieces along which dim it is, and its fingerprint, so that a comparison can name the rank whose piece
        differs (``logdiff/comparison/bundle_shards.py``). A piece that is not one such slice of the whole is left out."""
        from dataclasses import replace

        from logdiff.sources.megatron.weights import hf_fingerprints, logical_state, megatron_to_hf

        local = logical_state(self.model, None, None, offset.get)
        geo = replace(self.geo, heads=self.geo.heads // self.tp, groups=self.geo.groups // self.tp)  # this rank's
        local = megatron_to_hf({k: v for k, v in local.items() if ".local_experts." not in k}, geo)
        hashes = hf_fingerprints(local, (None,))[None]
        out: dict[str, Any] = {}
        for name, piece in local.items():
            full = whole.get(name)
            dims = [d for d in range(piece.dim()) if full is not None and piece.shape[d] != full.shape[d]]
            if len(dims) == 1 and full.shape[dims[0]] == piece.shape[dims[0]] * self.tp:
                out[name] = {"dim": dims[0], "index": self.tp_index, "of": self.tp, "fingerprint": hashes[name]}
        return out

    # ---- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> MegatronCapture:  # noqa: PYI034 - Python 3.10 has no typing.Self
        model = self.model
        self._handles.append(model.register_forward_pre_hook(self._begin_step, with_kwargs=True))
        modules = dict(model.named_modules())
        if "embedding" in modules:
            self._out(modules["embedding"], "model.embed_tokens")
        if "decoder.final_layernorm" in modules and modules["decoder.final_layernorm"] is not None:
            self._out(modules["decoder.final_layernorm"], "model.norm")
        if "output_layer" in modules:
            self._out(modules["output_layer"], "logits")
        for layer in (m for m in model.modules() if type(m).__name__ == "TransformerLayer"):
            self._hook_layer(layer)
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        for owner, attr in self._wrapped:
            delattr(owner, attr)  # the instance attribute goes: the class's method is back
        self._handles, self._wrapped = [], []
        self.writer.close()

    def _hook_layer(self, layer: Any) -> None:
        p = layer_prefix(layer)
        mods = dict(layer.named_modules())
        for sub, suffix in LAYER_OUTPUTS.items():
            if type(mods.get(sub)).__name__ not in ("NoneType", "IdentityOp"):
                self._out(mods[sub], f"{p}.{suffix}")
        inputs = dict(LAYER_INPUTS)
        if fused_norm(mods):  # the TE spec: the norms run inside linear_qkv / linear_fc1 (te.py: coded, not run)
            inputs.update(TE_LAYER_INPUTS)
        for sub, suffix in inputs.items():
            if type(mods.get(sub)).__name__ not in ("NoneType", "IdentityOp"):
                self._handles.append(mods[sub].register_forward_pre_hook(
                    lambda m, args, _n=f"{p}.{suffix}": self._emit(_n, args[0])))
        attn = mods.get("self_attention.core_attention")
        if attn is not None:
            self._handles.append(attn.register_forward_pre_hook(lambda m, args, _p=p: self._rope(_p, args)))
        qkv = mods.get("self_attention.linear_qkv")
        if qkv is not None:
            self._handles.append(qkv.register_forward_hook(lambda m, a, out, _p=p: self._qkv(_p, out)))
        fc1 = mods.get("mlp.linear_fc1")
        if fc1 is not None:
            self._handles.append(fc1.register_forward_hook(lambda m, a, out, _p=p: self._fc1(_p, out)))
        router = mods.get("mlp.router")
        if router is not None:
            self._wrap_gating(router, f"{p}.mlp.gate")
        if type(mods.get("mlp")).__name__ == "MoELayer":
            self._out(mods["mlp"], f"{p}.mlp")
        self._out(layer, f"{p}.residual_mlp")

    def _out(self, module: Any, name: str) -> None:
        self._handles.append(module.register_forward_hook(lambda m, a, out: self._emit(name, out)))

    def _wrap_gating(self, router: Any, name: str) -> None:
        gating = router.gating

        def recorded(inp: Any) -> Any:
            logits = gating(inp)
            self._emit(name, logits)
            return logits

        router.gating = recorded
        self._wrapped.append((router, "gating"))

    def _rope(self, prefix: str, args: tuple) -> None:
        """The query and key ``core_attention`` receives: after ``apply_rotary_pos_emb``."""
        self._emit(f"{prefix}.self_attn.rope_q", args[0])
        self._emit(f"{prefix}.self_attn.rope_k", args[1])

    def _qkv(self, prefix: str, out: Any) -> None:
        q, k, v = split_qkv(_first(out), self.geo)
        for part, t in zip("qkv", (q, k, v)):
            self._emit(f"{prefix}.self_attn.{part}_proj", t)

    def _fc1(self, prefix: str, out: Any) -> None:
        gate, up = split_fc1(_first(out))
        self._emit(f"{prefix}.mlp.gate_proj", gate)
        self._emit(f"{prefix}.mlp.up_proj", up)

    # ---- steps ------------------------------------------------------------------------------------

    def _begin_step(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise RuntimeError("logdiff.sources.megatron.capture: a forward without input_ids (every pipeline "
                               "stage must be given the step's tokens)")
        ids = ids.detach().cpu()
        batch, length = ids.shape
        pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        pos = torch.arange(length)[None].expand(batch, -1) if pos is None else pos.detach().cpu().expand(batch, -1)
        seq = (self._sequences + torch.arange(batch))[:, None].expand(-1, length)
        self._sequences += batch
        self.writer.begin_step(ids.reshape(-1), pos.reshape(-1), seq.reshape(-1), torch.ones(batch * length, dtype=torch.bool))
        self._step = (batch, length)

    def _emit(self, name: str, tensor: Any) -> None:
        """Record ``tensor`` (``[s, b, ...]``, this rank's) as rows ``b * S + s`` (the writer copies or sketches it
        now: bias_dropout_add writes in place)."""
        if self._step is None:
            return
        from logdiff.records.sketch import local_columns
        from logdiff.sources.megatron.placements import record_placement

        batch, length = self._step
        t = _first(tensor).detach()
        local = int(t.shape[0])
        rows = t.transpose(0, 1).reshape(batch * local, -1)
        split = local != length
        if split and (not self.sp or local * self.tp != length):
            raise RuntimeError(f"logdiff.sources.megatron.capture: {name} holds {local} of {length} positions")
        starts = [r * local for r in range(self.tp)] if split else [0]
        index = np.concatenate([(b * length + np.arange(s, s + local)) for s in starts for b in range(batch)])
        placement = record_placement(name, self.tp, split, int(rows.shape[-1]), self.vocab)
        layer = _layer_of(name)
        sketch = None
        if not split and not self.window.full(layer):
            sketch = local_columns(placement, self.tp_index, self.tp, int(rows.shape[-1]))
        self.writer.record(name, rows, placement, rows=index, sketch_columns=sketch)


def _first(out: Any) -> Any:
    """A module's tensor output (Megatron's linears return ``(output, bias)``, layers ``(hidden, context)``)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _layer_of(name: str) -> int | None:
    if name.startswith("model.layers."):
        return int(name.split(".")[2])
    return None


def capture(model: Any, out_dir: str | Path, hf_config: Any, role: str = "train", layout: Any = None,
            fingerprints: bool = True, window: int | str | None = 2) -> MegatronCapture:
    """A context manager recording every forward of a megatron-core ``GPTModel`` into the bundle at ``out_dir``
    (this rank's part), under the HF names of ``hf_config``'s architecture. ``window``, ``fingerprints``: as
    ``logdiff.capture``'s (the fingerprints gather the weights over the tensor- and expert-parallel groups on
    entry: every rank must enter)."""
    return MegatronCapture(model, out_dir, hf_config, role, layout, fingerprints, window)
