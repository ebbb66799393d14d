"""A capture's full window and the row sketches outside it (logdiff/records/sketch.py, issue 22).

* Sketches: the digest of a row is the sum of its slices' digests, whatever the slicing (shards, packed
  parts, a padded vocabulary), so ranks never gather; any one-element change (one ulp) or a swap of two
  columns changes it; the magnitudes give a lower bound of the largest difference, never more.
* A bundle written by two ranks' slices reads back as the sketch of the whole rows (numpy only).
* ``logdiff.capture`` keeps the first 2 layers whole by default and sketches the rest; ``logdiff compare``
  finds a fault planted outside the window at its op, bit-exactly, and says what sketches cannot tell.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from logdiff.records.layout import REPLICATE, ParallelLayout, Placement, shard
from logdiff.records.sketch import Window, combine, digest_of, local_columns, lower_bound, sketch

RNG = np.random.default_rng(0)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.int32) >> 16).astype(np.int16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("world", [2, 4])
def test_the_slices_digests_add_up_to_the_whole_rows(dtype: str, world: int) -> None:
    x = RNG.standard_normal((6, 32)).astype(np.float32)
    raw = _bf16_bits(x) if dtype == "bfloat16" else x
    whole = sketch(raw, dtype, np.arange(32))
    w = 32 // world
    pieces = [sketch(raw[:, i * w : (i + 1) * w], dtype, local_columns(shard(-1), i, world, w)) for i in range(world)]
    combined = combine(pieces)
    assert np.array_equal(digest_of(combined), digest_of(whole))
    assert np.allclose(combined, whole) and np.array_equal(combined[:, 2], whole[:, 2])
    # packed parts ([q_i, k_i] on each rank) and a padded vocabulary come out as the logical row too
    parts = Placement("shard", -1, (w // 2, w - w // 2))
    logical = np.concatenate([raw[:, i * w : i * w + w // 2] for i in range(world)]
                             + [raw[:, i * w + w // 2 : (i + 1) * w] for i in range(world)], axis=1)  # fmt: skip
    packed = combine([sketch(raw[:, i * w : (i + 1) * w], dtype, local_columns(parts, i, world, w))
                      for i in range(world)])  # fmt: skip
    assert np.array_equal(digest_of(packed), digest_of(sketch(logical, dtype, np.arange(32))))
    padded = Placement("shard", -1, None, 32 - 3)
    trimmed = combine([sketch(raw[:, i * w : (i + 1) * w], dtype, local_columns(padded, i, world, w))
                       for i in range(world)])  # fmt: skip
    assert np.array_equal(digest_of(trimmed), digest_of(sketch(raw[:, :29], dtype, np.arange(29))))


def test_a_one_ulp_change_or_a_column_swap_changes_the_digest_and_the_bound_never_overstates() -> None:
    x = RNG.standard_normal((8, 64)).astype(np.float32)
    base = sketch(x, "float32", np.arange(64))
    nudged = x.copy()
    nudged[3, 17] = np.nextafter(nudged[3, 17], np.float32(np.inf))
    changed = digest_of(sketch(nudged, "float32", np.arange(64))) != digest_of(base)
    assert changed.tolist() == [i == 3 for i in range(8)]
    swapped = x.copy()
    swapped[:, [5, 9]] = swapped[:, [9, 5]]
    assert (digest_of(sketch(swapped, "float32", np.arange(64))) != digest_of(base)).all()
    for _ in range(20):
        y = x + RNG.standard_normal(x.shape).astype(np.float32) * RNG.uniform(0, 1)
        truth = np.abs(y.astype(np.float64) - x).max(axis=1)
        assert (lower_bound(sketch(y, "float32", np.arange(64)), base) <= truth + 1e-12).all()


def test_a_partial_sum_or_another_split_is_kept_whole() -> None:
    assert local_columns(Placement("partial"), 0, 2, 8) is None
    assert local_columns(shard(0), 0, 2, 8) is None
    assert local_columns(REPLICATE, 1, 2, 8).tolist() == list(range(8))
    assert Window.parse("all").full(30) and Window.parse(2).full(1) and not Window.parse(2).full(2)
    assert Window().full(None)  # embeddings, final norm, logits: always whole
    with pytest.raises(ValueError):
        Window.parse("first")


def test_a_bundle_of_two_ranks_slices_reads_back_as_the_whole_rows_sketch(tmp_path: Path) -> None:
    from logdiff.records.bundle import Bundle
    from logdiff.records.bundle_writer import BundleWriter

    x = RNG.standard_normal((5, 16)).astype(np.float32)
    group = {"tp": (0, 1)}
    for rank in (0, 1):
        writer = BundleWriter(tmp_path / "b", "train", ParallelLayout(rank, 2, group))
        writer.begin_step(np.arange(5), np.arange(5), np.zeros(5), np.ones(5))
        local = x[:, rank * 8 : (rank + 1) * 8]
        writer.record("h", local, shard(-1), sketch_columns=local_columns(shard(-1), rank, 2, 8))
        writer.record("r", x, REPLICATE, sketch_columns=np.arange(16))
        writer.close()
    bundle = Bundle(tmp_path / "b")
    assert bundle.ranks[0].steps[0]["records"]["h"]["sketch"] is True
    (h,) = bundle.logical(0, "h").values()
    (r,) = bundle.logical(0, "r").values()
    assert np.array_equal(digest_of(h.value), digest_of(sketch(x, "float32", np.arange(16))))
    assert r.replicas_equal is True and np.array_equal(r.value, sketch(x, "float32", np.arange(16)))


# ---- a capture of the demo model with the default window, compared --------------------------------------------

PLANTED = "model.layers.3.post_attention_layernorm"  # outside the default window of 2 layers
IDS = [[5, 17, 3, 9, 42, 7, 11, 2, 8, 1], [8, 1, 30, 4, 6, 19, 23, 13, 3, 3]]


def _capture(model_dir: Path, out: Path, role: str, window: int | str = 2, plant: bool = False) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    import logdiff

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    if plant:
        with torch.no_grad():
            model.get_submodule(PLANTED).weight.mul_(1.01)
    with logdiff.capture(model, out, role, window=window) as cap, torch.no_grad():
        for ids in IDS:
            cap.logprobs(model(torch.tensor([ids])).logits)
    return out


@pytest.fixture(scope="module")
def windowed(demo_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    model = demo_model("qwen3")
    root = tmp_path_factory.mktemp("window")
    return {"train": _capture(model, root / "train", "train"), "full": _capture(model, root / "full", "train", "all"),
            "stale": _capture(model, root / "stale", "infer", plant=True),
            "same": _capture(model, root / "same", "infer")}


def test_the_default_window_keeps_two_layers_whole_and_sketches_the_rest(windowed) -> None:
    from logdiff.records.bundle import Bundle

    records = Bundle(windowed["train"]).ranks[0].steps[0]["records"]
    sketched = {n for n, e in records.items() if e.get("sketch")}
    assert sketched and all(n.startswith(("model.layers.2.", "model.layers.3.")) for n in sketched)
    assert {"logits", "log_softmax", "model.norm", "model.layers.1.mlp.down_proj"}.isdisjoint(sketched)
    assert "model.layers.3.mlp.down_proj" in sketched
    size = {k: sum(f.stat().st_size for f in Path(windowed[k]).rglob("*.safetensors")) for k in ("train", "full")}
    assert size["train"] < size["full"]


@pytest.mark.parametrize("train", ["train", "full"])
def test_compare_finds_a_fault_outside_the_window_bit_exactly(windowed, train: str) -> None:
    from logdiff.commands.compare import compare_bundles

    result = compare_bundles(windowed[train], windowed["stale"]).to_dict()
    first = result["first_divergence"]
    assert first["boundary"] == PLANTED and first["inputs_equal"] and first.get("sketched") is True
    (cause,) = [c for c in result["causes"] if c["boundary"] == PLANTED]
    assert (cause["class"], cause["kind"]) == ("framework_difference", "weights")
    assert any("row sketches only" in w for w in result["warnings"])
    same = compare_bundles(windowed[train], windowed["same"]).to_dict()
    assert same["verdict"] == "consistent" and same["first_divergence"] is None
