"""Rollout dumps (verl, OpenRLHF) as ``--sequences``: read back exactly, replayed, compared with the recording.

The writers below lay sequences out the way each framework holds them
(docs/rollout-dumps.md cites the source lines): verl's left-padded prompts and
right-padded responses with ``attention_mask``, ``response_mask`` and
``rollout_log_probs``; OpenRLHF's agent output and ``Experience``. The engine
tests record real logprobs with vLLM (or a perturbed HF decode) on the demo
model, write them in these layouts and scan them.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from logdiff.reports.schema import validate_result
from test_classify import perturbed
from test_verl_metrics import verl_metrics

import logdiff
from logdiff.commands.config import ScanConfig
from logdiff.commands.outputs import dump_json
from logdiff.comparison import metrics as compare
from logdiff.errors import InputError
from logdiff.records.sequences import Sequence
from logdiff.sources import dumps

PAD = 0
SCAN = {"depth": "logprobs", "seed": 0}


# ---------------------------------------------------------------- writers (each framework's layout)


def verl_batch(seqs: list[Sequence]) -> dict[str, list]:
    """A verl ``DataProto.batch`` as lists: prompts left-padded, responses right-padded (agent_loop.py)."""
    width_p = max(len(s.prompt_ids) for s in seqs) + 1  # one more: every row has padding on both sides
    width_r = max(len(s.response_ids) for s in seqs) + 2
    out: dict[str, list] = {k: [] for k in ("prompts", "responses", "input_ids", "attention_mask", "response_mask")}
    if all(s.rollout_logprobs is not None for s in seqs):
        out["rollout_log_probs"] = []
    for s in seqs:
        lp, lr = len(s.prompt_ids), len(s.response_ids)
        prompts = [PAD] * (width_p - lp) + s.prompt_ids
        responses = s.response_ids + [PAD] * (width_r - lr)
        out["prompts"].append(prompts), out["responses"].append(responses), out["input_ids"].append(prompts + responses)
        out["attention_mask"].append([0] * (width_p - lp) + [1] * (lp + lr) + [0] * (width_r - lr))
        out["response_mask"].append(list(s.response_mask or [1] * lr) + [0] * (width_r - lr))
        out.setdefault("position_ids", []).append([max(0, i - (width_p - lp)) for i in range(width_p + width_r)])
        if "rollout_log_probs" in out:
            out["rollout_log_probs"].append(list(s.rollout_logprobs) + [0.0] * (width_r - lr))
    return out


def agent_rows(seqs: list[Sequence]) -> list[dict]:
    """OpenRLHF agent executor output (openrlhf/utils/agent.py): one entry per observation token."""
    rows = []
    for s in seqs:
        lp = len(s.prompt_ids)
        mask = s.response_mask or [1] * len(s.response_ids)
        ranges, start = [], None
        for i, m in enumerate([*mask, 0]):
            if m and start is None:
                start = i
            if not m and start is not None:
                ranges.append([lp + start, lp + i]), (start := None)
        lps = [0.0] * lp + [x if m else 0.0 for x, m in zip(s.rollout_logprobs, mask)]
        rows.append({"observation_tokens": s.prompt_ids + s.response_ids, "action_ranges": ranges,
                     "rollout_log_probs": lps})  # fmt: skip
    return rows


def experience_batch(seqs: list[Sequence]) -> dict[str, list]:
    """OpenRLHF ``Experience`` fields, right-padded; action_mask and rollout_log_probs shifted by one."""
    width = max(len(s) for s in seqs) + 1
    out: dict[str, list] = {"sequences": [], "attention_mask": [], "action_mask": [], "rollout_log_probs": []}
    for row in agent_rows(seqs):
        n = len(row["observation_tokens"])
        flags = [0] * n
        for a, b in row["action_ranges"]:
            flags[a:b] = [1] * (b - a)
        out["sequences"].append(row["observation_tokens"] + [PAD] * (width - n))
        out["attention_mask"].append([1] * n + [0] * (width - n))
        out["action_mask"].append((flags + [0] * (width - n))[1:])
        out["rollout_log_probs"].append((row["rollout_log_probs"] + [0.0] * (width - n))[1:])
    return out


def write(columns_or_rows: dict | list, path: Path) -> Path:
    """Columns (a dict of batched lists) or rows as .jsonl, .parquet or .pt, as the suffix says."""
    rows = columns_or_rows
    if isinstance(rows, dict):
        rows = [dict(zip(rows, values)) for values in zip(*rows.values())]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        import pandas as pd

        pd.DataFrame(rows).to_parquet(path)
    else:
        cols = {k: [r[k] for r in rows] for k in rows[0]}
        dtype = {k: torch.float32 if "log_prob" in k else torch.long for k in cols}
        torch.save({k: torch.tensor(v, dtype=dtype[k]) for k, v in cols.items()}, path)
    return path


def synthetic(seed: int, n: int = 5) -> list[Sequence]:
    """Ragged multi-turn sequences; logprobs exact in float32 (k/64), 0.0 on tool tokens as the frameworks write."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(1, 500, int(rng.integers(2, 7))).tolist()
        response = rng.integers(1, 500, int(rng.integers(3, 10))).tolist()
        mask = [1] * len(response)
        if i % 2:  # a tool segment between two model turns
            mask[1 : len(response) - 1] = [0] * (len(response) - 2)
        lps = [-int(rng.integers(1, 300)) / 64 if m else 0.0 for m in mask]
        out.append(Sequence(prompt, response, lps, None if all(mask) else mask))
    return out


