"""``fake``: a third engine, added the way any engine is added, to prove the conformance suite.

It is a real engine, not a stub: a plain-PyTorch decoder of its own (``model.py``)
that loads a Llama-like checkpoint (Qwen3, Llama, Qwen2, Mistral: dense, default
RoPE, no sliding window) from the staged directory and scores teacher-forced,
one unpadded sequence at a time. Its modules are named and fused its own way
(``blocks.N.attn.wqkv``, ``blocks.N.ffn.w13``, explicit residual adds, the
log-softmax as a module), and ``taps.py`` maps the adapters' boundaries onto
them: no architecture adapter knows this engine exists. Its probes
(``FakeProbes``) need no function wrappers, since every op is a module.

It declares ``contract``, ``capture`` and ``full_logprobs``; sampling, consistent
mode and forced routing it does not have, and the suite checks that it refuses
them in one line. The test registers it for the test's duration
(``registered_fake``); nothing in logdiff imports this folder.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from logdiff.errors import EngineUnavailable, InputError
from logdiff.sources.base import Engine, EngineSpec, PathScores, TokenSequence
from logdiff.sources.registry import ENGINES

from .probes import FakeProbes
from .taps import TAPS

#: the HF model types whose checkpoints this engine computes (dense Llama-like decoders)
SUPPORTED = ("qwen3", "llama", "qwen2", "mistral")


class FakeEngine(Engine):
    name = "fake"
    mode = "forward"
    options = frozenset()
    capabilities = frozenset({"contract", "capture", "full_logprobs"})
    tap_mapping = TAPS

    def __init__(self, spec: EngineSpec):
        super().__init__(spec)
        if spec.device not in ("auto", "cpu"):
            raise EngineUnavailable(f"engine fake computes on the CPU only, not on {spec.device}")
        config = json.loads((Path(spec.model_dir) / "config.json").read_text())
        config.update(dict(spec.overrides))
        if config.get("model_type") not in SUPPORTED or config.get("use_sliding_window"):
            raise InputError(f"engine fake computes {', '.join(SUPPORTED)} decoders without a sliding window, "
                             f"not {config.get('model_type')!r}")
        rope = config.get("rope_parameters") or {"rope_type": "default"}
        if rope.get("rope_type", "default") != "default":
            raise InputError(f"engine fake computes default RoPE only, not {rope.get('rope_type')!r}")
        from .model import load

        self.config = config
        self.model = load(Path(spec.model_dir), config, spec.dtype)

    def score(self, seqs: list[TokenSequence]) -> list[PathScores]:
        import torch

        logprobs, top1 = [], []
        with torch.no_grad():
            for i, s in enumerate(seqs):
                self._begin_pass(self.name, [i])
                lp = self._forward(list(s.prompt_ids) + list(s.response_ids))
                p, n = len(s.prompt_ids), len(s.response_ids)
                rows = lp[p - 1 : p + n - 1]
                logprobs.append(rows.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0].numpy())
                top1.append(rows.argmax(-1).numpy())
        return [PathScores(self.name, self.mode, logprobs, top1)]

    def _forward(self, ids: list[int]) -> Any:
        import torch

        tokens = torch.tensor([ids])
        return self.model(input_ids=tokens, positions=torch.arange(len(ids))[None])[0]

    def full_logprobs(self, seqs: list[TokenSequence], limit: int, prompt: Any = list) -> list[np.ndarray]:
        import torch

        out, total = [], 0
        with torch.no_grad():
            for s in seqs:
                if total >= limit:
                    break
                head = prompt(list(s.prompt_ids))
                p, n = len(head), len(s.response_ids)
                out.append(self._forward(head + list(s.response_ids))[p - 1 : p + n - 1].numpy())
                total += n
        return out

    def module(self) -> Any:
        return self.model

    def probes(self) -> Any:
        return FakeProbes(self)

    def contract(self) -> dict[str, Any]:
        m, c = self.model, self.config
        attn = m.blocks[0].attn
        return {
            "dtype": str(m.tok_embeddings.weight.dtype).replace("torch.", ""),
            "vocab_size": int(m.output.weight.shape[0]),
            "rms_norm_eps": m.blocks[0].attn_norm.eps,
            "qk_norm_eps": attn.q_norm.eps if attn.q_norm is not None else None,
            "final_norm_eps": m.norm.eps,
            "rope_theta": attn.rope.theta,
            "rope_type": "default",
            "rope_style": "neox",
            "attention_scale": attn.core.scale,
            "sliding_window": None,
            "tie_word_embeddings": m.output.weight is m.tok_embeddings.weight,
            "num_experts_per_tok": c.get("num_experts_per_tok"),
            "norm_topk_prob": c.get("norm_topk_prob"),
            "temperature": 1.0,
            "logprobs_mode": "raw_logprobs",
        }

    def fingerprints(self) -> dict[str, str]:
        from logdiff.probes.contracts import fingerprint

        return {name: fingerprint(t) for name, t in self.model.hf_tensors().items()}

    def loaded_config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.spec.model_dir)

    def effective_options(self) -> dict[str, Any]:
        return {}

    def info(self) -> dict[str, Any]:
        return {"engine": self.name, "version": "test", "settings": {"dtype": self.spec.dtype}}


@contextlib.contextmanager
def registered_fake() -> Iterator[type[FakeEngine]]:
    """``fake`` in the engine registry inside the block (``get_engine("fake")``, scans, the CLI)."""
    ENGINES[FakeEngine.name] = FakeEngine
    try:
        yield FakeEngine
    finally:
        ENGINES.pop(FakeEngine.name, None)
