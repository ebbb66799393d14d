"""Capture on the ranks of a real sharded run, un-shard offline (issue 22).

Two processes on gloo run the demo Qwen3, each inside ``probes.capture.Capture``:

* under DTensor tensor parallel (``parallelize_module``: q/k/v, gate and up
  column-wise, o and down row-wise), both ranks on the same batch. Every record
  is rebuilt offline (``Bundle.logical``, numpy only) and compared with the same
  capture of the unsharded model: the same boundaries, the same shapes, the
  row-parallel replicas bitwise equal, and values within a float32 bound (the
  all-reduce reorders the row-parallel sums; nothing else differs). The planted
  control: rank 1 perturbs its own shard of layer 0's ``up_proj`` weight; the first
  record that differs is ``up_proj``, in rank 1's columns only.
* under FSDP2 (``fully_shard`` per layer and on the model), each rank on its own
  batch. FSDP2 gathers exact weights before each forward, so each rank's records
  must equal, bit for bit, the unsharded model's capture of that rank's batch.

Both runs compute in float32.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from sharding import expect_collective_order_only

pytestmark = pytest.mark.slow

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
IDS = [[5, 17, 3, 9, 42, 7, 11, 2], [8, 1, 30, 4, 6, 19, 23, 13]]
RANK_IDS = {0: [IDS[0]], 1: [IDS[1]]}  # FSDP2: each rank its own batch
PLANTED = "model.layers.0.mlp.up_proj"


def _load(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _capture(model, out: Path, batches: list[list[list[int]]], window: int | str = "all") -> None:
    """The public ``logdiff.capture``: the layout is read from the model (FSDP2, a DTensor mesh, or none)."""
    import torch

    import logdiff

    with logdiff.capture(model, out, "train", window=window), torch.no_grad():
        for ids in batches:
            model(torch.tensor(ids))


def _rank(rank: int, world: int, model_dir: str, out: str, store: str, mode: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = _load(model_dir)
        if mode == "2d":  # torchtitan's layout: TP inside each of 2 FSDP2 groups, each its own sequence
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
            _parallelize(model, mesh["tp"])
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            _capture(model, Path(out), [RANK_IDS[mesh.get_local_rank("dp")]])
            return
        mesh = init_device_mesh("cpu", (world,))
        if mode == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            _capture(model, Path(out), [RANK_IDS[rank]])  # data parallel: each rank its own tp group of one
            return
        _parallelize(model, mesh)
        if mode == "planted" and rank == 1:
            with torch.no_grad():
                dict(model.named_modules())[PLANTED].weight.to_local()[0] += 0.25
        _capture(model, Path(out), [IDS])
    finally:
        dist.destroy_process_group()


def _parallelize(model, mesh) -> None:
    """DTensor tensor parallel over ``mesh``: q/k/v, gate, up column-wise; o, down row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(model.config.num_hidden_layers):
        plan.update({f"model.layers.{i}.{m}": ColwiseParallel() for m in COLWISE})
        plan.update({f"model.layers.{i}.{m}": RowwiseParallel() for m in ROWWISE})
    parallelize_module(model, mesh, plan)


def _run(model_dir: Path, tmp_path: Path, mode: str, world: int = 2):
    import torch.multiprocessing as mp

    from logdiff.records.bundle import Bundle

    out = tmp_path / mode
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_rank, args=(world, str(model_dir), str(out), str(tmp_path / f"store-{mode}"), mode),
                       nprocs=world, join=True, start_method="spawn")
    return Bundle(out)


@pytest.fixture(scope="module")
def unsharded(demo_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory):
    """The demo model's directory and its captures, unsharded: of both sequences, and of each alone."""
    import torch

    from logdiff.records.bundle import Bundle

    model_dir = demo_model("qwen3")
    model = _load(str(model_dir))
    root = tmp_path_factory.mktemp("unsharded")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: a GEMM's bits may depend on its thread count
    try:
        _capture(model, root / "both", [IDS])
        _capture(model, root / "steps", [[ids] for ids in IDS])  # one sequence per step, as FSDP2's ranks run them
        for rank, ids in RANK_IDS.items():
            _capture(model, root / f"rank{rank}", [ids])
    finally:
        torch.set_num_threads(threads)
    return model_dir, Bundle(root / "both"), {r: Bundle(root / f"rank{r}") for r in RANK_IDS}


