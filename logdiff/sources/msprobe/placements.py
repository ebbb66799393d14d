"""Where each record of a tensor-parallel msprobe dump lives across its ``tp`` group: its ``Placement``.

An msprobe dump of a TP rank holds that rank's *local* tensors. What it says of their placement, and what
logdiff adds from the engine's known plan (the same declarations logdiff's own sharded captures use):

* **HF under DTensor TP** (``parallelize_module`` with logdiff's plan, ``sources/hf/tensor_parallel.tp_plan``):
  msprobe 26.2 saves a DTensor's local tensor (``to_local``) and writes its ``device_mesh`` and
  ``placements`` in dump.json. Its module hooks fire *inside* DTensor's input/output hooks, so a
  row-parallel layer's output is dumped as the rank's ``Partial`` summand (before the all-reduce) and its
  input as the ``Shard(-1)`` DTensor; column-parallel outputs as ``Shard(-1)``. Those stated placements are
  taken as written (``Partial(sum)`` is un-sharded as the sum of the pieces), the mesh checked against the
  ``tp`` group ``--tp`` gives.
* **HF, plain tensors** (norms, the activation, the residual stream, the embedding, the head): a plan
  module's own output is ``shard(-1)`` when column-parallel, replicated when row-parallel (the all-reduced
  value its consumers get); its input the other way round. Any other record is placed like the first of its
  inputs in the architecture adapter's correspondence, as ``probes/capture.py`` places a logdiff capture's
  (local heads stay local; a row-parallel output counts as replicated); a record with no inputs (the
  embedding) is replicated, since the plan shards none; one whose inputs were not dumped (the head, without
  the final norm) by its width: the whole width replicated, ``1/tp`` of it a shard (a plain tensor is never
  a partial sum).
* **vLLM**: its parallel layers' placement is their type (``sources/vllm/placements.vllm_placement``, used
  as it is, on a stand-in of the class the entry names, given the sizes the model's config implies:
  ``gather_output`` off where the output is a slice, ``reduce_results`` on, as vLLM's dense decoders build
  them). Untyped modules follow their inputs as above. A rank's packed ``qkv_proj`` splits by its local heads
  (``split_config``).

Every placement is checked against the record's local width and its logical width from the config
(``logical_width``): a shard holds ``1/tp`` of it, anything else all of it. A record whose placement cannot
be known (a DTensor on a multi-dimensional mesh, a shard along another dim, inputs never dumped, a width
that fits no placement, K/V heads replicated over ranks) is left out of the bundle, and said once in its
metadata (``summary``), never guessed.
"""

from __future__ import annotations

from typing import Any

from logdiff.errors import InputError
from logdiff.records.layout import REPLICATE, Placement, shard

_ROW_OUTPUT = "rowwise-output"


def _sizes(config: dict[str, Any]) -> tuple[int, int, int]:
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return heads, kv, head_dim


def logical_width(name: str, config: dict[str, Any]) -> int | None:
    """The whole (unsharded) width of boundary ``name`` of a Llama-like decoder; None for one it does not know."""
    heads, kv, head_dim = _sizes(config)
    hidden = int(config["hidden_size"])
    op = name.rsplit(".", 1)[-1]
    widths = {
        "embed_tokens": hidden, "input_layernorm": hidden, "post_attention_layernorm": hidden, "o_proj": hidden,
        "down_proj": hidden, "residual_attn": hidden, "residual_mlp": hidden, "norm": hidden,
        "q_proj": heads * head_dim, "q_norm": heads * head_dim, "rope_q": heads * head_dim,
        "attn_core": heads * head_dim, "k_proj": kv * head_dim, "v_proj": kv * head_dim, "k_norm": kv * head_dim,
        "rope_k": kv * head_dim, "gate_proj": config.get("intermediate_size"), "up_proj": config.get("intermediate_size"),
        "act_mul": config.get("intermediate_size"), "logits": config.get("vocab_size"),
    }  # fmt: skip
    width = widths.get(op)
    return int(width) if width else None


