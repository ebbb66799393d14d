"""The training path on 2 gloo ranks through logdiff itself (issue 22, items 6 and 7).

``score_sharded`` runs the demo Qwen3 (float32) under DTensor tensor parallel and
under FSDP2 and captures it; each bundle is un-sharded (``Bundle.logical``) and
compared record by record with a capture of the same sequences:

* stock kernels, TP = 2 against the unsharded model: every boundary un-shards to
  the same shape, and the first record that differs (if any) is a row-parallel
  output whose inputs are bitwise equal (the all-reduce's order);
* consistent mode: TP = 2 equals TP = 1 (``score_sharded`` on one rank) and the
  unsharded consistent model with the fixed-order row-parallel reduction
  (``consistent_tp``) in every record and the logprobs, bitwise; FSDP2 equals the
  unsharded consistent model on each rank's share, bitwise (with an idle forward
  on the rank with fewer batches);
* ``logdiff compare`` of the bundles (``logdiff.commands.compare``): the stock difference is
  ``operator_path`` / ``collective_order``, the consistent TP = 2 bundle equals TP = 1;
* negative controls: TP = 2 against the unsharded consistent model *without* the
  fixed-order reduction, and TP = 2 with ``row_parallel_linear`` replaced by a
  local GEMM and a plain all-reduce, must both differ, first at a row-parallel
  output with bitwise-equal inputs.

The references run in this process with one thread, as the ranks do.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from sharding import SLICED

from logdiff.errors import EngineUnavailable, InputError
from logdiff.records.bundle import Bundle
from logdiff.sources.base import EngineSpec
from logdiff.sources.hf import HFForward
from logdiff.sources.hf.sharded import _Job, _launch, _Seq, score_sharded

pytestmark = pytest.mark.slow

SEQS = [_Seq([5, 17, 3, 9], [42, 7, 11, 2]), _Seq([8, 1, 30], [4, 6, 19, 23, 13]), _Seq([2, 60, 7, 7, 1], [9, 3])]
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def _spec(model_dir: Path, **options: object) -> EngineSpec:
    return EngineSpec(str(model_dir), dtype="float32", options=tuple(options.items()))


def _reference(spec: EngineSpec, seqs: list[_Seq], out: Path, consistent: bool, fixed_order: bool) -> Bundle:
    """The unsharded ``hf`` path captured in this process, as one rank does it (one thread)."""
    import torch

    from logdiff.sources.hf.capture import capture
    from logdiff.sources.hf.sharded import _score
    from logdiff.sources.hf.tensor_parallel import consistent_tp, fixed_order_plan

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = HFForward(spec)
        with contextlib.ExitStack() as stack:
            if consistent:
                stack.enter_context(engine.consistent())
            if fixed_order:
                stack.enter_context(consistent_tp(engine.model, fixed_order_plan(engine.model, 1)))
            # as score_sharded captures: every record whole, the engine's own log-softmax
            with capture(engine.model, out, "train", log_softmax=engine._logprobs, window="all") as cap:
                _score(engine, cap, seqs)
    finally:
        torch.set_num_threads(threads)
    return Bundle(out)


def _value(bundle: Bundle, step: int, name: str, group: tuple[int, ...] | None = None) -> np.ndarray:
    (logical,) = bundle.logical(step, name, group).values()
    assert logical.replicas_equal in (None, True), f"{name}: the replicas differ"
    return logical.value


def _differing(got: Bundle, want: Bundle, group: tuple[int, ...] | None = None, step: int = 0) -> list[str]:
    """The records of ``step`` that are not bitwise equal, in the order the model ran them (shapes must match)."""
    assert got.names(step) == want.names(step)
    part = got.ranks[0] if group is None else got.part_of(group)
    assert part.load(step, ["tokens"])["tokens"].tolist() == want.rows(step)[(0,)]["tokens"].tolist()
    out = []
    for name in want.names(step):
        a, b = _value(got, step, name, group), _value(want, step, name)
        assert a.shape == b.shape, name
        if not np.array_equal(a, b):
            out.append(name)
    return out


def _first_is_row_parallel_with_equal_inputs(differing: list[str], got: Bundle, want: Bundle) -> str:
    """The first differing record is a row-parallel output and every input of it is bitwise equal."""
    from logdiff.probes.arch import adapter_for

    first = differing[0]
    assert first.endswith(ROWWISE), differing[:3]
    config = got.ranks[0].meta["config"]
    inputs = adapter_for(config["architectures"][0]).correspondence(config).get(first).inputs
    assert inputs and all(np.array_equal(_value(got, 0, i), _value(want, 0, i)) for i in inputs), first
    return first


@pytest.fixture(scope="module")
def model_dir(demo_model: Callable[[str], Path]) -> Path:
    return demo_model("qwen3")


class _Runs(dict):
    """The bundles by name, each made on first use: tests/test_portability.py's AVX2 rerun runs only the
    ``isa_sensitive`` test here, which reads two of the seven (the other five are four more spawns)."""

    def __init__(self, make: dict[str, Callable[[], Bundle]]):
        super().__init__()
        self._make = make

    def __missing__(self, name: str) -> Bundle:
        self[name] = self._make[name]()
        return self[name]


@pytest.fixture(scope="module")
def runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Bundle]:
    """The sharded bundles (four spawns) and the in-process references, each made once, when first read."""
    root = tmp_path_factory.mktemp("sharded")
    spec = _spec(model_dir)

    def sharded(name: str, spec: EngineSpec = spec, **layout: object) -> Callable[[], Bundle]:
        return lambda: Bundle(score_sharded(spec, SEQS, root / name, engine=HFForward, timeout_s=600, **layout))

    def reference(name: str, consistent: bool, fixed_order: bool) -> Callable[[], Bundle]:
        return lambda: _reference(spec, SEQS, root / name, consistent=consistent, fixed_order=fixed_order)

    return _Runs({
        "tp2": sharded("tp2", tensor_parallel_size=2),
        "tp1-consistent": sharded("tp1c", consistent=True),
        "tp2-consistent": sharded("tp2c", tensor_parallel_size=2, consistent=True),
        "fsdp2-consistent": sharded("fsdp2c", _spec(model_dir, batch_size=1), fsdp_size=2, consistent=True),
        "unsharded": reference("ref", consistent=False, fixed_order=False),
        "unsharded-consistent": reference("refc", consistent=True, fixed_order=False),
        "unsharded-fixed-order": reference("reff", consistent=True, fixed_order=True),
    })  # fmt: skip


@pytest.mark.isa_sensitive
def test_stock_tp2_unshards_and_differs_first_at_a_row_parallel_output(runs: dict[str, Bundle]) -> None:
    got, want = runs["tp2"], runs["unsharded"]
    assert got.world_size == 2 and [p.layout.group("tp") for p in got.ranks] == [(0, 1), (0, 1)]
    assert [p.meta["warnings"] for p in got.ranks] == [[], []]
    assert "log_softmax" in want.names(0) and want.names(0)[-1] == "log_softmax"
    differing = _differing(got, want)  # every record un-shards to the unsharded shape (asserted inside)
    if differing and differing[0].rsplit(".", 1)[-1] in SLICED:
        pytest.skip(f"this CPU's stock kernels give a tensor-parallel slice of {differing[0]} other bits than the "
                    "whole op")
    if differing:
        _first_is_row_parallel_with_equal_inputs(differing, got, want)


def test_consistent_tp2_equals_tp1_and_the_unsharded_fixed_order_model_bitwise(runs: dict[str, Bundle]) -> None:
    tp2 = runs["tp2-consistent"]
    assert tp2.ranks[0].meta["sharded"]["tensor_parallel_size"] == 2
    assert _differing(tp2, runs["tp1-consistent"]) == []
    assert _differing(tp2, runs["unsharded-fixed-order"]) == []
    sharded = [n for n in tp2.names(0) if tp2.logical(0, n)[(0, 1)].replicas_equal is None]
    assert "model.layers.0.self_attn.k_proj" in sharded and "model.layers.0.mlp.up_proj" in sharded  # truly split


def test_consistent_fsdp2_equals_the_unsharded_consistent_model_on_each_share(runs: dict[str, Bundle],
                                                                              model_dir: Path, tmp_path: Path) -> None:  # fmt: skip
    got = runs["fsdp2-consistent"]
    assert [len(p.steps) for p in got.ranks] == [2, 1]  # batch_size 1: rank 1 ran one idle forward, uncaptured
    spec = _spec(model_dir, batch_size=1)
    for rank in (0, 1):
        want = _reference(spec, SEQS[rank::2], tmp_path / f"rank{rank}", consistent=True, fixed_order=False)
        for step in range(len(want.ranks[0].steps)):
            assert _differing(got, want, group=(rank,), step=step) == [], (rank, step)


def test_control_without_the_fixed_order_the_consistent_comparison_fails(runs: dict[str, Bundle]) -> None:
    """The unsharded consistent model reduces each row-parallel K in one GEMM: TP = 2's fixed order differs there."""
    got, want = runs["tp2-consistent"], runs["unsharded-consistent"]
    differing = _differing(got, want)
    assert differing and "log_softmax" in differing
    _first_is_row_parallel_with_equal_inputs(differing, got, want)


