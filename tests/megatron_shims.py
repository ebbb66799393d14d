"""Test-side shims that let megatron-core 0.16.1's local spec run forwards on CPU over gloo.

Megatron assumes CUDA in a few places that a CPU forward reaches (docs/capture.md, "Megatron-core"):
``torch.cuda.current_device()`` (rotary embeddings, attention and ``mappings``'s gathers), the model-parallel
RNG tracker (``model_parallel_cuda_manual_seed``; dropout forks it even at p = 0), the default causal mask
built on ``cuda`` (tests pass an explicit mask), the local norms' sequence-parallel assert and the router's
``te_general_gemm``, unbound without Transformer Engine, and the all-to-all dispatcher's side stream and
split sizes; ``pipeline_schedule()`` covers the pipeline schedule's ``cuda`` tensors and ``torch.cuda.synchronize``. ``install()`` patches those in the calling process only: call it
in a worker process, never in the pytest process. logdiff's own code patches nothing of Megatron.
"""

from __future__ import annotations

import contextlib
import os


_installed = False


def install() -> None:
    """Patch the CUDA assumptions in this process (a spawned test worker); once, however often it is called."""
    global _installed
    if _installed:
        return
    _installed = True
    import torch

    torch.cuda.current_device = lambda: "cpu"  # tensors Megatron allocates "on the current device" go to the CPU
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # no CUDA RNG states: dropout is off (p = 0) anyway
    _sp_norms()
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 reads the name unbound when TE is not installed
        moe_utils.te_general_gemm = None
    _alltoall()


def _alltoall() -> None:
    """The all-to-all dispatcher copies its split sizes to the host on a CUDA side stream and hands them to
    ``all_to_all`` as numpy arrays: on the CPU, no stream, and the sizes as lists of ints."""
    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAlltoAllTokenDispatcher as Dispatcher,
    )

    Dispatcher.cuda_dtoh_stream = "cpu"  # set, so the constructor makes no torch.cuda.Stream()

    def host_sizes(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name, None)
                if hasattr(value, "tolist"):
                    setattr(self, name, value.tolist())
        return tokens_per_expert

    Dispatcher._maybe_dtoh_and_synchronize = host_sizes


def _sp_norms() -> None:
    """The local spec's torch norms assert ``not sequence_parallel`` although their forward is per row (SP only
    marks their gradients for an all-reduce): build them with the flag off, the rest of the model with it on."""
    import dataclasses

    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, *args, **kwargs):
        if getattr(config, "sequence_parallel", False):
            config = dataclasses.replace(config, sequence_parallel=False)
        return original(cls, config, *args, **kwargs)

    torch_norm.WrappedTorchNorm.__new__ = new


def init(rank: int, world: int, store: str) -> None:
    """gloo over a file store, and the shims; one thread (a GEMM's bits may depend on it)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    install()


@contextlib.contextmanager
def parallel_state(tp: int = 1, pp: int = 1, ep: int = 1):
    """Megatron's parallel state over the process group for the block, destroyed after it: one rank runs one
    layout after another, each in its own groups."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    try:
        yield
    finally:
        ps.destroy_model_parallel()


@contextlib.contextmanager
def pipeline_schedule():
    """Megatron's pipeline schedules count tokens in ``torch.zeros(..., device="cuda")`` and its p2p calls
    ``torch.cuda.synchronize()``: inside the block the first allocates on the CPU, the second does nothing."""
    import torch

    zeros, synchronize = torch.zeros, torch.cuda.synchronize

    def cpu_zeros(*args, **kwargs):
        if str(kwargs.get("device")) == "cuda":
            kwargs["device"] = "cpu"
        return zeros(*args, **kwargs)

    torch.zeros, torch.cuda.synchronize = cpu_zeros, lambda *a, **k: None
    try:
        yield
    finally:
        torch.zeros, torch.cuda.synchronize = zeros, synchronize


def causal_mask(length: int):
    """Megatron's mask convention: True where a query may not attend (``[1, 1, S, S]``)."""
    import torch

    return torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool), diagonal=1)


def finish() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()
