"""An output that cannot be written (issue 25): one line naming the path and the reason, exit 4,
no traceback, and nothing half-written left behind: no truncated file, no temporary, never a new
result.json beside an older report.html.

No engine loads here. ``logdiff report`` renders a saved result; ``scan`` and ``check`` run with
``logdiff.commands.cli_scan._run_scan`` replaced by one that returns the saved sample result (and a divergence
table), so everything from the output probe to the last rename runs as in a real scan. This
machine runs as root, where chmod cannot make a file unwritable, so the failures come from
``logdiff.commands.outputs``'s ``os`` calls made to fail (ENOSPC, EACCES, ...), from paths that fail for
root too (a directory where a file belongs, a parent that is a regular file, /proc), from /sys
where it refuses root, and, where this machine lets the test mount one, from a 64 KiB tmpfs (a
real full disk, then remounted read-only). Every failure has a negative control: the same
write, unbroken, produces the file.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from logdiff import cli
from logdiff.commands import cli_scan, outputs
from logdiff.errors import EXIT_OUTPUT, OutputError

runner = CliRunner()
SAMPLE = Path(__file__).parent / "reports" / "data" / "sample_result.json"
SCAN = ["--infer", "hf", "--depth", "logprobs"]  # never loaded: the scan is replaced
REASON = {code: os.strerror(code) for code in (errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO,
                                               errno.EDQUOT)}  # fmt: skip


def invoke_cli(*args: object, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    res = runner.invoke(cli.app, [str(a) for a in args], env=env)
    assert "Traceback" not in res.stdout + res.stderr and "internal error" not in res.stderr, res.stderr
    return res.exit_code, res.stdout, res.stderr


def the_error(code: int, stderr: str) -> str:
    """Exit 4 and exactly one line on stderr, the error; returns it."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == EXIT_OUTPUT and len(lines) == 1, (code, stderr)
    assert lines[0].startswith("logdiff: error: cannot write "), stderr
    return lines[0]


