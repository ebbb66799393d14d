"""examples/capture_vllm.py as documented: vLLM samples rollouts, logdiff's plugin captures its workers (issue 22).

Three runs of the example, each a fresh vLLM in a subprocess (the plugin is switched on by
``LOGDIFF_CAPTURE`` in the environment the workers inherit):

* TP=1 in vLLM's multi-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=1``): the bundle holds every
  request's prompt and response ids as far as they were fed, and in its metadata all of them (the last
  sampled token too); every boundary of the adapter is recorded in every step;
* TP=2 (two worker processes): each rank writes its part; every record un-shards to the TP=1 shapes,
  replicas are bitwise equal, and values are close to TP=1's on the rows both runs fed the same tokens
  (same prompts and seed; sampling may part later, through the all-reduce's rounding);
* the negative control: a different prompt set (the in-process engine, another seed) matches none of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "capture_vllm.py"
PROMPTS, PROMPT_LEN, MAX_TOKENS = 3, 16, 6
CLOSE = 2.0**-4  # of a record's largest magnitude: a few bf16 roundings, far below a different input's difference


def _run(model: Path, out: Path, *, multiprocessing: bool, tp: int = 1, seed: int = 0) -> tuple[Any, list[dict]]:
    """Run the example with ``LOGDIFF_CAPTURE=out``; the process and its rollouts (one JSON object per line)."""
    env = {**os.environ, "LOGDIFF_CAPTURE": str(out), "VLLM_ENABLE_V1_MULTIPROCESSING": str(int(multiprocessing)),
           "LOGDIFF_CAPTURE_WINDOW": "all"}  # every record whole: they are compared value by value
    run = subprocess.run([sys.executable, str(EXAMPLE), str(model), "--prompts", str(PROMPTS), "--prompt-len",
                          str(PROMPT_LEN), "--max-tokens", str(MAX_TOKENS), "--seed", str(seed),
                          "--tensor-parallel-size", str(tp)], capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    rollouts = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return run, rollouts


def _rows(bundle: Any, name: str) -> tuple[dict[tuple[int, int], np.ndarray], bool]:
    """Record ``name`` un-sharded, as float32 rows by (sequence, position) over all steps; whether every
    replicated record's replicas were bitwise equal."""
    from logdiff.records.unshard import to_float32

    rows, replicas_equal = {}, True
    for step in range(bundle.num_steps):
        (table,) = bundle.rows(step).values()
        (logical,) = bundle.logical(step, name).values()
        replicas_equal &= logical.replicas_equal is not False
        value = to_float32(logical.value, bundle.ranks[0].steps[step]["records"][name]["dtype"])
        for row, r in zip(value, bundle.record_rows(step, name)):
            rows[int(table["sequences"][r]), int(table["positions"][r])] = row
    return rows, replicas_equal


def _fed(bundle: Any) -> list[list[int]]:
    """The ids each sequence's rows fed, by position (-1 where none), from the row tables alone."""
    ids: dict[int, list[int]] = {}
    for step in range(bundle.num_steps):
        (table,) = bundle.rows(step).values()
        for s, p, t in zip(table["sequences"].tolist(), table["positions"].tolist(), table["tokens"].tolist()):
            row = ids.setdefault(s, [])
            row.extend([-1] * (p + 1 - len(row)))
            row[p] = t
    return [ids[s] for s in sorted(ids)]


def _distance(a: Any, b: Any, name: str, same_prefix: bool) -> tuple[float, int]:
    """Largest difference of record ``name`` between two bundles over the (sequence, position) rows both hold
    (only those fed the same tokens so far, with ``same_prefix``), relative to ``a``'s largest value; and
    how many rows were compared."""
    ra, _ = _rows(a, name)
    rb, _ = _rows(b, name)
    sa, sb = a.sequences(), b.sequences()
    keys = [k for k in ra if k in rb and (not same_prefix or sa[k[0]][: k[1] + 1] == sb[k[0]][: k[1] + 1])]
    assert all(ra[k].shape == rb[k].shape for k in keys), f"{name}: un-sharded shapes differ"
    if not keys:
        return float("inf"), 0
    scale = max(float(np.abs(ra[k]).max()) for k in keys)
    return max(float(np.abs(ra[k] - rb[k]).max()) for k in keys) / scale, len(keys)