def test_the_offline_comparison_names_the_collective_order_and_finds_consistent_tp_equal(
        runs: dict[str, Bundle], model_dir: Path) -> None:  # fmt: skip
    """The bundles as ``logdiff compare --model`` reads them: stock TP = 2 against the unsharded model diverges first
    at a row-parallel output classified ``operator_path`` / ``collective_order`` (each side within its bound of the
    exact function); consistent TP = 2 against TP = 1 is 0."""
    from logdiff.commands.compare import compare_bundles

    assert compare_bundles(runs["tp2-consistent"].root, runs["tp1-consistent"].root).to_dict()["verdict"] == "consistent"
    stock = compare_bundles(runs["tp2"].root, runs["unsharded"].root, model=model_dir).to_dict()
    if stock["verdict"] == "consistent":
        pytest.skip("this machine's stock row-parallel sums equal one rank's bitwise: no collective order to classify")
    first = stock["first_divergence"]["boundary"]
    assert first.endswith(ROWWISE) and stock["first_divergence"]["inputs_equal"]
    cause = next(c for c in stock["causes"] if c["boundary"] == first)
    assert (cause["class"], cause["kind"]) == ("operator_path", "collective_order")


def _plain_all_reduce_rank(rank: int, job: _Job) -> None:
    """A rank whose row-parallel linears add a local GEMM's partials with a plain all-reduce."""
    import torch.distributed as dist
    from logdiff.kernels import collective

    from logdiff import kernels
    from logdiff.sources.hf import sharded

    def plain(x, weight, bias=None, *, chunk, group=None):  # noqa: ARG001 - the signature it replaces
        out = kernels.linear(x, weight).contiguous()
        dist.all_reduce(out, group=group)
        return out if bias is None else out + bias

    collective.row_parallel_linear = plain
    sharded._rank_main(rank, job)


