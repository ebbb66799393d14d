"""Bundles and msprobe dumps are untrusted input (logdiff/records/bundle_input.py, logdiff/sources/msprobe/layout.py).

A real bundle pair of the demo Qwen3 (logdiff.capture, two batchings of the same sequences) is copied per case
and corrupted: each corruption is one line naming the file, exit 2, no traceback and no --json file; the
uncorrupted pair still compares. A NaN row in a training record is a ``non_finite`` finding, as in a scan.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hf_bundles import capture_hf as _capture
from typer.testing import CliRunner

from logdiff.cli import app

IDS = [[5, 17, 3, 9, 42, 7, 11, 2], [8, 1, 30, 4, 6, 19, 23, 13]]
DATA = Path(__file__).parent / "data" / "msprobe"
HF, VLLM = DATA / "hf-tensor-L0", DATA / "vllm-tensor-L0"
STEP = "rank-00000/step-000000.safetensors"
MANIFEST = "rank-00000/manifest.json"


@pytest.fixture(scope="module")
def pair(demo_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    model_dir = demo_model("qwen3")
    root = tmp_path_factory.mktemp("untrusted")
    return {"train": _capture(model_dir, root / "train", "train", [IDS]),
            "infer": _capture(model_dir, root / "infer", "infer", [[ids] for ids in reversed(IDS)])}


@pytest.fixture
def copy(pair: dict[str, Path], tmp_path: Path) -> tuple[Path, Path]:
    return shutil.copytree(pair["train"], tmp_path / "train"), shutil.copytree(pair["infer"], tmp_path / "infer")


def _cli(*args: object) -> tuple[int, str]:
    res = CliRunner().invoke(app, [str(a) for a in args])
    out = res.output + (res.stderr if res.stderr_bytes is not None else "")
    assert "Traceback" not in out
    return res.exit_code, res.stderr if res.stderr_bytes is not None else res.output


def _refused(a: Path, b: Path, tmp_path: Path, *words: str, extra: tuple[object, ...] = ()) -> str:
    out_json, out_dir = tmp_path / "out.json", tmp_path / "out"
    code, out = _cli("compare", a, b, *extra, "--json", out_json, "--out", out_dir, "--quiet")
    lines = [line for line in out.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("logdiff: error:"), out
    assert "internal error" not in lines[0] and all(w in lines[0] for w in words), lines[0]
    assert not out_json.exists() and not list(out_dir.glob("*"))  # nothing half-written
    return lines[0]


def _edit_manifest(bundle: Path, edit: Callable[[dict], None]) -> None:
    m = json.loads((bundle / MANIFEST).read_text())
    edit(m)
    (bundle / MANIFEST).write_text(json.dumps(m))


def _record(bundle: Path, contains: str = "layers.1.") -> tuple[str, dict]:
    records = json.loads((bundle / MANIFEST).read_text())["steps"][0]["records"]
    name = next(n for n, e in records.items() if contains in n and len(e["shape"]) >= 2 and e["shape"][-1] > 4)
    return name, records[name]


def _rewrite_step(bundle: Path, edit: Callable[[dict], None]) -> None:
    from safetensors.numpy import load_file, save_file

    arrays = load_file(str(bundle / STEP))
    edit(arrays)
    save_file(arrays, str(bundle / STEP))


def test_the_uncorrupted_pair_compares(copy, tmp_path: Path) -> None:
    code, out = _cli("compare", *copy, "--json", tmp_path / "out.json", "--quiet")
    r = json.loads((tmp_path / "out.json").read_text())
    assert code == 0 and r["verdict"] == "consistent" and r["non_finite"] is None, out


def test_a_truncated_step_file(copy, tmp_path: Path) -> None:
    f = copy[0] / STEP
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _refused(*copy, tmp_path, "step-000000.safetensors", "not a readable safetensors")


@pytest.mark.parametrize("name", ["../../etc/passwd", "../../../../etc/passwd", "/etc/passwd", "../infer/" + STEP])
def test_a_step_file_outside_the_rank_directory(copy, tmp_path: Path, name: str) -> None:
    _edit_manifest(copy[1], lambda m: m["steps"][0].update(file=name))
    _refused(*copy, tmp_path, "manifest.json", repr(name))


def test_a_link_out_of_the_rank_directory(copy, tmp_path: Path) -> None:
    (copy[1] / "rank-00000" / "step-000000.safetensors").unlink()
    (copy[1] / "rank-00000" / "step-000000.safetensors").symlink_to(copy[0] / STEP)
    _refused(*copy, tmp_path, "outside its rank directory")


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(steps="all"), "steps a list"),
    (lambda m: m.update(layout={"rank": "zero"}), "no valid layout"),
    (lambda m: m.update(meta=[1]), "meta must be an object"),
    (lambda m: m["steps"][0].update(file=7), "file 7"),
    (lambda m: m["steps"][0].update(weight_version="new"), "weight_version"),
    (lambda m: next(iter(m["steps"][0]["records"].values())).update(shape="big"), "needs a dtype, a shape"),
    (lambda m: next(iter(m["steps"][0]["records"].values())).update(placement={"kind": "scatter"}), "scatter"),
])
def test_a_manifest_of_the_wrong_types(copy, tmp_path: Path, edit, words: str) -> None:
    _edit_manifest(copy[0], edit)
    _refused(*copy, tmp_path, "manifest.json", words)


def test_unreadable_json(copy, tmp_path: Path) -> None:
    kept = (copy[0] / MANIFEST).read_text()
    (copy[0] / MANIFEST).write_text("{not json")
    _refused(*copy, tmp_path, "manifest.json", "not a readable")
    (copy[0] / MANIFEST).write_text("[1, 2]")
    _refused(*copy, tmp_path, "manifest.json", "expected an object")
    (copy[0] / MANIFEST).write_text(kept)
    head = json.loads((copy[1] / "bundle.json").read_text())
    (copy[1] / "bundle.json").write_text(json.dumps({**head, "world_size": "two"}))
    _refused(*copy, tmp_path, "bundle.json", "world_size")
    (copy[1] / "bundle.json").write_text(json.dumps({**head, "role": ["infer"]}))
    _refused(*copy, tmp_path, "bundle.json", "role")


def test_an_array_that_is_not_its_manifests(copy, tmp_path: Path) -> None:
    name, entry = _record(copy[0])
    _edit_manifest(copy[0], lambda m: m["steps"][0]["records"][name].update(shape=[entry["shape"][0] + 1,
                                                                                   *entry["shape"][1:]]))
    _refused(*copy, tmp_path, "step-000000.safetensors", repr(name), "its manifest says")


def test_an_array_stored_in_another_dtype(copy, tmp_path: Path) -> None:
    name, _ = _record(copy[0])
    _rewrite_step(copy[0], lambda a: a.update({name: a[name].astype(np.float32)}))
    _refused(*copy, tmp_path, "step-000000.safetensors", repr(name), "float32")


def test_a_record_missing_from_its_step_file(copy, tmp_path: Path) -> None:
    name, _ = _record(copy[0])
    _rewrite_step(copy[0], lambda a: a.pop(name))
    _refused(*copy, tmp_path, "step-000000.safetensors", repr(name), "no array")


def test_partners_of_different_widths(copy, tmp_path: Path) -> None:
    name, entry = _record(copy[1])
    narrow = entry["shape"][-1] // 2
    for step in range(len(IDS)):
        f = copy[1] / f"rank-00000/step-{step:06d}.safetensors"
        from safetensors.numpy import load_file, save_file

        arrays = load_file(str(f))
        arrays[name] = np.ascontiguousarray(arrays[name][..., :narrow])
        save_file(arrays, str(f))
    _edit_manifest(copy[1], lambda m: [s["records"][name].update(shape=[*s["records"][name]["shape"][:-1], narrow])
                                       for s in m["steps"]])
    _refused(*copy, tmp_path, repr(name), f"holds {entry['shape'][-1]} values a row", f"but {narrow}")


def test_a_rows_index_out_of_range(copy, tmp_path: Path) -> None:
    name, entry = _record(copy[0])
    rows = int(np.prod(entry["shape"][:-1]))
    _rewrite_step(copy[0], lambda a: a.update({f"{name}#rows": np.arange(rows, dtype=np.int64) + 10**6}))
    _refused(*copy, tmp_path, "step-000000.safetensors", "row index", "outside the step's")


def test_a_record_that_does_not_split_into_its_rows(copy, tmp_path: Path) -> None:
    name, _ = _record(copy[0])
    _rewrite_step(copy[0], lambda a: a.update({f"{name}#rows": np.arange(3, dtype=np.int64)}))
    _refused(*copy, tmp_path, "step-000000.safetensors", repr(name), "does not split into 3 rows")


def test_a_nan_row_in_a_training_record_is_a_finding(copy, tmp_path: Path) -> None:
    name, entry = _record(copy[0])
    assert entry["dtype"] == "bfloat16"

    def plant(arrays: dict) -> None:
        a = arrays[name].copy()
        a.reshape(-1, a.shape[-1])[3] = np.int16(0x7FC0)  # bfloat16 NaN bits, one row
        arrays[name] = a

    _rewrite_step(copy[0], plant)
    code, out = _cli("compare", *copy, "--json", tmp_path / "out.json", "--quiet")
    r = json.loads((tmp_path / "out.json").read_text())
    assert code in (0, 1), out
    found = r["non_finite"]
    assert found is not None and found["first"]["boundary"] == name, found
    assert found["first"]["paths"] == [r["pairs"][0]["train"]], found  # the training side only
    assert r["warnings"][0].startswith("NaN/inf found") and r["verdict"] != "consistent"
    assert any(c.get("kind") == "non_finite" for c in r["causes"]), r["causes"]


# msprobe dumps (tests/data/msprobe): copied and corrupted


@pytest.fixture
def model_dir(qwen3: Path, tmp_path: Path) -> Path:
    if json.loads((qwen3 / "config.json").read_text()) == json.loads((DATA / "qwen3-config.json").read_text()):
        return qwen3
    (tmp_path / "config").mkdir()
    shutil.copy(DATA / "qwen3-config.json", tmp_path / "config" / "config.json")
    return tmp_path / "config"


def _dump(tmp_path: Path) -> tuple[Path, Path]:
    dump = shutil.copytree(HF, tmp_path / "dump")
    return dump, next(dump.glob("step0/*/dump.json"))


def _embedding_input(head: dict) -> dict:
    entry = next(v for k, v in head["data"].items() if "embed_tokens" in k)
    return entry["input_args"][0]


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/etc/passwd", "../dump.json"])
def test_a_data_name_that_escapes_dump_tensor_data(model_dir: Path, tmp_path: Path, name: str) -> None:
    dump, f = _dump(tmp_path)
    head = json.loads(f.read_text())
    _embedding_input(head)["data_name"] = name
    f.write_text(json.dumps(head))
    _refused(dump, VLLM, tmp_path, "dump.json", repr(name), extra=("--model", model_dir))


def test_a_corrupt_pt_file(model_dir: Path, tmp_path: Path) -> None:
    dump, f = _dump(tmp_path)
    pt = f.parent / "dump_tensor_data" / _embedding_input(json.loads(f.read_text()))["data_name"]
    pt.write_bytes(b"not a torch file")
    _refused(dump, VLLM, tmp_path, pt.name, "not a tensor msprobe wrote", extra=("--model", model_dir))


def test_a_pt_file_that_holds_no_tensor(model_dir: Path, tmp_path: Path) -> None:
    import torch

    dump, f = _dump(tmp_path)
    pt = f.parent / "dump_tensor_data" / _embedding_input(json.loads(f.read_text()))["data_name"]
    torch.save({"ids": [1, 2]}, pt)
    _refused(dump, VLLM, tmp_path, pt.name, "holds a dict", extra=("--model", model_dir))


@pytest.mark.parametrize("edit, words", [
    (lambda f, head: f.write_text("{truncated"), "not readable JSON"),
    (lambda f, head: f.write_text(json.dumps({**head, "data": {"Module.model.embed_tokens.Embedding.forward.0": 3}})),
     "is not an object"),
    (lambda f, head: f.write_text(json.dumps({**head, "data": {k: {**v, "input_args": "ids"} for k, v in
                                                               head["data"].items()}})), "input_args"),
    (lambda f, head: (f.parent / "construct.json").write_text(json.dumps({"a": 1})), "construct.json"),
])
def test_a_dump_json_of_the_wrong_types(model_dir: Path, tmp_path: Path, edit, words: str) -> None:
    dump, f = _dump(tmp_path)
    edit(f, json.loads(f.read_text()))
    _refused(dump, VLLM, tmp_path, words, extra=("--model", model_dir))


@pytest.mark.parametrize("meta, words", [({"config": "qwen3"}, "meta config"),
                                         ({"prompt_lens": {"0": "four"}}, "meta prompt_lens"),
                                         ({"sequences": {"0": 1}}, "meta sequences")])
def test_metadata_of_the_wrong_types(copy, tmp_path: Path, meta: dict, words: str) -> None:
    _edit_manifest(copy[1], lambda m: m["meta"].update(meta))
    _refused(*copy, tmp_path, "manifest.json", words)


# --- issue 49: each hole a user met, by name ------------------------------------------------------------


def _outside(tmp_path: Path) -> Path:
    """A directory outside both bundles that a hostile bundle points into."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    return elsewhere


