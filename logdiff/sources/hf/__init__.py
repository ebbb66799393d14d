"""The transformers paths: the trainer's full forward and TRL-style KV-cache decode.

``hf`` is the training path: one teacher-forced forward over prompt + response,
batched with padding and an attention mask, exactly how an RL trainer
recomputes old/ref logprobs. ``hf-decode`` prefills the prompt and then feeds
the response one token at a time through the KV cache, as rollouts without
vLLM do. Both load the staged directory with ``from_pretrained`` and apply
per-side config overrides to the config before loading.

Logprobs are ``log_softmax`` of the fp32 logits (divided by the temperature
when one is set), gathered at the scored token. In consistent mode the
reference kernels replace the model's operators and the log_softmax.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from logdiff.errors import InputError
from logdiff.sources.base import (
    Engine,
    EngineSpec,
    PathScores,
    Sampled,
    TokenSequence,
    package_version,
    unsupported_as_input_error,
)
from logdiff.sources.hf.loading import load_model
from logdiff.sources.hf.scored_rows import ScoredRows
from logdiff.sources.hf.taps import TAPS


class HFEngine(Engine):
    """A transformers model on one device: the base of ``hf`` and ``hf-decode``."""

    options = frozenset({"temperature", "attn_implementation", "batch_size", "padding_side"})
    capabilities = frozenset({"sample", "contract", "consistent", "full_logprobs", "forced_routing", "capture"})
    tap_mapping = TAPS
    fixed_order_rows = True

    @classmethod
    def versions(cls) -> dict[str, str | None]:
        return {"transformers": package_version("transformers")}

    def __init__(self, spec: EngineSpec, model: Any = None):
        super().__init__(spec)
        self.model = load_model(spec) if model is None else model  # ``model``: one already loaded (a trainer's)
        self._scored: ScoredRows | None = None  # the full rows the last score kept, for full_logprobs
        self._consistent = False
        self._consistent_mode: tuple[tuple[str, ...] | None] | None = None  # (only,) while consistent

    @property
    def pad_id(self) -> int:
        cfg = self.model.config
        pad = getattr(cfg, "pad_token_id", None)
        return int(pad) if pad is not None else 0

    def _logprobs(self, logits: Any) -> Any:
        """fp32 log-probabilities of a ``[..., vocab]`` logits tensor."""
        import torch

        logits = logits.float()
        temperature = float(self.spec.option("temperature", 1.0))
        if temperature != 1.0:
            logits = logits / temperature
        if self._consistent:
            from logdiff.kernels import log_softmax

            return log_softmax(logits)
        return torch.log_softmax(logits, dim=-1)

    @property
    def device(self) -> Any:
        """The device the model computes on; inputs go there, results come back to the CPU."""
        return next(self.model.parameters()).device

    def _batches(self, n: int) -> Iterator[range]:
        size = int(self.spec.option("batch_size", 8))
        for start in range(0, n, size):
            yield range(start, min(n, start + size))

    @contextlib.contextmanager
    def consistent(self, only: tuple[str, ...] | None = None, fixed_order_rows: bool = False) -> Iterator[None]:
        from logdiff.sources.hf.consistent import consistent_hf

        installer = consistent_hf(self.model, only)
        if self.spec.option("grad", False) and only is None:
            from logdiff.sources.hf.training import consistent_training  # refuses active dropout

            installer = consistent_training(self.model)
        rows = quantized = contextlib.nullcontext()
        if fixed_order_rows and (only is None or "linear" in only):
            from logdiff.sources.hf.tensor_parallel import consistent_tp, fixed_order_plan

            rows = consistent_tp(self.model, fixed_order_plan(self.model, 1))
        scheme = self.spec.option("consistent_quantization")
        if scheme is not None and (only is None or "linear" in only):  # the INT8 rollout's quantization, here too
            from logdiff.sources.hf.consistent_quant import consistent_quantized

            if fixed_order_rows:
                raise InputError("--consistent: consistent_quantization has no fixed-order row-parallel linear yet")

            quantized = consistent_quantized(self.model, scheme)
        with unsupported_as_input_error(), installer, rows, quantized:
            self._consistent = only is None or "log_softmax" in only
            self._consistent_mode = (only,)  # what a path scored on ranks of its own installs there
            try:
                yield
            finally:
                self._consistent = False
                self._consistent_mode = None

    def module(self) -> Any:
        return self.model

    def probes(self) -> Any:
        from logdiff.sources.hf.probes import HFProbes

        return HFProbes(self)

    def full_logprobs(self, seqs: list[TokenSequence], limit: int, prompt: Any = list) -> list[np.ndarray]:
        """The rows the last ``score`` of these very sequences kept (``_scored``: the same forward, no second
        one), else one unpadded teacher-forced forward per sequence in fp32 ``log_softmax``."""
        kept = self._scored.rows_for(seqs, limit) if prompt is list and self._scored is not None else None
        if kept is not None:
            return kept
        import torch

        out: list[np.ndarray] = []
        total = 0
        with torch.no_grad():
            for s in seqs:
                if total >= limit:
                    break
                head = prompt(list(s.prompt_ids))
                p, n = len(head), len(s.response_ids)
                ids = torch.tensor([head + list(s.response_ids)], device=self.device)
                logits = self.model(input_ids=ids).logits[0, p - 1 : p + n - 1].float()
                out.append(torch.log_softmax(logits, dim=-1).cpu().numpy())
                total += n
        return out

    @contextlib.contextmanager
    def forced_routing(self, forced: Any) -> Iterator[dict[str, int]]:
        from logdiff.sources.hf.routing import forced_routing

        with forced_routing(self, forced) as counts:
            yield counts

    def router_biases(self) -> dict[int, Any]:
        from logdiff.probes.arch.base import router_biases

        return router_biases(self.model)

    def rope_params(self) -> dict[str | None, Any]:
        from logdiff.sources.hf.consistent_rope import rope_params_of

        rotary = next((m for m in self.model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
        try:
            return rope_params_of(rotary) if rotary is not None else {}
        except (NotImplementedError, ValueError, AttributeError, KeyError):  # a table the kernels do not cover
            return {}

    def contract(self) -> dict[str, Any]:
        from logdiff.sources.hf.contract import hf_contract

        return hf_contract(self.model, dict(self.spec.options))

    def fingerprints(self, at: str | None = None) -> dict[str, str]:
        from logdiff.sources.hf.contract import hf_fingerprints

        return hf_fingerprints(self.model, at)

    def loaded_config(self) -> Any:
        return self.model.config

    def effective_options(self) -> dict[str, Any]:
        return {
            "temperature": float(self.spec.option("temperature", 1.0)),
            "attn_implementation": self.model.config._attn_implementation,
            "batch_size": int(self.spec.option("batch_size", 8)),
            "padding_side": self.spec.option("padding_side", "right"),
        }

    def info(self) -> dict[str, Any]:
        import transformers

        return {
            "engine": self.name,
            "version": transformers.__version__,
            "settings": {
                "dtype": self.spec.dtype,
                "attn_implementation": self.model.config._attn_implementation,
                **{k: v for k, v in self.spec.options if k != "attn_implementation"},
            },
        }

    def sample(self, prompts: list[list[int]], response_len: int, seed: int) -> Sampled:
        """Sample with KV-cache decode at the engine's temperature (a TRL-style rollout)."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        responses: list[list[int]] = []
        for batch in self._batches(len(prompts)):
            self._begin_pass(self.name, list(batch))
            chosen: list[list[int]] = [[] for _ in batch]

            def pick(step_logprobs: Any, t: int) -> Any:
                # NaN/inf logprobs are a finding, reported from the scores: sample around them, a row with
                # no finite probability takes the pad token (as vLLM does), so the scan completes.
                probs = torch.nan_to_num(step_logprobs.exp(), nan=0.0, posinf=0.0, neginf=0.0)
                probs[probs.sum(-1) <= 0, self.pad_id] = 1.0
                nxt = torch.multinomial(probs.cpu(), 1, generator=gen)[:, 0]  # the same draws on any device
                for row, tok in enumerate(nxt.tolist()):
                    chosen[row].append(tok)
                return nxt

            self._decode([prompts[i] for i in batch], response_len, pick)
            responses.extend(chosen)
        return Sampled(responses)

    def _decode(self, prompts: list[list[int]], steps: int, next_token: Any) -> None:
        """Left-padded prefill, then ``steps`` KV-cache decode steps.

        ``next_token(step_logprobs [B, V], t)`` returns the ids fed at step t.
        """
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
        with torch.no_grad():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
            for t in range(steps):
                nxt = next_token(self._logprobs(out.logits[:, -1]), t)
                if t == steps - 1:
                    break
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                positions = positions[:, -1:] + 1
                out = self.model(
                    input_ids=nxt[:, None].to(self.device),
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )


class HFForward(HFEngine):
    """Teacher-forced full forward: the training path."""

    name = "hf"
    mode = "forward"
    #: tensor_parallel_size / fsdp_size: the ranks of the sharded training path (``sharded.score_sharded``)
    #: consistent_quantization: under --consistent, the linears compute as an INT8 rollout does (consistent_quant)
    options = HFEngine.options | {"grad", "tensor_parallel_size", "fsdp_size", "consistent_quantization"}
    capabilities = HFEngine.capabilities | {"captured_scoring"}

    def __init__(self, spec: EngineSpec, model: Any = None):
        self.tensor_parallel_size = int(spec.option("tensor_parallel_size", 1))
        self.fsdp_size = int(spec.option("fsdp_size", 1))
        if self.tensor_parallel_size > 1 or self.fsdp_size > 1:  # refused before the model loads, in one line
            from logdiff.sources.hf.sharded import check_sizes

            check_sizes(spec, self.tensor_parallel_size, self.fsdp_size)
        super().__init__(spec, model)

    def score_captured(self, seqs: list[TokenSequence], out_dir: Path) -> Path | None:
        """On ``tensor_parallel_size`` or ``fsdp_size`` ranks of its own (``sharded.score_sharded``), in the consistent
        mode this engine is in, captured into ``out_dir``; None when both sizes are 1."""
        if self.tensor_parallel_size == self.fsdp_size == 1:
            return None
        from logdiff.sources.hf.sharded import score_sharded

        mode = self._consistent_mode
        return score_sharded(self.spec, seqs, out_dir, engine=type(self),
                             tensor_parallel_size=self.tensor_parallel_size, fsdp_size=self.fsdp_size,
                             consistent=mode is not None,
                             consistent_kernels=mode[0] if mode is not None else None)

    def effective_options(self) -> dict[str, Any]:
        return {**super().effective_options(), "grad": bool(self.spec.option("grad", False)),
                "tensor_parallel_size": self.tensor_parallel_size, "fsdp_size": self.fsdp_size}

    @contextlib.contextmanager
    def _step_mode(self) -> Iterator[bool]:
        """``--set train.grad=true``: train mode with autograd recording, as in a real training step."""
        import torch

        if not self.spec.option("grad", False):
            with torch.no_grad():
                yield False
            return
        from logdiff.sources.hf.training import active_dropout

        dropout = active_dropout(self.model)
        if dropout:
            raise InputError("--set train.grad=true: the model trains with dropout (" + ", ".join(dropout) + ")")
        self.model.train()
        try:
            with torch.enable_grad():
                yield True
        finally:
            self.model.eval()
            self.model.zero_grad(set_to_none=True)

    def score(self, seqs: list[TokenSequence]) -> list[PathScores]:
        import torch

        left = self.spec.option("padding_side", "right") == "left"
        logprobs: list[np.ndarray] = []
        top1: list[np.ndarray] = []
        keep = ScoredRows.of(seqs) if float(self.spec.option("temperature", 1.0)) == 1.0 else None
        for batch in self._batches(len(seqs)):
            self._begin_pass(self.name, list(batch))
            rows = [seqs[i] for i in batch]
            width = max(len(s.prompt_ids) + len(s.response_ids) for s in rows)
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            starts = []
            for r, s in enumerate(rows):
                seq = s.prompt_ids + s.response_ids
                start = width - len(seq) if left else 0
                ids[r, start : start + len(seq)] = torch.tensor(seq)
                mask[r, start : start + len(seq)] = 1
                starts.append(start)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            with self._step_mode() as grad:
                logits = self.model(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device), position_ids=positions.to(self.device)
                ).logits
                scored = []
                for r, s in enumerate(rows):
                    p, n = len(s.prompt_ids), len(s.response_ids)
                    lp = self._logprobs(logits[r, starts[r] + p - 1 : starts[r] + p + n - 1]).cpu()
                    tokens = torch.tensor(s.response_ids)
                    scored.append(lp.gather(-1, tokens[:, None])[:, 0])
                    top1.append(lp.detach().argmax(-1).numpy())
                    if keep is not None:
                        keep.add(lp)
                if grad:  # the step's backward runs too (through the kernels' backwards in consistent mode)
                    torch.stack([x.sum() for x in scored]).sum().backward()
            logprobs.extend(x.detach().numpy() for x in scored)
        self._scored = keep
        return [PathScores(self.name, self.mode, logprobs, top1)]