def fields(s: Sequence) -> tuple:
    return s.prompt_ids, s.response_ids, s.rollout_logprobs, s.response_mask


# ---------------------------------------------------------------- reading


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".pt"])
@pytest.mark.parametrize("layout", ["verl", "openrlhf-agent", "openrlhf-experience"])
def test_every_layout_reads_back_exactly(tmp_path: Path, layout: str, suffix: str) -> None:
    seqs = synthetic(0)
    data = {"verl": verl_batch, "openrlhf-agent": agent_rows, "openrlhf-experience": experience_batch}[layout](seqs)
    if layout == "openrlhf-agent" and suffix == ".pt":
        pytest.skip("an agent output is ragged (one list per sample): it is written as JSONL or parquet")
    got, found = dumps.load(write(data, tmp_path / f"dump{suffix}"))
    assert found == layout
    assert [fields(s) for s in got] == [fields(s) for s in seqs]


def test_verl_without_prompts_takes_them_from_input_ids_and_without_logprobs_replays_only(tmp_path: Path) -> None:
    seqs = synthetic(1)
    batch = verl_batch(seqs)
    del batch["prompts"], batch["rollout_log_probs"], batch["response_mask"]
    got, _ = dumps.load(write(batch, tmp_path / "d.parquet"))
    assert [(s.prompt_ids, s.response_ids, s.rollout_logprobs, s.response_mask) for s in got] == \
        [(s.prompt_ids, s.response_ids, None, None) for s in seqs]  # fmt: skip


def test_logdiff_jsonl_keeps_its_reader(tmp_path: Path) -> None:
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3], "rollout_logprobs": [-0.5]}) + "\n")
    (s,), layout = dumps.load(f)
    assert layout == "logdiff" and fields(s) == ([1, 2], [3], [-0.5], None)


