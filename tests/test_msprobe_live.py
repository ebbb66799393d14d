"""Real msprobe dumps made in the suite as a ``logdiff compare`` source (issue 34; docs/msprobe.md).

``logdiff msprobe-config`` writes each side's msprobe config; tests/msprobe_run.py dumps the demo Qwen3 with
msprobe 26.2 on the CPU (HF teacher-forced forward at level ``mix``, so that HF's RoPE is in the dump; vLLM
in-process eager generation at ``L0``) while logdiff's own capture records the same runs. Then:

* each converted dump equals logdiff's own capture of the same run on every boundary, bit for bit;
* ``logdiff compare`` on the two dumps and on logdiff's own bundles gives the same logprob gap, the same first
  divergence and the same causes. A dump holds no contract (no eps, RoPE style or attention scale), so its ops
  are judged under the contract ``--model``'s config declares, and every conformance line says so; the one
  legitimate difference is a contract value that differs, which only a read contract can name
  (``config_contract``): a dump's side is then outside the declared function, a framework difference all the same;
* planted faults: a stale layer-2 ``o_proj`` on the vLLM side (found as a ``weights`` framework difference by
  conformance alone, no fingerprint) and a one-sided eps on HF (the same first divergence; its train side outside
  the norm the config declares);
* the negative control: an HF dump against an HF dump of the same forward is consistent and bitwise equal;
* a dump cut short (a truncated dump.json, a step without dump_tensor_data/, a rank directory without
  dump.json) is one line and exit 2, nothing written;
* msprobe's own ``msprobe compare`` runs on the planted pair (vLLM against vLLM, whose names match), and its
  first failing tensor is logdiff's first divergence.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from logdiff.cli import app

pytestmark = pytest.mark.skipif(importlib.util.find_spec("msprobe") is None,
                                reason="mindstudio-probe is not installed (pip install mindstudio-probe)")
runner = CliRunner()
#: what a dump's conformance evidence says: its side was judged under the contract --model's config declares
DECLARED = "as --model's config.json (the dump holds no contract) declares it"


def _cli(*args: Any) -> tuple[int, str]:
    res = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in res.output, res.output
    return res.exit_code, res.output  # stdout and stderr as a terminal shows them


def _one_line(out: str) -> str:
    lines = [line for line in out.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("logdiff: error:"), out
    return lines[0]


@pytest.fixture(scope="module")
def runs(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import msprobe_run

    def write_config(side: str, config: Path, dump: Path) -> None:
        level = ["--level", "mix"] if side == "hf" else []  # HF's RoPE is plain code: only mix holds it
        code, out = _cli("msprobe-config", config, "--side", side, "--dump-path", dump, *level)
        assert code == 0 and f"wrote {config}" in out, out

    return msprobe_run.make_runs(qwen3, tmp_path_factory.mktemp("msprobe-live"), write_config)


@pytest.fixture(scope="module")
def results(runs: dict[str, Path], qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``results(train, infer)``: the result.json of ``logdiff compare TRAIN INFER --model MODEL``, each once."""
    from msprobe_run import HF_STEPS, VLLM_STEPS, step_dir

    out, done = tmp_path_factory.mktemp("results"), {}
    paths = {**runs, **{f"hf-dump/{r}": step_dir(runs["hf-dump"], s) for r, s in HF_STEPS.items()},
             **{f"vllm-dump/{r}": step_dir(runs["vllm-dump"], s) for r, s in VLLM_STEPS.items()}}

    def get(train: str, infer: str) -> dict[str, Any]:
        if (train, infer) not in done:
            path = out / f"{len(done)}.json"
            code, text = _cli("compare", paths[train], paths[infer], "--model", qwen3, "--json", path, "--quiet")
            assert code in (0, 1), text
            done[train, infer] = json.loads(path.read_text())
        return done[train, infer]

    return get


