"""Conformance: each side's output measured against the exact function its own contract names.

A divergence that vanishes under the reference kernels does not prove an
operator-path cause: the kernel computes the *contracted* function, so it also
repairs a side that computes another one (a dropped soft cap, an ignored eps).
The local check here decides instead, on recorded tensors alone:

1. for an op that introduces error, take each side's own recorded inputs (the
   probes keep both sides' rows of the first sequences);
2. compute in fp64 the function that side's effective contract names (its
   eps, scale, soft cap, window, temperature, RoPE table; ``exact``), with the
   weights both sides were checked to share;
3. measure that side's recorded output against it in units of the dtype's
   spacing at the op's magnitude scale, against the op's rounding bound
   (``spacing.OpBound``).

Both sides within their bounds: the same function computed two ways
(``operator_path``). A side outside: it computes something else
(``framework_difference``), whatever its contract says. Each side is judged on
its contract as the op's layer computes with it (``contracts.at_layer``: that
layer's window and RoPE base). Where the two contracts differ at the op, each
side's output is also measured against the exact function under the *other*
side's contract (``crossed``): a side within the other's function and outside
its own computes what the other side's contract says, and the contract and
the measurement disagree (``contract_effect``). A linear of a side whose contract names a quantization
scheme there (an INT8 W8A8 rollout) is judged against that scheme's exact function (``exact_quant``): the
quantization is the contract's difference, a fault inside the quantized GEMM the side's. An MoE block is judged
on its own router logits under each side's own routing rule (``exact_moe``);
its router is a linear. An op this module has no exact function for (an
embedding, an unknown activation or RoPE style) is reported as unchecked,
with the reason, and classified ``not_judged`` (``classify``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from logdiff.diagnosis import exact, exact_quant
from logdiff.diagnosis.spacing import EPS32, eps
from logdiff.probes.contracts import DECLARED, applied, at_layer, norm_eps

SIDES = ("train", "infer")
#: rows read per side and op (evenly spaced over the kept sequences); attention reads every key before them
MAX_ROWS = 64


@dataclass
class SideCheck:
    """One side's output against the exact function, in units of the dtype's spacing at the op's scale."""

    error: float
    bound: float
    rows: int
    function: str

    @property
    def within(self) -> bool:
        return self.error <= self.bound

    def to_dict(self) -> dict[str, Any]:
        return {"error": _round(self.error), "bound": _round(self.bound), "rows": self.rows, "function": self.function}


@dataclass
class Conformance:
    """Both sides' checks of one op; ``unchecked`` says why a side could not be checked."""

    sides: dict[str, SideCheck] = field(default_factory=dict)
    unchecked: str | None = None
    #: each side's output against the exact function under the *other* side's contract (where they differ here)
    crossed: dict[str, SideCheck] = field(default_factory=dict)
    crossed_unchecked: str | None = None

    @property
    def decided(self) -> bool:
        """Both sides were checked."""
        return all(s in self.sides for s in SIDES)

    @property
    def conclusive(self) -> bool:
        """Both sides checked, and not both outside: two sides far from the function their contracts name
        agree with each other better than with it, so the contract as read describes neither (the check
        itself is then in doubt, and the op goes to the reference rerun)."""
        return self.decided and len(self.outside) < len(SIDES)

    @property
    def outside(self) -> list[str]:
        """The sides whose output is outside their rounding bound (they compute another function)."""
        return [s for s in SIDES if s in self.sides and not self.sides[s].within]

    @property
    def crossed_decided(self) -> bool:
        """Both sides were also checked under the other side's contract."""
        return self.decided and all(s in self.crossed for s in SIDES)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {s: self.sides[s].to_dict() for s in SIDES if s in self.sides}
        if self.unchecked:
            out["unchecked"] = self.unchecked
        if self.crossed:
            out["under_other_contract"] = {s: self.crossed[s].to_dict() for s in SIDES if s in self.crossed}
        return out

    def evidence(self, paths: dict[str, str]) -> list[str]:
        """One line per side: its error against the exact function and the bound."""
        lines = []
        for side, c in self.sides.items():
            verdict = "within" if c.within else "OUTSIDE"
            lines.append(f"conformance: {side} ({paths[side]}) is {c.error:.3g} units of the dtype's spacing from "
                         f"the exact {c.function}, {verdict} its rounding bound of {c.bound:.3g}")  # fmt: skip
        if self.unchecked:
            lines.append(f"conformance not checked locally: {self.unchecked}")
        other = dict(zip(SIDES, reversed(SIDES)))
        for side, c in self.crossed.items():
            verdict = "within" if c.within else "OUTSIDE"
            lines.append(f"conformance under the other side's contract: {side} ({paths[side]}) is {c.error:.3g} units "
                         f"from the exact {c.function} of the {other[side]} contract, {verdict} its bound of "
                         f"{c.bound:.3g}")  # fmt: skip
        if self.crossed_unchecked:
            lines.append(f"not checked under the other side's contract: {self.crossed_unchecked}")
        return lines


