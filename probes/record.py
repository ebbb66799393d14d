"""Module-depth probes on a live engine, attached only inside a ``with`` block.

``Recorder`` hooks every module of an engine's real ``nn.Module`` (for vLLM the
in-process model reached through ``apply_model``), plus the few functions HF
calls outside modules (``apply_rotary_pos_emb``, the attention function, the
engine's log_softmax) and vLLM's logits/log_softmax, which run outside the
model's forward. Everything it installs is removed on exit, also when the
block raises (TransformerLens/nnsight style: no hook outlives its context).

How a value becomes a boundary record:

1. The engine announces each pass (``Engine._begin_pass``): which path it is
   (``vllm`` decode, ``vllm-prefill``, ``hf``, ``hf-decode``), which sequences
   it runs and, for vLLM, the request counter. Passes of paths nobody asked
   for are ignored.
2. When the model's forward starts, ``align`` builds the pass's ``RowMap``
   (row -> sequence, position), or the caller's ``rows`` does (a capture in a
   vLLM worker numbers requests as it first sees them). The fed token ids are checked against the
   sequences; a row that does not match is dropped and counted as misaligned.
3. Module hooks keep a call stack of names (so vLLM's one shared
   ``rotary_emb`` is told apart per layer) and fire the taps of the
   ``CorrespondenceMap`` that match; each tap yields boundary tensors, which
   become ``[rows, width]`` and go to the pass's sinks.
4. Sinks: the first path's passes go to a ``store.PathStore`` on disk; the
   second path's go to a ``summary.PathComparer`` per stored path, which
   compares on the spot and, with the ``replay.ReplaySpec`` the HF taps attach,
   re-runs the live op on the stored path's inputs. An MoE model's router rows
   also go to a ``routing.RouterSink`` per (role, path), kept in memory for the
   routing diagnostics.

``session.ProbeSession`` owns the temporary directory, the stores and
comparers of one scan, and hands ``locate`` what it needs per (train, infer) pair.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from logdiff.probes import align, replay
from logdiff.probes.align import HEADS_FIRST, PLAIN, Layout, RowMap
from logdiff.probes.correspondence import CorrespondenceMap, Tap
from logdiff.probes.ops import OpTracer
from logdiff.probes.patching import Patches

_MISSING = object()
_LAYER = re.compile(r"^model\.layers\.(\d+)(?:\.|$)")
_DECODER_LAYER = re.compile(r"^model\.layers\.\d+$")


def family_of(engine: Any) -> str:
    """``hf`` or ``vllm``: which set of taps fits this engine (the engine says: ``probe_family``)."""
    family = getattr(engine, "probe_family", None)
    if family not in ("hf", "vllm"):
        raise NotImplementedError(f"no probes for engine {type(engine).__name__}")
    return family


@dataclass
class _Pass:
    path: str
    sequences: list[int]
    request_base: int | None
    sinks: list[Any]
    lengths: list[int]
    known: np.ndarray  # [num_sequences, max_len] token ids, -1 where unknown


class Recorder:
    """Hooks on one engine; records boundaries into per-path sinks."""

    def __init__(
        self,
        engine: Any,
        cmap: CorrespondenceMap,
        sinks_for: Callable[[str], list[Any]],
        seqs: list[Any],
        response_len: int,
        tracer: OpTracer | None = None,
        rows: Callable[[tuple, dict], RowMap] | None = None,
    ):
        self.engine = engine
        self.rows = rows  # a caller's row map of each forward (a capture that numbers sequences as it sees them)
        self.family = family_of(engine)
        self.cmap = cmap
        self.sinks_for = sinks_for
        self.seqs = seqs
        self.response_len = response_len
        self.tracer = tracer
        self.warnings: list[str] = []
        self.owners: dict[str, str] = {}  # boundary -> module (call-stack name) that produced it
        self.misaligned_rows = 0
        self.steps = 0
        self._patches = Patches()  # every hook and patch of this recording, undone on exit
        self._stack: list[tuple[str, Any]] = []
        self._pass: _Pass | None = None
        self._rmap: RowMap | None = None
        self._last_rmap: RowMap | None = None
        self._last_qsl: np.ndarray | None = None
        self._last_hidden: Any = None  # vLLM: the model's last output, rows of the last pass
        self._last_logits: Any = None  # HF: the last lm_head output
        self._recent_logits: list[tuple[Any, RowMap]] = []
        self._ctx: dict[str, Any] = {}
        self._paused = False
        self._tap_cache: dict[tuple[str, str], list[tuple[Tap, int | None]]] = {}
        self._compiled = [(t, t.regex()) for t in cmap.taps[self.family]]
        self._child_names: dict[tuple[int, int], str | None] = {}

    # ---- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Recorder:
        try:
            self.model = self.engine.module()
            self._names = {id(m): n for n, m in self.model.named_modules()}
            self._leaves = {id(m) for _, m in self.model.named_modules() if not m._modules}
            for _, m in self.model.named_modules():
                h1 = m.register_forward_pre_hook(self._pre, with_kwargs=True)
                h2 = m.register_forward_hook(self._post, with_kwargs=True, always_call=True)
                self._patches.on_exit(h1.remove)
                self._patches.on_exit(h2.remove)
            self.use_tracer(self.tracer)
            if self.family == "hf":
                self._install_hf_functions()
            else:
                self._install_vllm_functions()
            self._patches.set(self.engine, "listener", self)
        except BaseException:
            self._uninstall()
            raise
        return self

    def use_tracer(self, tracer: OpTracer | None) -> None:
        """Trace ops into ``tracer`` (``--depth ops``) whenever recording is not paused (a replay pauses it)."""
        self.tracer = tracer
        if tracer is not None:
            tracer.active = lambda: not self._paused

    def __exit__(self, *exc: Any) -> None:
        self._uninstall()
        if self.misaligned_rows:
            self._warn(f"{self.misaligned_rows} token rows did not carry the expected token ids and were dropped")

    def _uninstall(self) -> None:
        self._patches.close()
        self._pass = None
        self._rmap = self._last_rmap = None
        self._last_hidden = self._last_logits = None
        self._recent_logits.clear()
        self._ctx.clear()
        self._stack.clear()

    def _warn(self, msg: str) -> None:
        if msg not in self.warnings:
            self.warnings.append(msg)

    # ---- passes and steps -----------------------------------------------------------------

    def begin_pass(self, path: str, sequences: list[int], request_base: int | None = None) -> None:
        """Called by the engine before it runs ``sequences`` as path ``path``."""
        sinks = self.sinks_for(path)
        if not sinks:
            self._pass = None
            return
        lengths = [
            len(s.prompt_ids) + (len(s.response_ids) if s.response_ids else self.response_len) for s in self.seqs
        ]
        known = np.full((len(self.seqs), max(lengths)), -1, dtype=np.int64)
        for i, s in enumerate(self.seqs):
            ids = list(s.prompt_ids) + list(s.response_ids or [])
            known[i, : len(ids)] = ids
        self._pass = _Pass(path, list(sequences), request_base, sinks, lengths, known)

    def _begin_step(self, args: tuple, kwargs: dict) -> None:
        assert self._pass is not None
        p = self._pass
        # what the previous step left for its logits / log_softmax is no longer needed
        self._last_hidden = self._last_logits = None
        self._recent_logits = []
        try:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                raise ValueError("the forward got no input_ids")
            rmap = self._row_map(p, args, kwargs)
        except Exception as e:  # noqa: BLE001 - a pass we cannot align is reported, not fatal
            self._warn(f"{p.path}: could not align a forward pass to token positions ({type(e).__name__}: {e})")
            self._rmap = None
            return
        flat = ids.reshape(-1).detach().cpu().numpy().astype(np.int64)
        v = np.nonzero(rmap.valid)[0]
        inside = rmap.pos[v] < p.known.shape[1]
        v = v[inside]
        expected = p.known[rmap.seq[v], rmap.pos[v]]
        wrong = v[(expected >= 0) & (expected != flat[v])]
        if len(wrong):
            self.misaligned_rows += len(wrong)
            rmap.valid[wrong] = False
        self._rmap = rmap
        self.steps += 1
        if self.tracer is not None:
            if self.family == "hf":
                self.tracer.step = "prefill" if ids.shape[-1] > 1 else "decode"
            else:
                q = self._last_qsl
                self.tracer.step = "prefill" if q is not None and len(q) > 1 and int(np.diff(q).max()) > 1 else "decode"

    def _row_map(self, p: _Pass, args: tuple, kwargs: dict) -> RowMap:
        """Row -> (sequence, position) of the forward starting now: from the pass's sequences and, for vLLM,
        its request ids, or from the caller's ``rows`` (which sees the same ``args``/``kwargs``)."""
        if self.family == "hf":
            if self.rows is not None:
                return self.rows(args, kwargs)
            pos = kwargs.get("position_ids")
            mask = kwargs.get("attention_mask")
            if pos is None:
                import torch

                ids = kwargs.get("input_ids", args[0] if args else None)
                pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
            return align.hf_rows(p.sequences, pos, mask, p.lengths)
        qsl, req_ids = vllm_batch(self.engine.runner())
        self._last_qsl = qsl
        if self.rows is not None:
            return self.rows(args, kwargs)
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        return align.vllm_rows(pos, qsl, req_ids, p.sequences, p.request_base or 0, p.lengths)

    def _end_step(self, output: Any) -> None:
        if self.family == "vllm":
            self._last_hidden = output if _is_tensor(output) else None
        self._last_rmap = self._rmap
        self._rmap = None
        self._ctx.clear()

    # ---- module hooks ---------------------------------------------------------------------

    def _resolve(self, module: Any) -> str:
        if self._stack:
            parent_name, parent = self._stack[-1]
            key = (id(parent), id(module))
            if key not in self._child_names:
                self._child_names[key] = next((k for k, v in parent._modules.items() if v is module), None)
            attr = self._child_names[key]
            if attr is not None:
                return f"{parent_name}.{attr}" if parent_name else attr
        return self._names.get(id(module), type(module).__name__)

    def _pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self._paused or self._pass is None:
            return None
        name = self._resolve(module)
        self._stack.append((name, module))
        if self.tracer is not None:
            self.tracer.enter(name)
        if len(self._stack) == 1 and module is self.model:
            self._begin_step(args, kwargs)
        if _DECODER_LAYER.match(name):
            self._ctx.clear()
        if self._rmap is not None:
            value = args[0] if args else next((v for v in kwargs.values() if _is_tensor(v)), None)
            if value is not None:
                self._taps(name, module, "input", value, args, kwargs)
        return None

    def _post(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._stack or self._stack[-1][1] is not module:
            return None
        name = self._stack[-1][0]
        try:
            if not self._paused:
                if self._rmap is not None:
                    self._taps(name, module, "output", output, args, kwargs)
                if len(self._stack) == 1 and module is self.model:
                    self._end_step(output)
                elif self.family == "vllm" and module is getattr(self.model, "logits_processor", None):
                    self._vllm_logits(args, kwargs, output)
        finally:
            self._stack.pop()
            if self.tracer is not None:
                self.tracer.exit(name)
        return None

    def _matching(self, name: str, source: str, module: Any) -> list[tuple[Tap, int | None]]:
        key = (name, source)
        hit = self._tap_cache.get(key)
        if hit is None:
            hit = []
            for tap, rx in self._compiled:
                if tap.source != source:
                    continue
                if not self.cmap.mapped and id(module) not in self._leaves:
                    continue
                m = rx.match(name)
                if m:
                    layer = m.groupdict().get("N")
                    hit.append((tap, int(layer) if layer is not None else None))
            self._tap_cache[key] = hit
        return hit

    def _taps(self, name: str, module: Any, source: str, value: Any, args: tuple, kwargs: dict) -> None:
        for tap, layer in self._matching(name, source, module):
            tensors = self._select(tap.select, value)
            if tensors is None:
                continue
            for bname, t in zip(self.cmap.names_for(tap, layer, name), tensors):
                if bname is None or t is None:
                    continue
                if self.cmap.mapped and self.cmap.get(bname) is None:
                    continue
                if self.family == "hf":
                    self._ctx[bname] = t
                    if bname == "logits":
                        self._last_logits = t
                if tap.emit:
                    spec = self._module_replay(bname, module, args, tap) if self.family == "hf" else None
                    # an input tap reads a value its parent computed (a residual add, act * up)
                    owner = self._stack[-2][0] if source == "input" and len(self._stack) >= 2 else name
                    layout = HEADS_FIRST if tap.select == "heads_first" else PLAIN
                    self._emit(bname, t, layout, self._rmap, spec, owner)

    def _select(self, how: str, value: Any) -> list[Any] | None:
        if how in ("tensor", "heads_first"):
            return [value] if _is_tensor(value) else None
        if how == "first":
            if _is_tensor(value):
                return [value]
            return [value[0]] if isinstance(value, (tuple, list)) and value and _is_tensor(value[0]) else None
        if how == "logits_field":  # a model output's soft-capped ``logits`` (Gemma)
            logits = getattr(value, "logits", None)
            return [logits] if _is_tensor(logits) else None
        if how in ("pair", "norm_pair"):
            if _is_tensor(value):
                return [value, None] if how == "norm_pair" else None
            return [value[0], value[1]] if isinstance(value, (tuple, list)) and len(value) >= 2 else None
        if how == "pair_deinterleaved":  # GPT-J RoPE output in HF's rope_interleave layout: even, then odd lanes
            if not (isinstance(value, (tuple, list)) and len(value) >= 2):
                return None
            return [deinterleave(value[0]), deinterleave(value[1])]
        out = value[0] if isinstance(value, (tuple, list)) else value
        if how == "split_qkv":
            attn = self._stack[-2][1] if len(self._stack) >= 2 else None
            q, kv = _qkv_sizes(attn)
            if q is None or kv is None:
                self._warn("vLLM attention module has no q_size/kv_size; cannot split qkv_proj")
                return None
            return list(out.split([q, kv, kv], dim=-1))
        if how == "split_half":
            return list(out.chunk(2, dim=-1))
        if how.startswith(("split:", "split_heads:")):
            return self._split_by_attributes(how, out)
        raise ValueError(f"unknown tap selection {how!r}")

    def _split_by_attributes(self, how: str, out: Any) -> list[Any] | None:
        """``split:a,b``: the last dim in parts of the calling module's attributes ``a``, ``b`` (MLA's
        ``kv_lora_rank``, ``qk_rope_head_dim``); ``split_heads:a,b``: each head's slice in such parts."""
        kind, _, attrs = how.partition(":")
        parent = self._stack[-2][1] if len(self._stack) >= 2 else None
        sizes = [getattr(parent, a, None) for a in attrs.split(",")]
        if any(not isinstance(n, int) for n in sizes):
            self._warn(f"{type(parent).__name__} has no {attrs}; cannot split its projection")
            return None
        if kind == "split_heads":
            out = out.reshape(*out.shape[:-1], -1, sum(sizes))
        return list(out.split(sizes, dim=-1))

    def _emit(
        self, name: str, tensor: Any, layout: Layout, rmap: RowMap | None, spec: Any, owner: str | None = None
    ) -> None:
        if rmap is None or self._pass is None:
            return
        try:
            rows = layout.to_rows(tensor.detach(), len(rmap))
        except ValueError as e:
            self._warn(f"{self._pass.path}: {name}: {e}")
            return
        self.owners.setdefault(name, owner or (self._stack[-1][0] if self._stack else name))
        self._paused = True
        try:
            for sink in self._pass.sinks:
                sink.emit(name, rows, rmap, spec if getattr(sink, "wants_replay", False) else None)
        except Exception as e:  # noqa: BLE001 - a probe must never break the engine's own run
            self._warn(f"{self._pass.path}: probe failed at {name} ({type(e).__name__}: {e}); values incomplete")
        finally:
            self._paused = False

    # ---- HF: replays and function taps ------------------------------------------------------

    def _module_replay(self, name: str, module: Any, args: tuple, tap: Tap) -> Any:
        b = self.cmap.get(name)
        if b is None or not any(getattr(s, "wants_replay", False) for s in self._pass.sinks):
            return None
        if tap.select == "logits_field":  # the whole model's output: not replayable as one op
            return None
        if b.kind in ("linear", "norm", "router", "moe", "logits") and args and _is_tensor(args[0]) and b.inputs:
            select = tap.select
            # a split tap (HF's own packed projections, Phi-3) replays the part named ``name``
            part = self.cmap.names_for(tap, b.layer, name).index(name) if len(tap.names) > 1 else 0

            def pick(out: Any) -> Any:
                got = self._select(select, out)
                return got[part] if got else out

            layout = HEADS_FIRST if select == "heads_first" else PLAIN
            return replay.module(module, b.inputs[0], args[0], pick, layout)
        if b.kind == "add":
            live = [self._ctx.get(n) for n in b.inputs]
            return replay.add(b.inputs, live) if all(t is not None for t in live) else None
        if b.kind == "act":
            parent = self._stack[-2][1] if len(self._stack) >= 2 else None
            act = getattr(parent, "act_fn", None) or getattr(parent, "activation_fn", None)
            live = [self._ctx.get(n) for n in b.inputs]
            if act is None or not all(t is not None for t in live):
                return None
            return replay.act_mul(act, b.inputs, live)
        return None

    def _layer_from_stack(self) -> int | None:
        for name, _ in reversed(self._stack):
            m = _LAYER.match(name)
            if m:
                return int(m.group(1))
        return None

    def _install_hf_functions(self) -> None:
        # the modeling module of the model's own class: FSDP2's fully_shard swaps in a subclass defined elsewhere
        modeling = next((m for m in (sys.modules.get(c.__module__) for c in type(self.model).__mro__)
                         if hasattr(m, self.cmap.rope_function)), sys.modules.get(type(self.model).__module__))
        # apply_rotary_pos_emb(q, k, cos, sin), or the adapter's (DeepSeek-V2: apply_rotary_emb(q, k, freqs))
        rope_name = self.cmap.rope_function
        orig_rope = getattr(modeling, rope_name, None)
        if orig_rope is not None and self.cmap.mapped:

            def rope(q: Any, k: Any, *tables: Any, **kw: Any) -> Any:
                with self._traced(rope_name) as pseudo:
                    out = orig_rope(q, k, *tables, **kw)
                if self._rmap is not None and not self._paused:
                    self._rope_tap(orig_rope, q, k, tables, kw, out, pseudo)
                return out

            self._patches.set(modeling, rope_name, rope)
        elif self.cmap.mapped:
            self._warn(f"{type(self.model).__name__}: no {rope_name} found; rope_q/rope_k not recorded")

        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        impl = getattr(self.model.config, "_attn_implementation", None) or "eager"
        local = ALL_ATTENTION_FUNCTIONS._local_mapping
        orig_attn = local.get(impl) or ALL_ATTENTION_FUNCTIONS._global_mapping.get(impl)
        if orig_attn is None:
            orig_attn = getattr(modeling, "eager_attention_forward", None)
        if orig_attn is not None and self.cmap.mapped:

            def attention(owner: Any, query: Any, key: Any, value: Any, *a: Any, **kw: Any) -> Any:
                with self._traced("attention_interface") as pseudo:
                    out = orig_attn(owner, query, key, value, *a, **kw)
                if self._rmap is not None and not self._paused and id(owner) in self._names:
                    self._attention_tap(orig_attn, owner, query, key, value, a, kw, out, pseudo)
                return out

            old = local.get(impl, _MISSING)
            local[impl] = attention
            self._patches.on_exit(lambda: local.pop(impl, None) if old is _MISSING else local.__setitem__(impl, old))

        orig_lp = self.engine._logprobs

        def logprobs(logits: Any) -> Any:
            with self._traced("log_softmax"):
                out = orig_lp(logits)
            if self._pass is not None and not self._paused:
                self._hf_log_softmax(orig_lp, logits, out)
            return out

        self._patches.set(self.engine, "_logprobs", logprobs)

    @contextlib.contextmanager
    def _traced(self, function: str) -> Iterator[str]:
        """Trace a function HF calls outside modules as a pseudo-module ``<caller>.<function>``."""
        name = f"{self._stack[-1][0]}.{function}" if self._stack else function
        on = self.tracer is not None and self._pass is not None and not self._paused
        if on:
            self.tracer.enter(name)
        try:
            yield name
        finally:
            if on:
                self.tracer.exit(name)

    def _rope_tap(self, fn: Any, q: Any, k: Any, tables: tuple, kw: dict, out: Any, owner: str) -> None:
        n = self._layer_from_stack()
        if n is None:
            return
        names = [self.cmap.function_boundary("rope_q", n), self.cmap.function_boundary("rope_k", n)]
        bq, bk = (self.cmap.get(name) if name else None for name in names)
        if bq is None or bk is None:
            return
        inputs = (bq.inputs[0], bk.inputs[0])
        for which, (name, t) in enumerate(zip(names, out)):
            # replayable with its position tables (cos, sin or complex freqs), not with legacy extra arguments
            spec = replay.rope(fn, inputs, q, k, tables, which, **kw) if len(tables) <= 2 else None
            self._emit(name, t, HEADS_FIRST, self._rmap, spec, owner)

    def _attention_tap(
        self, fn: Any, owner: Any, q: Any, k: Any, v: Any, a: tuple, kw: dict, out: Any, pseudo: str
    ) -> None:
        n = self._layer_from_stack()
        if n is None:
            return
        name = self.cmap.function_boundary("attn_core", n)
        b = self.cmap.get(name) if name else None
        if b is None:
            return
        spec = None
        if k.shape[2] == q.shape[2]:  # the call sees the whole context: replayable
            if self.cmap.attention_replay is not None:  # q, k, v rebuilt from other boundaries (MLA's latent)
                spec = self.cmap.attention_replay(fn, owner, b.inputs, q, k, v, a, kw, dict(self._ctx))
            elif len(b.inputs) == 3:
                spec = replay.attention(fn, owner, b.inputs, q, k, v, a, kw)
        self._emit(name, out[0], PLAIN, self._rmap, spec, pseudo)

    def _hf_log_softmax(self, fn: Any, logits: Any, out: Any) -> None:
        if self._last_logits is None or self._last_rmap is None:
            return
        base = self._last_logits
        rows = align.view_rows(logits, base.reshape(-1, base.shape[-1]))
        if rows is None:
            self._warn(f"{self._pass.path}: log_softmax input is not a view of the logits; not recorded")
            return
        spec = replay.function(fn, "logits", logits)
        self._emit("log_softmax", out, PLAIN, self._last_rmap.take(rows), spec, "log_softmax")

    # ---- vLLM: logits and log_softmax run outside the model's forward -------------------------

    def _install_vllm_functions(self) -> None:
        runner = self.engine.runner()
        sampler = runner.sampler
        orig = sampler.compute_logprobs

        def compute_logprobs(logits: Any) -> Any:
            with self._traced("log_softmax"):
                out = orig(logits)
            if self._pass is not None and not self._paused:
                rmap = next((m for t, m in reversed(self._recent_logits) if t is logits), None)
                if rmap is None:
                    rmap = next((m for t, m in reversed(self._recent_logits) if t.shape == logits.shape), None)
                if rmap is not None:
                    self._emit("log_softmax", out, PLAIN, rmap, None, "log_softmax")
                else:
                    self._warn(f"{self._pass.path}: vLLM log_softmax rows could not be matched to logits rows")
            return out

        self._patches.set(sampler, "compute_logprobs", compute_logprobs)

    def _vllm_logits(self, args: tuple, kwargs: dict, output: Any) -> None:
        if self._pass is None or self._last_rmap is None or self._last_hidden is None:
            return
        hidden = args[1] if len(args) > 1 else kwargs.get("hidden_states")
        if not _is_tensor(hidden) or not _is_tensor(output):
            return
        rows = self._logits_rows(hidden)
        if rows is None:
            self._warn(f"{self._pass.path}: vLLM logits rows could not be matched to token rows; logits not recorded")
            return
        rmap = self._last_rmap.take(rows)
        self._recent_logits = (self._recent_logits + [(output, rmap)])[-4:]
        self._emit("logits", output, PLAIN, rmap, None)

    def _logits_rows(self, hidden: Any) -> np.ndarray | None:
        import torch

        base = self._last_hidden
        rows = align.view_rows(hidden, base)
        if rows is not None:
            return rows
        if self._last_qsl is not None:
            cand = self._last_qsl[1:] - 1
            if len(cand) == hidden.shape[0] and torch.equal(base[torch.as_tensor(cand)], hidden):
                return cand
        # last resort: match rows by content
        lookup: dict[bytes, int] = {}
        for i, r in enumerate(base):
            lookup.setdefault(r.contiguous().view(torch.uint8).numpy().tobytes(), i)
        found = [lookup.get(r.contiguous().view(torch.uint8).numpy().tobytes()) for r in hidden]
        return None if any(f is None for f in found) else np.asarray(found, dtype=np.int64)


def vllm_batch(runner: Any) -> tuple[np.ndarray, list[str]]:
    """The running vLLM forward's ``query_start_loc`` (request r's rows are ``qsl[r]:qsl[r + 1]``) and the
    request ids of those rows, in batch order (``runner.input_batch.req_ids``)."""
    from vllm.forward_context import get_forward_context

    md = get_forward_context().attn_metadata
    items = md.values() if isinstance(md, dict) else (md if isinstance(md, list) else [md])
    qsl = None
    for m in items:
        if isinstance(m, dict):
            m = next(iter(m.values()), None)
        qsl = getattr(m, "query_start_loc", None)
        if qsl is not None:
            break
    if qsl is None:
        raise RuntimeError("vLLM attention metadata has no query_start_loc")
    qsl = np.asarray(qsl.detach().cpu().numpy() if hasattr(qsl, "detach") else qsl, dtype=np.int64)
    return qsl, list(runner.input_batch.req_ids)[: len(qsl) - 1]


def _qkv_sizes(attn: Any) -> tuple[int | None, int | None]:
    """(q, k/v) widths of a packed qkv output: vLLM's ``q_size``/``kv_size``, else HF's head counts (Phi-3)."""
    q, kv = getattr(attn, "q_size", None), getattr(attn, "kv_size", None)
    if q is None and hasattr(attn, "head_dim") and hasattr(attn, "num_key_value_heads"):
        config = getattr(attn, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        if heads is not None:
            q, kv = heads * attn.head_dim, attn.num_key_value_heads * attn.head_dim
    return q, kv


def deinterleave(x: Any) -> Any:
    """``[x0, x1, x2, x3, ...]`` -> ``[x0, x2, ..., x1, x3, ...]`` along the last dim."""
    import torch

    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)
