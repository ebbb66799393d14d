"""Capture inside megatron-core models (issue 35): TP, TP + SP, PP and EP on gloo, against HF.

The demo Qwen3 (and the demo Qwen3-MoE) converted to a megatron-core ``GPTModel`` of the local spec
(``megatron_models.py``), run in float32 on 1 or 2 spawned gloo processes with test-side CUDA shims
(``megatron_shims.py``), each inside ``logdiff.sources.megatron.capture``. One launch per world size (starting a
rank costs more than its forwards), running its parallel layouts one after another, each in a parallel state of
its own and making all of its captures:

* TP = 1 (one process): Megatron stock and with kernels/collective.py's fixed-order row-parallel reduction;
  the HF model (eager attention, and SDPA) on the same tokens;
* TP = 2: stock, fixed-order, and a planted weight (rank 1's slice of layer 0's ``up`` half of ``linear_fc1``);
* TP = 2 + sequence parallel; PP = 2 (Megatron's ``forward_only`` schedule, one micro-batch); EP = 2 on the MoE
  variant (the all-gather and the all-to-all dispatchers).

``logdiff compare`` judges them: Megatron TP = 1 against HF eager is ``consistent`` (bitwise, every weight
verified through the name mapping); against HF's SDPA it is not (the attention core: the negative control);
TP = 2 against TP = 1 first diverges at a row-parallel sum (``collective_order``), and is bitwise equal with the
fixed-order reduction on both; the planted shard is found, by name, in rank 1's columns only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

# found, not imported: importing megatron.core adds pathlib.PosixPath to torch's weights-only safe globals for the
# whole process, which other tests' refusals of pickled objects depend on (the ranks import it, in their processes)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None,
                                                     reason="megatron-core is not installed")]

sys.path.insert(0, str(Path(__file__).parent))
from sharding import expect_collective_order_only

CHUNK = 64  # the fixed-order reduction's K-chunk: divides linear_proj's 256 and linear_fc2's 768 on 1 or 2 ranks
PLANTED = "model.layers.0.mlp.up_proj"


def _ids() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return rng.integers(5, 4000, size=(3, 16)).tolist()


def _fixed_order(model) -> None:
    """Every ``RowParallelLinear`` of ``model`` reduces in kernels/collective.py's fixed order (test-side)."""
    from logdiff.kernels.collective import row_parallel_linear
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    for module in model.modules():
        if type(module).__name__ == "RowParallelLinear":
            module.forward = (lambda x, *a, _m=module, **k:
                              (row_parallel_linear(x, _m.weight, chunk=CHUNK, group=group), None))


def _forward(model, ids, mask) -> None:
    import torch

    batch = torch.tensor(ids)
    pos = torch.arange(batch.shape[1])[None].expand(batch.shape[0], -1)
    with torch.no_grad():
        model(batch, pos, mask)


# ---- the mapping alone (no process group) ---------------------------------------------------------------------


def _geometry():
    from logdiff.sources.megatron.names import Geometry

    return Geometry(heads=4, groups=2, head_dim=8, ffn=12)


def _hf_layer(seed: int = 0) -> dict:
    import torch

    g, hidden = torch.Generator().manual_seed(seed), 16
    shapes = {"self_attn.q_proj.weight": (32, hidden), "self_attn.k_proj.weight": (16, hidden),
              "self_attn.v_proj.weight": (16, hidden), "self_attn.o_proj.weight": (hidden, 32),
              "mlp.gate_proj.weight": (12, hidden), "mlp.up_proj.weight": (12, hidden),
              "mlp.down_proj.weight": (hidden, 12), "input_layernorm.weight": (hidden,)}
    return {f"model.layers.0.{k}": torch.randn(*v, generator=g) for k, v in shapes.items()}