def listing(directory: Path) -> list[str]:
    """Every name under ``directory``, hidden ones (temporaries) included."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def sample() -> dict[str, Any]:
    return json.loads(SAMPLE.read_text())


# --- making outputs.os fail -----------------------------------------------------------------


class FaultyOS:
    """``logdiff.commands.outputs``'s ``os``, with one call failing for the files whose name ``hit`` accepts.

    ``open`` fails before the file exists; ``write`` writes half of the data first (a truncated
    file that must not survive); ``fsync`` after the data is written; ``replace`` at the rename.
    Every other call, and every file ``hit`` rejects (the output probe's), goes to the real ``os``.
    """

    def __init__(self, call: str, code: int, hit: Callable[[str], bool]) -> None:
        self.call, self.code, self.hit = call, code, hit
        self.fds: dict[int, str] = {}
        self.failed: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _fail(self, name: str) -> None:
        self.failed.append(name)
        raise OSError(self.code, os.strerror(self.code), name)

    def open(self, path: Any, flags: int, mode: int = 0o777) -> int:
        if self.call == "open" and self.hit(str(path)):
            self._fail(str(path))
        fd = os.open(path, flags, mode)
        self.fds[fd] = str(path)
        return fd

    def write(self, fd: int, data: Any) -> int:
        name = self.fds.get(fd)
        if self.call == "write" and name is not None and self.hit(name):
            os.write(fd, bytes(data)[: max(1, len(data) // 2)])
            self._fail(name)
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        name = self.fds.get(fd)
        if self.call == "fsync" and name is not None and self.hit(name):
            self._fail(name)
        os.fsync(fd)

    def replace(self, src: Any, dst: Any) -> None:
        if self.call == "replace" and self.hit(str(dst)):
            self._fail(str(dst))
        os.replace(src, dst)


@pytest.fixture
def fail(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FaultyOS]]:
    def install(call: str, code: int, name: str | None = None) -> FaultyOS:
        hit = (lambda p: True) if name is None else (lambda p: Path(p).name == name or f".{name}." in Path(p).name)
        faulty = FaultyOS(call, code, hit)
        monkeypatch.setattr(outputs, "os", faulty)
        return faulty

    yield install


@pytest.fixture
def fake_scan(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Replace the scan with the sample result and a small divergence table; counts the scans run."""
    import pandas as pd

    runs: list[int] = []

    def run(cfg: Any, quiet: bool, tables: dict[str, Any] | None = None) -> dict[str, Any]:
        runs.append(1)
        if tables is not None:
            tables["divergence_table"] = pd.DataFrame({"boundary": ["model.norm"] * 3, "max_abs": [0.0, 0.5, 1.0]})
        return sample()

    monkeypatch.setattr(cli_scan, "_run_scan", run)
    return runs


def _table_name() -> str:
    try:
        import pyarrow  # noqa: F401

        return "divergence_table.parquet"
    except ImportError:
        return "divergence_table.csv"


# --- logdiff report --out: one file ----------------------------------------------------------

FAULTS = [
    ("write", errno.ENOSPC),  # a full disk, halfway through the file
    ("write", errno.EDQUOT),
    ("open", errno.EACCES),
    ("open", errno.EPERM),
    ("replace", errno.EROFS),
    ("fsync", errno.EIO),  # any other OSError
]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A result.json alone in its directory (report writes report.html beside it)."""
    d = tmp_path / "run"
    d.mkdir()
    shutil.copy(SAMPLE, d / "result.json")
    return d / "result.json"


@pytest.mark.parametrize("call,code", FAULTS)
def test_report_write_failure_is_one_line_and_leaves_nothing(
    saved: Path, fail: Callable[..., FaultyOS], call: str, code: int
) -> None:
    faulty = fail(call, code, "report.html")
    rc, stdout, stderr = invoke_cli("report", saved)
    target = saved.parent / "report.html"
    assert the_error(rc, stderr) == f"logdiff: error: cannot write {target}: {REASON[code]}"
    assert faulty.failed and stdout == ""  # it failed where it was meant to, before the summary
    assert listing(saved.parent) == ["result.json"]  # no report.html, truncated or not, and no temporary


def test_report_write_failure_keeps_the_previous_report(saved: Path, fail: Callable[..., FaultyOS]) -> None:
    (saved.parent / "report.html").write_text("the report of an earlier render")
    fail("write", errno.ENOSPC, "report.html")
    rc, _, stderr = invoke_cli("report", saved)
    assert "No space left on device" in the_error(rc, stderr)
    assert (saved.parent / "report.html").read_text() == "the report of an earlier render"  # not truncated
    assert listing(saved.parent) == ["report.html", "result.json"]


def test_report_to_paths_that_cannot_take_a_file(saved: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = {
        tmp_path: f"cannot write {tmp_path} (--html): is a directory, expected a file path",
        a_file / "report.html": f"cannot write {a_file}/report.html (--html): {a_file} exists and is not a directory",
        a_file / "sub" / "report.html": f"cannot write {a_file}/sub/report.html (--html): cannot create the directory",
        Path("/proc/logdiff-x/report.html"): "cannot write /proc/logdiff-x/report.html (--html): cannot create the "
                                             "directory /proc/logdiff-x (No such file or directory)",
    }  # fmt: skip
    for target, message in cases.items():
        rc, stdout, stderr = invoke_cli("report", saved, "--html", target)
        assert the_error(rc, stderr).startswith(f"logdiff: error: {message}"), stderr
        assert stdout == ""
    assert a_file.read_text() == "x" and listing(saved.parent) == ["result.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "run"]  # no temporary anywhere


def test_report_where_even_root_may_not_write(saved: Path) -> None:
    try:  # /sys refuses root here (EACCES); skip where it does not
        fd = os.open("/sys/.logdiff-probe", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        reason = e.strerror
    else:  # pragma: no cover - a machine where /sys takes files
        os.close(fd)
        os.unlink("/sys/.logdiff-probe")
        pytest.skip("/sys is writable here")
    rc, _, stderr = invoke_cli("report", saved, "--html", "/sys/logdiff-report.html")
    assert the_error(rc, stderr) == f"logdiff: error: cannot write /sys/logdiff-report.html (--html): {reason}"


def test_report_negative_control(saved: Path, tmp_path: Path) -> None:
    rc, stdout, stderr = invoke_cli("report", saved)
    assert rc == 0 and stdout and stderr.strip() == f"wrote {saved.parent / 'report.html'}"
    assert listing(saved.parent) == ["report.html", "result.json"]
    assert (saved.parent / "report.html").read_text().lstrip().lower().startswith("<!doctype html")
    assert oct((saved.parent / "report.html").stat().st_mode & 0o777) != oct(0o600)  # the umask's, not mkstemp's
    nested = tmp_path / "new" / "deeper" / "page.html"  # a missing parent that can be created
    rc, _, _ = invoke_cli("report", saved, "--html", nested)
    assert rc == 0 and nested.is_file() and listing(nested.parent) == ["page.html"]


def test_report_out_is_a_directory_and_an_old_html_out_still_works(saved: Path, tmp_path: Path) -> None:
    """``--out DIR`` is a directory, as for every command (DIR/report.html); ``--out X.html``, its old meaning,
    still writes the file, with a note to use ``--html``; both at once, or a file as DIR, is one line."""
    rc, stdout, stderr = invoke_cli("report", saved, "--out", tmp_path / "dir" / "sub", "-q")
    assert rc == 0 and stderr.strip() == f"wrote {tmp_path / 'dir' / 'sub' / 'report.html'}"
    assert listing(tmp_path / "dir") == ["sub", "sub/report.html"]
    rc, _, stderr = invoke_cli("report", saved, "--out", tmp_path / "old.html", "-q")
    lines = stderr.strip().splitlines()
    assert rc == 0 and (tmp_path / "old.html").is_file() and len(lines) == 2, stderr
    assert lines[0].startswith("logdiff: note: report --out ")
    assert lines[0].endswith(f"use --html {tmp_path / 'old.html'}")
    rc, _, stderr = invoke_cli("report", saved, "--out", tmp_path / "d2", "--html", tmp_path / "x.html")
    assert rc == 2 and stderr.strip() == "logdiff: error: report: give --out DIR or --html FILE, not both"
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    rc, _, stderr = invoke_cli("report", saved, "--out", a_file)
    assert the_error(rc, stderr) == f"logdiff: error: cannot write {a_file} (--out): exists and is not a directory"
    assert not (tmp_path / "d2").exists() and not (tmp_path / "x.html").exists() and a_file.read_text() == "x"


# --- scan --out DIR: several files that belong together ------------------------------------------


@pytest.mark.parametrize("call,code,name", [
    ("write", errno.ENOSPC, "result.json"),  # the last file written: the others are already staged
    ("write", errno.ENOSPC, "report.html"),
    ("open", errno.EACCES, "result.json"),
    ("fsync", errno.EIO, "report.html"),
    ("replace", errno.EROFS, "result.json"),  # the last rename: report.html and the table are in place
    ("replace", errno.ENOSPC, "report.html"),
])  # fmt: skip
def test_scan_out_failure_keeps_the_earlier_files(
    tmp_path: Path, fake_scan: list[int], fail: Callable[..., FaultyOS], call: str, code: int, name: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for old in ("result.json", "report.html", _table_name()):  # an earlier run's outputs
        (out / old).write_text("from an earlier run")
    (out / "notes.txt").write_text("the user's")
    faulty = fail(call, code, name)
    rc, stdout, stderr = invoke_cli("scan", tmp_path / "model", *SCAN, "--out", out)
    assert the_error(rc, stderr) == f"logdiff: error: cannot write {out / name}: {REASON[code]}"
    assert fake_scan and faulty.failed and stdout == ""
    # the earlier run's files as they were, none of this run's: never a new result.json beside an old report
    assert listing(out) == sorted(["notes.txt", "result.json", "report.html", _table_name()])
    assert all((out / old).read_text() == "from an earlier run" for old in ("result.json", "report.html", _table_name()))


def test_scan_table_write_failure_names_the_table(
    tmp_path: Path, fake_scan: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pandas as pd

    def full_disk(self: Any, path: Any, *a: Any, **k: Any) -> None:
        Path(path).write_bytes(b"PAR1 trunc")  # a truncated table
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a writer reports it: no file name

    monkeypatch.setattr(pd.DataFrame, "to_parquet", full_disk)
    monkeypatch.setattr(pd.DataFrame, "to_csv", full_disk)
    out = tmp_path / "out"
    rc, _, stderr = invoke_cli("scan", tmp_path / "model", *SCAN, "--out", out)
    assert the_error(rc, stderr) == f"logdiff: error: cannot write {out / _table_name()}: No space left on device"
    assert listing(out) == []


def test_scan_json_failure(tmp_path: Path, fake_scan: list[int], fail: Callable[..., FaultyOS]) -> None:
    js = tmp_path / "sub" / "r.json"
    fail("write", errno.ENOSPC, "r.json")
    rc, _, stderr = invoke_cli("scan", tmp_path / "model", *SCAN, "--json", js, "--out", tmp_path / "out")
    assert the_error(rc, stderr) == f"logdiff: error: cannot write {js}: No space left on device"
    assert listing(js.parent) == [] and listing(tmp_path / "out") == []


def test_scan_output_paths_are_refused_before_the_scan(tmp_path: Path, fake_scan: list[int]) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    (tmp_path / "out" / "result.json").mkdir(parents=True)  # a directory where result.json goes
    cases = [
        (["--out", tmp_path / "out"], f"cannot write {tmp_path}/out/result.json (--out): is a directory"),
        (["--out", a_file], f"cannot write {a_file} (--out): exists and is not a directory"),
        (["--json", a_file / "r.json"], f"cannot write {a_file}/r.json (--json): {a_file} exists and is not a"),
        (["--json", tmp_path], f"cannot write {tmp_path} (--json): is a directory"),
        (["--out", "/proc/logdiff-x"], "cannot write /proc/logdiff-x (--out): cannot create the directory"),
    ]
    for args, message in cases:
        rc, _, stderr = invoke_cli("scan", tmp_path / "model", *SCAN, *args)
        assert the_error(rc, stderr).startswith(f"logdiff: error: {message}"), stderr
    assert fake_scan == []  # every one before the scan: no scan is lost to an output path
    assert listing(tmp_path) == ["a-file", "out", "out/result.json"]


def test_probe_failure_is_exit_4_too(tmp_path: Path, fake_scan: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    def read_only(*a: Any, **k: Any) -> Any:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    rc, _, stderr = invoke_cli("scan", tmp_path / "model", *SCAN, "--out", tmp_path / "out")
    assert the_error(rc, stderr) == f"logdiff: error: cannot write {tmp_path / 'out'} (--out): Read-only file system"
    assert fake_scan == []


def test_scan_negative_control(tmp_path: Path, fake_scan: list[int], fail: Callable[..., FaultyOS]) -> None:
    faulty = fail("write", errno.ENOSPC, "no-such-output")  # installed, never hit
    out, js = tmp_path / "out", tmp_path / "r.json"
    rc, stdout, stderr = invoke_cli("scan", tmp_path / "model", *SCAN, "--out", out, "--json", js)
    assert rc == 0 and stdout and stderr == "" and not faulty.failed
    assert listing(out) == sorted(["report.html", "result.json", _table_name()])  # and no temporary
    assert json.loads((out / "result.json").read_text()) == json.loads(js.read_text())
    assert json.loads(js.read_text())["verdict"] == sample()["verdict"]
    assert listing(tmp_path) == ["out", *(f"out/{n}" for n in listing(out)), "r.json"]


# --- check: JUnit XML, the baseline, the step summary -----------------------------------------

GATE = ["--max-abs-diff", "1e9"]


def test_check_junit_failure(tmp_path: Path, fake_scan: list[int], fail: Callable[..., FaultyOS]) -> None:
    junit = tmp_path / "junit.xml"
    fail("write", errno.ENOSPC, "junit.xml")
    rc, stdout, stderr = invoke_cli("check", tmp_path / "model", *SCAN, *GATE, "--junit", junit)
    assert the_error(rc, stderr) == f"logdiff: error: cannot write {junit} (--junit): No space left on device"
    assert "gates passed" in stdout and listing(tmp_path) == []  # exit 4 wins over the gates' 0 (or 1)


def test_check_update_baseline_failure(tmp_path: Path, fake_scan: list[int], fail: Callable[..., FaultyOS]) -> None:
    base = tmp_path / "b.json"
    fail("replace", errno.EROFS, "b.json")
    rc, _, stderr = invoke_cli("check", tmp_path / "model", *SCAN, *GATE, "--baseline", base, "--update-baseline")
    assert the_error(rc, stderr) == f"logdiff: error: cannot write {base} (--baseline): Read-only file system"
    assert listing(tmp_path) == []


def test_check_step_summary_failure(tmp_path: Path, fake_scan: list[int]) -> None:
    summary = "/proc/logdiff-x/summary.md"
    rc, _, stderr = invoke_cli("check", tmp_path / "model", *SCAN, *GATE, "--github",
                               env={"GITHUB_STEP_SUMMARY": summary})  # fmt: skip
    assert the_error(rc, stderr) == (
        f"logdiff: error: cannot write {summary} ($GITHUB_STEP_SUMMARY): No such file or directory"
    )


def test_check_negative_control(tmp_path: Path, fake_scan: list[int]) -> None:
    junit, base, summary = tmp_path / "junit.xml", tmp_path / "b.json", tmp_path / "summary.md"
    rc, stdout, _ = invoke_cli("check", tmp_path / "model", *SCAN, *GATE, "--junit", junit, "--baseline", base,
                               "--update-baseline", "--github", env={"GITHUB_STEP_SUMMARY": str(summary)})  # fmt: skip
    assert rc == 0 and "gates passed" in stdout
    assert listing(tmp_path) == ["b.json", "junit.xml", "summary.md"]
    assert json.loads(base.read_text())["pairs"] and junit.read_text().startswith("<?xml")


# --- demo-model: its own writer, probed before training -------------------------------------------


def test_demo_model_target_is_probed_before_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import logdiff.demo

    def never(*a: Any, **k: Any) -> Path:
        raise AssertionError("trained although the target cannot be written")

    monkeypatch.setattr(logdiff.demo, "build_demo_model", never)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for target, message in [
        (a_file, f"cannot write {a_file}: exists and is not a directory"),
        (a_file / "model", f"cannot write {a_file}/model: {a_file} exists and is not a directory"),
        (Path("/proc/logdiff-x/model"), "cannot write /proc/logdiff-x/model: cannot create the directory"),
    ]:
        rc, _, stderr = invoke_cli("demo-model", target, "--max-steps", "0")
        assert the_error(rc, stderr).startswith(f"logdiff: error: {message}"), stderr


def test_demo_model_write_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import logdiff.demo

    target = tmp_path / "model"

    def build(path: Path, *a: Any, code: int = errno.ENOSPC, name: str | None = None, **k: Any) -> Path:
        raise OSError(code, os.strerror(code), name)

    monkeypatch.setattr(logdiff.demo, "build_demo_model", build)
    rc, _, stderr = invoke_cli("demo-model", target, "--max-steps", "0")
    assert the_error(rc, stderr) == f"logdiff: error: cannot write {target}: No space left on device"
    # a failure naming a file in its staging directory beside the target (EACCES, say)
    monkeypatch.setattr(logdiff.demo, "build_demo_model",
                        lambda path, *a, **k: build(path, code=errno.EACCES, name=str(tmp_path / ".model.x1/w")))
    rc, _, stderr = invoke_cli("demo-model", target, "--max-steps", "0")
    assert the_error(rc, stderr) == f"logdiff: error: cannot write {target}: Permission denied"
    # safetensors saving the weights reports a full disk as its own error, not an OSError
    class SafetensorError(Exception):  # as safetensors names it
        pass

    def save_weights(path: Path, *a: Any, **k: Any) -> Path:
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(logdiff.demo, "build_demo_model", save_weights)
    rc, _, stderr = invoke_cli("demo-model", target, "--max-steps", "0")
    assert the_error(rc, stderr) == f"logdiff: error: cannot write {target}: No space left on device"
    # negative control: an OSError reading something else is not blamed on the output (an internal error)
    monkeypatch.setattr(logdiff.demo, "build_demo_model",
                        lambda path, *a, **k: build(path, code=errno.EACCES, name="/usr/lib/python3/os.py"))
    res = runner.invoke(cli.app, ["demo-model", str(target), "--max-steps", "0"])
    assert res.exit_code == 101 and "cannot write" not in res.stderr
    # and a build that writes its directory succeeds
    monkeypatch.setattr(logdiff.demo, "build_demo_model", lambda path, *a, **k: path.mkdir() or path)
    rc, stdout, _ = invoke_cli("demo-model", target, "--max-steps", "0")
    assert rc == 0 and target.is_dir() and f"wrote {target}" in stdout


# --- the writers themselves (the Python API) ------------------------------------------------------


def test_write_text_raises_output_error(tmp_path: Path, fail: Callable[..., FaultyOS]) -> None:
    target = tmp_path / "x.txt"
    fail("write", errno.ENOSPC)
    with pytest.raises(OutputError) as info:
        outputs.write_text(target, "hello " * 1000, "--junit")
    e = info.value
    assert (e.path, e.reason, e.what, e.exit_code) == (target, "No space left on device", "--junit", 4)
    assert isinstance(e.__cause__, OSError) and e.__cause__.errno == errno.ENOSPC
    assert listing(tmp_path) == []


def test_write_result_rolls_back_every_rename(tmp_path: Path, fail: Callable[..., FaultyOS]) -> None:
    out, js = tmp_path / "out", tmp_path / "r.json"
    fail("replace", errno.EIO, "result.json")  # the last rename: r.json and report.html are in place
    with pytest.raises(OutputError) as info:
        outputs.write_result(sample(), out, js)
    assert info.value.path == out / "result.json" and info.value.reason == REASON[errno.EIO]
    assert listing(tmp_path) == ["out"] and listing(out) == []


def test_dump_json_is_atomic(tmp_path: Path, fail: Callable[..., FaultyOS], monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "r.json"
    target.write_text('{"old": true}')
    fail("write", errno.ENOSPC)
    with pytest.raises(OutputError):
        outputs.dump_json(sample(), target)
    assert target.read_text() == '{"old": true}' and listing(tmp_path) == ["r.json"]
    monkeypatch.setattr(outputs, "os", os)  # negative control
    outputs.dump_json({"x": float("inf")}, target)
    assert json.loads(target.read_text()) == {"x": None} and listing(tmp_path) == ["r.json"]


def test_output_error_message_and_pickling() -> None:
    import pickle

    e = OutputError("out/result.json", "No space left on device")
    assert str(e) == "cannot write out/result.json: No space left on device"
    assert str(pickle.loads(pickle.dumps(e))) == str(e)
    raw = OSError("[Errno 28] No space left on device")  # a writer that puts the errno in the text
    assert OutputError.from_os("t.parquet", raw).reason == "No space left on device"


# --- a real full disk and a real read-only file system, where this machine lets us mount one ----


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (smaller than a report), or a skip where mounting is not allowed."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)]
    done = subprocess.run(mount, capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def test_real_full_disk_and_read_only_file_system(small_tmpfs: Path, fake_scan: list[int]) -> None:
    import subprocess

    out = small_tmpfs / "out"
    rc, _, stderr = invoke_cli("scan", small_tmpfs / "model", *SCAN, "--out", out)
    assert the_error(rc, stderr) == f"logdiff: error: cannot write {out / 'report.html'}: No space left on device"
    # the report is ~90 KB: nothing truncated, no temporary, and the --out directory the run created is gone
    assert listing(small_tmpfs) == []
    rc, _, stderr = invoke_cli("report", SAMPLE, "--html", small_tmpfs / "report.html")
    assert "No space left on device" in the_error(rc, stderr) and listing(small_tmpfs) == []
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    rc, _, stderr = invoke_cli("report", SAMPLE, "--html", small_tmpfs / "report.html")
    assert the_error(rc, stderr) == (
        f"logdiff: error: cannot write {small_tmpfs / 'report.html'} (--html): Read-only file system"
    )
    # negative control: the same scan into a directory with room
    rc, _, _ = invoke_cli("scan", small_tmpfs / "model", *SCAN, "--out", small_tmpfs.parent / "roomy")
    assert rc == 0 and (small_tmpfs.parent / "roomy" / "result.json").is_file()


def test_the_error_line_is_inert(saved: Path, tmp_path: Path) -> None:
    hostile = tmp_path / "evil\n::error::x\x1b[2J"
    hostile.write_text("a file, not a directory")
    rc, _, stderr = invoke_cli("report", saved, "--html", hostile / "report.html")
    line = the_error(rc, stderr)  # one line: the newline in the path is escaped, and so is ESC
    assert "\x1b" not in stderr and "evil\\n::error::x\\x1b[2J" in line


# --- the staged checkpoint: logdiff's own scratch space ------------------------------------------


def _staging_fault(monkeypatch: pytest.MonkeyPatch, error: OSError | None) -> list[Path]:
    """Make converting a .pt checkpoint write half a file, then raise ``error`` (None: write it)."""
    from logdiff.sources import checkpoint

    real_save, staged = checkpoint._save, []

    def save(sd: dict, out: Path) -> None:
        staged.append(out)
        if error is None:
            return real_save(sd, out)
        (out / "model.safetensors").write_bytes(b"half")
        error.filename = error.filename or str(out / "model.safetensors")
        raise error

    monkeypatch.setattr(checkpoint, "_save", save)
    return staged


@pytest.fixture(scope="module")
def pt_ckpt(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from safetensors.torch import load_file

    path = tmp_path_factory.mktemp("pt") / "ckpt.pt"
    torch.save(load_file(str(qwen3 / "model.safetensors")), path)
    return path


def test_staging_on_a_full_disk_is_exit_4_and_leaves_nothing(
    qwen3: Path, pt_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staged = _staging_fault(monkeypatch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    rc, stdout, stderr = invoke_cli("scan", qwen3, pt_ckpt, "--infer", "hf-decode", "--depth", "logprobs",
                                    "--json", tmp_path / "r.json")
    line = the_error(rc, stderr)
    assert line.startswith(f"logdiff: error: cannot write {staged[0].parent}: {REASON[errno.ENOSPC]}"), line
    assert "TMPDIR" in line and not staged[0].exists()  # no half-staged directory for the next run to trust
    assert not (tmp_path / "r.json").exists()


def test_an_unreadable_source_while_staging_is_an_input_error(
    qwen3: Path, pt_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from logdiff.errors import InputError
    from logdiff.sources import checkpoint

    _staging_fault(monkeypatch, OSError(errno.EIO, os.strerror(errno.EIO), str(pt_ckpt)))
    with pytest.raises(InputError, match=f"cannot read {pt_ckpt}: {REASON[errno.EIO]}"):
        checkpoint.stage(qwen3, pt_ckpt)


def test_staging_negative_control(qwen3: Path, pt_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from logdiff.sources import checkpoint

    staged = _staging_fault(monkeypatch, None)
    model = checkpoint.stage(qwen3, pt_ckpt)
    assert staged and model.path == staged[0] and (model.path / ".complete").is_file()