def test_msprobe_accepts_the_config_and_bad_arguments_are_one_line(tmp_path: Path) -> None:
    from msprobe.pytorch.dump.debugger.debugger_config import DebuggerConfig
    from msprobe.pytorch.dump.pt_config import parse_json_config

    for side, extra, head in (("hf", [], "lm_head"), ("vllm", ["--layers", "0,3", "--steps", "0"], "logits_processor"),
                              ("hf", ["--statistics"], "lm_head")):
        path = tmp_path / f"{side}-{len(extra)}.json"
        code, out = _cli("msprobe-config", path, "--side", side, "--dump-path", tmp_path / "dump", *extra)
        assert code == 0 and "PrecisionDebugger" in out and len(out.strip().splitlines()) == 1, out
        config = json.loads(path.read_text())
        common, task = parse_json_config(str(path), None)
        DebuggerConfig(common, task, None, None, None)  # msprobe's own checks (raises on a bad config)
        selection = config[config["task"]]
        assert config["level"] == "L0" and selection["list"][0] == "model.embed_tokens"
        assert selection["list"][-1] == head
        if "--layers" in extra:
            assert selection["list"][1:3] == ["model.layers.0.", "model.layers.3."] and config["step"] == [0]
        if "--statistics" in extra:
            assert config["task"] == "statistics" and selection["summary_mode"] == "md5"
    bad = [(["--side", "megatron"], "--side"), (["--side", "hf", "--layers", "1,x"], "--layers"),
           (["--side", "hf", "--steps", "-1"], "--steps"), (["--side", "vllm", "--level", "mix"], "KV cache"),
           (["--side", "hf", "--level", "L1"], "--level")]
    for args, words in bad:
        code, out = _cli("msprobe-config", tmp_path / "bad.json", "--dump-path", tmp_path / "d", *args)
        assert code == 2 and words in _one_line(out), out
    (tmp_path / "file").write_text("")
    code, out = _cli("msprobe-config", tmp_path / "file" / "c.json", "--side", "hf", "--dump-path", tmp_path / "d")
    assert code == 4 and "c.json" in _one_line(out), out
    assert not (tmp_path / "bad.json").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


#: the demo Qwen3's boundaries both sides record: embedding, 17 per layer (4), final norm, logits
ALL_BOUNDARIES = 3 + 17 * 4


def _boundaries(result: dict[str, Any]) -> dict[str, float]:
    return {row["boundary"]: row["max_abs_diff"] for row in result["pairs"][0]["boundaries"]}


@pytest.mark.vllm
@pytest.mark.parametrize("side, dump, run", [("hf", "hf-dump", "clean"), ("vllm", "vllm-dump", "clean"),
                                             ("vllm", "vllm-dump", "stale")])
def test_a_converted_dump_equals_logdiffs_own_capture_of_the_run(runs: dict[str, Path], qwen3: Path, side: str,
                                                                 dump: str, run: str, tmp_path: Path) -> None:
    """msprobe and logdiff hooked the same forwards: every boundary of the converted dump equals the capture's."""
    from msprobe_run import HF_STEPS, VLLM_STEPS, step_dir

    from logdiff.commands.compare import compare_bundles
    from logdiff.sources.msprobe import convert
    from logdiff.sources.msprobe.source import model_config

    step = step_dir(runs[dump], (HF_STEPS if side == "hf" else VLLM_STEPS)[run])
    converted = convert(step, tmp_path / "dump", "train", model_config(qwen3, step))
    r = compare_bundles(converted, runs[f"{side}-{run}"]).to_dict()
    rows = _boundaries(r)
    assert r["verdict"] == "consistent" and r["logprobs"]["abs_diff_max"] == 0.0 and not r.get("first_divergence")
    assert len(rows) == ALL_BOUNDARIES and set(rows.values()) == {0.0}, rows  # RoPE too: vLLM's module, HF's mix
    assert r["sequences"]["count"] == 2


PAIRS = {"clean": (("hf-clean", "vllm-clean"), ("hf-dump/clean", "vllm-dump/clean")),
         "stale": (("hf-clean", "vllm-stale"), ("hf-dump/clean", "vllm-dump/stale")),
         "eps": (("hf-eps", "vllm-clean"), ("hf-dump/eps", "vllm-dump/clean"))}