def _bad(tmp_path: Path, name: str, columns: dict) -> str:
    with pytest.raises(InputError) as e:
        dumps.load(write(columns, tmp_path / name))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_missing_columns_are_named(tmp_path: Path) -> None:
    batch = verl_batch(synthetic(2))
    del batch["attention_mask"]
    msg = _bad(tmp_path, "d.parquet", batch)
    found = "input_ids, position_ids, prompts, response_mask, responses, rollout_log_probs"
    assert f"no known rollout layout in columns [{found}]" in msg


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_nan_logprobs_are_refused(tmp_path: Path, suffix: str) -> None:
    batch = verl_batch(synthetic(3))
    batch["rollout_log_probs"][1][0] = float("nan")
    msg = _bad(tmp_path, f"d{suffix}", batch)
    assert "row 1" in msg or ":2:" in msg
    assert "rollout_logprobs at response position 0 is nan, not a finite number" in msg


def test_mismatched_lengths_are_refused(tmp_path: Path) -> None:
    batch = verl_batch(synthetic(4))
    batch["rollout_log_probs"][2] = batch["rollout_log_probs"][2][:-1]
    assert "'rollout_log_probs' needs" in _bad(tmp_path, "d.jsonl", batch)
    batch = verl_batch(synthetic(4))
    batch["attention_mask"][0] = batch["attention_mask"][0][:-1]
    assert "'attention_mask' needs" in _bad(tmp_path, "e.jsonl", batch)
    rows = agent_rows(synthetic(4))
    rows[0]["action_ranges"] = [[2, 99]]
    assert "is not a [start, end) inside" in _bad(tmp_path, "f.jsonl", rows)
    del rows[3]["action_ranges"]
    rows[0]["action_ranges"] = [[len(rows[0]["observation_tokens"]) - 1, len(rows[0]["observation_tokens"])]]
    assert _bad(tmp_path, "g.jsonl", rows).endswith("g.jsonl:4: no action_ranges (every openrlhf-agent row needs it)")


def test_left_padded_responses_are_refused(tmp_path: Path) -> None:
    batch = verl_batch(synthetic(5))
    width = len(batch["prompts"][0])
    batch["attention_mask"][0] = [1] * width + batch["attention_mask"][0][width:][::-1]
    assert "not right-padded" in _bad(tmp_path, "d.jsonl", batch)


class DataProto:
    """A stand-in for verl's pickled ``DataProto``: a class no library adds to torch's weights-only safe globals
    (megatron-core adds ``pathlib.PosixPath`` when imported)."""


def test_a_pickled_object_is_not_unpickled(tmp_path: Path) -> None:
    f = tmp_path / "dataproto.pt"
    torch.save({"batch": DataProto()}, f)  # a global a weights-only load refuses, as a DataProto pickle
    with pytest.raises(InputError, match="weights_only=True refused it") as e:
        dumps.load(f)
    assert "\n" not in str(e.value)


def test_unknown_suffix_and_missing_pyarrow_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "d.csv"
    f.write_text("a,b\n")
    with pytest.raises(InputError, match=r"unknown sequences file type '\.csv'"):
        dumps.load(f)
    g = write(verl_batch(synthetic(6)), tmp_path / "d.parquet")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    with pytest.raises(InputError, match="reading parquet needs pyarrow"):
        dumps.load(g)


