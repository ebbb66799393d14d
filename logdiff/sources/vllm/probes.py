"""What the recorder asks of a vLLM model (``EngineProbes``): packed rows, logits and log_softmax.

vLLM runs one flat, packed batch per forward that mixes prefill chunks and
decode tokens of several requests (``align.packed_rows``). Its layout is read
once per forward from the attention metadata in vLLM's forward context
(``vllm_batch``: ``query_start_loc`` and the runner's request ids in batch order),
before the row map is built; a capture in a worker reads the same ``batch``.

The logits and the log-softmax run outside the model's forward: the runner
calls the model's ``logits_processor`` on the rows it samples from, and the
sampler's ``compute_logprobs`` on those logits (or, for a sampling step with
``logprobs_mode="processed_logprobs"``, its top-k/top-p sampler's own
log-softmax of the processed logits: what the engine reports). The logits rows are found among
the last forward's output rows (a view, the last row of each request, or by
content); the log_softmax rows are those of the logits it was given. vLLM's
modules are not replayed (their replays are HF's: the comparer re-runs the
training side's op).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from logdiff.probes import align
from logdiff.probes.align import PLAIN, RowMap
from logdiff.probes.correspondence import CorrespondenceMap, Tap


class VLLMProbes:
    """The ``EngineProbes`` of an in-process vLLM model (a ``VLLMEngine``, or a worker capture's view)."""

    def __init__(self, engine: Any):
        self.engine = engine  # has module(), runner() and tap_mapping
        self.reset()

    def taps(self, cmap: CorrespondenceMap) -> list[Tap]:
        return self.engine.tap_mapping.taps(cmap)  # the engine's own: a derived engine may extend vLLM's

    def reset(self) -> None:
        #: the running forward's ``(query_start_loc, request ids)``; None outside a forward that could be read
        self.batch: tuple[np.ndarray, list[str]] | None = None
        self._batch_of: Any = None  # the attention metadata ``batch`` was read from
        self.last_hidden: Any = None  # the model's last output: the rows logits are computed from
        self.recent_logits: list[tuple[Any, RowMap]] = []

    def read_batch(self) -> tuple[np.ndarray, list[str]]:
        """The running forward's batch (``vllm_batch``), read once per forward whoever asks first."""
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata
        if self.batch is None or self._batch_of is not metadata:
            self.batch, self._batch_of = vllm_batch(self.engine.runner(), metadata), metadata
        return self.batch

    # ---- rows -----------------------------------------------------------------------------------

    def begin_step(self, rec: Any, args: tuple, kwargs: dict) -> None:
        self.last_hidden, self.recent_logits = None, []
        self.read_batch()

    def rows(self, rec: Any, p: Any, args: tuple, kwargs: dict) -> RowMap:
        qsl, req_ids = self.batch
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        return align.packed_rows(pos, qsl, req_ids, p.sequences, p.request_base or 0, p.lengths)

    def step_kind(self, ids: Any) -> str:
        q = self.batch[0] if self.batch is not None else None
        return "prefill" if q is not None and len(q) > 1 and int(np.diff(q).max()) > 1 else "decode"

    def end_step(self, rec: Any, output: Any) -> None:
        self.last_hidden = output if _is_tensor(output) else None

    def replay(self, rec: Any, name: str, module: Any, args: tuple, tap: Tap, value: Any) -> Any:
        return None

    # ---- logits and log_softmax, outside the model's forward ----------------------------------------

    def install(self, rec: Any) -> None:
        sampler = self.engine.runner().sampler
        orig = sampler.compute_logprobs

        def compute_logprobs(logits: Any) -> Any:
            with rec.traced("log_softmax"):
                out = orig(logits)
            self._emit_log_softmax(rec, logits, out)
            return out

        rec.patches.set(sampler, "compute_logprobs", compute_logprobs)
        # ``logprobs_mode="processed_logprobs"`` (TRL's, verl's): a sampling step's logprobs are taken inside the
        # top-k/top-p sampler, past ``compute_logprobs``; they are what the engine reports, so they are recorded
        topk_topp = getattr(sampler, "topk_topp_sampler", None)
        if getattr(topk_topp, "logprobs_mode", None) == "processed_logprobs":
            sample = topk_topp.forward

            def sample_and_record(logits: Any, *args: Any, **kwargs: Any) -> Any:
                with rec.traced("log_softmax"):
                    sampled, processed = sample(logits, *args, **kwargs)
                if processed is not None:
                    self._emit_log_softmax(rec, logits, processed)
                return sampled, processed

            rec.patches.set(topk_topp, "forward", sample_and_record)

    def _emit_log_softmax(self, rec: Any, logits: Any, out: Any) -> None:
        """``out``, the log-softmax of ``logits`` (the recorded logits, or a processed copy of the same rows)."""
        if not rec.recording:
            return
        rmap = next((m for t, m in reversed(self.recent_logits) if t is logits), None)
        if rmap is None:
            rmap = next((m for t, m in reversed(self.recent_logits) if t.shape == logits.shape), None)
        if rmap is not None:
            rec.emit("log_softmax", out, PLAIN, rmap, None, "log_softmax")
        else:
            rec.warn(f"{rec.pass_.path}: vLLM log_softmax rows could not be matched to logits rows")

    def after_module(self, rec: Any, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if module is not getattr(rec.model, "logits_processor", None):
            return
        if rec.pass_ is None or rec.last_rmap is None or self.last_hidden is None:
            return
        hidden = args[1] if len(args) > 1 else kwargs.get("hidden_states")
        if not _is_tensor(hidden) or not _is_tensor(output):
            return
        rows = self._logits_rows(hidden)
        if rows is None:
            rec.warn(f"{rec.pass_.path}: vLLM logits rows could not be matched to token rows; logits not recorded")
            return
        rmap = rec.last_rmap.take(rows)
        self.recent_logits = (self.recent_logits + [(output, rmap)])[-4:]
        rec.emit("logits", output, PLAIN, rmap, None)

    def _logits_rows(self, hidden: Any) -> np.ndarray | None:
        import torch

        base = self.last_hidden
        rows = align.view_rows(hidden, base)
        if rows is not None:
            return rows
        if self.batch is not None:
            cand = self.batch[0][1:] - 1
            if len(cand) == hidden.shape[0] and torch.equal(base[torch.as_tensor(cand)], hidden):
                return cand
        # last resort: match rows by content
        lookup: dict[bytes, int] = {}
        for i, r in enumerate(base):
            lookup.setdefault(r.contiguous().view(torch.uint8).numpy().tobytes(), i)
        found = [lookup.get(r.contiguous().view(torch.uint8).numpy().tobytes()) for r in hidden]
        return None if any(f is None for f in found) else np.asarray(found, dtype=np.int64)


def vllm_batch(runner: Any, md: Any) -> tuple[np.ndarray, list[str]]:
    """A vLLM forward's ``query_start_loc`` (request r's rows are ``qsl[r]:qsl[r + 1]``) from its attention
    metadata ``md``, and the request ids of those rows, in batch order (``runner.input_batch.req_ids``)."""
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


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)
