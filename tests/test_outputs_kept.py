"""A failed run never costs the user an earlier result (issue 49, item 1; logdiff/commands/outputs.py).

Each command that writes is given bad input over the outputs of an earlier run: the earlier files must be
byte-identical afterwards, nothing new may lie beside them (no partial directory, no temporary), and a
directory the run had to create is gone again. Positive controls: the same commands with good input do
replace the files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from logdiff.cli import app
from logdiff.commands import outputs

SAMPLE = Path(__file__).parent / "reports" / "data" / "sample_result.json"


def _run(*args: object) -> tuple[int, str]:
    res = CliRunner().invoke(app, [str(a) for a in args])
    out = res.output + (res.stderr if res.stderr_bytes is not None else "")
    assert "Traceback" not in out and "internal error" not in out, out
    return res.exit_code, out


def _earlier(root: Path, *names: str) -> dict[Path, bytes]:
    """An earlier run's files under ``root`` (and one of the user's), each with its own bytes."""
    files = {}
    for name in (*names, "notes.txt"):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"{name} of an earlier run\n".encode() + bytes(range(256)))
        files[path] = path.read_bytes()
    return files


def _kept(files: dict[Path, bytes], *roots: Path) -> None:
    for path, data in files.items():
        assert path.read_bytes() == data, f"{path} changed"
    for root in roots:
        extra = sorted(str(p) for p in root.rglob("*") if p not in files and p.is_file())
        assert not extra, f"left behind: {extra}"


def _bundle(root: Path, **head: object) -> Path:
    """A bundle directory whose bundle.json says ``head`` (enough to be refused before any model)."""
    root.mkdir(parents=True)
    (root / "bundle.json").write_text(json.dumps({"format": "logdiff-capture", "version": 1, "role": "train",
                                                  "world_size": 1, **head}))
    return root


OUT = ("result.json", "report.html", "divergence_table.parquet")


def test_scan_with_a_missing_model_keeps_the_earlier_outputs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    files = _earlier(out, *OUT)
    files |= _earlier(tmp_path / "side", "r.json")
    code, text = _run("scan", tmp_path / "no" / "such" / "model", "--out", out, "--json", tmp_path / "side" / "r.json",
                      "--depth", "logprobs")
    assert code == 2, text
    _kept(files, out, tmp_path / "side")


def test_scan_into_a_new_directory_leaves_none_behind(tmp_path: Path) -> None:
    code, _ = _run("scan", tmp_path / "no-model", "--out", tmp_path / "new" / "out", "--json",
                   tmp_path / "j" / "r.json", "--depth", "logprobs")
    assert code == 2 and not (tmp_path / "new").exists() and not (tmp_path / "j").exists()


@pytest.mark.parametrize("make", [
    lambda t: (t / "bundles" / "trian", _bundle(t / "bundles" / "infer", role="infer")),  # a typo in a path
    lambda t: (_bundle(t / "a", version=2), _bundle(t / "b", role="infer")),  # another version
    lambda t: (_bundle(t / "a", version="1"), _bundle(t / "b", role="infer")),  # a string version
])  # fmt: skip
def test_compare_with_bad_bundles_keeps_the_earlier_outputs(tmp_path: Path, make) -> None:
    train, infer = make(tmp_path)
    out = tmp_path / "keep3"
    files = _earlier(out, *OUT)
    code, text = _run("compare", train, infer, "--out", out)
    assert code == 2, text
    _kept(files, out)


def test_check_with_a_missing_model_keeps_the_earlier_outputs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    files = _earlier(out, *OUT) | _earlier(tmp_path / "ci", "junit.xml", "r.json")
    code, _ = _run("check", tmp_path / "missing", "--depth", "logprobs", "--max-abs-diff", "1", "--out", out,
                   "--junit", tmp_path / "ci" / "junit.xml", "--json", tmp_path / "ci" / "r.json")
    assert code == 2
    _kept(files, out, tmp_path / "ci")


def test_report_of_a_bad_result_keeps_the_earlier_report(tmp_path: Path) -> None:
    files = _earlier(tmp_path, "report.html")
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": ')
    files[bad] = bad.read_bytes()
    code, _ = _run("report", bad, "--out", tmp_path / "report.html")
    assert code == 2
    _kept(files, tmp_path)
    code, _ = _run("report", SAMPLE, "--out", tmp_path / "report.html")  # positive control: replaced
    assert code == 0 and b"earlier run" not in (tmp_path / "report.html").read_bytes()


def test_msprobe_config_with_a_bad_option_keeps_the_earlier_config(tmp_path: Path) -> None:
    files = _earlier(tmp_path, "config.json")
    code, _ = _run("msprobe-config", tmp_path / "config.json", "--side", "nope", "--dump-path", tmp_path / "dump")
    assert code == 2
    _kept(files, tmp_path)
    code, _ = _run("msprobe-config", tmp_path / "config.json", "--side", "hf", "--dump-path", tmp_path / "dump")
    assert code == 0 and json.loads((tmp_path / "config.json").read_text())  # positive control: replaced


def test_demo_model_that_fails_keeps_the_earlier_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import logdiff.demo

    model = tmp_path / "models" / "demo"
    files = _earlier(model, "config.json", "model.safetensors")

    def fails(path: Path, *a: object, **k: object) -> Path:
        raise KeyboardInterrupt  # the user stops the build halfway (the build's own staging: the next test)

    monkeypatch.setattr(logdiff.demo, "build_demo_model", fails)
    res = CliRunner().invoke(app, ["demo-model", str(model)])
    assert res.exit_code != 0
    _kept(files, model.parent)
    res = CliRunner().invoke(app, ["demo-model", str(tmp_path / "new" / "deeper" / "demo")])
    assert res.exit_code != 0 and not (tmp_path / "new").exists()  # no directory left from a failed build


def test_the_demo_swap_puts_the_earlier_model_back_when_the_rename_fails(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from logdiff.demo import build

    model, staging = tmp_path / "demo", tmp_path / ".staging"
    files = _earlier(model, "config.json")
    staging.mkdir()
    (staging / "config.json").write_text("new")
    real = Path.rename

    def rename(self: Path, target: Path) -> Path:
        if self == staging:
            raise OSError(28, "No space left on device")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError):
        build._swap_in(staging, model)
    monkeypatch.undo()
    assert {p.read_bytes() for p in files} == set(files.values()) and sorted(tmp_path.iterdir()) == [staging, model]
    build._swap_in(staging, model)  # positive control
    assert (model / "config.json").read_text() == "new" and sorted(tmp_path.iterdir()) == [model]


def test_the_in_loop_writer_keeps_a_steps_earlier_outputs_when_the_swap_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-loop comparison writes through ``write_result`` (logdiff/integrations/trl): an interrupt in the
    swap itself puts the earlier files back."""
    out = tmp_path / "step-2"
    files = _earlier(out, *OUT)
    real = outputs.os.replace
    calls = []

    def replace(src: object, dst: object) -> None:
        calls.append(dst)
        if len(calls) == 5:  # three moved aside, the first new file placed, then the interrupt
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(outputs.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        outputs.write_result(json.loads(SAMPLE.read_text()), out, None)
    monkeypatch.undo()
    _kept(files, out)
