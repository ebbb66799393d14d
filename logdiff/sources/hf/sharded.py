"""The training path on N ranks, as a sharded trainer runs it: score sequences and capture them into a bundle.

``score_sharded(spec, seqs, out_dir, tensor_parallel_size=N)`` (or ``fsdp_size=N``)
starts N processes with ``torch.multiprocessing`` (spawn; a ``file://``
rendezvous in a temporary directory; gloo on CPU, NCCL on CUDA, HCCL on Ascend),
one thread each. Every rank loads the model through the HF engine itself
(``engine(spec)``, the class that asks, ``HFForward``: the same loading, options and
scoring a scan's ``hf`` path runs), then shards it with torch's own parallelism,
nothing hand-written:

* tensor parallel: ``parallelize_module`` with the colwise/rowwise plan derived
  from the model (``tensor_parallel.tp_plan``, which refuses in one line what it
  cannot shard). Every rank scores every sequence, as the ranks of one TP
  group see one batch.
* FSDP2: ``fully_shard`` on every decoder layer and on the model. Each rank
  scores its round-robin share of the sequences (data parallel), and runs idle
  forwards after its capture so that every rank joins as many all-gathers as
  the busiest one.

Each rank scores inside ``logdiff.capture(model, out_dir, "train")``, with the
engine's logprobs routed through ``Capture.logprobs``, so the bundle holds every
boundary the adapter knows, per rank (placements included, for ``unshard``), and
the ``log_softmax`` boundary, computed by the engine's own log-softmax
(temperature, and the consistent kernel in consistent mode). The bundle's
metadata says how it was run (``sharded``).

With ``consistent=True`` every rank runs the HF engine's consistent mode, and
under tensor parallel (any size, one included) ``tensor_parallel.consistent_tp``
on top: the fixed-order row-parallel reduction, so TP = N gives TP = 1's bits.

Both at once (a 2-D mesh) is refused. A rank that fails ends the run with one
line naming the rank and its exception (``InputError`` when the rank's was one,
otherwise ``EngineUnavailable``), and so does a run past ``timeout_s``.

The engine class travels in the job (pickled by reference across the spawn): this
module imports no engine, so ``HFForward``, which launches it, is not imported back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from logdiff.errors import EngineUnavailable, InputError
from logdiff.sources.base import Engine, EngineSpec, TokenSequence, resolve_device

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl", "xpu": "xccl"}


@dataclasses.dataclass(frozen=True)
class _Job:
    """What every rank is given (picklable: it crosses the spawn)."""

    spec: EngineSpec
    seqs: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (prompt ids, response ids)
    out_dir: str
    scratch: str  # rendezvous file and the ranks' error reports
    device: str  # the resolved device type: cpu, cuda, npu, ...
    tensor_parallel_size: int
    fsdp_size: int
    consistent: bool
    consistent_kernels: tuple[str, ...] | None
    timeout_s: float
    engine: type[Engine]  # what every rank loads and scores with (``HFForward``)

    @property
    def world(self) -> int:
        return self.tensor_parallel_size * self.fsdp_size


@dataclasses.dataclass
class _Seq:
    prompt_ids: list[int]
    response_ids: list[int]


def score_sharded(spec: EngineSpec, seqs: Sequence[TokenSequence], out_dir: str | Path, *, engine: type[Engine],
                  tensor_parallel_size: int = 1, fsdp_size: int = 1, consistent: bool = False,
                  consistent_kernels: tuple[str, ...] | None = None, timeout_s: float = 3600.0) -> Path:  # fmt: skip
    """Score ``seqs`` with the ``hf`` training path (``engine``: ``HFForward``) on ``tensor_parallel_size`` x
    ``fsdp_size`` ranks, captured into the bundle at ``out_dir`` (returned). ``consistent_kernels``: the families
    consistent mode covers (None: all), as ``HFEngine.consistent`` takes them."""
    tp, fsdp = check_sizes(spec, tensor_parallel_size, fsdp_size, consistent and _linear_consistent(consistent_kernels))
    device = resolve_device(spec.device).split(":")[0]
    if device not in BACKENDS:
        raise InputError(f"sharded training path: no collective backend for device {device!r}")
    _check_device_count(device, tp * fsdp)
    out = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="logdiff-ranks-") as scratch:
        job = _Job(spec, tuple((tuple(s.prompt_ids), tuple(s.response_ids)) for s in seqs), str(out), scratch,
                   device, tp, fsdp, consistent, consistent_kernels, float(timeout_s), engine)  # fmt: skip
        _launch(job)
    return out


def check_sizes(spec: EngineSpec, tensor_parallel_size: int, fsdp_size: int, consistent_linear: bool = False) -> tuple[int, int]:
    """The sizes, checked before any rank starts (InputError: one line): integers >= 1, not both above one,
    a model the TP plan can shard at that size (read on the meta device: nothing is loaded)."""
    for key, value in (("tensor_parallel_size", tensor_parallel_size), ("fsdp_size", fsdp_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{key}={value!r}: must be an integer >= 1")
    if tensor_parallel_size > 1 and fsdp_size > 1:
        raise InputError("tensor_parallel_size and fsdp_size both above 1 (a 2-D mesh) is not supported; choose one")
    if spec.option("grad", False):
        raise InputError("the sharded training path scores forward only (grad=true is not supported with it)")
    if tensor_parallel_size > 1:
        from logdiff.sources.hf.tensor_parallel import check_row_chunks, tp_plan

        model = _meta_model(spec)
        plan = tp_plan(model, tensor_parallel_size)
        if consistent_linear:
            check_row_chunks(model, plan, tensor_parallel_size)
    return tensor_parallel_size, fsdp_size


def _linear_consistent(kernels: tuple[str, ...] | None) -> bool:
    return kernels is None or "linear" in kernels


def _meta_model(spec: EngineSpec) -> Any:
    """The model's modules with this side's config overrides, on the meta device (shapes only)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from logdiff.sources.hf.loading import apply_override

    config = AutoConfig.from_pretrained(spec.model_dir, trust_remote_code=spec.trust_remote_code)
    for key, value in spec.overrides:
        apply_override(config, key, value)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=spec.trust_remote_code)


