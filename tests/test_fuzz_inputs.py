"""A fuzzer over real capture bundles and real msprobe dumps (issue 49, item 8).

Each case copies a pristine input pair, mutates it once (seeded: the case's seed names it), and runs
``logdiff compare`` on it in a forked child of one worker process (tests/fuzz_worker.py) under a time limit
and an ``open`` audit hook. Every case must end with

- an exit code logdiff documents (0 to 4), never 101 (an internal error), a signal or a hang;
- where it fails, one line on stderr and no traceback;
- no file opened outside the two inputs and the output directory (a secret copy of the inputs lies beside
  them, and the links the mutations plant point into it);
- an earlier run's files in the output directory byte-identical where the case failed.

Mutations: JSON fields (another type, a huge or negative number, a key removed) of bundle.json, a manifest
and dump.json; safetensors headers and files cut short; links out of the input and within it; a FIFO for a
file; a file or rank removed or duplicated; permissions taken away. Negative control: the pristine pair
compares (exit 0), and a planted out-of-root read is seen by the audit hook.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hf_bundles import capture_hf

IDS = [[5, 17, 3, 9, 42, 7, 11, 2], [8, 1, 30, 4, 6, 19, 23, 13]]
DUMPS = Path(__file__).parent / "data" / "msprobe"
EARLIER = {"result.json": b'{"from": "an earlier run"}', "report.html": b"<p>an earlier report</p>"}
CASES = {"bundle-json": 150, "bundle-files": 150, "msprobe": 40}
TIMEOUT = 120.0


class Worker:
    """The fuzz worker process: one case in, one answer out."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fuzz_worker.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def run(self, argv: list[str], watch: Path, allowed: list[Path], warm: bool = False) -> dict[str, Any]:
        case = {"argv": [str(a) for a in argv], "watch": str(watch), "allowed": [str(a) for a in allowed],
                "timeout": TIMEOUT, "warm": warm}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the fuzz worker died"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


