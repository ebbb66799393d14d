"""A vLLM V1 logits processor that forces recorded tokens through the decode path.

A request carries ``SamplingParams(extra_args={"forced_tokens": [...]})``; at
each decode step the processor keeps only the logit of the next recorded token,
so the engine emits exactly that sequence. The logprobs vLLM returns are still
computed from the unprocessed logits (the sampler computes them before any
logits processor runs), so they are the decode path's real logprobs of the
recorded tokens. Requests without ``forced_tokens`` are left alone.

This module imports vLLM at import time; ``logdiff.sources.vllm`` loads
it only when an engine starts. It must stay importable by module path so that
an engine running in another process can load it as ``"module:Class"``.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor


class ForcedTokens(AdapterLogitsProcessor):
    """Per-request processor: keep only ``forced_tokens[len(output_so_far)]``."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: Any) -> Any:
        forced = (params.extra_args or {}).get("forced_tokens")
        if not forced:
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            token = forced[min(len(output_ids), len(forced) - 1)]
            keep = logits[token].clone()
            logits.fill_(float("-inf"))
            logits[token] = keep
            return logits

        return force
