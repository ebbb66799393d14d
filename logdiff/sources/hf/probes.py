"""What the recorder asks of an HF model (``EngineProbes``): rows, function taps and live replays.

An HF forward is a padded ``[B, L]`` batch (``align.padded_rows``: the engine
announces which sequence each row is, ``position_ids`` and ``attention_mask``
give positions and padding), and a KV-cache decode step is the same with
``L = 1``. Three values HF computes in plain functions, not modules, so they are
wrapped here for the duration of a recording:

* the adapter's RoPE function in the model's modeling module
  (``apply_rotary_pos_emb(q, k, cos, sin)``, DeepSeek-V2's ``apply_rotary_emb``),
  recorded as ``rope_q``/``rope_k``;
* the attention function of the model's ``_attn_implementation`` in
  transformers' ``ALL_ATTENTION_FUNCTIONS`` (the attention core);
* the engine's log_softmax (``_logprobs``), whose input is a view of the logits.

Every module boundary carries a replay of the live op (``probes.replay``): the
module itself re-run on another path's input (linear, norm, router, MoE), the
residual add and the gated activation from this layer's context, RoPE and the
attention function with their tables and masks. The comparer re-runs it where it
wants one (``wants_replay``); nothing is built for a sink that does not.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from logdiff.probes import align, replay
from logdiff.probes.align import HEADS_FIRST, PLAIN, RowMap
from logdiff.probes.correspondence import CorrespondenceMap, Tap

_MISSING = object()
_LAYER = re.compile(r"^model\.layers\.(\d+)(?:\.|$)")


def _layer(rec: Any) -> int | None:
    """The decoder layer running now, from the recorder's call stack of HF module names, or None."""
    for name, _ in reversed(rec.stack):
        m = _LAYER.match(name)
        if m:
            return int(m.group(1))
    return None