def test_a_rank_directory_that_links_out_of_the_bundle(copy, tmp_path: Path) -> None:
    elsewhere = _outside(tmp_path) / "rank-00000"
    shutil.move(str(copy[0] / "rank-00000"), elsewhere)
    (copy[0] / "rank-00000").symlink_to(elsewhere, target_is_directory=True)
    line = _refused(*copy, tmp_path, "rank-00000", "leads outside the capture bundle")
    assert str(copy[0]) in line


def test_a_manifest_that_links_to_etc_passwd_is_not_read(copy, tmp_path: Path, opened: list[str]) -> None:
    (copy[0] / MANIFEST).unlink()
    (copy[0] / MANIFEST).symlink_to("/etc/passwd")
    _refused(*copy, tmp_path, "manifest.json", "leads outside the capture bundle")
    assert not [p for p in opened if "passwd" in p], opened


def test_a_bundle_json_that_links_out(copy, tmp_path: Path) -> None:
    target = _outside(tmp_path) / "bundle.json"
    shutil.move(str(copy[0] / "bundle.json"), target)
    (copy[0] / "bundle.json").symlink_to(target)
    _refused(*copy, tmp_path, "bundle.json", "leads outside the capture bundle")


@pytest.mark.parametrize("world_size", [1_000_000_000, 1_000_000])
def test_a_huge_world_size_is_one_short_line_at_once(copy, tmp_path: Path, world_size: int) -> None:
    import time

    head = json.loads((copy[0] / "bundle.json").read_text())
    (copy[0] / "bundle.json").write_text(json.dumps({**head, "world_size": world_size}))
    start = time.monotonic()
    line = _refused(*copy, tmp_path, f"world size {world_size:,}", "no records from ranks 1, 2, 3, 4, 5 and")
    assert time.monotonic() - start < 30 and len(line) < 400, (len(line), line[:200])


