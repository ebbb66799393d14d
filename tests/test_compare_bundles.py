"""``logdiff compare``: two capture bundles compared offline (logdiff/commands/compare.py, logdiff/comparison/pairing.py).

The bundles here are captured in-process from the demo Qwen3 (bf16, unsharded; the sharded ones are in
tests/test_capture_sharded.py). The inference bundle runs the same sequences in another batching (one per
step, in reverse order), so the comparison must join them by token ids. Controls: identical weights must
give bitwise equality; a planted stale weight must be found at its op.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hf_bundles import capture_hf as _capture
from plants import assert_closes

IDS = [[5, 17, 3, 9, 42, 7, 11, 2, 8, 1], [8, 1, 30, 4, 6, 19, 23, 13, 3, 3], [8, 1, 30, 4, 9, 9, 9, 9]]
PLANTED = "model.layers.1.post_attention_layernorm"


def _plant(model) -> None:
    model.get_submodule(PLANTED).weight.mul_(1.01)


@pytest.fixture(scope="module")
def bundles(demo_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    model_dir = demo_model("qwen3")
    root = tmp_path_factory.mktemp("bundles")
    return {
        "model": model_dir,
        "train": _capture(model_dir, root / "train", "train", [IDS[:2], [IDS[2]]]),
        "infer": _capture(model_dir, root / "infer", "infer", [[ids] for ids in reversed(IDS)]),
        "stale": _capture(model_dir, root / "stale", "infer", [[ids] for ids in IDS], edit=_plant),
        "other": _capture(model_dir, root / "other", "infer", [[[7, 7, 7, 7, 7, 7]]]),
    }


def _compare(train: Path, infer: Path, **kw):
    from logdiff.commands.compare import compare_bundles

    return compare_bundles(train, infer, **kw).to_dict()


def test_the_same_weights_in_another_batching_are_bitwise_consistent(bundles) -> None:
    result = _compare(bundles["train"], bundles["infer"])
    assert result["verdict"] == "consistent" and result["causes"] == []
    assert result["closure"]["closure"] == 1.0 and result["closure"]["gap_max"] == 0.0
    assert result["sequences"]["count"] == 3 and result["logprobs"]["abs_diff_max"] == 0.0
    # every token after the first is scored (a capture of whole sequences names no prompt)
    assert result["logprobs"]["num_tokens"] == sum(len(ids) - 1 for ids in IDS)
    assert all(row["max_abs_diff"] == 0.0 for row in result["pairs"][0]["boundaries"])


def test_a_stale_weight_is_found_at_its_op(bundles) -> None:
    result = _compare(bundles["train"], bundles["stale"], model=bundles["model"])
    assert result["first_divergence"]["boundary"] == PLANTED and result["first_divergence"]["inputs_equal"]
    (cause,) = [c for c in result["causes"] if c["boundary"] == PLANTED]
    assert (cause["class"], cause["kind"]) == ("framework_difference", "weights")
    assert f"weight differs: {PLANTED}.weight" in " ".join(cause["evidence"])
    assert any("live engines" in w for w in result["warnings"])
    assert_closes(result)  # offline too: a plant before the logits closes at 1


def test_conformance_runs_with_the_model(bundles) -> None:
    """With --model, the op is measured against the exact function on each side's own recorded rows (here both
    within: a 1% weight change is about one unit of bf16 spacing; the fingerprints are what catch it)."""
    result = _compare(bundles["train"], bundles["stale"], model=bundles["model"])
    (cause,) = [c for c in result["causes"] if c["boundary"] == PLANTED]
    train = cause["conformance"]["train"]
    assert train["function"].startswith("rms_norm") and train["rows"] > 0 and train["error"] <= train["bound"]
    assert "infer" in cause["conformance"]
    assert not any("conformance not checked" in w for w in result["warnings"])
    without = _compare(bundles["train"], bundles["stale"])
    assert any("conformance not checked" in w for w in without["warnings"])


def test_the_sides_are_labelled_train_and_infer_with_their_engines(bundles) -> None:
    """Two HF bundles: the paths are named by role (not both "hf"), each with the engine and version its bundle
    recorded, in result.json and in the terminal summary (issue 52: it said "hf (hf ?, forward)" twice)."""
    import io
    from importlib.metadata import version

    from rich.console import Console

    from logdiff.reports import print_summary

    result = _compare(bundles["train"], bundles["stale"])
    transformers = version("transformers")
    assert [(p["name"], p["role"], p["engine"], p["version"]) for p in result["paths"]] == [
        ("train", "train", "hf", transformers), ("infer", "infer", "hf", transformers)]
    assert (result["pairs"][0]["train"], result["pairs"][0]["infer"]) == ("train", "infer")
    console = Console(record=True, no_color=True, width=160, file=io.StringIO())
    print_summary(result, console)
    text = console.export_text()
    assert f"train (hf {transformers}, forward), infer (hf {transformers}, forward)" in text, text
    assert "train vs infer" in text and "hf (hf" not in text and " ?," not in text


def test_unmatched_sequences_are_left_out_and_said(bundles) -> None:
    result = _compare(bundles["train"], bundles["stale"])
    assert result["sequences"]["count"] == 3
    from logdiff.errors import InputError

    with pytest.raises(InputError, match="share no token sequence"):
        _compare(bundles["train"], bundles["other"])


def test_match_sequences_joins_prefixes_and_uses_each_once() -> None:
    from logdiff.comparison.pairing import match_sequences

    g = (0,)
    train = {(g, 0): [1, 2, 3, 4], (g, 1): [1, 2, 3, 4], (g, 2): [9, 9]}
    infer = {((1,), 5): [1, 2, 3], ((1,), 6): [1, 2, 3, 4, 5], ((1,), 7): [8]}
    m = match_sequences(train, infer)
    assert m.ids == [[1, 2, 3, 4, 5], [1, 2, 3, 4]]  # the longer agreement first, then what is left
    assert m.train == {(g, 0): 0, (g, 1): 1} and m.infer == {((1,), 6): 0, ((1,), 5): 1}
    assert m.unmatched == {"train": 1, "infer": 1}


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``logdiff`` in a fresh interpreter that reports, after the command, whether vLLM was imported."""
    code = ("import sys\nfrom logdiff.cli import main\nsys.argv = ['logdiff', *sys.argv[1:]]\ntry:\n    main()\n"
            "except SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
            "print('VLLM_IMPORTED' if 'vllm' in sys.modules else 'NO_VLLM', file=sys.stderr)\nsys.exit(code)\n")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)