class Placer:
    """Places one rank's records (``place``), in a forward's order; remembers what it could not place."""

    def __init__(self, engine: str, config: dict[str, Any], tp: int, group: tuple[int, ...],
                 declared: Any, inputs: dict[str, tuple[str, ...]]):
        self.engine, self.config, self.tp, self.group = engine, config, tp, group
        self.declared = declared  # (boundary, module, cls, width) -> Placement | None | a reason (str)
        self.inputs = inputs
        self.seen: dict[str, Placement] = {}  # each placed boundary as its consumers see it
        self.skipped: dict[str, str] = {}
        self.classes: dict[str, str] = {}  # module path template -> its class (``learn``)

    def learn(self, steps: list[Any]) -> None:
        """Each module's class, by its path's layer template, from a rank's dump.json entries (vLLM's layer types)."""
        from logdiff.sources.msprobe.layout import ENTRY
        from logdiff.sources.msprobe.names import template

        for rank in steps:
            for entry in rank.data:
                m = ENTRY.match(entry)
                if m:
                    self.classes.setdefault(template(m.group("path"))[0], m.group("cls"))

    def split_config(self) -> dict[str, Any]:
        """The config a rank's packed ``qkv_proj`` splits by: its local heads (vLLM)."""
        heads, kv, head_dim = _sizes(self.config)
        return {**self.config, "num_attention_heads": heads // self.tp, "num_key_value_heads": max(1, kv // self.tp),
                "head_dim": head_dim}  # fmt: skip

    def place(self, name: str, width: int, module: str, desc: Any, cls: str | None = None) -> Placement | None:
        """Record ``name``'s placement (``width``: its local last dim; ``module``: the module path that gave it,
        ``desc``: its dump.json description, ``cls``: the module's class); None: not knowable, left out."""
        from logdiff.sources.msprobe.names import template

        found = self._stated(name, desc)
        if found is None:
            found = self.declared(name, module, cls or self.classes.get(template(module)[0]), width)
        if found is None:
            found = self._follow(name, width)
        if isinstance(found, str):
            self.skipped.setdefault(name, found)
            return None
        placement = REPLICATE if found == _ROW_OUTPUT else found
        whole = logical_width(name, self.config)
        fits = {"shard": width * self.tp == whole}.get(placement.kind, width == whole)
        if whole is not None and not fits:
            self.skipped.setdefault(name, f"a local width {width} that a {placement.kind} placement of the whole "
                                          f"{whole} across {self.tp} ranks does not give")  # fmt: skip
            return None
        self.seen[name] = REPLICATE if found == _ROW_OUTPUT or placement.kind == "partial" else placement
        return placement

    def _stated(self, name: str, desc: Any) -> Placement | str | None:
        """A DTensor's own placement, as msprobe wrote it (``device_mesh``, ``placements``); None for a plain tensor."""
        if not isinstance(desc, dict) or not desc.get("placements"):
            return None
        mesh, placements, shape = desc.get("device_mesh"), desc["placements"], desc.get("shape")
        shape = shape if isinstance(shape, list) else []
        if not isinstance(placements, list) or not all(isinstance(p, dict) and len(p) == 1 for p in placements):
            return f"a DTensor whose placements {placements!r} are not msprobe's"
        if not isinstance(mesh, list) or not all(isinstance(r, int) for r in mesh) or len(placements) != 1:
            return "a DTensor on a multi-dimensional mesh (only a 1-D tp mesh is read)"
        if tuple(mesh) != self.group:
            raise InputError(f"{name}: the dump's DTensor mesh {mesh} is not the tp group {list(self.group)} that "
                             f"--tp {self.tp} gives this rank")
        kind, args = next(iter(placements[0].items()))
        if kind == "Replicate":
            return REPLICATE
        if kind == "Partial" and isinstance(args, dict) and args.get("reduce_op") == "sum":
            return Placement("partial")
        if kind == "Shard" and isinstance(args, dict) and isinstance(args.get("dim"), int):
            dim = args["dim"] % len(shape) if shape else args["dim"]
            if shape and dim == len(shape) - 1:
                return shard(-1)
            return f"a DTensor sharded along dim {args['dim']} of {shape} (sequence parallel is not un-sharded yet)"
        return f"a DTensor placed as {placements[0]} (not rebuilt)"

    def _follow(self, name: str, width: int) -> Placement | str:
        """Placed like the first of its inputs already placed; replicated where it has none (the embedding). Where
        no input was dumped, a plain tensor of the whole width is replicated and one of ``1/tp`` of it a shard
        (no plain tensor is a partial sum)."""
        inputs = self.inputs.get(name, ())
        if not inputs:
            return REPLICATE
        for source in inputs:
            if source in self.seen:
                return self.seen[source]
        whole = logical_width(name, self.config)
        if whole is not None and width == whole:
            return REPLICATE
        if whole is not None and width * self.tp == whole:
            return shard(-1)
        return f"none of its inputs ({', '.join(inputs)}) is in the dump"

    def summary(self) -> str:
        """The bundle metadata's ``missing`` line on placements."""
        line = f"placements (derived from the TP={self.tp} plan of {self.engine} and the dump's DTensors"
        if not self.skipped:
            return line + ")"
        names = "; ".join(f"{n}: {why}" for n, why in sorted(self.skipped.items()))
        return f"{line}; left out, not knowable from the dump: {names})"


def placer_for(engine: str, config: dict[str, Any], tp: int, group: tuple[int, ...]) -> Placer:
    """The placer of ``engine``'s records (``hf`` or ``vllm``) for one rank of a TP=``tp`` run."""
    from logdiff.probes.arch import adapter_for

    architecture = (config.get("architectures") or ["?"])[0]
    try:
        cmap = adapter_for(architecture).correspondence(config)
    except (KeyError, TypeError, ValueError, InputError) as e:
        raise InputError(f"--tp {tp}: no architecture adapter lays out {architecture} ({type(e).__name__})") from None
    inputs = {b.name: tuple(b.inputs) for b in cmap.boundaries}
    declared = _hf_declared(config, tp) if engine == "hf" else _vllm_declared(config, tp)
    return Placer(engine, config, tp, group, declared, inputs)


