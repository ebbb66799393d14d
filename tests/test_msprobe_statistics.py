"""Statistics-only msprobe dumps as a ``logdiff compare`` source (logdiff/sources/msprobe/statistics.py, docs/msprobe.md).

Real dumps of the demo Qwen3 (HF, bf16, one [2, 7] forward per msprobe step), made here: the same run three
times per dump, step 0 as loaded, step 1 with ``PLANT`` scaled by ``FACTOR`` (a one-sided weight fault), step 2
as loaded again (the negative control). Three dumps of those runs, each in a process of its own (msprobe's
debugger is one per process): ``statistics`` task with summary_mode ``md5`` and ``statistics``, and a whole-model
``tensor`` dump, whose tensors give the true max |Δ| and whose tensor-mode comparison names the first divergence
the statistics must name too. Run as a script, this file writes one dump (``python THIS MODEL MODE OUT``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from logdiff.cli import app

PLANT = "model.layers.1.mlp.up_proj"
FACTOR = 1.25
MODES = ("md5", "statistics", "tensor")
runner = CliRunner()


def _dump(model: str, mode: str, out: Path) -> None:
    """Three msprobe steps of one forward each: clean, PLANT scaled by FACTOR, clean again."""
    import torch
    from msprobe.pytorch import PrecisionDebugger
    from transformers import AutoModelForCausalLM

    task = "tensor" if mode == "tensor" else "statistics"
    cfg = {"task": task, "dump_path": str(out), "level": "L0", "step": [], "rank": [], "async_dump": False,
           task: {"scope": [], "list": [], "data_mode": ["all"]}}
    if task == "statistics":
        cfg[task]["summary_mode"] = mode
    config = out.parent / f"{out.name}-config.json"
    config.write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    ids = torch.randint(1, 4000, (2, 7), generator=torch.Generator().manual_seed(0))
    weight = hf.get_submodule(PLANT).weight
    clean = weight.detach().clone()
    debugger = PrecisionDebugger(config_path=str(config))
    for run in ("clean", "plant", "again"):
        with torch.no_grad():
            weight.copy_(clean * FACTOR if run == "plant" else clean)
            debugger.start(model=hf)
            hf(ids)
            debugger.stop()
            debugger.step()


@pytest.fixture(scope="module")
def dumps(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three dumps (made in parallel processes), by mode."""
    pytest.importorskip("msprobe.pytorch")
    root = tmp_path_factory.mktemp("msprobe-statistics")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = {m: subprocess.Popen([sys.executable, __file__, str(qwen3), m, str(root / m)], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for m in MODES}
    for m, p in procs.items():
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"the {m} dump failed:\n{err[-3000:]}"
    return {m: root / m for m in MODES}


@pytest.fixture(scope="module")
def config_only(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """--model as a directory with only config.json (no weights: no replay or conformance, only the config)."""
    d = tmp_path_factory.mktemp("qwen3-config")
    shutil.copy(qwen3 / "config.json", d / "config.json")
    return d


def _compare(a: Path, b: Path, model: Path, out: Path, *extra: str) -> tuple[int, str, dict | None]:
    res = runner.invoke(app, ["compare", str(a), str(b), "--model", str(model), "--json", str(out), *extra])
    result = json.loads(out.read_text()) if out.exists() else None
    return res.exit_code, res.output, result


def _tensor(dump: Path, entry_field: str):
    """The tensor a statistics difference names (``Module... output.0``), from the tensor dump's step."""
    import torch

    entry, field = entry_field.rsplit(" ", 1)
    rank = next(p for p in dump.iterdir() if p.is_dir())
    data = json.loads((rank / "dump.json").read_text())["data"][entry]
    where, index = field.split(".")
    seq = data["output"] if where == "output" else (data.get("input_args") or list(data["input_kwargs"].values()))
    return torch.load(rank / "dump_tensor_data" / seq[int(index)]["data_name"], weights_only=True)


@pytest.mark.parametrize("mode", ["md5", "statistics"])
def test_the_same_run_dumped_twice_has_no_differing_module(dumps, config_only, tmp_path, mode) -> None:
    from logdiff.reports import validate_result

    code, out, r = _compare(dumps[mode] / "step0", dumps[mode] / "step2", config_only, tmp_path / "r.json")
    assert code == 0, out
    s = r["statistics"]
    assert s["compared"] >= 60 and s["equal"] == s["compared"] and s["different"] == 0
    assert s["first_difference"] is None and r["verdict"] == "consistent"
    assert s["by"] == ("crc" if mode == "md5" else "statistics")
    assert r["causes"] == [] and r["pairs"] == [] and r["logprobs"]["abs_diff_max"] is None
    assert "statistics only" in out and validate_result(r) == []


@pytest.fixture(scope="module")
def tensor_first_divergence(dumps, config_only, tmp_path_factory) -> dict:
    """The tensor-mode comparison of the clean and planted runs: its first divergence."""
    out = tmp_path_factory.mktemp("tensor-compare") / "r.json"
    code, text, r = _compare(dumps["tensor"] / "step0", dumps["tensor"] / "step1", config_only, out)
    assert code == 0, text
    assert "statistics" not in r and r["first_divergence"]
    return r["first_divergence"]


@pytest.mark.parametrize("mode", ["md5", "statistics"])
def test_a_planted_weight_is_the_first_differing_module_tensor_mode_names(dumps, config_only, tmp_path, mode,
                                                                           tensor_first_divergence) -> None:
    from logdiff.reports import validate_result

    code, out, r = _compare(dumps[mode] / "step0", dumps[mode] / "step1", config_only, tmp_path / "r.json")
    assert code == 0, out  # compare reports a difference, it does not gate on it
    s = r["statistics"]
    first = s["first_difference"]
    assert first["boundary"] == tensor_first_divergence["boundary"] == PLANT
    assert first["proven"] and first["max_abs_diff_lower_bound"] > 0
    assert r["verdict"] == "divergent" and r["causes"] == [] and validate_result(r) == []
    assert s["different"] == len(s["differences"]) and s["equal"] + s["different"] == s["compared"]
    assert "statistics only" in out and PLANT in out.replace("\n", "").replace("  ", " ")
    assert "no cause is classified" in " ".join(r["warnings"])
    broken = json.loads(json.dumps(r))
    broken["statistics"]["equal"] += 1
    assert any("equal" in e and "compared" in e for e in validate_result(broken))
    broken = json.loads(json.dumps(r))
    broken["statistics"]["first_difference"] = broken["statistics"]["differences"][-1]
    assert any("first_difference" in e for e in validate_result(broken))
    assert any("$.pairs" in e for e in validate_result({k: v for k, v in r.items() if k != "statistics"}))


def test_the_lower_bound_never_exceeds_the_true_max_difference(dumps, config_only, tmp_path) -> None:
    """(c) every differing tensor's bound <= its true max |Δ| (from the tensor dumps of the same runs), > 0 at the
    plant; and every pair called equal by CRC is bitwise equal there."""
    import torch

    code, out, r = _compare(dumps["md5"] / "step0", dumps["md5"] / "step1", config_only, tmp_path / "r.json")
    assert code == 0, out
    s = r["statistics"]
    clean, plant = dumps["tensor"] / "step0", dumps["tensor"] / "step1"
    assert s["differences"] and len(s["differences"]) == s["different"]  # all of them named (< 50)
    positive = 0
    for d in s["differences"]:
        a, b = _tensor(clean, d["train_entry"]).double(), _tensor(plant, d["infer_entry"]).double()
        true = (a - b).abs().max().item()
        assert true > 0, d["boundary"]  # a CRC difference is a real one
        assert d["max_abs_diff_lower_bound"] <= true, (d["boundary"], d["max_abs_diff_lower_bound"], true)
        positive += d["max_abs_diff_lower_bound"] > 0
    assert s["first_difference"]["max_abs_diff_lower_bound"] > 0 and positive >= len(s["differences"]) // 2
    before = _tensor(clean, "Module.model.layers.1.mlp.gate_proj.Linear.forward.0 output.0")
    assert torch.equal(before, _tensor(plant, "Module.model.layers.1.mlp.gate_proj.Linear.forward.0 output.0"))


def _msprobe_stats(t) -> dict:
    """Max/Min/Mean/Norm as msprobe 26.2 computes them (pytorch_processor.get_stat_info): in the tensor's dtype."""
    import torch

    return {"Max": torch.max(t).item(), "Min": torch.min(t).item(), "Mean": torch.mean(t).item(),
            "Norm": torch.norm(t).item()}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_bound_is_below_the_truth_and_zero_on_equal_tensors(dtype) -> None:
    import torch

    from logdiff.sources.msprobe.stat_bound import lower_bound

    g = torch.Generator().manual_seed(0)
    hits = 0
    for trial in range(40):
        a = (torch.randn(64, 96, generator=g) * (1 + trial % 5)).to(getattr(torch, dtype))
        assert lower_bound(_msprobe_stats(a), _msprobe_stats(a.clone()), a.numel(), dtype) == (0.0, None)
        b = a.clone().flatten()
        k = torch.randint(0, b.numel(), (1 + trial % 7,), generator=g)
        b[k] += (torch.randn(len(k), generator=g) * 10.0 ** (1 - trial % 5)).to(b.dtype)  # 10 .. 1e-3
        b = b.view_as(a)
        true = (a.double() - b.double()).abs().max().item()
        bound, _ = lower_bound(_msprobe_stats(a), _msprobe_stats(b), a.numel(), dtype)
        assert 0 <= bound <= true, (trial, bound, true)
        if true > 2 * a.abs().max().item():  # an element left a's range: Max or Min moved, exactly known
            assert bound > 0, (trial, true)
            hits += 1
    assert hits >= 5  # such plants happened


def test_packed_and_reshaped_pairs_are_named_not_comparable() -> None:
    from logdiff.sources.msprobe.statistics import Site, Summary, compare_sites

    st = {"Max": 1.0, "Min": -1.0, "Mean": 0.0, "Norm": 2.0}
    a = "model.layers.0.self_attn"

    def site(shape, dtype="bfloat16"):
        return Site("Module.x.forward.0", "output.0", "x", Summary(dtype, tuple(shape), st, None))

    train = {(0, 0, (f"{a}.q_proj",)): site([1, 5, 256]), (0, 0, (f"{a}.k_proj",)): site([1, 5, 128]),
             (0, 0, (f"{a}.v_proj",)): site([1, 5, 128]), (0, 0, ("model.embed_tokens",)): site([1, 5, 256]),
             (0, 0, ("model.norm",)): site([2, 5, 256]), (0, 0, ("logits",)): site([5, 4096])}
    infer = {(0, 0, (f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj")): site([5, 512]),
             (0, 0, ("model.embed_tokens",)): site([5, 256]), (0, 0, ("model.norm",)): site([10, 256]),
             (0, 0, ("logits",)): site([5, 4096], "float32"), (0, 0, (f"{a}.rope_q",)): site([5, 256])}
    s = compare_sites(train, infer)
    assert s["only_one_side"] == {"train": 0, "infer": 1}  # HF applies RoPE in plain code: no module to dump
    assert s["compared"] == 1 and s["equal"] == 1  # the embedding: [1, 5, 256] is [5, 256]
    why = {x["boundary"]: x["why"] for x in s["not_comparable_pairs"]}
    assert why == {f"{a}.q_proj": "packed with other boundaries on one side", f"{a}.k_proj": why[f"{a}.q_proj"],
                   f"{a}.v_proj": why[f"{a}.q_proj"], "model.norm": "shapes differ", "logits": "dtypes differ"}
    assert s["not_comparable"] == 5 and "5 pairs not comparable" in s["summary"]


def test_vllm_statistics_pair_packed_alike_and_not_with_hf(tmp_path) -> None:
    """The vLLM fixture's own statistics (a real msprobe dump.json, its task relabelled ``statistics``): against
    the tensor dump it came from, every pair is equal, packed ``qkv_proj`` included; against HF's padded [3, 16]
    batch nothing shares a layout, which is one line and exit 2, naming why."""
    data = Path(__file__).parent / "data" / "msprobe"
    stats = tmp_path / "vllm-stats"
    shutil.copytree(data / "vllm-tensor-L0", stats)
    for f in stats.glob("step*/*/dump.json"):
        f.write_text(json.dumps({**json.loads(f.read_text()), "task": "statistics"}))
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(data / "qwen3-config.json", model / "config.json")
    code, out, r = _compare(stats, data / "vllm-tensor-L0", model, tmp_path / "r.json")
    assert code == 0 and r["statistics"]["different"] == 0 and r["statistics"]["not_comparable"] == 0, out
    assert r["paths"][0]["engine"] == "vllm" and r["verdict"] == "consistent"
    code, out, r = _compare(data / "hf-tensor-L0", stats, model, tmp_path / "r2.json")
    assert code == 2 and r is None and len(out.strip().splitlines()) == 1, out
    assert "packed with other boundaries" in out and "shapes differ" in out


def _md5_copy(dumps, tmp_path: Path, step: int = 0) -> tuple[Path, dict, Path]:
    src = dumps["md5"] / f"step{step}"
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    f = next(dst.glob("*/dump.json"))
    return dst, json.loads(f.read_text()), f


def test_a_crc_difference_with_equal_statistics_is_different_with_bound_zero(dumps, config_only, tmp_path) -> None:
    dst, head, f = _md5_copy(dumps, tmp_path)
    entry = "Module.model.layers.2.mlp.down_proj.Linear.forward.0"
    crc = head["data"][entry]["output"][0]["md5"]
    head["data"][entry]["output"][0]["md5"] = f"{(int(crc, 16) ^ 1):08x}"  # the bytes differ, the statistics not
    f.write_text(json.dumps(head))
    code, out, r = _compare(dumps["md5"] / "step0", dst, config_only, tmp_path / "r.json")
    assert code == 0, out
    first = r["statistics"]["first_difference"]
    assert first["boundary"] == "model.layers.2.mlp.down_proj" and first["by"] == "crc" and first["proven"]
    assert first["max_abs_diff_lower_bound"] == 0 and "CRCs differ but all four statistics are equal" in first["note"]
    assert r["statistics"]["different"] == 1


def test_a_tensor_dump_compares_by_its_statistics_and_a_bundle_is_refused(dumps, config_only, tmp_path) -> None:
    code, out, r = _compare(dumps["tensor"] / "step0", dumps["statistics"] / "step2", config_only,
                            tmp_path / "r.json")
    assert code == 0, out
    assert r["statistics"]["different"] == 0 and "only its statistics were read" in " ".join(r["warnings"])
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "bundle.json").write_text("{}")
    code, out, r = _compare(dumps["statistics"] / "step0", bundle, config_only, tmp_path / "b.json")
    assert code == 2 and r is None and len(out.strip().splitlines()) == 1 and "statistics msprobe dump" in out


@pytest.mark.parametrize("break_it", ["truncated", "no_statistics", "bad_number", "no_shape"])
def test_a_malformed_statistics_dump_is_one_line_exit_2(dumps, config_only, tmp_path, break_it) -> None:
    dst, head, f = _md5_copy(dumps, tmp_path)
    desc = head["data"]["Module.model.layers.0.mlp.down_proj.Linear.forward.0"]["output"][0]
    if break_it == "truncated":
        f.write_text(f.read_text()[: len(f.read_text()) // 2])
    else:
        if break_it == "no_statistics":
            for k in ("Max", "Min", "Mean", "Norm", "md5"):
                desc.pop(k)
        elif break_it == "bad_number":
            desc["Max"] = "big"
        else:
            desc.pop("shape")
        f.write_text(json.dumps(head))
    code, out, r = _compare(dumps["md5"] / "step0", dst, config_only, tmp_path / "r.json", "--out",
                            str(tmp_path / "out"))
    assert code == 2 and r is None and not (tmp_path / "out").exists(), out
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out and "dump.json" in out


def test_report_and_explain_render_a_statistics_result(dumps, config_only, tmp_path) -> None:
    code, out, _ = _compare(dumps["statistics"] / "step0", dumps["statistics"] / "step1", config_only,
                            tmp_path / "out" / "result.json", "--out", str(tmp_path / "out"))
    assert code == 0, out
    res = runner.invoke(app, ["report", str(tmp_path / "out" / "result.json"), "--html", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output
    html = (tmp_path / "r.html").read_text()
    assert "statistics only" in html and "first differing module" in html and PLANT.replace(".", ".<wbr>") in html
    res = runner.invoke(app, ["explain", str(tmp_path / "out" / "result.json")])
    assert res.exit_code == 0 and "statistics only" in res.output and PLANT in res.output, res.output


if __name__ == "__main__":
    _dump(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