def test_a_step_file_that_is_a_fifo_is_refused_without_blocking(copy, tmp_path: Path) -> None:
    import os

    (copy[0] / STEP).unlink()
    os.mkfifo(copy[0] / STEP)  # nobody writes it: opening it would block for ever
    _refused(*copy, tmp_path, "step-000000.safetensors", "expected a regular file, found a FIFO")


def test_a_token_outside_the_vocabulary_in_one_bundle_only(copy, tmp_path: Path) -> None:
    vocab = json.loads((copy[0] / MANIFEST).read_text())["meta"]["config"]["vocab_size"]
    _rewrite_step(copy[0], lambda a: a["tokens"].__setitem__(3, vocab + 7))
    _refused(*copy, tmp_path, "train bundle's sequence", f"token id {vocab + 7:,}", "outside the vocabulary")


def test_a_wrong_dtype_in_the_manifest_is_named_before_any_model_loads(copy, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import logdiff.commands.compare as compare

    name, entry = _record(copy[0])
    assert entry["dtype"] == "bfloat16"
    _edit_manifest(copy[0], lambda m: m["steps"][0]["records"][name].update(dtype="float32"))
    loads = []
    monkeypatch.setattr(compare, "_training_engine", lambda *a, **k: loads.append(a))
    line = _refused(*copy, tmp_path, repr(name), "stored as int16 (a bfloat16 or int16 record's bits)",
                    "manifest says float32")
    assert not loads and "is int16" not in line


def test_a_version_written_as_a_string_names_its_type(copy, tmp_path: Path) -> None:
    head = json.loads((copy[0] / "bundle.json").read_text())
    (copy[0] / "bundle.json").write_text(json.dumps({**head, "version": "1"}))
    _refused(*copy, tmp_path, "bundle version '1' (a JSON str)", "reads version 1 (an integer)")


def test_a_duplicated_rank_directory_names_both(copy, tmp_path: Path) -> None:
    shutil.copytree(copy[0] / "rank-00000", copy[0] / "rank-00001")
    head = json.loads((copy[0] / "bundle.json").read_text())
    (copy[0] / "bundle.json").write_text(json.dumps({**head, "world_size": 2}))
    _refused(*copy, tmp_path, "rank-00001/manifest.json and", "rank-00000/manifest.json both hold rank 0")


def test_a_capture_is_readable_by_the_users_group_and_others_as_umask_allows(pair: dict[str, Path]) -> None:
    import os
    import stat

    written = [p for p in pair["train"].rglob("*") if p.is_file()]
    modes = {oct(stat.S_IMODE(p.stat().st_mode)) for p in written}
    mask = os.umask(0o022)
    os.umask(mask)
    assert modes == {oct(0o666 & ~mask)}, {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in written}


def test_compare_without_torch_is_one_line_and_exit_3(copy, tmp_path: Path) -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "from logdiff.cli import main\nsys.argv = ['logdiff', 'compare', *sys.argv[1:]]\nmain()")
    done = subprocess.run([sys.executable, "-c", code, str(copy[0]), str(copy[1]), "--quiet"],
                          capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 3 and len(lines) == 1, done.stderr
    assert "needs PyTorch" in lines[0] and "pip install" in lines[0] and "Traceback" not in done.stderr


@pytest.fixture
def opened() -> Iterator[list[str]]:
    """Every path this process opens during the test (``open`` audit events). Audit hooks cannot be removed:
    this one goes quiet at teardown."""
    import os
    import sys

    seen: list[str] = []
    active = [True]

    def hook(event: str, args: tuple) -> None:
        if active[0] and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            seen.append(os.fsdecode(args[0]))

    sys.addaudithook(hook)
    yield seen
    active[0] = False


def test_a_model_whose_weights_link_out_of_its_directory_is_refused_before_loading(copy, qwen3: Path,
                                                                                     tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for f in qwen3.glob("*.json"):
        shutil.copy(f, model / f.name)
    for f in qwen3.glob("*.safetensors"):
        (model / f.name).symlink_to(f.resolve())  # the weights live elsewhere: a link out of --model
    _refused(*copy, tmp_path, "model.safetensors", "leads outside the model directory (--model)",
             extra=("--model", model))


def test_a_sequences_file_that_is_a_fifo_is_one_line(qwen3: Path, tmp_path: Path) -> None:
    import os

    os.mkfifo(tmp_path / "rollouts.jsonl")  # nobody writes it: reading it would block for ever
    code, out = _cli("scan", qwen3, "--sequences", tmp_path / "rollouts.jsonl", "--depth", "logprobs",
                     "--infer", "hf")
    lines = [line for line in out.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, out
    assert "rollouts.jsonl: expected a regular file, found a FIFO" in lines[0], lines[0]