@pytest.fixture(scope="module")
def tp2(unsharded, tmp_path_factory: pytest.TempPathFactory):
    """The TP=2 capture of both sequences."""
    return _run(unsharded[0], tmp_path_factory.mktemp("tp2"), "tp")


@pytest.fixture(scope="module")
def fsdp2(unsharded, tmp_path_factory: pytest.TempPathFactory):
    """The FSDP2 capture: each rank its own sequence."""
    return _run(unsharded[0], tmp_path_factory.mktemp("fsdp2"), "fsdp")


def _single(bundle, name: str) -> np.ndarray:
    (logical,) = bundle.logical(0, name).values()
    return logical.value


def _f32(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float32)


def test_unsharded_capture_records_every_boundary_the_adapter_knows(unsharded) -> None:
    from logdiff.probes.arch import adapter_for

    model_dir, both, _ = unsharded
    config = json.loads((model_dir / "config.json").read_text())
    known = adapter_for(config["architectures"][0]).correspondence(config).order
    # all of them, in the order the model ran them; log_softmax only when the trainer's goes through the capture
    assert set(both.names(0)) == set(known) - {"log_softmax"}
    (table,) = both.rows(0).values()
    assert table["tokens"].tolist() == sum(IDS, []) and table["sequences"].tolist() == [0] * 8 + [1] * 8
    meta = both.ranks[0].meta
    assert meta["warnings"] == [] and meta["contract"]["vocab_size"] == config["vocab_size"]
    # one rank (a process group of one, as an in-process vLLM leaves, reads the same)
    assert (both.world_size, both.ranks[0].layout.group("tp")) == (1, (0,))


def test_tp2_capture_unshards_to_the_unsharded_capture(unsharded, tp2) -> None:
    model_dir, both, _ = unsharded
    bundle = tp2
    assert bundle.world_size == 2 and bundle.names(0) == both.names(0)
    assert [part.meta["warnings"] for part in bundle.ranks] == [[], []]
    assert [part.layout.group("tp") for part in bundle.ranks] == [(0, 1), (0, 1)]
    sharded = set()
    for name in both.names(0):
        (logical,) = bundle.logical(0, name).values()
        want = _f32(_single(both, name))
        assert logical.ranks == (0, 1) and logical.value.shape == want.shape, name
        if logical.replicas_equal is None:
            sharded.add(name)
        else:
            assert logical.replicas_equal, f"{name}: the replicas differ"
        assert np.max(np.abs(_f32(logical.value) - want)) <= 1e-5 * (np.abs(want).max() + 1e-30), name
    assert {n for n in sharded if n.startswith("model.layers.0.")} >= {
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.rope_q", "model.layers.0.self_attn.attn_core",
        "model.layers.0.mlp.act_mul"}  # fmt: skip
    assert "model.layers.0.self_attn.o_proj" not in sharded and "logits" not in sharded


def test_a_shard_planted_on_rank_1_is_the_first_record_to_differ(unsharded, tmp_path: Path) -> None:
    model_dir, both, _ = unsharded
    bundle = _run(model_dir, tmp_path, "planted")
    differing = []
    for name in both.names(0):
        want = _f32(_single(both, name))
        got = _f32(_single(bundle, name))
        if np.max(np.abs(got - want)) > 1e-5 * (np.abs(want).max() + 1e-30):
            differing.append((name, got - want))
    assert differing and differing[0][0] == PLANTED
    per_column = np.abs(differing[0][1]).max(axis=0)
    half = per_column.shape[0] // 2
    assert per_column[:half].max() <= 1e-5 and per_column[half] > 0  # rank 0's columns untouched


def test_fsdp2_ranks_equal_the_unsharded_model_on_their_batches_bitwise(unsharded, fsdp2) -> None:
    model_dir, _, alone = unsharded
    bundle = fsdp2
    for rank, reference in alone.items():
        assert bundle.names(0) == reference.names(0)
        for name in reference.names(0):
            logical = bundle.logical(0, name)[(rank,)]
            assert np.array_equal(logical.value, _single(reference, name)), f"rank {rank}: {name}"
        assert bundle.rows(0)[(rank,)]["tokens"].tolist() == RANK_IDS[rank][0]
    assert [part.layout.group("dp") for part in bundle.ranks] == [(0, 1), (0, 1)]