class HFDecode(HFEngine):
    """Prefill the prompt, then teacher-forced token-by-token decode through the KV cache."""

    name = "hf-decode"
    mode = "decode"

    def effective_options(self) -> dict[str, Any]:
        return {**super().effective_options(), "padding_side": "left"}  # decode always left-pads

    def score(self, seqs: list[TokenSequence]) -> list[PathScores]:
        import torch

        logprobs: list[np.ndarray] = []
        top1: list[np.ndarray] = []
        for batch in self._batches(len(seqs)):
            self._begin_pass(self.name, list(batch))
            rows = [seqs[i] for i in batch]
            steps = max(len(s.response_ids) for s in rows)
            # Finished rows keep decoding a pad token; their extra steps are discarded.
            forced = torch.full((len(rows), steps), self.pad_id, dtype=torch.long)
            for r, s in enumerate(rows):
                forced[r, : len(s.response_ids)] = torch.tensor(s.response_ids)
            step_lp: list[Any] = []
            step_top: list[Any] = []

            def feed(lp: Any, t: int) -> Any:
                lp = lp.cpu()
                step_lp.append(lp.gather(-1, forced[:, t : t + 1])[:, 0])
                step_top.append(lp.argmax(-1))
                return forced[:, t]

            self._decode([s.prompt_ids for s in rows], steps, feed)
            lp_all = torch.stack(step_lp, dim=1).numpy()
            top_all = torch.stack(step_top, dim=1).numpy()
            for r, s in enumerate(rows):
                n = len(s.response_ids)
                logprobs.append(lp_all[r, :n].copy())
                top1.append(top_all[r, :n].copy())
        return [PathScores(self.name, self.mode, logprobs, top1)]
