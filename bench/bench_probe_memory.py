"""Peak memory of ``--depth modules`` as the sequence length doubles.

Each measurement runs in a fresh subprocess (peak RSS, ``VmHWM``, only grows
within a process) and scans the same model twice over: once at
``--depth logprobs`` (the engines alone) and once at ``--depth modules``
(probes on every boundary, the inference path recorded to disk, the training
path compared on the spot). The *probe overhead* is the difference. The
script also prints what keeping every boundary's values in memory would
cost ("all values": the peak bytes held in the on-disk stores, which is
exactly that), so the two can be compared: the overhead must stay far below
it and must not double with it. Classification (follow-up scans with kernels
swapped) is switched off so only localization is measured.

Usage::

    .venv/bin/python bench/bench_probe_memory.py [--model DIR] [--infer hf-decode|vllm]
        [--sequences 8] [--lengths 128,256,512]

Without ``--model`` a random demo-sized bf16 Qwen3 (hidden 256, 4 layers,
vocab 4096, init std 0.2) is built in a temporary directory. Half of each
length is prompt, half response. Timings are printed but are not the point.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, os, sys, time
from pathlib import Path
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
from logdiff.commands.config import ScanConfig
from logdiff.commands.scan import scan
import logdiff.records.store as store

model, infer, depth, n, prompt, response = sys.argv[1:7]
live = {"now": 0, "peak": 0}  # bytes of boundary values held in on-disk stores at once
orig_init, orig_close = store.RowStore.__init__, store.RowStore.close
def spy_init(self, path, num_sequences, max_len, width, dtype):
    orig_init(self, path, num_sequences, max_len, width, dtype)
    self._bench_bytes = num_sequences * max_len * width * self._itemsize
    live["now"] += self._bench_bytes
    live["peak"] = max(live["peak"], live["now"])
def spy_close(self):
    if self._fd >= 0:
        live["now"] -= self._bench_bytes
    orig_close(self)
store.RowStore.__init__, store.RowStore.close = spy_init, spy_close

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
t = time.time()
cfg = ScanConfig(model=Path(model), infer=[infer], num_sequences=int(n), prompt_len=int(prompt),
                 response_len=int(response), depth=depth)
# localization only: no follow-up scans (classification reruns paths with kernels swapped)
try:
    from logdiff.commands.scan import measure
    r = measure(cfg).result.to_dict()
except ImportError:  # a revision before the typed result
    r = scan(cfg, classify=False)
print(json.dumps({"peak_rss": hwm(), "seconds": time.time() - t, "store_bytes": live["peak"],
                  "boundaries": len((r.get("divergence_table") or {}).get("boundaries", []))}))
"""


def build_model(path: Path) -> Path:
    from logdiff.demo import build_random_model

    return build_random_model(path, "qwen3")


def measure(model: Path, infer: str, depth: str, n: int, length: int) -> dict:
    prompt, response = length // 2, length - length // 2
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), infer, depth, str(n), str(prompt), str(response)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"child failed ({depth}, L={length}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--infer", default="hf-decode")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--lengths", default="128,256,512")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    mib = 1 / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_model(Path(tmp) / "model")
        print(f"model {model}, infer {args.infer}, {args.sequences} sequences, machine {os.uname().machine}")
        print(f"{'L':>6} {'logprobs MiB':>13} {'modules MiB':>12} {'overhead MiB':>13} {'all values MiB':>15} "
              f"{'boundaries':>10} {'t_log s':>8} {'t_mod s':>8}")
        rows = []
        for length in lengths:
            base = measure(model, args.infer, "logprobs", args.sequences, length)
            mod = measure(model, args.infer, "modules", args.sequences, length)
            over = mod["peak_rss"] - base["peak_rss"]
            rows.append((length, over, mod["store_bytes"]))
            print(f"{length:>6} {base['peak_rss'] * mib:>13.1f} {mod['peak_rss'] * mib:>12.1f} {over * mib:>13.1f} "
                  f"{mod['store_bytes'] * mib:>15.1f} {mod['boundaries']:>10} {base['seconds']:>8.1f} "
                  f"{mod['seconds']:>8.1f}")
        (l0, o0, s0), (l1, o1, s1) = rows[0], rows[-1]
        print(f"L x{l1 / l0:.0f}: all boundary values x{s1 / max(s0, 1):.1f}, probe overhead "
              f"{o0 * mib:.1f} -> {o1 * mib:.1f} MiB")


if __name__ == "__main__":
    main()