def test_the_weight_mapping_round_trips_and_qkv_splits_per_query_group() -> None:
    """HF -> Megatron -> HF gives the same tensors; ``linear_qkv``'s columns split per query group are q, k, v
    (and the HF-style ``[q | k | v]`` split is not: the negative control)."""
    import torch

    from logdiff.sources.megatron.names import split_fc1, split_qkv
    from logdiff.sources.megatron.weights import hf_to_megatron, megatron_to_hf

    hf, geo = _hf_layer(), _geometry()
    meg = hf_to_megatron(hf, geo, 1)
    back = megatron_to_hf(meg, geo)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    # an output's columns are the weight's rows: split the transposed weight as the capture splits an output
    columns = meg["decoder.layers.0.self_attention.linear_qkv.weight"].T
    for part, t in zip("qkv", split_qkv(columns, geo)):
        assert torch.equal(t, hf[f"model.layers.0.self_attn.{part}_proj.weight"].T), part
    assert not torch.equal(columns[:, :32], hf["model.layers.0.self_attn.q_proj.weight"].T)
    gate, up = split_fc1(meg["decoder.layers.0.mlp.linear_fc1.weight"].T)
    assert torch.equal(gate, hf["model.layers.0.mlp.gate_proj.weight"].T)
    assert torch.equal(up, hf["model.layers.0.mlp.up_proj.weight"].T)


def test_strided_shards_rebuild_the_logical_tensor() -> None:
    """``partition_stride`` 2 (``linear_fc1``): rank i holds ``[gate_i; up_i]``; the slices rejoin in order."""
    import torch

    from logdiff.sources.megatron.weights import shard_of, unstride

    t = torch.arange(24.0).reshape(8, 3)
    pieces = [shard_of(t, 0, 2, r, 2) for r in range(2)]
    assert pieces[0][:, 0].tolist() == [0.0, 3.0, 12.0, 15.0]  # gate rows 0-1, up rows 4-5
    assert torch.equal(unstride(pieces, 0, 2), t)
    assert not torch.equal(torch.cat(pieces), t)  # a plain join is not the logical tensor


def test_te_spec_names_map_to_hf() -> None:
    """The TE spec's fused norm weights and grouped-GEMM experts by name (coded, not run: no TE here)."""
    import torch

    from logdiff.sources.megatron.weights import megatron_to_hf

    w = torch.ones(4)
    hf = megatron_to_hf({"decoder.layers.2.self_attention.linear_qkv.layer_norm_weight": w,
                         "decoder.layers.2.mlp.linear_fc1.layer_norm_weight": 2 * w,
                         "decoder.layers.2.mlp.experts.linear_fc1.weight1": torch.ones(6, 4),
                         "decoder.layers.2.mlp.experts.linear_fc1.weight0": torch.zeros(6, 4),
                         "decoder.layers.2.mlp.experts.linear_fc2.weight0": torch.zeros(4, 3),
                         "decoder.layers.2.mlp.experts.linear_fc2.weight1": torch.ones(4, 3)}, _geometry())
    assert torch.equal(hf["model.layers.2.input_layernorm.weight"], w)
    assert torch.equal(hf["model.layers.2.post_attention_layernorm.weight"], 2 * w)
    assert hf["model.layers.2.mlp.experts.gate_up_proj"][:, 0, 0].tolist() == [0.0, 1.0]


def test_the_entry_point_stays_callable_once_its_module_is_loaded(tmp_path: Path) -> None:
    """``logdiff.sources.megatron.capture`` loads its module on the first call; every later call, and a later import
    of the name, still get the function (a submodule of the same name once replaced it on the package)."""
    import types

    import logdiff.sources.megatron as megatron
    from logdiff.errors import InputError

    for _ in range(2):
        with pytest.raises(InputError, match="hf_config"):
            megatron.capture(None, tmp_path / "bundle", hf_config=3)
    from logdiff.sources.megatron import capture

    assert callable(capture) and not isinstance(capture, types.ModuleType)


def test_a_bad_hf_config_is_one_input_error(tmp_path: Path) -> None:
    from logdiff.errors import InputError
    from logdiff.sources.megatron.recording import _hf_config

    with pytest.raises(InputError, match="cannot read the HF config"):
        _hf_config(tmp_path / "missing.json")
    with pytest.raises(InputError, match="hf_config is a int"):
        _hf_config(3)


# ---- the parallel runs ----------------------------------------------------------------------------------------


#: the layouts each world size runs, in order, in one launch: (mode, model)
LAUNCHES = {1: (("tp1", "dense"), ("moe1", "moe")),
            2: (("tp2", "dense"), ("sp", "dense"), ("pp", "dense"), ("ep", "moe"))}


