"""msprobe dumps of a tensor-parallel run, un-sharded with ``--tp N`` (logdiff/sources/msprobe/ranks.py, placements.py).

Real dumps, made here: the demo Qwen3 in float32 under DTensor TP = 2 on two gloo processes (the plan of
tests/test_capture_sharded.py), msprobe 26.2.0 dumping every rank (``step0/rank0``, ``step0/rank1``) and, in
the same forward, logdiff's own capture; and the same tokens unsharded in one process (``step0/proc{PID}``).
What msprobe writes under TP (measured here): each DTensor's *local* tensor, with its ``device_mesh`` and
``placements`` in dump.json; its hooks fire inside DTensor's, so a row-parallel output is the rank's
``Partial`` summand (before the all-reduce) and the column-parallel outputs ``Shard(-1)`` slices.

Checked: (a) the TP = 1 dump against the TP = 2 dump parts first at a row-parallel sum, ``collective_order``;
(b) the TP = 2 dump rebuilds, bit for bit, the logical tensors logdiff's own capture of the same run holds;
(c) the TP = 2 dump against itself is consistent, and a perturbed slice in rank 1's file is found at its
boundary, in rank 1's columns only; the kept weight shards, joined, hash as the whole weights; and bad rank
layouts or sizes are one line, exit 2.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from sharding import expect_collective_order_only
from typer.testing import CliRunner

from logdiff.cli import app

pytestmark = pytest.mark.slow

IDS = [[5, 17, 3, 9, 42, 7, 11, 2], [8, 1, 30, 4, 6, 19, 23, 13]]
PLANTED = "Module.model.layers.0.mlp.up_proj.Linear.forward.0.output.0.pt"
runner = CliRunner()


def _msprobe_config(dump: str) -> str:
    config = {"task": "tensor", "dump_path": dump, "level": "L0", "step": [], "rank": [], "async_dump": False,
              "tensor": {"scope": [], "list": ["model.embed_tokens", "model.layers.0.", "lm_head"],
                         "data_mode": ["all"]}}  # fmt: skip
    path = Path(dump).with_suffix(".json")
    path.write_text(json.dumps(config))
    return str(path)


def _rank(rank: int, world: int, model_dir: str, dump: str, capture: str, store: str) -> None:
    """One process: the model (TP = ``world`` over gloo when above 1), one forward dumped by msprobe and, under
    TP, captured by logdiff in the same forward."""
    import contextlib

    import torch
    from msprobe.pytorch import PrecisionDebugger
    from test_capture_sharded import _load, _parallelize

    import logdiff

    torch.set_num_threads(1)
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = _load(model_dir)
        if world > 1:
            _parallelize(model, init_device_mesh("cpu", (world,)))
        debugger = PrecisionDebugger(config_path=_msprobe_config(dump))
        with contextlib.ExitStack() as stack, torch.no_grad():
            if world > 1:
                stack.enter_context(logdiff.capture(model, capture, "train", window="all"))
            debugger.start(model=model)
            model(torch.tensor(IDS))
            debugger.stop()
            debugger.step()
    finally:
        if world > 1:
            dist.destroy_process_group()


def _start(model_dir: Path, root: Path, world: int):
    import torch.multiprocessing as mp

    dump, capture = root / f"dump-tp{world}", root / f"capture-tp{world}"
    return mp.start_processes(_rank, args=(world, str(model_dir), str(dump), str(capture),
                                           str(root / f"store-{world}")), nprocs=world, join=False,
                              start_method="spawn")  # fmt: skip


@pytest.fixture(scope="module")
def runs(demo_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The TP = 2 dump and capture of one forward, and the TP = 1 dump of the same tokens, run at once (the
    TP = 1 one in its own process too: msprobe patches torch process-wide)."""
    model_dir = demo_model("qwen3")
    root = tmp_path_factory.mktemp("msprobe-tp")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    contexts = [_start(model_dir, root, world) for world in (2, 1)]
    for context in contexts:
        while not context.join():
            pass
    return {"model": model_dir, "tp1": root / "dump-tp1", "tp2": root / "dump-tp2", "capture": root / "capture-tp2"}


