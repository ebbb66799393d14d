"""``scan --window``: boundaries beyond the window compared by row sketches, and fetched whole when needed.

Without engines: the windowed sink hands a boundary inside the window to every
sink whole (its replay spec only to those that want one) and any other as one
row sketch; the second pass's sink keeps the rows it was asked for and counts
the rows whose digest is not the first pass's (a planted change must count).
On the demo Qwen3, a split-K plant in layer 2 of the inference side: beyond a
window of one layer the first divergence is still found, at the same boundary,
by sketches; the patched attribution fetches what it needs in a second pass and
gives the unwindowed scan's numbers exactly (against vLLM too); a second pass
that computes other values is caught and not used; identical paths stay equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from logdiff.probes.align import RowMap
from logdiff.probes.correspondence import Boundary
from logdiff.probes.session import StoreSink
from logdiff.probes.windowed import FetchSink, WindowedSinks, row_sketches
from plants import split_k

import logdiff
from logdiff.diagnosis import beyond_window
from logdiff.records.sketch import SUFFIX, Window
from logdiff.records.store import PathStore
from logdiff.sources import base, checkpoint, pool

SMALL = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "modules"}
TARGET = "model.layers.2.self_attn.o_proj"


class _Sink:
    def __init__(self, wants_replay: bool):
        self.wants_replay, self.got = wants_replay, []

    def emit(self, name: str, rows: Any, rmap: Any, spec: Any = None) -> None:
        self.got.append((name, rows, spec))


class _Map:
    def get(self, name: str) -> Boundary | None:
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        return Boundary(name, "linear", int(layer) if layer is not None else None)


def _rmap(n: int) -> RowMap:
    return RowMap(np.zeros(n, np.int64), np.arange(n), np.ones(n, bool))


def test_the_window_sends_whole_rows_inside_and_one_sketch_beyond() -> None:
    replaying, storing = _Sink(True), _Sink(False)
    sinks = WindowedSinks([replaying, storing], Window(1), _Map())
    assert sinks.wants_replay
    rows = torch.randn(3, 16).to(torch.bfloat16)
    for name in ("model.embed_tokens", "model.layers.0.mlp", "model.layers.1.mlp"):
        sinks.emit(name, rows, _rmap(3), "spec")
    assert [g[0] for g in replaying.got] == ["model.embed_tokens", "model.layers.0.mlp", "model.layers.1.mlp#sketch"]
    assert [g[2] for g in replaying.got] == ["spec", "spec", None] and [g[2] for g in storing.got] == [None] * 3
    assert replaying.got[0][1] is rows  # whole: the recorder's rows themselves
    sketch = replaying.got[2][1]
    assert sketch is storing.got[2][1] and tuple(sketch.shape) == (3, 5)  # made once for every sink
    changed = rows.clone()
    changed[1, 7] = changed[1, 7] * 2 + 1
    other = row_sketches(changed)
    assert torch.equal(other[[0, 2]], sketch[[0, 2]]) and not torch.equal(other[1, :2], sketch[1, :2])


def test_the_second_pass_keeps_what_it_was_asked_for_and_counts_rows_it_did_not_reproduce(tmp_path: Path) -> None:
    first = PathStore(tmp_path / "first", "infer", 1, 4)
    rows = torch.randn(4, 8).to(torch.bfloat16)
    first.emit("a" + SUFFIX, row_sketches(rows), np.zeros(4, np.int64), np.arange(4))
    same = FetchSink(StoreSink(tmp_path / "same", "infer", 1, 4), first, {"a"})
    planted = rows.clone()
    planted[2, 3] += 1
    other = FetchSink(StoreSink(tmp_path / "other", "infer", 1, 4), first, {"a"})
    for sink, value in ((same, rows), (other, planted)):
        sink.emit("a", value, _rmap(4))
        sink.emit("b", value, _rmap(4))  # not asked for
    assert same.mismatched == {} and same.checked == 4  # identical rows: equal (the control)
    assert other.mismatched == {"a": 1} and other.checked == 4  # the planted row is found, the others are not
    assert torch.equal(same.store.get("a").read(np.zeros(4, np.int64), np.arange(4)), rows)
    assert same.store.get("b") is None


# --- on the demo Qwen3 -----------------------------------------------------------------------------


def _planted_scan(qwen3: Path, window: int | None, **extra: Any) -> dict[str, Any]:
    engine = pool.acquire("hf-decode", base.EngineSpec(str(checkpoint.stage(qwen3).path)))  # the pooled engine
    with split_k(engine.model.get_submodule(TARGET)):
        return logdiff.scan(qwen3, infer=["hf-decode"], consistent=True, consistent_kernels=("attention",),
                            window=window, **SMALL, **extra)


@pytest.mark.isa_sensitive
def test_beyond_the_window_the_divergence_is_found_by_sketches_and_attributed_as_without_one(
        qwen3: Path, shared_scan: Any) -> None:
    # the unwindowed scan is test_attribute_patched.py's planted one (the same plant and options)
    whole = shared_scan(qwen3, split_k=("hf-decode", TARGET), infer=["hf-decode"], consistent=True,
                        consistent_kernels=("attention",), **SMALL)
    windowed = _planted_scan(qwen3, 1)
    first = windowed["first_divergence"]
    assert first["boundary"] == whole["first_divergence"]["boundary"] == TARGET and first["sketched"] is True
    assert first["inputs_equal"] is True  # the sketches of its inputs are equal: the op introduced it
    assert [c["boundary"] for c in windowed["causes"]] == [TARGET]
    assert any("compared by row sketches only" in w for w in windowed["warnings"])
    # conformance fetched the op's rows beyond the window (one more pass of each side): judged as without one
    assert [c["class"] for c in windowed["causes"]] == [c["class"] for c in whole["causes"]] == ["operator_path"]
    assert "fetch" in windowed["timings"] and "fetch" not in whole["timings"]
    a, b = whole["attribution"], windowed["attribution"]
    assert b["game"] == "patched", b.get("fallback")
    fetched = b["patched"]["fetched"]
    assert fetched["boundaries"] > 0 and fetched["rows_checked"] > 0 and "mismatched" not in fetched
    assert "fetched" not in a["patched"]  # nothing beyond a window to fetch
    # the fetched rows are the scan's own: every coalition's gap is the unwindowed scan's, bit for bit
    for key in ("baseline", "residual", "closed", "levers"):
        assert b[key] == a[key], key


@pytest.mark.vllm
@pytest.mark.isa_sensitive
def test_against_vllm_the_patched_game_fetches_what_the_window_left_and_matches_the_whole_scan(
        qwen3: Path, stock_varies: Any, shared_scan: Any) -> None:
    """Every family of the stock HF-vs-vLLM gap, the final norm's (in the window, its input beyond) included."""
    whole = shared_scan(qwen3, infer=["vllm"], **SMALL)  # test_attribute_patched.py's patched scan
    stock_varies(whole["verdict"] == "consistent", "HF and vLLM agree bitwise here")
    windowed = logdiff.scan(qwen3, infer=["vllm"], window=1, **SMALL)
    a, b = whole["attribution"], windowed["attribution"]
    assert a["game"] == b["game"] == "patched", b.get("fallback")
    assert b["patched"]["fetched"]["rows_checked"] > 0 and "mismatched" not in b["patched"]["fetched"]
    for key in ("baseline", "residual", "closed"):
        assert b[key] == a[key], key
    # every lever's numbers bit for bit; fewer causes share them (the window judged only its own layers' ops)
    numbers = [{k: v for k, v in lv.items() if k != "causes"} for lv in a["levers"]]
    assert [{k: v for k, v in lv.items() if k != "causes"} for lv in b["levers"]] == numbers
    assert {c["boundary"] for c in windowed["causes"]} <= {c["boundary"] for c in whole["causes"]}
    assert windowed["scratch_bytes"] < whole["scratch_bytes"]