def test_control_a_plain_all_reduce_breaks_the_consistent_tp_equality(runs: dict[str, Bundle], model_dir: Path,
                                                                      tmp_path: Path, monkeypatch) -> None:  # fmt: skip
    from logdiff.sources.hf import sharded

    job = _Job(_spec(model_dir), tuple((tuple(s.prompt_ids), tuple(s.response_ids)) for s in SEQS),
               str(tmp_path / "plain"), str(tmp_path), "cpu", 2, 1, True, None, 600.0, HFForward)  # fmt: skip
    monkeypatch.setattr(sharded, "_rank_main", _plain_all_reduce_rank)
    _launch(job)
    got, want = Bundle(tmp_path / "plain"), runs["tp1-consistent"]
    differing = _differing(got, want)
    assert differing and "log_softmax" in differing
    _first_is_row_parallel_with_equal_inputs(differing, got, want)


def test_sizes_the_plan_cannot_shard_are_one_line(model_dir: Path, demo_model: Callable[[str], Path],
                                                  tmp_path: Path) -> None:  # fmt: skip
    spec = _spec(model_dir)
    cases = [
        ({"tensor_parallel_size": 3}, "tensor_parallel_size=3 does not divide num_attention_heads=4"),
        ({"tensor_parallel_size": 4}, "tensor_parallel_size=4 does not divide num_key_value_heads=2"),
        ({"tensor_parallel_size": 2, "fsdp_size": 2}, "a 2-D mesh"),
        ({"fsdp_size": 0}, "fsdp_size=0: must be an integer >= 1"),
    ]
    for sizes, message in cases:
        with pytest.raises(InputError, match=message) as e:
            score_sharded(spec, SEQS, tmp_path / "never", engine=HFForward, **sizes)
        assert "\n" not in str(e.value)
    with pytest.raises(InputError, match="qwen3-moe is a mixture of experts"):
        score_sharded(_spec(demo_model("qwen3-moe")), SEQS, tmp_path / "never", engine=HFForward,
                      tensor_parallel_size=2)
    assert not (tmp_path / "never").exists()


def test_a_rank_that_fails_is_one_line_naming_it(model_dir: Path, tmp_path: Path) -> None:
    broken = dataclasses.replace(_spec(model_dir), model_dir=str(tmp_path / "no-model"))
    with pytest.raises(EngineUnavailable, match=r"^sharded training path, rank 0/1: OSError: ") as e:
        score_sharded(broken, SEQS, tmp_path / "out", engine=HFForward, timeout_s=120)
    assert "\n" not in str(e.value)


def test_ranks_past_the_timeout_are_ended_in_one_line(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(EngineUnavailable, match=r"^sharded training path: the 2 ranks did not finish within 1 s$"):
        score_sharded(_spec(model_dir), SEQS, tmp_path / "out", engine=HFForward, fsdp_size=2, timeout_s=1)