def _config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def _convert(runs: dict[str, Path], dump: Path, out: Path, tp: int | None = 2, role: str = "infer"):
    from logdiff.records.bundle import Bundle
    from logdiff.sources.msprobe.ranks import Parallel, convert_parallel

    parallel = Parallel(tp) if tp else None
    return Bundle(convert_parallel(dump, out, role, _config(runs["model"]), str(runs["model"]), parallel))


def _cli(*args) -> tuple[int, str]:
    res = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in res.output
    return res.exit_code, res.stderr if res.stderr_bytes is not None else res.output


def _one_line(out: str) -> str:
    lines = [line for line in out.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("logdiff: error:"), out
    return lines[0]


def test_msprobe_dumps_dtensor_local_pieces_with_their_placements(runs) -> None:
    """What msprobe 26.2 writes for HF under DTensor TP (the facts placements.py reads)."""
    ranks = sorted(p.name for p in (runs["tp2"] / "step0").iterdir())
    assert ranks == ["rank0", "rank1"] and [p.name[:4] for p in (runs["tp1"] / "step0").iterdir()] == ["proc"]
    data = json.loads((runs["tp2"] / "step0" / "rank1" / "dump.json").read_text())["data"]
    q = data["Module.model.layers.0.self_attn.q_proj.Linear.forward.0"]["output"][0]
    o = data["Module.model.layers.0.self_attn.o_proj.Linear.forward.0"]["output"][0]
    assert q["shape"][-1] * 2 == _config(runs["model"])["num_attention_heads"] * 64  # the local slice
    assert (q["device_mesh"], q["placements"]) == ([0, 1], [{"Shard": {"dim": 2}}])
    assert o["placements"] == [{"Partial": {"reduce_op": "sum"}}]  # dumped before the all-reduce


def test_tp2_dump_rebuilds_logdiffs_own_capture_of_the_same_run_bitwise(runs, tmp_path: Path) -> None:
    from logdiff.records.bundle import Bundle

    mine, theirs = _convert(runs, runs["tp2"], tmp_path / "b"), Bundle(runs["capture"])
    assert mine.world_size == 2 and [p.layout.group("tp") for p in mine.ranks] == [(0, 1), (0, 1)]
    placements = {n: e["placement"]["kind"] for n, e in mine.ranks[0].steps[0]["records"].items()}
    assert placements["model.layers.0.self_attn.q_proj"] == "shard" and placements["logits"] == "replicate"
    assert placements["model.layers.0.self_attn.o_proj"] == placements["model.layers.0.mlp.down_proj"] == "partial"
    assert not [m for m in mine.meta["missing"] if "left out" in m]  # every boundary of the dump was placed
    common = [n for n in mine.names(0) if n in theirs.names(0)]
    assert len(common) == 17, common  # layer 0 (no RoPE at L0), the embedding and the logits
    for name in common:
        (a,) = mine.logical(0, name).values()
        (b,) = theirs.logical(0, name).values()
        assert a.replicas_equal in (None, True), name
        assert a.value.dtype == b.value.dtype and np.array_equal(a.value, b.value), name


def test_compare_tp1_dump_against_tp2_dump_blames_the_row_parallel_sums(runs, tmp_path: Path) -> None:
    """The dumps computed in float32 keep their weights, hashed as a float32 capture's: --model's live engine
    matches them, and no weight is a cause."""
    tp1, tp2 = runs["tp1"], runs["tp2"]
    code, out = _cli("compare", tp1, tp2, "--model", runs["model"], "--tp", 2, "--json", tmp_path / "r.json", "-q")
    assert code in (0, 1), out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["sequences"]["count"] == 2 and [p["settings"]["tensor_parallel_size"] for p in r["paths"]] == [1, 2]
    expect_collective_order_only(r)  # last: it skips where this CPU slices other ops differently


def test_tp2_dump_against_itself_is_consistent_and_a_planted_slice_is_found(runs, tmp_path: Path) -> None:
    import torch

    from logdiff.commands.compare import compare_bundles
    from logdiff.records.bundle import Bundle

    same = compare_bundles(_convert(runs, runs["tp2"], tmp_path / "a", role="train").root,
                           _convert(runs, runs["tp2"], tmp_path / "b").root).to_dict()
    assert same["verdict"] == "consistent" and same["logprobs"]["abs_diff_max"] == 0.0
    assert same["first_divergence"] is None and same["sequences"]["count"] == 2
    planted = tmp_path / "planted"
    shutil.copytree(runs["tp2"], planted)
    f = planted / "step0" / "rank1" / "dump_tensor_data" / PLANTED
    t = torch.load(f, weights_only=True)
    t[..., 0] += 0.25  # rank 1's first column: logical column width/2
    torch.save(t, f)
    bundle = _convert(runs, planted, tmp_path / "c")
    r = compare_bundles(tmp_path / "a", bundle.root).to_dict()
    first = r["first_divergence"]
    assert first["boundary"] == "model.layers.0.mlp.up_proj" and first["inputs_equal"], first
    (got,) = bundle.logical(0, "model.layers.0.mlp.up_proj").values()
    (want,) = Bundle(tmp_path / "a").logical(0, "model.layers.0.mlp.up_proj").values()
    diff = np.abs(got.value - want.value).max(axis=0)
    half = diff.shape[0] // 2
    assert diff[:half].max() == 0 and diff[half] > 0 and diff[half + 1 :].max() == 0


def test_kept_weight_shards_hash_as_the_whole_weights(runs) -> None:
    from logdiff.sources.msprobe.layout import read_dump
    from logdiff.sources.msprobe.placements import gathered_parameters
    from logdiff.sources.msprobe.weights import fingerprint_sets, hf_fingerprints

    whole, rounded = hf_fingerprints(read_dump(runs["tp1"]))
    assert set(rounded) == {"bfloat16", "float16"} and rounded["bfloat16"] != whole  # a float32 run's, as a capture's
    steps = {r: read_dump(runs["tp2"] / "step0" / f"rank{r}") for r in (0, 1)}
    joined, joined_rounded = fingerprint_sets(gathered_parameters(steps, 2))
    assert "model.layers.0.self_attn.q_proj.weight" in joined and "model.layers.0.mlp.down_proj.weight" in joined
    assert (joined, joined_rounded) == (whole, rounded)
    assert fingerprint_sets(gathered_parameters({0: steps[1], 1: steps[0]}, 2))[0] != whole  # the ranks' order


def test_bad_rank_layouts_and_sizes_are_one_line_and_exit_2(runs, tmp_path: Path) -> None:
    model, tp1, tp2 = runs["model"], runs["tp1"], runs["tp2"]
    gap = tmp_path / "gap"  # ranks 0 and 2: rank 1 missing
    shutil.copytree(tp2, gap)
    (gap / "step0" / "rank1").rename(gap / "step0" / "rank2")
    alone = tmp_path / "alone"  # rank 1 only: its DTensors span ranks 0 and 1
    shutil.copytree(tp2, alone)
    shutil.rmtree(alone / "step0" / "rank0")
    cases = [((), "--tp N"), (("--tp", 3), "not a multiple of --tp 3"), (("--parallel", "pp=2"), "not supported yet"),
             (("--parallel", "zz=2"), "KEY=SIZE"), (("--tp", 0), "integer >= 1"),
             (("--tp", 2, "--parallel", "tp=4"), "disagree"), (("--tp", 1), "is not the tp group")]
    for args, words in cases:
        code, out = _cli("compare", tp1, tp2, "--model", model, *args)
        assert code == 2 and words in _one_line(out), (args, out)
    for dump, words in ((gap, "no rank1 directory"), (alone, "directories are missing")):
        code, out = _cli("compare", tp1, dump, "--model", model, "--tp", 2)
        assert code == 2 and words in _one_line(out), out


# ---- vLLM's parallel layers (sources/vllm/placements.py), on a dump sharded here ----------------------------------

VLLM = Path(__file__).parent / "data" / "msprobe" / "vllm-tensor-L0"


def _shard_vllm_dump(src: Path, dst: Path, config: dict, tp: int = 2) -> None:
    """The real TP = 1 vLLM fixture cut into the ``tp`` ranks' dumps a TP run of vLLM's layers would write
    (``rank{R}``): each column-parallel output (packed ``qkv_proj`` and ``gate_up_proj`` part by part), and what
    holds local heads or columns after it (q/k norms, RoPE, attention, activation), sliced on the last dim; the
    row-parallel outputs (all-reduced), norms, embedding and logits whole on every rank. Not a real vLLM TP
    dump (none is made on this CPU): a round trip the placements must invert."""
    import torch

    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], 64
    packed = {"QKVParallelLinear": [heads * hd, kv * hd, kv * hd], "MergedColumnParallelLinear": [
        config["intermediate_size"]] * 2}
    sliced = ("q_norm.RMSNorm", "k_norm.RMSNorm", "RotaryEmbedding", "attn.Attention", "SiluAndMul")
    (rank_dir,) = (src / "step0").iterdir()
    for r in range(tp):
        out = dst / "step0" / f"rank{r}"
        shutil.copytree(rank_dir, out)
        for f in (out / "dump_tensor_data").glob("*.output.*.pt"):
            cls = next((c for c in packed if f".{c}." in f.name), None)
            if cls is None and not any(f".{s}." in f.name for s in sliced):
                continue
            t = torch.load(f, weights_only=True)
            if cls is not None:
                parts = t.split(packed[cls], dim=-1)
                t = torch.cat([p.chunk(tp, dim=-1)[r] for p in parts], dim=-1)
            else:
                t = t.chunk(tp, dim=-2 if t.dim() == 3 else -1)[r]  # [T, heads, D]: the rank's heads
            torch.save(t.contiguous(), f)