def _check_device_count(device: str, world: int) -> None:
    if device == "cpu":
        return
    import torch

    have = getattr(torch, device).device_count()
    if world > have:
        raise InputError(f"the sharded training path needs {world} {device} devices; torch sees {have}")


# ------------------------------------------------------------------------------------------ launching


def _launch(job: _Job) -> None:
    """Run ``_rank_main`` on every rank; one line naming the first rank that failed, or the timeout."""
    import torch.multiprocessing as mp

    context = mp.start_processes(_rank_main, args=(job,), nprocs=job.world, join=False, start_method="spawn")
    deadline = time.monotonic() + job.timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"sharded training path: the {job.world} ranks did not finish within "
                                        f"{job.timeout_s:g} s")  # fmt: skip
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:  # a rank failed; torch ended the others
        raise _failure(job, e) from None
    finally:
        for process in context.processes:  # only ours, and only those still running (after a timeout)
            if process.is_alive():
                process.terminate()
                process.join(5)


def _failure(job: _Job, e: Exception) -> Exception:
    """The earliest error a rank reported (the others often fail only because it left), as one line."""
    reports = []
    for path in Path(job.scratch).glob("error-*.json"):
        with contextlib.suppress(OSError, ValueError):
            reports.append(json.loads(path.read_text()))
    if not reports:
        return EngineUnavailable(f"sharded training path: {str(e).splitlines()[0]}")
    first = min(reports, key=lambda r: r["time"])
    line = f"sharded training path, rank {first['rank']}/{job.world}: {first['message']}"
    return InputError(line) if first["input"] else EngineUnavailable(line)


def _rank_main(rank: int, job: _Job) -> None:
    """One rank: set up, score and capture; any exception is written for the launcher and the rank exits 1."""
    import sys

    try:
        _rank(rank, job)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which raises it in one line
        message = str(e).splitlines()[0] if str(e) else ""
        report = {"rank": rank, "time": time.time(), "input": isinstance(e, InputError),
                  "message": message if isinstance(e, InputError) else f"{type(e).__name__}: {message}"}
        (Path(job.scratch) / f"error-{rank}.json").write_text(json.dumps(report))
        sys.exit(1)