def _round(x: float) -> float:
    return float(f"{x:.4g}") if np.isfinite(x) else x


class NotCheckable(Exception):
    """This op has no exact function here (the message says why)."""


@dataclass
class Site:
    """What one check reads: a side's rows of the op's inputs and output."""

    inputs: list[Any]
    output: Any
    seq: np.ndarray
    pos: np.ndarray


class ConformanceCheck:
    """The conformance of introducing ops of one probed pair.

    ``model`` is the training path's HF module (the weights both sides were
    fingerprinted to share), ``adapter`` the architecture adapter,
    ``contracts`` each side's effective contract (the preflight's; a side that could read none may bring the
    one its config declares, marked ``DECLARED``, which every evidence line then names),
    ``rope_params`` the training engine's RoPE tables by layer type.
    """

    def __init__(self, record: Any, model: Any, adapter: Any, contracts: dict[str, Any], dtype: str,
                 rope_params: dict[Any, Any] | None = None):  # fmt: skip
        self.record, self.model, self.adapter = record, model, adapter
        self.contracts, self.dtype = contracts, dtype
        self.rope_params = rope_params or {}
        self.stores = {"train": record.train_store, "infer": record.store}

    def check(self, boundary: str) -> Conformance:
        """Both sides' conformance at ``boundary`` (``unchecked`` says why not, where it could not run)."""
        out = Conformance()
        b = self.record.cmap.get(boundary)
        if b is None:
            out.unchecked = f"{boundary} is not in the architecture's correspondence map"
            return out
        widened: dict[Any, Callable[[Any], exact.Exact]] = {}  # a linear's fp64 weight, for both sides
        for side in SIDES:
            try:
                out.sides[side] = self._side(b, side, side, widened)
            except NotCheckable as e:
                out.unchecked = str(e)
                return out
        if self._contracts_differ_here(b):
            for side, other in zip(SIDES, reversed(SIDES)):
                try:
                    out.crossed[side] = self._side(b, side, other, widened)
                except NotCheckable as e:
                    out.crossed, out.crossed_unchecked = {}, str(e)
                    break
        return out

    def _side(self, b: Any, side: str, under: str, widened: dict[Any, Any]) -> SideCheck:
        """``side``'s recorded output at ``b`` against the exact function of ``under``'s contract (its own, or
        the other side's), the worst of its sites."""
        function = self._function(b, side, widened, under)
        checks = [self._measure(function, site, self.op_dtype(b, side)) for site in self._sites(b, side)]
        if not checks:
            raise NotCheckable(f"no rows of {b.name} were recorded with their inputs on the {side} side")
        worst = max(checks, key=lambda c: c.error / c.bound if c.bound else c.error)
        worst.rows = sum(c.rows for c in checks)
        if self.contracts[under].get(DECLARED):  # a dump's side: the function its config declares
            worst.function += f" (as {self.contracts[under][DECLARED]} declares it)"
        return worst

    def _contracts_differ_here(self, b: Any) -> bool:
        """Whether a contract key the op at ``b`` reads differs between the sides at its layer."""
        from logdiff.diagnosis.contract_effect import layer_differs

        keys = self.adapter.contract_keys(b.name, b.kind)[0]
        return bool(layer_differs(keys, self.contracts, b.layer))

    def contract(self, side: str, layer: int | None) -> dict[str, Any]:
        """``side``'s contract as ``layer`` computes with it (``at_layer``)."""
        return at_layer(self.contracts[side], layer)

    # ---- rows ------------------------------------------------------------------------------

    def _sites(self, b: Any, side: str) -> list[Site]:
        """One ``Site`` per kept sequence (attention: its queries and every key before them)."""
        store = self.stores[side]
        target = store.get(b.name)
        sources = [store.get(n) for n in self._inputs(b)]
        if target is None or any(s is None for s in sources):
            return []
        sequences = range(_kept(self.record.train_store))
        per_seq = max(1, MAX_ROWS // max(1, len(sequences)))
        sites = []
        for seq in sequences:
            pos = np.arange(target.max_len)
            seqs = np.full(len(pos), seq)
            ok = target.has(seqs, pos)
            for i, src in enumerate(sources):  # attention also reads every earlier key and value
                ok &= src.has_prefix(seqs, pos) if b.causal and i > 0 else src.has(seqs, pos)
            pos = pos[ok]
            if not len(pos):
                continue
            if len(pos) > per_seq:
                pos = pos[np.linspace(0, len(pos) - 1, per_seq).round().astype(int)]
            seqs = np.full(len(pos), seq)
            if b.causal:  # every key and value up to the last query
                keys = np.arange(int(pos.max()) + 1)
                ins = [sources[0].read(seqs, pos)] + [s.read(np.full(len(keys), seq), keys) for s in sources[1:]]
            else:
                ins = [s.read(seqs, pos) for s in sources]
            sites.append(Site(ins, target.read(seqs, pos), seqs, pos))
        return sites

    def op_dtype(self, b: Any, side: str) -> str:
        """The spacing ``side``'s op at ``b`` is judged in: its contract's dtype, or the narrowest dtype its recorded
        inputs and output hold where narrower (a float32 model under bf16 autocast, TRL's default: its linears
        return bf16 and a norm fed bf16 rounds its intermediate to bf16)."""
        store = self.stores[side]
        held = [getattr(store.get(n), "dtype", None) for n in (b.name, *self._inputs(b))]
        return max([self.side_dtype(side), *(d for d in held if d in ("float32", "bfloat16", "float16"))], key=eps)

    def side_dtype(self, side: str) -> str:
        """The dtype ``side`` computes in (its contract's: an fp32 trainer against a bf16 engine is judged
        in fp32 spacing, the engine in bf16), else the scan's."""
        return str(self.contracts[side].get("dtype") or self.dtype)

    @staticmethod
    def _measure(function: Callable[[Site], exact.Exact], site: Site, dtype: str) -> SideCheck:
        ex = function(site)
        units = exact.error_units(site.output, ex, eps(dtype))
        return SideCheck(units, ex.bound.units(dtype), len(site.pos), ex.function)

    # ---- the contracted function of each op kind ---------------------------------------------

    def _function(self, b: Any, side: str, widened: dict[Any, Any], under: str | None = None
                  ) -> Callable[[Site], exact.Exact]:
        """The exact function of ``b`` under ``under``'s contract (default: ``side``'s own), for ``side``'s rows."""
        under = under or side
        contract = self.contract(under, b.layer)
        kind = b.kind
        if kind in ("linear", "logits", "router"):  # the same weight on both sides: widened once for both
            mod = self._module(b.name) if kind != "logits" else self.adapter.lm_head(self.model)
            cap = applied(contract.get("final_logit_softcapping")) if kind == "logits" else None  # off: None
            scheme = exact_quant.scheme_at(contract, b.name) if kind != "logits" else None
            if scheme and not exact_quant.has_exact_function(scheme):
                raise NotCheckable(f"no exact function for a {scheme} quantized linear here ({under}'s contract)")
            key = (id(mod.weight), cap, scheme)
            if key not in widened:
                bias = getattr(mod, "bias", None)
                widened[key] = (exact_quant.quantized_linear_of(mod.weight, bias) if scheme
                                else exact.linear_of(mod.weight, bias, cap))  # fmt: skip
            return lambda s, f=widened[key]: f(s.inputs[0])
        if kind == "norm":
            mod = self._module(b.name)
            key = next((k for k in self.adapter.contract_keys(b.name, "norm")[0] if k.endswith("eps")), None)
            if key is None or contract.get(key) is None:
                raise NotCheckable(f"the {side} side's eps of {b.name} is unknown")
            # eps as this norm module holds it (the contract reads one norm per key); a side whose contract
            # differs from the training model's holds its own
            held = norm_eps(mod)
            agree = self.contract("train", b.layer).get(key) == contract[key]
            value = float(held if agree and held is not None else contract[key])
            offset = bool(self.adapter.norm_offset)
            return lambda s: exact.rms_norm(s.inputs[0], mod.weight, value, offset)
        if kind == "add":
            return lambda s: exact.add(s.inputs[0], s.inputs[1])
        if kind == "act":
            act = self.adapter.mlp_activation(self.model.config)
            if act not in exact.ACTIVATIONS:
                raise NotCheckable(f"no exact function for the activation {act!r}")
            return lambda s: exact.act_mul(s.inputs[0], s.inputs[1], act)
        if kind == "rope":
            return self._rope(b, under, side)
        if kind == "attn":
            return self._attention(b, under, side)
        if kind == "log_softmax":
            t = float(contract.get("temperature") or 1.0)
            t = t if contract.get("logprobs_mode") == "processed_logprobs" else 1.0
            return lambda s: exact.log_softmax(s.inputs[0], t)
        if kind == "moe":
            return self._moe(b, side, under)
        if kind == "embed":
            return self._embed(b)
        raise NotCheckable(f"no exact function for a {kind} op")

    def _embed(self, b: Any) -> Callable[[Site], exact.Exact]:
        """The training model's embedding rows of the tokens each site's rows were fed (the sequences' own ids),
        times the module's ``embed_scale`` where it has one (Gemma's)."""
        import torch

        mod = self._module(b.name)
        scale = getattr(mod, "scalar_embed_scale", None)
        ids = [list(s.prompt_ids) + list(s.response_ids or []) for s in self.record.seqs]

        def run(s: Site) -> exact.Exact:
            tokens = torch.tensor([ids[q][p] for q, p in zip(s.seq.tolist(), s.pos.tolist())], dtype=torch.long)
            return exact.embedding(mod.weight, tokens, None if scale is None else float(scale))

        return run

    def _inputs(self, b: Any) -> tuple[str, ...]:
        """The boundaries whose rows a check of ``b`` reads: its inputs, and for an MoE block the same
        layer's router logits last (the routing each side made)."""
        if b.kind != "moe":
            return tuple(b.inputs)
        router = layer_router(self.record.cmap, b.layer)
        if router is None:
            raise NotCheckable(f"no router boundary in layer {b.layer} to read the routing from")
        return (*b.inputs, router)

    def _moe(self, b: Any, side: str, under: str) -> Callable[[Site], exact.Exact]:
        """The routed experts' weighted sum (plus the shared expert) under the side's own routing rule
        (``exact_moe``), with the training model's experts and correction bias."""
        from logdiff.diagnosis import exact_moe
        from logdiff.diagnosis.routing_rules import rule_of

        layer = self.adapter.layers(self.model)[b.layer]
        block = getattr(layer, "mlp", None)
        try:
            experts = exact_moe.Experts.of(block.experts, self.adapter.experts_parts, self.adapter.experts_activation)
        except (AttributeError, ValueError) as e:
            raise NotCheckable(f"the experts of {b.name} could not be read: {e}") from None
        experts = replace(experts, fp32_units=EPS32 / eps(self.side_dtype(side)))
        config = self.model.config.to_dict()
        rule = rule_of(self.contract(under, b.layer), config, getattr(self.adapter, "router_renormalizes", None))
        bias = self.adapter.router_bias(layer)
        bias = bias.detach().double().cpu().numpy() if bias is not None else None
        shared = len(b.inputs) > 1  # (norm, shared expert's output): the block adds it

        def run(s: Site) -> exact.Exact:
            return exact_moe.routed(s.inputs[0], s.inputs[-1], experts, rule, bias, s.inputs[1] if shared else None)

        return run

    def _module(self, name: str) -> Any:
        try:
            mod = self.model.get_submodule(name)
        except AttributeError:
            raise NotCheckable(f"{name} is not a module of the training model (packed or fused)") from None
        if getattr(mod, "weight", None) is None:
            raise NotCheckable(f"{name} holds no weight")
        return mod

    def _rope(self, b: Any, side: str, rows: str) -> Callable[[Site], exact.Exact]:
        """RoPE under ``side``'s contract at ``b``'s layer, at the model positions of ``rows``' sequences: the
        training model's table, with the side's own base
        where it differs (an override), or the plain table of its base where the side's type is ``default``
        and the training model scales its RoPE (``--set infer.rope_parameters={"rope_type": "default", ...}``)."""
        contract = self.contract(side, b.layer)
        style = contract.get("rope_style")
        if style is None:  # no contract (an msprobe dump): unknown, not unsupported
            raise NotCheckable(f"the {side} side's RoPE style is unknown")
        if style not in ("neox", "gptj"):
            raise NotCheckable(f"no exact function for RoPE style {style!r}")
        params = self._rope_params(b.layer)
        if params is None:
            raise NotCheckable("the RoPE table the training model computes could not be read")
        from logdiff.kernels.rope import (
            RopeParams,
            rope_attention_scaling,
            rope_inv_freq,
        )

        if contract.get("rope_theta") is None:
            raise NotCheckable(f"the {side} side's RoPE base is unknown")
        if contract.get("rope_type") == "default" and params.rope_type != "default":  # the base alone defines it
            params = RopeParams(theta=float(contract["rope_theta"]), rotary_dim=params.rotary_dim)
        elif contract.get("rope_type") not in (None, params.rope_type):
            raise NotCheckable(f"the {side} side's RoPE type {contract.get('rope_type')!r} is not the training model's")
        theta = self.contract("train", b.layer).get("rope_theta")
        if contract["rope_theta"] != theta and params.theta == theta:  # a side with its own base (an override)
            params = replace(params, theta=float(contract["rope_theta"]))
        inv_freq, factor = rope_inv_freq(params), rope_attention_scaling(params)
        head_dim = _rope_head_dim(self.model.config)
        # HF's interleaved RoPE (DeepSeek-V3) returns even lanes, then odd; the probes record vLLM's that way too
        split = self.record.cmap.rope_function == "apply_rotary_pos_emb_interleave"

        def run(s: Site) -> exact.Exact:
            heads = s.inputs[0].shape[1] // head_dim
            at = s.pos + self.record.position_offsets.get(rows, {}).get(int(s.seq[0]), 0)  # the model positions
            ex = exact.rope(s.inputs[0], _tensor(at), inv_freq, factor, heads, params.rotary_dim, style)
            ex = replace(ex, function=f"{ex.function[:-1]}, {params.rope_type} theta={params.theta:g})")
            return exact.deinterleaved(ex, heads) if split else ex

        return run

    def _rope_params(self, layer: int | None) -> Any:
        if None in self.rope_params:
            return self.rope_params[None]
        types = getattr(self.model.config, "layer_types", None)
        return self.rope_params.get(types[layer]) if types and layer is not None else None

    def _attention(self, b: Any, side: str, rows: str) -> Callable[[Site], exact.Exact]:
        """Attention under ``side``'s contract at ``b``'s layer, judged in the spacing of ``rows``' dtype."""
        contract = self.contract(side, b.layer)
        layer_module = self.adapter.layers(self.model)[b.layer]
        attn = self.adapter.attention(layer_module)
        if self.adapter.latent_attention(attn):
            return _latent_attention(attn, contract, side, self.side_dtype(rows))
        sinks = getattr(attn, "sinks", None)  # gpt-oss: one logit per head in the denominator
        if contract.get("attention_scale") is None:
            raise NotCheckable(f"the {side} side's attention scale is unknown")
        scale, cap = float(contract["attention_scale"]), applied(contract.get("attn_logit_softcapping"))
        window = self._window(attn, contract)
        heads = int(self.model.config.num_attention_heads)

        def run(s: Site) -> exact.Exact:
            return exact.attention(s.inputs[0], s.inputs[1], s.inputs[2], _tensor(s.pos), heads, scale, cap, window,
                                   sinks)  # fmt: skip

        return run


    @staticmethod
    def _window(attn: Any, contract: dict[str, Any]) -> int | None:
        """The window of a contract at one layer (``at_layer``: off on a full layer). A contract not read per
        layer (a dump's declared one) slides where the training model's module does (Gemma, Qwen: None on
        full-attention layers; a module without one, Mistral, on every layer), with the contract's width."""
        window = applied(contract.get("sliding_window"))
        if "layer_types" in contract:
            return window
        return window if getattr(attn, "sliding_window", window) is not None else None


def _latent_attention(attn: Any, contract: dict[str, Any], side: str, dtype: str) -> Callable[[Site], exact.Exact]:
    """MLA (``exact_mla``) on the side's (q nope, RoPE'd q, latent, RoPE'd k) with the training model's
    ``kv_b_proj``; the RoPE'd query is read with the keys (every position up to the last query)."""
    from logdiff.diagnosis import exact_mla

    if contract.get("attention_scale") is None:
        raise NotCheckable(f"the {side} side's attention scale is unknown")
    up, scale = exact_mla.LatentUp.of_module(attn, EPS32 / eps(dtype)), float(contract["attention_scale"])

    def run(s: Site) -> exact.Exact:
        pos = _tensor(s.pos)
        return exact_mla.latent_attention(s.inputs[0], s.inputs[1][pos], s.inputs[2], s.inputs[3], up, pos, scale)

    return run


def layer_router(cmap: Any, layer: int | None) -> str | None:
    """The router boundary of ``layer`` (an MoE block reads the routing it made), or None."""
    return next((r.name for r in cmap.boundaries if r.kind == "router" and r.layer == layer), None)


def _kept(store: Any) -> int:
    """How many sequences a training-path store kept (``StoreSink.sequences``)."""
    return getattr(store, "sequences", None) or store.num_sequences


def _rope_head_dim(config: Any) -> int:
    """The per-head width of the rows RoPE rotates (MLA rotates its ``qk_rope_head_dim`` part alone)."""
    rope_part = getattr(config, "qk_rope_head_dim", None)
    return int(rope_part or getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _tensor(pos: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.asarray(pos, dtype=np.int64))

