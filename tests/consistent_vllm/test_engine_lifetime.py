"""Closing a vLLM engine tears down the parallel state vLLM set up in this process (issue 23).

vLLM keeps its process groups in ``vllm.distributed.parallel_state``'s module globals and
creates the expert-parallel group only for an MoE model. An engine closed without tearing them
down leaves the next engine to reuse a dense model's groups: an MoE model loaded after a dense
one then fails with "expert parallel group is not initialized". Each test scopes its own pool,
so the engines it loads are closed when it ends.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from logdiff.records.sequences import Sequence
from logdiff.sources.base import EngineSpec
from logdiff.sources.pool import engine_pool

pytestmark = pytest.mark.vllm

SPEC = (("max_num_seqs", 2), ("max_model_len", 64), ("max_num_batched_tokens", 64))


def _groups() -> tuple[bool, bool]:
    """(vLLM's model-parallel groups are set up, torch.distributed is initialized)."""
    import torch.distributed
    from vllm.distributed import parallel_state

    return parallel_state.model_parallel_is_initialized(), torch.distributed.is_initialized()


def test_a_moe_model_loads_after_a_dense_one(demo_model: Callable[[str], Path]) -> None:
    seq = [Sequence(prompt_ids=[3, 4, 5, 6], response_ids=[7, 8, 9])]
    with engine_pool() as pool:
        for arch in ("qwen3", "qwen3-moe"):  # the second evicts (closes) the first: vLLM is exclusive
            engine = pool.acquire("vllm", EngineSpec(model_dir=str(demo_model(arch)), options=SPEC))
            assert _groups() == (True, True)  # control: a live engine holds them
            (scores,) = engine.score(seq)[:1]
            assert len(scores.logprobs[0]) == 3
    assert _groups() == (False, False)  # released with the pool