def _worker(rank: int, world: int, layouts: list[tuple[str, str]], root: str, store: str) -> None:
    """One rank: every layout of ``layouts`` (mode, model directory) in turn, its captures under ``root/mode``."""
    import megatron_shims as sh

    sh.init(rank, world, store)
    try:
        for mode, model_dir in layouts:
            with sh.parallel_state(**_sizes(mode, world)):
                _layout(rank, world, mode, model_dir, f"{root}/{mode}")
    finally:
        sh.finish()


def _sizes(mode: str, world: int) -> dict[str, int]:
    """The parallel sizes of a layout: tensor, pipeline and expert parallel."""
    return {"tp": {"tp1": 1, "tp2": 2, "sp": 2}.get(mode, 1), "pp": 2 if mode == "pp" else 1,
            "ep": world if mode == "ep" else 1}


def _layout(rank: int, world: int, mode: str, model_dir: str, out: str) -> None:
    """One layout's captures, in the parallel state ``_sizes`` gives it."""
    import megatron_models as mm
    import megatron_shims as sh

    from logdiff.sources.megatron import capture

    ids = _ids()
    mask = sh.causal_mask(len(ids[0]))
    tp = _sizes(mode, world)["tp"]
    if mode in ("tp1", "tp2", "sp"):
        model = mm.build(Path(model_dir), tp=tp, sp=mode == "sp")
        with capture(model, f"{out}/stock", hf_config=model_dir, window="all"):
            _forward(model, ids, mask)
        if mode == "sp":
            return
        fixed = mm.build(Path(model_dir), tp=tp)
        _fixed_order(fixed)
        with capture(fixed, f"{out}/fixed", hf_config=model_dir, window="all"):
            _forward(fixed, ids, mask)
        if mode == "tp2":
            import torch

            with torch.no_grad():  # rank 1's slice of the up half: its local [gate_1; up_1], first up row
                fc1 = model.decoder.layers[0].mlp.linear_fc1.weight
                if rank == 1:
                    fc1[fc1.shape[0] // 2] += 0.25
            with capture(model, f"{out}/planted", hf_config=model_dir, window="all"):
                _forward(model, ids, mask)
        if mode == "tp1":
            _hf_captures(model_dir, out, ids)
    elif mode in ("moe1", "ep"):
        _moe(rank, world, mode, model_dir, out, ids, mask)
    elif mode == "pp":
        _pipeline(rank, mm.build(Path(model_dir), pp=2), model_dir, out, ids, mask)


def _pipeline(stage: int, model, model_dir: str, out: str, ids: list[list[int]], mask) -> None:
    """Two pipeline stages, one micro-batch, through Megatron's own ``forward_only`` schedule."""
    import megatron_shims as sh
    import torch
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    from logdiff.sources.megatron import capture

    batch = torch.tensor(ids)
    pos = torch.arange(batch.shape[1])[None].expand(batch.shape[0], -1)

    def step(_data, chunk):  # every stage is given the step's tokens (the capture's row table)
        return chunk(batch, pos, mask), lambda output, non_loss_data=False: (output.sum() * 0, {})

    with capture(model, f"{out}/stock", hf_config=model_dir, window="all"), torch.no_grad(), sh.pipeline_schedule():
        get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=[model],
                                    num_microbatches=1, seq_length=batch.shape[1], micro_batch_size=batch.shape[0],
                                    forward_only=True)


def _moe(rank: int, world: int, mode: str, model_dir: str, out: str, ids: list[list[int]], mask) -> None:
    """The MoE variant: at EP = 1 all sequences (and HF's capture of them); at EP = 2 each rank its own sequences
    (expert parallel ranks are data parallel): the all-gather dispatcher stock and with a router weight planted
    on every rank, and the all-to-all dispatcher."""
    import megatron_models as mm
    import torch

    from logdiff.sources.megatron import capture

    mine = ids if world == 1 else [ids[rank]]  # equal batches: the all-gather dispatcher gathers equal sizes
    model = mm.build(Path(model_dir), ep=world)
    with capture(model, f"{out}/stock", hf_config=model_dir, window="all"):
        _forward(model, mine, mask)
    if mode == "moe1":
        _hf_captures(model_dir, out, ids, ("eager",))
        return
    with torch.no_grad():
        model.decoder.layers[1].mlp.router.weight[3] += 0.5  # expert 3's row, the same on every rank
    with capture(model, f"{out}/planted", hf_config=model_dir, window="all"):
        _forward(model, mine, mask)
    alltoall = mm.build(Path(model_dir), ep=world, dispatcher="alltoall")
    with capture(alltoall, f"{out}/alltoall", hf_config=model_dir, window="all"):
        _forward(alltoall, mine, mask)