# ---------------------------------------------------------------------------------------------- HF


def _hf_declared(config: dict[str, Any], tp: int) -> Any:
    """HF: the plan logdiff's own TP capture runs (``tp_plan``, on the model built on the meta device)."""
    from logdiff.sources.hf.tensor_parallel import COLWISE, tp_plan

    plan = tp_plan(_meta_model(config), tp)

    def declared(name: str, module: str, cls: str | None, width: int) -> Placement | str | None:
        role = plan.get(module)
        if role is None:
            return None
        if name == module:  # the module's output: a column's slice, or the row-parallel sum its consumers get
            return shard(-1) if role == COLWISE else _ROW_OUTPUT
        return REPLICATE if role == COLWISE else shard(-1)  # its input

    return declared


def _meta_model(config: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        hf_config = AutoConfig.for_model(**config)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_config)
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"--tp: transformers cannot build the model of this config.json ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None


# ---------------------------------------------------------------------------------------------- vLLM


def _vllm_declared(config: dict[str, Any], tp: int) -> Any:
    """vLLM: ``vllm_placement`` on a stand-in of the entry's layer class with the config's sizes."""
    from logdiff.sources.vllm.placements import vllm_placement

    def declared(name: str, module: str, cls: str | None, width: int) -> Placement | str | None:
        standin = _standin(cls, config, tp, name, width)
        if standin is None:
            return None
        try:
            return vllm_placement(standin, name, width)
        except NotImplementedError as e:
            return str(e).split(": ", 1)[-1]

    return declared


def _standin(cls: str | None, config: dict[str, Any], tp: int, name: str, width: int) -> Any:
    """An instance of vLLM's layer class ``cls`` (no weights, ``__init__`` not run) holding the attributes
    ``vllm_placement`` reads; None for a class it does not declare."""
    from torch import nn
    from vllm.model_executor.layers import (
        linear,
        logits_processor,
        vocab_parallel_embedding,
    )

    kind = next((getattr(m, cls) for m in (linear, logits_processor, vocab_parallel_embedding)
                 if cls and isinstance(getattr(m, cls, None), type)), None)  # fmt: skip
    if kind is None or not issubclass(kind, nn.Module):
        return None
    heads, kv, head_dim = _sizes(config)
    whole = logical_width(name, config)
    attrs = {"tp_size": tp, "reduce_results": True, "gather_output": whole is not None and width == whole and tp > 1,
             "num_heads": heads // tp, "num_kv_heads": max(1, kv // tp), "head_size": head_dim,
             "v_head_size": head_dim, "num_kv_head_replicas": max(1, tp // kv),
             "output_sizes": [int(config.get("intermediate_size") or 0)] * 2}  # fmt: skip
    if name.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        attrs["gather_output"] = False  # a part split off a packed slice is a slice
    m = kind.__new__(kind)
    nn.Module.__init__(m)
    for key, value in attrs.items():
        object.__setattr__(m, key, value)
    return m


# ---------------------------------------------------------------------------------------------- weights


def gathered_parameters(steps: dict[int, list[Any]], tp: int) -> dict[str, Any]:
    """HF: the whole parameters the first ``tp`` group's dump kept, each rebuilt from its ranks' pieces by the
    DTensor placement msprobe wrote (``Shard(d)``: joined along ``d``; ``Replicate`` or a plain tensor equal on
    every rank: one of them); a parameter whose pieces make no whole is left out."""
    from logdiff.sources.msprobe.layout import ENTRY

    ranks = [steps[r] for r in range(tp)]
    out: dict[str, Any] = {}
    for s, first in enumerate(ranks[0]):
        for name, entry in first.data.items():
            m = ENTRY.match(name)
            for param, desc in ((entry.get("parameters") or {}).items() if m else ()):
                key = f"{m.group('path')}.{param}"
                if key in out:
                    continue
                descs = [r[s].data.get(name, {}).get("parameters", {}).get(param) for r in ranks]
                pieces = [r[s].load(d) for r, d in zip(ranks, descs)]
                if any(p is None for p in pieces):
                    continue
                whole = _whole(desc, pieces)
                if whole is not None:
                    out[key] = whole
    return out


def _whole(desc: Any, pieces: list[Any]) -> Any:
    import torch

    placements = desc.get("placements") if isinstance(desc, dict) else None
    if placements and len(placements) == 1 and isinstance(placements[0], dict) and "Shard" in placements[0]:
        dim = placements[0]["Shard"].get("dim")
        return torch.cat(pieces, dim=dim) if isinstance(dim, int) else None
    if all(p.shape == pieces[0].shape and torch.equal(p, pieces[0]) for p in pieces[1:]):
        return pieces[0]
    return None