@pytest.mark.vllm
@pytest.mark.parametrize("pair", list(PAIRS))
def test_compare_on_dumps_gives_what_compare_on_logdiffs_bundles_gives(results: Any, pair: str) -> None:
    own_pair, dump_pair = PAIRS[pair]
    own, dump = results(*own_pair), results(*dump_pair)
    assert dump["logprobs"]["abs_diff_max"] == own["logprobs"]["abs_diff_max"]
    assert dump["logprobs"]["abs_diff_mean"] == own["logprobs"]["abs_diff_mean"]
    if pair != "clean":  # a plant must show (whether the stock engines differ at all is this CPU's kernels' affair)
        assert own["logprobs"]["abs_diff_max"] > 0 and own["first_divergence"]
    keys = ("boundary", "layer", "position", "sequence", "max_abs_diff", "inputs_equal")
    first = [r["first_divergence"] and {k: r["first_divergence"][k] for k in keys} for r in (dump, own)]
    assert first[0] == first[1]
    mine = {c["boundary"]: c for c in own["causes"]}
    theirs = {c["boundary"]: c for c in dump["causes"]}
    assert set(theirs) == set(mine)
    for name, c in theirs.items():
        assert any(DECLARED in e for e in c["evidence"] if e.startswith("conformance: ")), c
        if (c["class"], c["kind"]) != (mine[name]["class"], mine[name]["kind"]):
            # the one legitimate difference: a contract value that differs, which only a read contract can name
            assert mine[name]["kind"] == "config_contract" and c["class"] == "framework_difference", (c, mine[name])
    said = [w for w in dump["warnings"] if w.startswith("msprobe dumps read")]
    assert len(said) == 1 and "no contracts" in said[0]
    assert not [w for w in own["warnings"] if w.startswith("msprobe dumps read")]


@pytest.mark.vllm
def test_a_stale_weight_on_the_vllm_side_is_found_and_classified(results: Any) -> None:
    from msprobe_run import STALE

    site = STALE.rsplit(".", 1)[0]
    for train, infer in PAIRS["stale"]:
        r = results(train, infer)
        (cause,) = [c for c in r["causes"] if c["boundary"] == site]
        assert (cause["class"], cause["kind"]) == ("framework_difference", "weights"), cause
        assert any(e.startswith("conformance: infer (vllm)") and "OUTSIDE" in e for e in cause["evidence"]), cause
        named = any(STALE in e and "fingerprint" in e for e in cause["evidence"])
        assert named == (train == "hf-clean")  # only logdiff's own vLLM bundle hashes its weights
    for pair in PAIRS["clean"]:  # the control: without the plant, no framework difference there
        assert not [c for c in results(*pair)["causes"] if c["boundary"] == site
                    and c["class"] == "framework_difference"]


@pytest.mark.vllm
def test_a_one_sided_eps_is_found_outside_the_function_the_config_declares(results: Any) -> None:
    own, dump = (results(*p) for p in PAIRS["eps"])
    first = "model.layers.0.input_layernorm"
    for r in (own, dump):
        assert r["first_divergence"]["boundary"] == first and r["first_divergence"]["inputs_equal"]
    (mine,) = [c for c in own["causes"] if c["boundary"] == first]
    (theirs,) = [c for c in dump["causes"] if c["boundary"] == first]
    assert (mine["class"], mine["kind"]) == ("framework_difference", "config_contract")
    assert any("rms_norm_eps = 0.5 (train)" in e for e in mine["evidence"]), mine
    # the dump holds no eps: its train side is outside the norm its config declares, the infer side within it
    assert theirs["class"] == "framework_difference", theirs
    conformance = [e for e in theirs["evidence"] if e.startswith("conformance: ")]
    assert len(conformance) == 2 and all(DECLARED in e for e in conformance), conformance
    assert [("OUTSIDE" in e) for e in conformance] == [True, False], conformance  # train, infer