def _hf_captures(model_dir: str, out: str, ids: list[list[int]], attns: tuple[str, ...] = ("eager", "sdpa")) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import logdiff

    for attn in attns:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()
        with logdiff.capture(hf, f"{out}/hf-{attn}", "train", window="all"), torch.no_grad():
            hf(torch.tensor(ids))


def _launch(world: int, models: dict[str, Path], root: Path) -> None:
    """Run ``LAUNCHES[world]`` on ``world`` spawned ranks; each layout's captures land in ``root/mode``."""
    import torch.multiprocessing as mp

    layouts = [(mode, str(models[model])) for mode, model in LAUNCHES[world]]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_worker, args=(world, layouts, str(root), str(root / f"store-{world}")),
                       nprocs=world, join=True, start_method="spawn")


@pytest.fixture(scope="module")
def runs(demo_model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every layout's captures (``root/mode``), from two launches: one rank, then two."""
    models = {"dense": demo_model("qwen3"), "moe": demo_model("qwen3-moe")}
    root = tmp_path_factory.mktemp("megatron")
    for world in LAUNCHES:
        _launch(world, models, root)
    return {**models, **{mode: root / mode for layouts in LAUNCHES.values() for mode, _ in layouts}}


@pytest.fixture(scope="module")
def dense(runs: dict[str, Path]) -> dict[str, Path]:
    return {"model": runs["dense"], "tp1": runs["tp1"], "tp2": runs["tp2"]}


def _compare(train: Path, infer: Path, model: Path | None = None) -> dict:
    from logdiff.commands.compare import compare_bundles

    return compare_bundles(train, infer, model=model).to_dict()


def _values(path: Path, name: str) -> np.ndarray:
    """Record ``name`` of step 0 rebuilt, its rows in the step's row order."""
    from logdiff.records.bundle import Bundle

    bundle = Bundle(path)
    (logical,) = bundle.logical(0, name).values()
    rows = bundle.record_rows(0, name)
    value = logical.value.astype(np.float32)
    return value if rows is None else value[np.argsort(rows)]


def test_megatron_records_every_boundary_the_hf_capture_has(dense) -> None:
    from logdiff.records.bundle import Bundle

    hf, meg = Bundle(dense["tp1"] / "hf-eager"), Bundle(dense["tp1"] / "stock")
    assert set(meg.names(0)) == set(hf.names(0))  # the same boundaries (each in the order its model ran them)
    assert meg.widths() == hf.widths()
    (mine,), (theirs,) = meg.rows(0).values(), hf.rows(0).values()
    for key in ("tokens", "positions", "sequences"):
        assert np.array_equal(mine[key], theirs[key]), key
    assert meg.meta["engine"] == "megatron" and meg.meta["architecture"] == "Qwen3ForCausalLM"
    tp2 = Bundle(dense["tp2"] / "stock")
    assert tp2.names(0) == meg.names(0) and [p.layout.group("tp") for p in tp2.ranks] == [(0, 1), (0, 1)]
    for name in tp2.names(0):
        (logical,) = tp2.logical(0, name).values()
        assert logical.replicas_equal in (None, True), name
        assert logical.value.shape == Bundle(dense["tp1"] / "stock").logical(0, name)[(0,)].value.shape, name


def test_tp1_megatron_against_hf_eager_is_consistent(dense) -> None:
    """The converted weights hash as HF's (every one verified), the contracts agree, and every boundary is equal:
    Megatron's local spec computes the HF model's function in the same float32 operations."""
    result = _compare(dense["tp1"] / "stock", dense["tp1"] / "hf-eager")
    weights = result["contracts"]["weights"]
    assert weights["differs"] == [] and weights["unverified"] == [] and weights["verified"] == 47, weights
    assert result["contracts"]["differs"] == []
    assert result["verdict"] == "consistent", (result["first_divergence"], result["causes"])
    assert result["logprobs"]["abs_diff_max"] == 0.0 and result["first_divergence"] is None


def test_tp1_megatron_against_hf_sdpa_differs_at_the_attention_core(dense, stock_varies) -> None:
    """Negative control: HF's SDPA attention is another order of the same sum than Megatron's local attention."""
    equal = np.array_equal(_values(dense["tp1"] / "stock", "model.layers.0.self_attn.attn_core"),
                           _values(dense["tp1"] / "hf-sdpa", "model.layers.0.self_attn.attn_core"))
    stock_varies(equal, "HF's SDPA attention gives Megatron's local attention's bits on this CPU")
    result = _compare(dense["tp1"] / "stock", dense["tp1"] / "hf-sdpa", dense["model"])
    first = result["first_divergence"]
    assert first["boundary"] == "model.layers.0.self_attn.attn_core" and first["inputs_equal"], first


def test_tp2_against_tp1_first_diverges_at_a_row_parallel_sum(dense) -> None:
    result = _compare(dense["tp2"] / "stock", dense["tp1"] / "stock", dense["model"])
    assert result["paths"][0]["settings"]["tensor_parallel_size"] == 2
    assert result["contracts"]["weights"]["differs"] == [] and result["contracts"]["weights"]["verified"] == 47
    first = result["first_divergence"]
    assert first is not None, "TP=2 and TP=1 summed the row-parallel products in the same order on this CPU"
    if result["logprobs"]["abs_diff_max"] == 0.0:  # no gap to explain: no cause is named, the divergence is
        assert first["inputs_equal"] and first["boundary"].rsplit(".", 1)[-1] in ("o_proj", "down_proj"), first
        return
    expect_collective_order_only(result)


def test_tp2_against_tp1_with_the_fixed_order_reduction_is_bitwise_equal(dense, stock_varies) -> None:
    result = _compare(dense["tp2"] / "fixed", dense["tp1"] / "fixed")
    first = result["first_divergence"]
    if first is not None and first["boundary"].rsplit(".", 1)[-1] not in ("o_proj", "down_proj"):
        pytest.skip(f"this CPU's stock kernels give a tensor-parallel slice of {first['boundary']} other bits "
                    "than the whole op: the fixed-order reduction cannot make the sides equal there")
    assert first is None and result["logprobs"]["abs_diff_max"] == 0.0, first
    assert result["verdict"] == "consistent"


def test_a_weight_shard_planted_on_rank_1_is_found_in_its_slice(dense) -> None:
    result = _compare(dense["tp2"] / "planted", dense["tp1"] / "stock", dense["model"])
    assert result["contracts"]["weights"]["differs"] == [f"{PLANTED}.weight"]
    assert result["first_divergence"]["boundary"] == PLANTED
    causes = [c for c in result["causes"] if c["boundary"] == PLANTED]
    assert causes and (causes[0]["class"], causes[0]["kind"]) == ("framework_difference", "weights"), causes
    ffn = json.loads((dense["model"] / "config.json").read_text())["intermediate_size"]
    named = [e for e in causes[0]["evidence"] if "'s piece" in e]  # against --model's weight, piece by piece
    assert named == [f"{PLANTED}.weight: rank 1's piece (rows {ffn // 2}:{ffn}, 2 of 2) differs from --model's; "
                     "the other ranks' pieces equal it (train bundle)"], causes[0]["evidence"]
    import torch
    from transformers import AutoModelForCausalLM

    from logdiff.comparison.bundle_shards import shard_lines
    from logdiff.records.bundle import Bundle

    state = AutoModelForCausalLM.from_pretrained(dense["model"], dtype=torch.float32).state_dict()
    stock = Bundle(dense["tp2"] / "stock")
    assert {p.meta["shards"][f"{PLANTED}.weight"]["index"] for p in stock.ranks} == {0, 1}
    assert shard_lines(stock, [f"{PLANTED}.weight"], state) == {}  # the control: every stock piece equals --model's
    diff = np.abs(_values(dense["tp2"] / "planted", PLANTED) - _values(dense["tp2"] / "stock", PLANTED)).max(axis=0)
    half = diff.shape[0] // 2  # the logical up_proj's columns: rank 0 holds the first half, rank 1 the second
    assert diff[:half].max() == 0.0 and diff[half] > 0 and diff[half + 1 :].max() == 0.0


# ---- sequence parallel and pipeline parallel -------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_pp(runs: dict[str, Path]) -> dict[str, Path]:
    return {"sp": runs["sp"], "pp": runs["pp"]}


def test_sequence_parallel_rows_rebuild_the_tp2_capture_bitwise(dense, sp_pp) -> None:
    """Under SP the norms, residuals and row-parallel outputs hold each rank's positions (``shard(-2)``); rebuilt,
    every record equals the TP = 2 capture's bit for bit (the reduce-scatter sums what the all-reduce sums)."""
    from logdiff.records.bundle import Bundle

    sp = Bundle(sp_pp["sp"] / "stock")
    assert sp.meta["megatron"]["sequence_parallel"] is True
    placements = sp.ranks[0].steps[0]["records"]
    assert placements["model.layers.0.input_layernorm"]["placement"] == {"kind": "shard", "dim": -2}
    assert placements["model.layers.0.self_attn.q_proj"]["placement"] == {"kind": "shard", "dim": -1}
    for name in sp.names(0):
        assert np.array_equal(_values(sp_pp["sp"] / "stock", name), _values(dense["tp2"] / "stock", name)), name
    result = _compare(sp_pp["sp"] / "stock", dense["tp2"] / "stock")
    assert result["verdict"] == "consistent" and result["first_divergence"] is None


def test_sequence_parallel_against_tp1_blames_the_reduce_scatter(dense, sp_pp) -> None:
    result = _compare(sp_pp["sp"] / "stock", dense["tp1"] / "stock", dense["model"])
    first = result["first_divergence"]
    assert first is not None, "TP=2 + SP and TP=1 summed the row-parallel products in the same order on this CPU"
    if result["logprobs"]["abs_diff_max"] == 0.0:
        assert first["inputs_equal"] and first["boundary"].rsplit(".", 1)[-1] in ("o_proj", "down_proj"), first
        return
    expect_collective_order_only(result)


def test_pipeline_stages_record_global_layers_and_join_into_the_tp1_capture(dense, sp_pp, tmp_path: Path) -> None:
    """Each stage records its own layers under their global numbers, bitwise equal to TP = 1; the comparison
    joins the stages (``probes.stages``) and the bundle compares ``consistent`` against TP = 1, every weight
    verified."""
    from logdiff.records.bundle import Bundle
    from logdiff.records.stages import has_stages

    pp = Bundle(sp_pp["pp"] / "stock")
    first, last = (list(part.steps[0]["records"]) for part in pp.ranks)
    assert first[0] == "model.embed_tokens" and first[-1] == "model.layers.1.residual_mlp"
    assert last[0] == "model.layers.2.input_layernorm" and last[-1] == "logits"
    assert has_stages(sp_pp["pp"] / "stock") and not has_stages(dense["tp1"] / "stock")
    result = _compare(sp_pp["pp"] / "stock", dense["tp1"] / "stock")
    assert result["paths"][0]["settings"]["bundle"] == str(sp_pp["pp"] / "stock")
    assert result["contracts"]["weights"]["verified"] == 47 and result["contracts"]["weights"]["differs"] == []
    assert result["verdict"] == "consistent" and result["first_divergence"] is None
    assert result["logprobs"]["abs_diff_max"] == 0.0


# ---- expert parallel (the MoE variant) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe(runs: dict[str, Path]) -> dict[str, Path]:
    return {"model": runs["moe"], "ep1": runs["moe1"], "ep2": runs["ep"]}


def _routes(path: Path, layer: int, k: int = 2) -> dict[tuple[int, ...], list[set[int]]]:
    """Each captured sequence's chosen experts per token (top-k of the router logits), keyed by its token ids."""
    from logdiff.records.bundle import Bundle

    bundle = Bundle(path)
    out = {}
    for group in bundle.groups():
        table = bundle.rows(0)[group]
        (logical,) = bundle.logical(0, f"model.layers.{layer}.mlp.gate", group).values()
        order = bundle.record_rows(0, f"model.layers.{layer}.mlp.gate", group)
        logits = np.empty_like(logical.value)
        logits[order] = logical.value
        for s in np.unique(table["sequences"]):
            mine = table["sequences"] == s
            top = np.argsort(-logits[mine], axis=1, kind="stable")[:, :k]
            out[tuple(table["tokens"][mine].tolist())] = [set(t.tolist()) for t in top]
    return out


def test_moe_tp1_against_hf_verifies_every_weight_and_routes_alike(moe) -> None:
    """The MoE variant at EP = 1 against HF (eager): every weight verified through the expert mapping (fused
    ``gate_up_proj`` rows = ``local_experts.{e}.linear_fc1``), the router logits bitwise equal, and what differs
    is the MoE block's own sum (Megatron adds the experts' weighted outputs in another order than HF)."""
    result = _compare(moe["ep1"] / "stock", moe["ep1"] / "hf-eager")
    weights = result["contracts"]["weights"]
    assert weights["verified"] == 47 and weights["differs"] == [] and result["contracts"]["differs"] == []
    assert np.array_equal(_values(moe["ep1"] / "stock", "model.layers.0.mlp.gate"),
                          _values(moe["ep1"] / "hf-eager", "model.layers.0.mlp.gate"))
    first = result["first_divergence"]
    assert first is None or (first["boundary"].endswith(".mlp") and first["inputs_equal"]), first


def test_ep2_routes_every_token_as_ep1_and_a_planted_router_weight_is_found(moe) -> None:
    """EP = 2 (each rank its own sequence, 4 local experts each, the all-gather dispatcher): per token the same
    experts as EP = 1; the planted router row changes layer 1's routing and is named by its fingerprint."""
    reference, stock = _routes(moe["ep1"] / "stock", 1), _routes(moe["ep2"] / "stock", 1)
    assert len(stock) == 2 and all(stock[ids] == reference[ids] for ids in stock)
    result = _compare(moe["ep2"] / "stock", moe["ep1"] / "stock")
    assert result["sequences"]["count"] == 2 and result["contracts"]["weights"]["differs"] == []
    assert result["contracts"]["weights"]["verified"] == 47  # the experts gathered over the EP group
    first = result["first_divergence"]
    assert first is None or (first["inputs_equal"] and first["boundary"].endswith(".mlp")), first
    planted = _compare(moe["ep2"] / "planted", moe["ep1"] / "stock")
    assert planted["contracts"]["weights"]["differs"] == ["model.layers.1.mlp.gate.weight"]
    # where EP = 2 already parts from EP = 1 before layer 1 on this host (an operator path: the experts' outputs
    # summed in another order, allowed above), that comes first; else the planted gate is the first divergence
    earlier = first is not None and int(first["boundary"].split(".")[2]) < 1
    assert planted["first_divergence"]["boundary"] == (first["boundary"] if earlier else "model.layers.1.mlp.gate")
    (cause,) = [c for c in planted["causes"] if c["boundary"] == "model.layers.1.mlp.gate"]
    assert (cause["class"], cause["kind"]) == ("framework_difference", "weights")
    moved = _routes(moe["ep2"] / "planted", 1)
    assert any(moved[ids] != reference[ids] for ids in moved)  # the negative control: routing really changed


def test_the_alltoall_dispatcher_gives_the_allgather_dispatchers_records(moe) -> None:
    """EP = 2 with the all-to-all dispatcher (its side stream and split sizes shimmed): the same experts per token
    and, here, the same bits as the all-gather dispatcher."""
    assert _routes(moe["ep2"] / "alltoall", 1) == _routes(moe["ep2"] / "stock", 1)
    result = _compare(moe["ep2"] / "alltoall", moe["ep2"] / "stock")
    assert result["sequences"]["count"] == 2 and result["contracts"]["weights"]["differs"] == []
    first = result["first_divergence"]
    assert first is None or (first["inputs_equal"] and first["boundary"].endswith(".mlp")), first