def test_with_identical_paths_the_window_finds_nothing(qwen3: Path) -> None:
    r = logdiff.scan(qwen3, infer=["hf"], window=1, **SMALL)
    assert r["verdict"] == "consistent" and r["causes"] == [] and r["first_divergence"] is None


@pytest.mark.isa_sensitive
def test_a_second_pass_that_does_not_reproduce_the_scan_is_caught_and_not_used(qwen3: Path, monkeypatch: Any) -> None:
    """The negative control of the fetches: second passes under another plant (layer 2's v_proj split too, upstream
    of the planted op) differ from the scan's sketches, so their rows are used neither by conformance nor by
    attribution."""
    engine = pool.acquire("hf-decode", base.EngineSpec(str(checkpoint.stage(qwen3).path)))
    second_pass = beyond_window.second_pass

    def another_pass(*args: Any) -> Any:
        run = second_pass(*args)

        def planted(recording: Any) -> Any:
            with split_k(engine.model.get_submodule("model.layers.2.self_attn.v_proj")):
                return run(recording)

        return planted

    monkeypatch.setattr(beyond_window, "second_pass", another_pass)
    r = _planted_scan(qwen3, 1)
    assert any("beyond the window were not checked" in w and "did not reproduce" in w for w in r["warnings"])
    assert [c["class"] for c in r["causes"]] == ["not_judged"]  # no rows to judge it against its exact function
    a = r["attribution"]
    assert a["game"] == "rescan" and "did not reproduce the scan" in a["fallback"], a.get("fallback")


@pytest.mark.parametrize(("window", "message"), [
    ("x", "--window expects 'all' or a number of layers"),
    ("-1", "--window needs --depth modules or ops and a number of layers >= 0"),
])  # fmt: skip
def test_a_bad_window_is_one_line_and_exit_2(qwen3: Path, window: str, message: str) -> None:
    from typer.testing import CliRunner

    from logdiff.cli import app

    res = CliRunner().invoke(app, ["scan", str(qwen3), "--window", window, "--quiet"])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output


def test_the_window_needs_a_depth_that_records(qwen3: Path) -> None:
    from logdiff.errors import InputError

    with pytest.raises(InputError, match="--window needs --depth modules"):
        logdiff.scan(qwen3, window=1, depth="logprobs")