def test_cli_compares_copied_bundles_without_vllm(bundles, tmp_path: Path) -> None:
    from logdiff.reports.schema import validate_result

    moved = tmp_path / "elsewhere"
    for name in ("train", "stale"):
        shutil.copytree(bundles[name], moved / name)
    run = _cli("compare", str(moved / "train"), str(moved / "stale"), "--out", str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr
    assert "NO_VLLM" in run.stderr
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert validate_result(result) == []
    assert result["first_divergence"]["boundary"] == PLANTED
    assert (tmp_path / "out" / "report.html").is_file()


def test_cli_bad_bundles_are_one_line_and_exit_2(bundles, tmp_path: Path) -> None:
    missing = _cli("compare", str(tmp_path / "nothing"), str(bundles["infer"]))
    assert missing.returncode == 2 and "not a capture bundle" in missing.stderr
    other = tmp_path / "other-model"
    shutil.copytree(bundles["infer"], other)
    manifest = other / "rank-00000" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["meta"]["config"]["hidden_size"] += 1
    manifest.write_text(json.dumps(data))
    run = _cli("compare", str(bundles["train"]), str(other), "--json", str(tmp_path / "r.json"))
    assert run.returncode == 2 and "different models: hidden_size" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "r.json").exists()
    disjoint = _cli("compare", str(bundles["train"]), str(bundles["other"]))
    assert disjoint.returncode == 2 and "share no token sequence" in disjoint.stderr
