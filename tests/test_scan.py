"""End-to-end scans through the real paths on the trained bf16 demo Qwen3.

Properties, not CPU-specific sizes: the identity control is exactly 0, replay
through vLLM's decode path reproduces the sampled logprobs bitwise, and a
weight perturbed on the inference side raises the diff by a wide margin.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

import logdiff
from logdiff.commands.config import ScanConfig
from logdiff.commands.scan import run_paths

SMALL = {"num_sequences": 4, "prompt_len": 12, "response_len": 12}


def test_identity_control_is_exactly_zero(qwen3: Path) -> None:
    r = logdiff.scan(qwen3, infer=["hf"], **SMALL)
    m = r["logprobs"]
    assert m["abs_diff_max"] == 0.0 and m["bitwise_equal_fraction"] == 1.0
    assert r["verdict"] == "consistent"
    assert r["sequences"]["response_lens"] == [12] * 4


@pytest.mark.isa_sensitive
def test_hf_decode_differs_from_full_forward(qwen3: Path, stock_varies: Callable) -> None:
    # SDPA's causal prefill and its one-query decode step reduce in different orders on the CPUs
    # of ../shared/notes/cpu-numerics.md; on an H200 they agreed bitwise at this size.
    r = logdiff.scan(qwen3, infer=["hf-decode"], **SMALL)
    m = r["logprobs"]
    assert r["pairs"][0]["infer"] == "hf-decode"
    stock_varies(m["abs_diff_max"] == 0.0, "HF forward and KV-cache decode agree bitwise here")
    assert 0.0 < m["abs_diff_max"] < 1.0
    assert m["bitwise_equal_fraction"] < 1.0
    assert r["verdict"] == "divergent"


@pytest.mark.vllm
def test_vllm_paths_and_replay(qwen3: Path, tmp_path: Path) -> None:
    cfg = ScanConfig(model=qwen3, infer=["vllm"], **SMALL)
    run = run_paths(cfg)
    seqs, infers = run.sequences, run.infers
    assert run.source == "probe" and [p.path for p in infers] == ["vllm", "vllm-prefill"]
    assert [p.name for p in run.paths] == ["hf", "vllm", "vllm-prefill"] and run.engine_of("vllm-prefill").name == "vllm"
    decode, prefill = infers

    # Replaying the sampled tokens through vLLM's decode path reproduces its logprobs bitwise.
    jsonl = tmp_path / "seqs.jsonl"
    jsonl.write_text(
        "".join(
            json.dumps({"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "rollout_logprobs": lp.tolist()})
            + "\n"
            for s, lp in zip(seqs, decode.logprobs)
        )
    )
    # A rescan's primary-only run scores vLLM's decode replay alone, with the same numbers.
    from dataclasses import replace

    from logdiff.commands.scan import measure

    alone = measure(replace(cfg, replay=tuple(seqs), primary_path_only=True)).result
    assert [p.infer for p in alone.pairs] == ["vllm"]
    full = measure(replace(cfg, replay=tuple(seqs))).result
    assert [p.infer for p in full.pairs] == ["vllm", "vllm-prefill"]
    assert alone.primary.metrics == full.primary.metrics

    replay = logdiff.scan(qwen3, infer=["vllm"], sequences=jsonl)
    names = [(p["train"], p["infer"]) for p in replay["pairs"]]
    assert names == [("hf", "vllm"), ("hf", "vllm-prefill"), ("hf", "rollout")]
    by_name = {p["infer"]: p["metrics"] for p in replay["pairs"]}
    # The recorded rollout is vLLM's decode, bit for bit (it records no top-1 tokens).
    assert by_name["rollout"].pop("argmax_flip_fraction") is None
    by_name["vllm"].pop("argmax_flip_fraction")
    assert by_name["rollout"] == by_name["vllm"]
    assert replay["settings"]["sequence_source"] == "jsonl"


@pytest.mark.vllm
def test_infer_ckpt_perturbed_layer_raises_the_diff(qwen3: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(qwen3 / "model.safetensors"))
    name = "model.layers.2.mlp.down_proj.weight"
    sd[name] = (sd[name].float() * 1.5).to(sd[name].dtype)
    bad = tmp_path / "bad.safetensors"
    save_file(sd, str(bad))
    clean = logdiff.scan(qwen3, infer=["vllm"], **SMALL)
    broken = logdiff.scan(qwen3, infer=["vllm"], infer_ckpt=bad, **SMALL)
    assert broken["infer_checkpoint"] == str(bad)
    assert broken["logprobs"]["abs_diff_mean"] > 5 * clean["logprobs"]["abs_diff_mean"]


def test_checkpoint_formats_load_the_same_weights(qwen3: Path, tmp_path: Path) -> None:
    """HF dir, .safetensors, .pt and a torch.distributed.checkpoint dir give bitwise equal logprobs."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    sd = load_file(str(qwen3 / "model.safetensors"))
    torch.save({"model": sd}, tmp_path / "w.pt")
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    ref = logdiff.scan(qwen3, infer=["hf"], **SMALL)
    for ckpt in (qwen3, qwen3 / "model.safetensors", tmp_path / "w.pt", tmp_path / "dcp"):
        # --infer-ckpt so the training side keeps MODEL's own weights: equality proves the load.
        r = logdiff.scan(qwen3, infer=["hf"], infer_ckpt=ckpt, **SMALL)
        assert r["logprobs"]["bitwise_equal_fraction"] == 1.0, ckpt
        assert r["pairs"][0]["metrics"] == ref["pairs"][0]["metrics"]


def test_set_overrides_one_side_only(qwen3: Path) -> None:
    # Against the identity path, any difference is the override's doing.
    eps = {"rms_norm_eps": 1e-2}
    one_side = logdiff.scan(qwen3, infer=["hf"], infer_set=eps, **SMALL)
    both_sides = logdiff.scan(qwen3, infer=["hf"], train_set=eps, infer_set=eps, **SMALL)
    assert one_side["settings"]["overrides"]["infer"] == {"rms_norm_eps": 0.01}
    assert one_side["logprobs"]["abs_diff_max"] > 1e-3
    assert both_sides["logprobs"]["abs_diff_max"] == 0.0


def test_text_prompts_use_the_tokenizer_and_chat_template(qwen3: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "def add(a, b):"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "import os"}]}) + "\n"
    )  # fmt: skip
    r = logdiff.scan(qwen3, infer=["hf"], prompts=prompts, response_len=6)
    assert r["settings"]["sequence_source"] == "prompts"
    assert r["sequences"]["count"] == 2 and r["logprobs"]["abs_diff_max"] == 0.0
    assert isinstance(r["pairs"][0]["worst"]["token_text"], str)


@pytest.mark.parametrize("replay_all_paths", [False, True])
def test_replays_serve_the_primary_path_unless_all_are_asked_for(qwen3: Path, replay_all_paths: bool) -> None:
    cfg = ScanConfig(model=qwen3, infer=["hf-decode"], depth="modules", replay_all_paths=replay_all_paths, **SMALL)
    run = run_paths(cfg)
    try:
        assert run.probes.replay_paths == (None if replay_all_paths else {"hf-decode"})
        assert run.probes.comparers[("hf", "hf-decode")].wants_replay
    finally:
        run.probes.close()