@pytest.fixture(scope="module")
def bundles(demo_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fuzz-pristine")
    model = demo_model("qwen3")
    return (capture_hf(model, root / "train", "train", [IDS]),
            capture_hf(model, root / "infer", "infer", [[ids] for ids in reversed(IDS)]))


@pytest.fixture(scope="module")
def dump_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dumps' model as its config alone: the dumps are read and compared, no weights load (the fuzzer is
    after the reading, and a weight load per case would cost seconds)."""
    config = tmp_path_factory.mktemp("fuzz-config")
    shutil.copy(DUMPS / "qwen3-config.json", config / "config.json")
    return config


# ------------------------------------------------------------------------------------------ mutations


def _json_paths(value: Any, path: tuple = (), depth: int = 6) -> Iterator[tuple]:
    yield path
    if depth == 0:
        return
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in list(items)[:64]:
        yield from _json_paths(child, (*path, key), depth - 1)


def mutate_json(rng: random.Random, f: Path) -> str:
    data = json.loads(f.read_text())
    paths = [p for p in _json_paths(data) if p]
    if not paths:
        f.write_text(json.dumps([]))
        return f"{f.name}: replaced by []"
    by_depth: dict[int, list[tuple]] = {}
    for p in paths:  # a depth first, then a field: the structure is hit as often as the leaves of a large map
        by_depth.setdefault(len(p), []).append(p)
    path = rng.choice(by_depth[rng.choice(sorted(by_depth))])
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    op = rng.choice(["type", "type", "huge", "negative", "missing", "float"])
    if op == "missing":
        del parent[path[-1]]
    else:
        parent[path[-1]] = {"type": lambda: rng.choice(["x", "1", [], {}, None, True, [1, 2]]),
                            "huge": lambda: rng.choice([10**18, 2**63, 10**9, 1e308]),
                            "negative": lambda: rng.choice([-1, -(10**9)]),
                            "float": lambda: 0.5}[op]()
    f.write_text(json.dumps(data))
    return f"{f.name}: {'/'.join(map(str, path))} {op}"


def mutate_binary(rng: random.Random, f: Path) -> str:
    data = bytearray(f.read_bytes())
    op = rng.choice(["truncate", "header-length", "header-bytes", "empty"])
    if op == "truncate":
        data = data[: rng.randrange(0, len(data))]
    elif op == "header-length":
        data[:8] = rng.choice([2**63, 2**40, 0, 3, len(data)]).to_bytes(8, "little")
    elif op == "header-bytes":
        n = min(int.from_bytes(data[:8], "little"), len(data) - 8)
        for _ in range(rng.randint(1, 4)):
            data[8 + rng.randrange(max(n, 1))] = rng.randrange(256)
    else:
        data = bytearray()
    f.write_bytes(bytes(data))
    return f"{f.name}: {op}"


def mutate_file(rng: random.Random, f: Path, secret: Path, root: Path) -> str:
    """A file-system mutation of ``f`` (a file or directory under ``root``): links out and in, a FIFO, removal,
    duplication, permissions."""
    op = rng.choice(["link-out", "link-out", "link-in", "fifo", "remove", "duplicate", "chmod"])
    target = secret / f.relative_to(root)
    if op == "link-out":
        _remove(f)
        f.symlink_to(target, target_is_directory=target.is_dir())
    elif op == "link-in":
        others = [p for p in root.rglob("*") if p.is_file() and p != f and f not in p.parents]
        if not others:
            return mutate_file(rng, f, secret, root)
        _remove(f)
        f.symlink_to(os.path.relpath(rng.choice(others), f.parent))
    elif op == "fifo":
        _remove(f)
        os.mkfifo(f)
    elif op == "remove":
        _remove(f)
    elif op == "duplicate":
        twin = f.with_name(f.name.replace("00000", "00001").replace("0", "1", 1) if f.name != "dump.json"
                           else f.name + ".copy")
        if twin.exists() or twin == f:
            twin = f.with_name(f.name + "-copy")
        (shutil.copytree if f.is_dir() else shutil.copy)(f, twin)
    else:
        f.chmod(0)
    return f"{f.relative_to(root)}: {op}"


def _remove(f: Path) -> None:
    if f.is_dir() and not f.is_symlink():
        shutil.rmtree(f)
    else:
        f.unlink()


# --------------------------------------------------------------------------------------------- the run


def _case(tmp: Path, pristine: tuple[Path, Path], seed: int, kind: str) -> tuple[Path, Path, Path, Path, str]:
    """Copy the inputs (and their secret twin outside them) and mutate one thing; returns the inputs, the case
    directory, the output directory and what was done."""
    rng = random.Random(seed)
    case = tmp / f"case-{seed}"
    a, b = (shutil.copytree(p, case / side, symlinks=True) for p, side in zip(pristine, ("a", "b")))
    secret = case / "secret"
    for p, side in zip(pristine, ("a", "b")):
        shutil.copytree(p, secret / side, symlinks=True)
    out = case / "out"
    out.mkdir()
    for name, data in EARLIER.items():
        (out / name).write_bytes(data)
    side = rng.choice([a, b])
    files = sorted(p for p in side.rglob("*"))
    if kind == "bundle-json" or (kind == "msprobe" and rng.random() < 0.5):
        targets = [p for p in files if p.suffix == ".json" and p.is_file()]
        done = mutate_json(rng, rng.choice(targets))
    elif kind == "bundle-files" and rng.random() < 0.4:
        done = mutate_binary(rng, rng.choice([p for p in files if p.suffix == ".safetensors"]))
    else:
        done = mutate_file(rng, rng.choice(files), secret, case)
    return a, b, case, out, f"seed {seed}: {side.name}/{done}"


def _problems(answer: dict[str, Any], out: Path) -> list[str]:
    found = []
    if answer["status"] != "exit":
        found.append(f"{answer['status']} {answer['code']}")
    elif answer["code"] not in (0, 1, 2, 3, 4):
        found.append(f"exit {answer['code']}")
    lines = [line for line in answer["stderr"].splitlines() if line.strip()]
    if answer["code"] and (len(lines) != 1 or not lines[0].startswith("logdiff: error:")):
        found.append(f"not one error line: {answer['stderr'][-600:]!r}")
    if "Traceback" in answer["stderr"]:
        found.append("a traceback")
    if answer["outside"]:
        found.append(f"opened outside the inputs: {sorted(set(answer['outside']))[:3]}")
    if answer["code"] != 0 and any((out / n).read_bytes() != d for n, d in EARLIER.items() if (out / n).exists()):
        found.append("an earlier output changed")
    if answer["code"] != 0 and sorted(p.name for p in out.iterdir()) != sorted(EARLIER):
        found.append(f"the output directory holds {sorted(p.name for p in out.iterdir())}")
    return found


def _fuzz(worker: Worker, tmp: Path, pristine: tuple[Path, Path], kind: str, extra: list[object]) -> dict:
    warm = worker.run(["compare", *pristine, "--out", tmp / "warm", "--quiet", *extra], tmp, [], warm=True)
    assert warm["code"] == 0, warm  # the pristine pair compares: the control every mutation departs from
    failures, codes = [], {}
    for seed in range(CASES[kind]):
        a, b, case, out, done = _case(tmp, pristine, seed, kind)
        answer = worker.run(["compare", a, b, "--out", out, "--quiet", *extra], case, [a, b, out, *extra[1:]])
        codes[answer["code"]] = codes.get(answer["code"], 0) + 1
        problems = _problems(answer, out)
        if problems:
            failures.append(f"{done}: {'; '.join(problems)}")
        for p in case.rglob("*"):  # chmod 0 and FIFOs: make the case removable
            if not p.is_symlink() and p.exists():
                p.chmod(0o700 if p.is_dir() else 0o600)
        shutil.rmtree(case)
    assert not failures, f"{len(failures)} of {CASES[kind]} {kind} cases:\n" + "\n".join(failures[:20])
    return codes


def test_the_pristine_pair_compares_and_the_hook_sees_a_read_outside(worker: Worker, bundles: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    a, b = (shutil.copytree(p, tmp_path / side) for p, side in zip(bundles, ("a", "b")))
    out = tmp_path / "out"
    answer = worker.run(["compare", a, b, "--out", out, "--quiet"], tmp_path, [a, b, out])
    assert answer["status"] == "exit" and answer["code"] == 0 and not answer["outside"], answer
    assert json.loads((out / "result.json").read_text())["verdict"] == "consistent"
    # the control: a read the rules would refuse, made by hand, is seen by the same hook
    (tmp_path / "secret.txt").write_text("x")
    answer = worker.run(["report", tmp_path / "secret.txt"], tmp_path, [a])
    assert answer["outside"] == [str((tmp_path / "secret.txt").resolve())], answer


def test_fuzz_bundle_json(worker: Worker, bundles: tuple[Path, Path], tmp_path: Path) -> None:
    codes = _fuzz(worker, tmp_path, bundles, "bundle-json", [])
    assert codes.get(2, 0) > CASES["bundle-json"] // 2, codes  # most mutations are caught as bad input


def test_fuzz_bundle_files(worker: Worker, bundles: tuple[Path, Path], tmp_path: Path) -> None:
    codes = _fuzz(worker, tmp_path, bundles, "bundle-files", [])
    assert codes.get(2, 0) > CASES["bundle-files"] // 2, codes


def test_fuzz_msprobe_dumps(worker: Worker, dump_model: Path, tmp_path: Path) -> None:
    pristine = (DUMPS / "hf-tensor-L0", DUMPS / "vllm-tensor-L0")
    codes = _fuzz(worker, tmp_path, pristine, "msprobe", ["--model", dump_model])
    assert codes.get(2, 0) > CASES["msprobe"] // 4, codes