class HFProbes:
    """The ``EngineProbes`` of an HF model (an ``HFEngine``, or a capture's view of the user's model)."""

    def __init__(self, engine: Any):
        self.engine = engine  # has module(), _logprobs(logits) and tap_mapping
        self.last_logits: Any = None  # the last lm_head output (log_softmax is taken over views of it)

    def taps(self, cmap: CorrespondenceMap) -> list[Tap]:
        return self.engine.tap_mapping.taps(cmap)  # the engine's own: a derived engine may extend HF's

    def reset(self) -> None:
        self.last_logits = None

    # ---- rows -----------------------------------------------------------------------------------

    def begin_step(self, rec: Any, args: tuple, kwargs: dict) -> None:
        self.last_logits = None

    def rows(self, rec: Any, p: Any, args: tuple, kwargs: dict) -> RowMap:
        pos = kwargs.get("position_ids")
        if pos is None:
            import torch

            ids = kwargs.get("input_ids", args[0] if args else None)
            pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        return align.padded_rows(p.sequences, pos, kwargs.get("attention_mask"), p.lengths)

    def step_kind(self, ids: Any) -> str:
        return "prefill" if ids.shape[-1] > 1 else "decode"

    def end_step(self, rec: Any, output: Any) -> None:
        self.last_logits = rec.context.get("logits")

    def after_module(self, rec: Any, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        return None

    # ---- replays of module boundaries ------------------------------------------------------------

    def replay(self, rec: Any, name: str, module: Any, args: tuple, tap: Tap, value: Any) -> Any:
        b = rec.cmap.get(name)
        if b is None or not rec.wants_replay:
            return None
        if tap.select == "logits_field":  # the whole model's output: not replayable as one op
            return None
        if b.kind in ("linear", "norm", "router", "moe", "logits") and args and _is_tensor(args[0]) and b.inputs:
            select = tap.select
            # a split tap (HF's own packed projections, Phi-3) replays the part named ``name``
            part = rec.cmap.names_for(tap, b.layer, name).index(name) if len(tap.names) > 1 else 0

            def pick(out: Any) -> Any:
                got = rec.select(select, out)
                return got[part] if got else out

            layout = HEADS_FIRST if select == "heads_first" else PLAIN
            return replay.module(module, b.inputs[0], args[0], pick, layout)
        live = [rec.context.get(n) for n in b.inputs]
        if b.kind == "add":
            return replay.add(b.inputs, live) if all(t is not None for t in live) else None
        if b.kind == "act":
            parent = rec.stack[-2][1] if len(rec.stack) >= 2 else None
            act = getattr(parent, "act_fn", None) or getattr(parent, "activation_fn", None)
            if act is None or not all(t is not None for t in live):
                return None
            return replay.act_mul(act, b.inputs, live)
        return None

    # ---- functions HF calls outside modules ---------------------------------------------------------

    def install(self, rec: Any) -> None:
        model, cmap = rec.model, rec.cmap
        # the modeling module of the model's own class: FSDP2's fully_shard swaps in a subclass defined elsewhere
        modeling = next((m for m in (sys.modules.get(c.__module__) for c in type(model).__mro__)
                         if hasattr(m, cmap.rope_function)), sys.modules.get(type(model).__module__))
        # apply_rotary_pos_emb(q, k, cos, sin), or the adapter's (DeepSeek-V2: apply_rotary_emb(q, k, freqs))
        rope_name = cmap.rope_function
        orig_rope = getattr(modeling, rope_name, None)
        if orig_rope is not None and cmap.mapped:

            def rope(q: Any, k: Any, *tables: Any, **kw: Any) -> Any:
                with rec.traced(rope_name) as pseudo:
                    out = orig_rope(q, k, *tables, **kw)
                if rec.rmap is not None and rec.recording:
                    self._rope_tap(rec, orig_rope, q, k, tables, kw, out, pseudo)
                return out

            rec.patches.set(modeling, rope_name, rope)
        elif cmap.mapped:
            rec.warn(f"{type(model).__name__}: no {rope_name} found; rope_q/rope_k not recorded")

        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        local = ALL_ATTENTION_FUNCTIONS._local_mapping
        orig_attn = local.get(impl) or ALL_ATTENTION_FUNCTIONS._global_mapping.get(impl)
        if orig_attn is None:
            orig_attn = getattr(modeling, "eager_attention_forward", None)
        if orig_attn is not None and cmap.mapped:

            def attention(owner: Any, query: Any, key: Any, value: Any, *a: Any, **kw: Any) -> Any:
                with rec.traced("attention_interface") as pseudo:
                    out = orig_attn(owner, query, key, value, *a, **kw)
                if rec.rmap is not None and rec.recording and id(owner) in rec.names:
                    self._attention_tap(rec, orig_attn, owner, query, key, value, a, kw, out, pseudo)
                return out

            old = local.get(impl, _MISSING)
            local[impl] = attention
            rec.patches.on_exit(lambda: local.pop(impl, None) if old is _MISSING else local.__setitem__(impl, old))

        orig_lp = self.engine._logprobs

        def logprobs(logits: Any) -> Any:
            with rec.traced("log_softmax"):
                out = orig_lp(logits)
            if rec.recording:
                self._log_softmax_tap(rec, orig_lp, logits, out)
            return out

        rec.patches.set(self.engine, "_logprobs", logprobs)

    def _rope_tap(self, rec: Any, fn: Any, q: Any, k: Any, tables: tuple, kw: dict, out: Any, owner: str) -> None:
        n = _layer(rec)
        if n is None:
            return
        names = [rec.cmap.function_boundary("rope_q", n), rec.cmap.function_boundary("rope_k", n)]
        bq, bk = (rec.cmap.get(name) if name else None for name in names)
        if bq is None or bk is None:
            return
        inputs = (bq.inputs[0], bk.inputs[0])
        for which, (name, t) in enumerate(zip(names, out)):
            # replayable with its position tables (cos, sin or complex freqs), not with legacy extra arguments
            spec = replay.rope(fn, inputs, q, k, tables, which, **kw) if len(tables) <= 2 else None
            rec.emit(name, t, HEADS_FIRST, rec.rmap, spec, owner)

    def _attention_tap(
        self, rec: Any, fn: Any, owner: Any, q: Any, k: Any, v: Any, a: tuple, kw: dict, out: Any, pseudo: str
    ) -> None:
        n = _layer(rec)
        if n is None:
            return
        name = rec.cmap.function_boundary("attn_core", n)
        b = rec.cmap.get(name) if name else None
        if b is None:
            return
        spec = None
        if k.shape[2] == q.shape[2]:  # the call sees the whole context: replayable
            if rec.cmap.attention_replay is not None:  # q, k, v rebuilt from other boundaries (MLA's latent)
                spec = rec.cmap.attention_replay(fn, owner, b.inputs, q, k, v, a, kw, dict(rec.context))
            elif len(b.inputs) == 3:
                spec = replay.attention(fn, owner, b.inputs, q, k, v, a, kw)
        rec.emit(name, out[0], PLAIN, rec.rmap, spec, pseudo)

    def _log_softmax_tap(self, rec: Any, fn: Any, logits: Any, out: Any) -> None:
        if self.last_logits is None or rec.last_rmap is None:
            return
        base = self.last_logits
        rows = align.view_rows(logits, base.reshape(-1, base.shape[-1]))
        if rows is None:
            rec.warn(f"{rec.pass_.path}: log_softmax input is not a view of the logits; not recorded")
            return
        spec = replay.function(fn, "logits", logits)
        rec.emit("log_softmax", out, PLAIN, rec.last_rmap.take(rows), spec, "log_softmax")


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)