def _rank(rank: int, job: _Job) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    distributed = job.world > 1
    if distributed:
        if job.device == "cpu":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # this process's own environment
        dist.init_process_group(BACKENDS[job.device], init_method=f"file://{job.scratch}/rendezvous", rank=rank,
                                world_size=job.world, timeout=timedelta(seconds=job.timeout_s))  # fmt: skip
    try:
        _score_rank(rank, job)
    finally:
        if distributed:
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ one rank


def _score_rank(rank: int, job: _Job) -> None:
    import torch

    from logdiff.sources.hf.capture import capture
    from logdiff.sources.hf.tensor_parallel import consistent_tp, fixed_order_plan, parallelize

    device = job.device if job.device == "cpu" else f"{job.device}:{rank}"
    if job.device != "cpu":
        getattr(torch, job.device).set_device(rank)
    # the rank itself is one unsharded engine: the sizes are this launcher's, not its
    options = tuple((k, v) for k, v in job.spec.options if k not in ("tensor_parallel_size", "fsdp_size"))
    engine = job.engine(dataclasses.replace(job.spec, device=device, options=options))
    model = engine.model
    mesh = None
    if job.world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(job.device, (job.world,))
    tp = job.tensor_parallel_size
    plan = fixed_order_plan(model, tp) if job.fsdp_size == 1 and (tp > 1 or job.consistent) else {}
    if tp > 1:
        parallelize(model, plan, mesh)
    elif job.fsdp_size > 1:
        from torch.distributed.fsdp import fully_shard

        from logdiff.probes.arch import adapter_of

        for layer in adapter_of(model).layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    every = [_Seq(list(p), list(r)) for p, r in job.seqs]
    share = every if tp > 1 or job.world == 1 else every[rank :: job.world]
    with contextlib.ExitStack() as stack:
        if job.consistent:
            stack.enter_context(engine.consistent(job.consistent_kernels))
            if plan and _linear_consistent(job.consistent_kernels):
                stack.enter_context(consistent_tp(model, plan, mesh if tp > 1 else None))
        # a collective on every rank (the weights' fingerprints); the engine's log-softmax (temperature,
        # consistent kernel) computes the recorded boundary
        with capture(model, job.out_dir, "train", log_softmax=engine._logprobs, window="all") as cap:
            cap.writer.meta_update({"sharded": {"tensor_parallel_size": tp, "fsdp_size": job.fsdp_size,
                                                "consistent": job.consistent,
                                                "consistent_kernels": job.consistent_kernels}})  # fmt: skip
            _score(engine, cap, share)
        if job.fsdp_size > 1:
            _idle_forwards(engine, model, every, rank, job.world)


def _score(engine: Any, cap: Any, seqs: list[_Seq]) -> None:
    """The ``hf`` path's teacher-forced batches (``HFForward.score``: its batch size, padding side and positions),
    each batch's logprobs taken once over all its logits through ``cap.logprobs``: the ``log_softmax`` boundary."""
    import torch

    left = engine.spec.option("padding_side", "right") == "left"
    with torch.no_grad():
        for batch in engine._batches(len(seqs)):
            rows = [seqs[i].prompt_ids + seqs[i].response_ids for i in batch]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), engine.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, seq in enumerate(rows):
                start = width - len(seq) if left else 0
                ids[r, start : start + len(seq)] = torch.tensor(seq)
                mask[r, start : start + len(seq)] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = engine.model(input_ids=ids.to(engine.device), attention_mask=mask.to(engine.device),
                                  position_ids=positions.to(engine.device)).logits  # fmt: skip
            cap.logprobs(logits)


def _idle_forwards(engine: Any, model: Any, every: list[_Seq], rank: int, world: int) -> None:
    """FSDP2 all-gathers weights in every forward: a rank with fewer batches runs (uncaptured) idle ones."""
    import torch

    batch = int(engine.spec.option("batch_size", 8))
    forwards = [-(-len(every[r::world]) // batch) for r in range(world)]
    with torch.no_grad():
        for _ in range(max(forwards) - forwards[rank]):
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=engine.device))