def test_logprobs_routed_through_the_capture_are_recorded(unsharded, tmp_path: Path) -> None:
    import torch

    import logdiff
    from logdiff.records.bundle import Bundle

    model_dir, both, _ = unsharded
    model = _load(str(model_dir))
    with logdiff.capture(model, tmp_path / "lp", "train", window="all") as cap, torch.no_grad():
        logprobs = cap.logprobs(model(torch.tensor(IDS)).logits)
    bundle = Bundle(tmp_path / "lp")
    assert set(bundle.names(0)) == set(both.names(0)) | {"log_softmax"}
    recorded = _single(bundle, "log_softmax")
    assert np.array_equal(recorded, logprobs.reshape(-1, logprobs.shape[-1]).numpy())


# ---- logdiff compare of these bundles (logdiff/commands/compare.py) ----------------------------------------------------------


def _compare(train, infer, tmp_path: Path | None = None, model: Path | None = None) -> dict:
    """``logdiff compare`` of two bundles; with ``model`` (``--model``, the checkpoint both ran) each side's ops
    are judged against their exact functions, without it no op gets a class but ``not_judged``."""
    from logdiff.commands.compare import compare_bundles

    return compare_bundles(train.root, infer.root, model=model).to_dict()


def test_compare_tp2_against_unsharded_blames_the_row_parallel_sums(unsharded, tp2) -> None:
    """Only the row-parallel outputs introduce error (their inputs equal bit for bit once un-sharded), and each
    is ``collective_order``: the TP=2 side sums over 2 ranks, the unsharded one over 1."""
    _, both, _ = unsharded
    result = _compare(tp2, both, model=unsharded[0])
    assert result["sequences"]["count"] == 2 and result["settings"]["sequence_source"] == "bundle"
    assert result["paths"][0]["settings"]["tensor_parallel_size"] == 2
    weights = result["contracts"]["weights"]  # the sharded weights, gathered on entry, hash as the whole ones
    assert weights["differs"] == [] and weights["unverified"] == [] and weights["verified"] > 0
    expect_collective_order_only(result)  # last: it skips where this CPU slices other ops differently


def test_compare_fsdp2_against_unsharded_is_bitwise_consistent(unsharded, fsdp2, tmp_path: Path) -> None:
    """Two data-parallel ranks, each its own sequence, joined by token ids against the unsharded capture of the
    same sequences: equal everywhere. The negative control is the TP=2 comparison above, and a planted weight."""
    import torch

    _, _, _ = unsharded
    steps = unsharded[1].root.parent / "steps"
    from logdiff.records.bundle import Bundle

    result = _compare(fsdp2, Bundle(steps))
    assert result["verdict"] == "consistent", result["warnings"]
    assert result["logprobs"]["abs_diff_max"] == 0.0 and result["first_divergence"] is None
    assert result["sequences"]["count"] == 2
    # a planted stale weight on the unsharded side is found, at its op, as a weight difference
    model = _load(str(unsharded[0]))
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight.mul_(1.01)
    torch.set_num_threads(1)
    _capture(model, tmp_path / "stale", [[ids] for ids in IDS])
    planted = _compare(fsdp2, Bundle(tmp_path / "stale"))
    assert planted["first_divergence"]["boundary"] == "model.layers.1.post_attention_layernorm"
    (cause,) = [c for c in planted["causes"] if c["boundary"] == "model.layers.1.post_attention_layernorm"]
    assert (cause["class"], cause["kind"]) == ("framework_difference", "weights")
    assert planted["contracts"]["weights"]["differs"] == ["model.layers.1.post_attention_layernorm.weight"]


def test_compare_fsdp2_with_tp_on_a_2d_mesh(unsharded, tmp_path: Path) -> None:
    """4 ranks: 2 FSDP2 groups x TP = 2. The layout is read from the 2-D mesh (each TP pair one ``tp`` group, one
    sequence each); against the unsharded capture of those sequences, what differs is a row-parallel sum,
    ``collective_order``, and the contracts and weights (gathered whole on entry) are the same."""
    from logdiff.records.bundle import Bundle

    bundle = _run(unsharded[0], tmp_path, "2d", world=4)
    assert [(p.layout.group("tp"), p.layout.group("dp")) for p in bundle.ranks] == [
        ((0, 1), (0, 2)), ((0, 1), (1, 3)), ((2, 3), (0, 2)), ((2, 3), (1, 3))]  # fmt: skip
    result = _compare(bundle, Bundle(unsharded[1].root.parent / "steps"), model=unsharded[0])
    assert result["sequences"]["count"] == 2 and result["first_divergence"]["inputs_equal"]
    assert result["contracts"]["differs"] == [] and result["contracts"]["weights"]["differs"] == []
    expect_collective_order_only(result)