def test_the_plugin_is_registered_and_idle_without_the_variable() -> None:
    """vLLM loads every general plugin in every process: without LOGDIFF_CAPTURE it must do nothing, import
    neither torch nor vLLM."""
    from importlib.metadata import entry_points

    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "logdiff_capture"]
    assert plugin.value == "logdiff.sources.vllm.capture:register"
    code = ("import sys; from logdiff.sources.vllm.capture import register; register(); "
            "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "LOGDIFF_CAPTURE"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr[-2000:]


@pytest.fixture(scope="module")
def tp1(demo_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("vllm-tp1") / "bundle"
    run, rollouts = _run(demo_model("qwen3"), out, multiprocessing=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, rollouts


@pytest.mark.vllm
@pytest.mark.slow
def test_multiprocess_engine_captures_prompts_and_responses(tp1: tuple[Path, list[dict]]) -> None:
    from logdiff.probes.arch import adapter_for

    from logdiff.records.bundle import Bundle

    out, rollouts = tp1
    bundle = Bundle(out)
    assert len(rollouts) == PROMPTS and all(len(r["response_ids"]) == MAX_TOKENS for r in rollouts)
    assert bundle.role == "infer" and bundle.world_size == 1
    # the rows hold what was fed: the prompt and every sampled token but the last; the metadata the rest
    fed = [[t for t in table_ids if t >= 0] for table_ids in _fed(bundle)]
    assert fed == [r["prompt_ids"] + r["response_ids"][:-1] for r in rollouts]
    assert bundle.sequences() == [r["prompt_ids"] + r["response_ids"] for r in rollouts]
    meta = bundle.ranks[0].meta
    assert [s["ids"] for s in meta["sequences"]] == [r["prompt_ids"] + r["response_ids"] for r in rollouts]
    assert [s["prompt_len"] for s in meta["sequences"]] == [PROMPT_LEN] * PROMPTS
    assert meta["warnings"] == [] and meta["architecture"] == "Qwen3ForCausalLM" and "contract" in meta
    # what the sampler applied to each request, read in the engine core's worker process (records/processing.py)
    assert [(s["sampling"]["temperature"], s["sampling"]["max_tokens"], s["sampling"]["logprobs_mode"])
            for s in meta["sequences"]] == [(1.0, MAX_TOKENS, "raw_logprobs")] * PROMPTS
    # every boundary the adapter knows, in every step (the prefill and each decode step)
    cmap = adapter_for(meta["architecture"]).correspondence(meta["config"])
    boundaries = {b.name for b in cmap.boundaries}
    assert bundle.num_steps >= MAX_TOKENS
    assert all(set(bundle.names(step)) == boundaries for step in range(bundle.num_steps))


@pytest.mark.vllm
@pytest.mark.slow
def test_tensor_parallel_2_unshards_to_tp1(tp1: tuple[Path, list[dict]], demo_model: Callable[[str], Path],
                                           tmp_path: Path) -> None:  # fmt: skip
    from logdiff.records.bundle import Bundle

    run, rollouts = _run(demo_model("qwen3"), tmp_path / "tp2", multiprocessing=True, tp=2)
    if run.returncode != 0:
        error = next((ln for ln in reversed(run.stderr.splitlines()) if "Error" in ln), run.stderr[-500:])
        pytest.skip(f"vLLM's CPU build did not run tensor_parallel_size=2 here: {error.strip()}")
    tp2, one = Bundle(tmp_path / "tp2"), Bundle(tp1[0])
    assert tp2.world_size == 2 and [p.layout.group("tp") for p in tp2.ranks] == [(0, 1), (0, 1)]
    assert tp2.sequences() == [r["prompt_ids"] + r["response_ids"] for r in rollouts]
    assert [r["prompt_ids"] for r in rollouts] == [r["prompt_ids"] for r in tp1[1]]
    placements = {record["placement"]["kind"] for record in tp2.ranks[0].steps[0]["records"].values()}
    assert placements == {"shard", "replicate"}  # column-parallel pieces and all-reduced/gathered outputs
    assert set(tp2.names(0)) == set(one.names(0))
    for name in one.names(0):
        _, replicas_equal = _rows(tp2, name)
        distance, compared = _distance(one, tp2, name, same_prefix=True)
        assert replicas_equal, f"{name}: the ranks' replicas differ"
        assert compared >= PROMPTS * PROMPT_LEN or name in ("logits", "log_softmax"), (name, compared)
        assert distance <= CLOSE, f"{name}: TP=2 differs from TP=1 by {distance:.3g} of its scale"


@pytest.mark.vllm
@pytest.mark.slow
def test_a_different_prompt_set_does_not_match(tp1: tuple[Path, list[dict]], demo_model: Callable[[str], Path],
                                               tmp_path: Path) -> None:  # fmt: skip
    from logdiff.records.bundle import Bundle

    run, rollouts = _run(demo_model("qwen3"), tmp_path / "other", multiprocessing=False, seed=1)
    assert run.returncode == 0, run.stderr[-3000:]
    other, one = Bundle(tmp_path / "other"), Bundle(tp1[0])
    assert other.sequences() == [r["prompt_ids"] + r["response_ids"] for r in rollouts]
    assert other.sequences() != one.sequences()
    assert _distance(one, other, "model.embed_tokens", same_prefix=True)[1] == 0  # no row fed the same tokens
    for name in one.names(0):
        distance, compared = _distance(one, other, name, same_prefix=False)
        assert compared > 0 and distance > CLOSE, f"{name}: a different prompt set matched ({distance:.3g})"