def test_cli_bad_dump_is_exit_2(qwen3: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from logdiff.cli import app

    batch = verl_batch(synthetic(7))
    del batch["responses"]
    f = write(batch, tmp_path / "d.parquet")
    res = CliRunner().invoke(app, ["scan", str(qwen3), "--infer", "hf", "--sequences", str(f)])
    lines = [line for line in (res.output + (res.stderr if res.stderr_bytes is not None else "")).splitlines() if line]
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert lines[-1].startswith("logdiff: error: ") and "no known rollout layout in columns" in lines[-1]


# ---------------------------------------------------------------- replay against real engines


def _record(model: Path, seqs_file: Path | None, infer: str, **kw) -> tuple[list[Sequence], list[np.ndarray], list]:
    """Run the paths once: the sequences, HF's logprobs, and ``infer``'s logprobs (the recording)."""
    from logdiff.commands.scan import run_paths

    opts = {"num_sequences": 4, "prompt_len": 8, "response_len": 8} if seqs_file is None else {"sequences": seqs_file}
    run = run_paths(ScanConfig(model=model, infer=[infer], **SCAN, **opts, **kw))
    rec = next(p for p in run.infers if p.path == infer)
    return run.sequences, run.train.logprobs, rec.logprobs


def _multiturn(model: Path, tmp_path: Path) -> tuple[list[Sequence], list[np.ndarray]]:
    """vLLM's sampled rollouts with a tool segment spliced in, recorded by a vLLM replay (0.0 on tool tokens)."""
    sampled, _, _ = _record(model, None, "vllm")
    rows = []
    for i, s in enumerate(sampled):
        response = list(s.response_ids)
        mask = [1] * len(response)
        if i % 2 == 0:
            response[2:5], mask[2:5] = [7, 8, 9], [0, 0, 0]  # a tool's output between two model turns
        rows.append({"prompt_ids": s.prompt_ids, "response_ids": response, "response_mask": mask})
    f = tmp_path / "multiturn.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seqs, hf, vllm = _record(model, f, "vllm")
    for s, lp in zip(seqs, vllm):
        s.rollout_logprobs = [float(x) if m else 0.0 for x, m in zip(lp, s.response_mask or [1] * len(lp))]
    return seqs, hf


@pytest.fixture(scope="module")
def multiturn(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[], tuple[list[Sequence], list]]:
    """``multiturn()`` -> a fresh copy of one multi-turn rollout recorded by vLLM (built once per module)."""
    seqs, hf = _multiturn(qwen3, tmp_path_factory.mktemp("multiturn"))
    return lambda: (copy.deepcopy(seqs), hf)


@pytest.mark.vllm
def test_a_real_vllm_rollout_dumped_by_verl_replays(qwen3: Path, tmp_path: Path) -> None:
    seqs, hf, rollout = _record(qwen3, None, "vllm")  # vLLM sampled these responses and reported these logprobs
    for s, lp in zip(seqs, rollout):
        s.rollout_logprobs = [float(x) for x in lp]
    f = write(verl_batch(seqs), tmp_path / "rollout.parquet")
    r = logdiff.scan(qwen3, infer=["vllm"], sequences=f, **SCAN)
    assert r["sequences"]["source"] == "dump" and r["sequences"]["format"] == "verl"
    assert r["sequences"]["response_lens"] == [len(s.response_ids) for s in seqs]
    assert [(p["train"], p["infer"]) for p in r["pairs"]] == [("hf", "vllm"), ("hf", "vllm-prefill"), ("hf", "rollout")]
    replay = r["rollout_replay"]
    assert [e["path"] for e in replay["engines"]] == ["vllm", "vllm-prefill"] and replay["format"] == "verl"
    # the forced replay runs the sampling pass's computation again (tests/test_scan.py: decode replays bit for bit)
    assert replay["reproduced"] is True and replay["engines"][0]["bitwise_equal_fraction"] == 1.0
    assert r["pairs"][2]["metrics"] == compare.token_metrics(hf, rollout)  # the recording, read back bit for bit
    dump_json(r, tmp_path / "result.json")
    saved = json.loads((tmp_path / "result.json").read_text())
    assert validate_result(saved) == []
    saved["rollout_replay"]["reproduced"] = not saved["rollout_replay"]["reproduced"]  # negative control
    saved["rollout_replay"]["engines"][1]["path"] = "hf"
    assert validate_result(saved) == ["$.rollout_replay.engines[1].path: 'hf' is not an inference path",
                                      "$.rollout_replay.reproduced: must be the first engine's"]  # fmt: skip


@pytest.mark.vllm
def test_multiturn_dump_gives_verls_metrics_and_is_reproduced(qwen3: Path, tmp_path: Path, multiturn: Callable) -> None:
    seqs, hf = multiturn()
    assert any(s.response_mask for s in seqs)
    batch = verl_batch(seqs)
    r = logdiff.scan(qwen3, infer=["vllm"], sequences=write(batch, tmp_path / "verl.parquet"), **SCAN)
    # verl's own formulas on verl's own padded batch: rollout_log_probs and response_mask exactly as dumped
    width = len(batch["responses"][0])
    hf_padded = [np.concatenate([lp, np.full(width - len(lp), np.nan)]) for lp in hf]
    reference = verl_metrics(hf_padded, batch["rollout_log_probs"], batch["response_mask"])
    ours = r["pairs"][2]["metrics"]
    assert r["pairs"][2]["infer"] == "rollout" and ours["num_tokens"] == sum(map(sum, batch["response_mask"]))
    for key, value in reference.items():
        rel = 1e-7 if "fraction" in key and ("_seq_" in key or "sequence_ratio" in key) else 1e-12
        # abs 1e-12: verl's padded batch is wider than logdiff's, so float64 sums run in another order
        assert ours[key] == pytest.approx(value, rel=rel, abs=1e-12, nan_ok=True), key
    # identical paths: the recording was made by this engine on these ids, so it is reproduced (tool tokens unscored)
    assert r["rollout_replay"]["reproduced"] is True
    assert r["rollout_replay"]["summary"].startswith("vllm reproduces the recorded rollout logprobs bitwise")
    # the same rollout in OpenRLHF's layout gives the same comparison
    o = logdiff.scan(qwen3, infer=["vllm"], sequences=write(agent_rows(seqs), tmp_path / "openrlhf.jsonl"), **SCAN)
    assert o["sequences"]["format"] == "openrlhf-agent"
    assert o["rollout_replay"]["engines"] == r["rollout_replay"]["engines"]
    assert o["pairs"][2]["metrics"] == ours


@pytest.mark.vllm
@pytest.mark.parametrize("recorded_with", ["a stale weight", "temperature 0.7"])
def test_a_rollout_recorded_otherwise_is_not_reproduced(
    qwen3: Path, tmp_path: Path, multiturn: Callable, recorded_with: str
) -> None:
    seqs, _ = multiturn()
    plain = tmp_path / "ids.jsonl"
    plain.write_text("".join(json.dumps({"prompt_ids": s.prompt_ids, "response_ids": s.response_ids}) + "\n"
                             for s in seqs))  # fmt: skip
    if recorded_with == "a stale weight":  # the rollout engine missed a weight sync
        how = {"infer_ckpt": perturbed(qwen3, tmp_path, "model.layers.1.mlp.down_proj.weight", 1.05)}
    else:  # the rollout reported logprobs at its sampling temperature (verl's processed_logprobs)
        how = {"infer_set": {"temperature": 0.7}}
    _, _, recorded = _record(qwen3, plain, "hf-decode", **how)
    for s, lp in zip(seqs, recorded):
        s.rollout_logprobs = [float(x) for x in lp]
    r = logdiff.scan(qwen3, infer=["vllm"], sequences=write(verl_batch(seqs), tmp_path / "stale.pt"), **SCAN)
    replay = r["rollout_replay"]
    assert replay["reproduced"] is False and replay["engines"][0]["bitwise_equal_fraction"] < 1.0
    assert replay["engines"][0]["abs_diff_max"] > 0 and not math.isnan(replay["engines"][0]["abs_diff_max"])
    assert replay["summary"].startswith("vllm does not reproduce the recorded rollout logprobs:")
    from io import StringIO

    from logdiff.reports.html import render_html
    from logdiff.reports.terminal import print_summary
    from rich.console import Console

    out = StringIO()
    print_summary(r, Console(file=out, width=200))
    assert "recorded rollout: vllm does not reproduce" in out.getvalue()
    assert 'id="rollout-replay"' in render_html(r)
    from logdiff.reports.narrative import explain

    assert "Recorded rollout: vllm does not reproduce the recorded rollout logprobs" in explain(r)