def test_vllm_tp_layers_are_placed_by_their_type_and_rebuild_the_whole(tmp_path: Path) -> None:
    config = json.loads((VLLM.parent / "qwen3-config.json").read_text())
    _shard_vllm_dump(VLLM, tmp_path / "tp2", config)
    runs = {"model": tmp_path}
    (tmp_path / "config.json").write_text(json.dumps(config))
    whole, sharded = _convert(runs, VLLM, tmp_path / "a", tp=None), _convert(runs, tmp_path / "tp2", tmp_path / "b")
    kinds = {n: e["placement"] for n, e in sharded.ranks[1].steps[0]["records"].items()}
    assert kinds["model.layers.0.self_attn.k_proj"] == {"kind": "shard", "dim": -1}  # a part split off qkv_proj
    assert kinds["model.layers.0.self_attn.o_proj"] == kinds["logits"] == {"kind": "replicate"}
    assert kinds["model.layers.0.self_attn.rope_k"] == kinds["model.layers.0.mlp.act_mul"] == {"kind": "shard",
                                                                                                "dim": -1}
    assert sharded.ranks[1].steps[0]["records"]["model.layers.0.self_attn.k_proj"]["shape"] == [37, 64]
    assert sharded.num_steps == whole.num_steps == 3 and sharded.meta["prompt_lens"] == whole.meta["prompt_lens"]
    for step in range(3):
        assert sharded.names(step) == whole.names(step)
        for name in whole.names(step):
            (a,) = sharded.logical(step, name).values()
            (b,) = whole.logical(step, name).values()
            assert a.replicas_equal in (None, True) and np.array_equal(a.value, b.value), (step, name)
    # a placement the layer type cannot give (the whole width where a slice belongs) is left out, said once
    name = "Module.model.layers.0.self_attn.attn.Attention.forward.0.output.0.pt"
    (src,) = (VLLM / "step0").iterdir()
    for r in (0, 1):
        shutil.copy(src / "dump_tensor_data" / name, tmp_path / "tp2" / "step0" / f"rank{r}" / "dump_tensor_data")
    odd = _convert(runs, tmp_path / "tp2", tmp_path / "c")
    assert "model.layers.0.self_attn.attn_core" not in odd.names(0)
    (line,) = [m for m in odd.meta["missing"] if m.startswith("placements")]
    assert "model.layers.0.self_attn.attn_core: a local width 256" in line