@pytest.mark.vllm
def test_an_hf_dump_against_a_dump_of_the_same_forward_is_bitwise_equal(results: Any) -> None:
    r = results("hf-dump/clean", "hf-dump/again")
    assert r["verdict"] == "consistent" and r["logprobs"]["abs_diff_max"] == 0.0 and not r.get("first_divergence")
    rows = _boundaries(r)
    assert len(rows) == ALL_BOUNDARIES and set(rows.values()) == {0.0} and not r["causes"]


def _partial(dump: Path, root: Path) -> Path:
    """A copy of ``dump`` whose files are hard links (instant); a file to change is replaced, never edited."""
    return Path(shutil.copytree(dump, root, copy_function=os.link))


def _rank(dump: Path, step: int) -> Path:
    return next(p for p in (dump / f"step{step}").iterdir() if p.is_dir())


@pytest.mark.vllm
def test_a_live_dump_cut_short_is_one_line_and_exit_2(runs: dict[str, Path], qwen3: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    truncated = _partial(runs["hf-dump"], tmp_path / "truncated")
    f = _rank(truncated, 1) / "dump.json"
    text = f.read_bytes()
    f.unlink()
    f.write_bytes(text[: len(text) // 2])  # msprobe killed while writing step 1
    no_tensors = _partial(runs["hf-dump"], tmp_path / "no-tensors")
    shutil.rmtree(_rank(no_tensors, 1) / "dump_tensor_data")
    no_json = _partial(runs["hf-dump"], tmp_path / "no-json")
    (_rank(no_json, 1) / "dump.json").unlink()
    cases = [(truncated, "not readable JSON"), (no_tensors, "no dump_tensor_data"), (no_json, "with no dump.json")]
    for dump, words in cases:
        code, out = _cli("compare", dump, runs["vllm-dump"] / "step0", "--model", qwen3, "--out", tmp_path / "out")
        line = _one_line(out)
        assert code == 2 and words in line and "step1" in line, out
    assert not list(tmp_path.glob("out/*")) and not list((tmp_path / "scratch").iterdir())


@pytest.mark.vllm
def test_msprobes_own_compare_runs_on_the_dumps_and_agrees_where_it_can_align(runs: dict[str, Path], results: Any,
                                                                              tmp_path: Path) -> None:
    """``msprobe compare`` (docs/msprobe.md, side by side) on vLLM clean against vLLM stale, whose entries match by
    name: its first failing tensor is the boundary logdiff names as the first divergence of the same pair."""
    import csv
    import subprocess
    import sys

    exe = Path(sys.executable).parent / "msprobe"
    if not exe.exists():
        pytest.skip(f"no msprobe command beside {sys.executable}")
    target, golden = (_rank(runs["vllm-dump"], s) / "dump.json" for s in (1, 0))
    proc = subprocess.run([str(exe), "compare", "-tp", str(target), "-gp", str(golden), "-o", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    tables = list(tmp_path.glob("compare_result_*.csv"))
    assert proc.returncode == 0 and len(tables) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    with tables[0].open(newline="") as f:
        rows = list(csv.DictReader(f))
    failed = [r["NPU Name"] for r in rows if r["Result"] == "error"]
    assert failed and all(r["Bench Name"] for r in rows)  # the same engine twice: every entry matched by name
    first = results("vllm-dump/clean", "vllm-dump/stale")["first_divergence"]
    assert first["boundary"] == "model.layers.2.self_attn.o_proj" and first["inputs_equal"]
    # msprobe's first error is o_proj's output, or, where its rule takes o_proj's differing parameters to explain
    # its output ("input/parameters ... while the output", near its thresholds on some hosts' demo weights), the
    # output of the attention module that returns o_proj's as is: the same tensor, and nothing before it fails
    assert failed[0].endswith(".output.0") and failed[0].startswith(
        ("Module.model.layers.2.self_attn.o_proj.", "Module.model.layers.2.self_attn.Qwen3Attention.forward.0."))

