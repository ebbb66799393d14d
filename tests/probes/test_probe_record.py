"""The recorder on real HF engines: alignment, replay, and hooks that never outlive the block."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from logdiff.probes.session import ProbeSession

from logdiff.comparison.locate import locate
from logdiff.records.sequences import Sequence
from logdiff.sources.base import EngineSpec
from logdiff.sources.hf import HFDecode, HFForward


def _seqs(n: int = 3, seed: int = 0) -> list[Sequence]:
    rng = random.Random(seed)
    return [
        Sequence([rng.randrange(1, 512) for _ in range(6 - i)], [rng.randrange(1, 512) for _ in range(5 + i)])
        for i in range(n)
    ]


def _session(model: Path, seqs: list[Sequence], **kw: object) -> ProbeSession:
    import json

    cfg = json.loads((model / "config.json").read_text())
    return ProbeSession(seqs, 5, cfg["architectures"][0], cfg, **kw)


@pytest.fixture(scope="module")
def engines(tiny_qwen3: Path) -> dict[str, object]:
    spec = EngineSpec(str(tiny_qwen3), "bfloat16", options=(("batch_size", 2),))
    return {"hf": HFForward(spec), "hf-decode": HFDecode(spec)}


def _hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_hooks_and_patches_are_removed_even_on_error(engines: dict, tiny_qwen3: Path) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eng = engines["hf"]
    modeling = sys.modules[type(eng.model).__module__]
    before = (_hook_count(eng.model), modeling.apply_rotary_pos_emb, dict(ALL_ATTENTION_FUNCTIONS._local_mapping))
    session = _session(tiny_qwen3, _seqs())
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with session.record(eng, "infer"):
                assert _hook_count(eng.model) > before[0]
                assert eng.listener is not None and "_logprobs" in eng.__dict__
                raise RuntimeError("boom")
    finally:
        session.close()
    assert _hook_count(eng.model) == before[0]
    assert modeling.apply_rotary_pos_emb is before[1]
    assert dict(ALL_ATTENTION_FUNCTIONS._local_mapping) == before[2]
    assert eng.listener is None and "_logprobs" not in eng.__dict__
    assert not session.root.exists()


def _run_pair(model: Path, infer: object, train: object, seqs: list[Sequence], **kw: object):
    session = _session(model, seqs, **kw)
    try:
        with session.record(infer, "infer") as rec_i:
            infer.score(seqs)
        with session.record(train, "train") as rec_t:
            train.score(seqs)
        assert rec_i.misaligned_rows == 0 and rec_t.misaligned_rows == 0
        pair = session.pairs()[0]
        return pair, locate(pair), session
    finally:
        session.close()


def test_same_path_twice_is_bitwise_equal_everywhere_with_exact_replay(engines: dict, tiny_qwen3: Path) -> None:
    seqs = _seqs()
    pair, loc, session = _run_pair(tiny_qwen3, engines["hf"], engines["hf"], seqs)
    compared = pair.comparer.summaries
    assert set(compared) == set(session.cmap.order)  # every mapped boundary seen on both sides
    assert all(s.equal for s in compared.values())
    total = sum(len(s.prompt_ids) + len(s.response_ids) for s in seqs)
    assert compared["model.embed_tokens"].rows == total
    # replay ran for every replayable op and reproduced the stored op exactly
    replayed = {n for n, s in pair.comparer.local.items() if s.elements}
    assert {"model.layers.0.self_attn.rope_q", "model.layers.0.self_attn.attn_core", "model.layers.1.mlp.act_mul",
            "model.layers.2.residual_mlp", "logits", "log_softmax"} <= replayed
    assert all(pair.comparer.local[n].equal for n in replayed)
    assert loc.first_divergence is None and loc.introducing_ops == []
    assert list(loc.table.index) == session.cmap.order


def test_a_changed_weight_is_found_by_replay(engines: dict, tiny_qwen3: Path) -> None:
    seqs = _seqs()
    other = HFForward(EngineSpec(str(tiny_qwen3), "bfloat16"))
    with torch.no_grad():
        other.model.model.layers[1].self_attn.k_proj.weight.mul_(1.5)
    pair, loc, _ = _run_pair(tiny_qwen3, engines["hf"], other, seqs)
    assert loc.first_divergence["boundary"] == "model.layers.1.self_attn.k_proj"
    assert loc.first_divergence["inputs_equal"] is True
    assert [op["boundary"] for op in loc.introducing_ops] == ["model.layers.1.self_attn.k_proj"]
    # downstream ops see different inputs but replay shows they add nothing of their own
    assert not pair.comparer.summaries["model.layers.1.self_attn.attn_core"].equal
    assert pair.comparer.local["model.layers.1.self_attn.attn_core"].equal


def test_decode_rows_align_with_the_full_forward(engines: dict, tiny_qwen3: Path) -> None:
    seqs = _seqs(4, seed=1)
    pair, loc, _ = _run_pair(tiny_qwen3, engines["hf-decode"], engines["hf"], seqs)
    emb = pair.comparer.summaries["model.embed_tokens"]
    # decode feeds a sequence's last response token only when a longer one in its batch
    # (batch_size 2) still needs steps; rows past a sequence's end are dropped
    fed = 0
    for a, b in (seqs[0:2], seqs[2:4]):
        steps = max(len(a.response_ids), len(b.response_ids))
        for s in (a, b):
            n = len(s.response_ids)
            fed += len(s.prompt_ids) + (n if n < steps else n - 1)
    assert emb.equal and emb.rows == fed
    # log_softmax exists on the decode path only where it scores a token (last column of each step)
    lp = pair.comparer.summaries["log_softmax"]
    assert sum(len(s.response_ids) for s in seqs) <= lp.rows < emb.rows
    if loc.first_divergence is not None:
        assert loc.first_divergence["inputs_equal"] is True
        assert loc.first_divergence["boundary"] in {op["boundary"] for op in loc.introducing_ops}


def test_left_padding_aligns(tiny_qwen3: Path, engines: dict) -> None:
    left = HFForward(EngineSpec(str(tiny_qwen3), "bfloat16", options=(("padding_side", "left"),)))
    pair, _loc, _ = _run_pair(tiny_qwen3, engines["hf"], left, _seqs())
    assert pair.comparer.summaries["model.embed_tokens"].equal
    assert pair.comparer.summaries["model.layers.0.input_layernorm"].equal


def test_ops_depth_traces_modules(engines: dict, tiny_qwen3: Path) -> None:
    seqs = _seqs(2)
    session = _session(tiny_qwen3, seqs, ops=True, drill="model.layers.0.self_attn")
    try:
        with session.record(engines["hf-decode"], "infer"):
            engines["hf-decode"].score(seqs)
        with session.record(engines["hf"], "train"):
            engines["hf"].score(seqs)
        tracer = session.tracers[("infer", "hf-decode")]
        calls = tracer.calls("model.layers.0.self_attn")
        assert {c.step for c in calls} == {"prefill", "decode"}
        assert not tracer.calls("model.layers.1.self_attn")  # --drill restricts tracing
        assert any("attention_interface" in o.module for o in calls[0].ops)
    finally:
        session.close()
    assert torch._C._len_torch_dispatch_stack() == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_other_architectures_are_fully_aligned(arch: str, tmp_path: Path) -> None:
    from tiny_models import build_tiny

    model = build_tiny(tmp_path / arch, arch)
    spec = EngineSpec(str(model), "bfloat16")
    seqs = _seqs(2)
    pair, loc, session = _run_pair(model, HFDecode(spec), HFForward(spec), seqs)
    compared = pair.comparer.summaries
    assert set(compared) == set(session.cmap.order) and not loc.warnings
    replayed = {n for n, s in pair.comparer.local.items() if s.elements}
    assert replayed == {b.name for b in session.cmap.boundaries if b.kind != "embed"}
    if arch == "qwen3-moe":
        assert compared["model.layers.0.mlp.gate"].rows == compared["model.embed_tokens"].rows
    else:
        assert session.cmap.get("model.layers.0.self_attn.q_norm") is None
    if loc.first_divergence is not None:
        assert loc.first_divergence["inputs_equal"] is True


def test_rows_with_unexpected_token_ids_are_dropped(engines: dict, tiny_qwen3: Path) -> None:
    # negative control for alignment: the engine runs the sequences in another order than announced
    seqs = _seqs()
    session = _session(tiny_qwen3, seqs)
    try:
        with session.record(engines["hf"], "infer") as rec:
            engines["hf"].score(list(reversed(seqs)))
        assert rec.misaligned_rows > 0
        assert any("expected token ids" in w for w in session.warnings)
    finally:
        session.close()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "qwen3-moe", "deepseek-v2", "phi3"])
def test_replays_on_equal_inputs_reuse_the_live_output_exactly(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Layer 0 sees equal inputs on both paths (its replays reuse the live output); layer 1's input norm is
    # changed on the training path (from there on, replays run). Forcing every replay must give the same locals.
    from logdiff.probes.summary import PathComparer
    from tiny_models import build_tiny

    model = build_tiny(tmp_path / arch, arch)
    spec = EngineSpec(str(model), "bfloat16")
    stored, live = HFForward(spec), HFForward(spec)
    with torch.no_grad():
        live.model.model.layers[1].input_layernorm.weight.add_(0.25)
    seqs = _seqs(2)
    pair, loc, _ = _run_pair(model, stored, live, seqs)
    monkeypatch.setattr(PathComparer, "replay_equal_inputs", True)
    forced, forced_loc, _ = _run_pair(model, stored, live, seqs)

    assert pair.comparer.replays["equal_inputs"] > 0 and pair.comparer.replays["run"] > 0
    assert forced.comparer.replays["equal_inputs"] == 0
    assert sum(pair.comparer.replays.values()) == forced.comparer.replays["run"]
    local, forced_local = pair.comparer.local, forced.comparer.local
    assert set(local) == set(forced_local)
    for name in local:
        assert local[name].to_dict() == forced_local[name].to_dict(), name
        np.testing.assert_array_equal(local[name].per_position, forced_local[name].per_position)
    assert loc.introducing_ops == forced_loc.introducing_ops
    assert [op["boundary"] for op in loc.introducing_ops] == ["model.layers.1.input_layernorm"]


def test_only_the_named_paths_are_replayed(engines: dict, tiny_qwen3: Path) -> None:
    seqs = _seqs()
    other = HFForward(EngineSpec(str(tiny_qwen3), "bfloat16"))
    with torch.no_grad():
        other.model.model.layers[1].self_attn.k_proj.weight.mul_(1.5)
    session = _session(tiny_qwen3, seqs)
    try:
        for engine in (engines["hf"], engines["hf-decode"]):
            with session.record(engine, "infer"):
                engine.score(seqs)
        session.replay_paths = {"hf"}
        with session.record(other, "train"):
            other.score(seqs)
        replayed, compared = session.pair("hf", "hf"), session.pair("hf", "hf-decode")
        assert replayed.comparer.local and not compared.comparer.local
        assert compared.comparer.summaries.keys() == replayed.comparer.summaries.keys()
        assert [op["boundary"] for op in locate(replayed).introducing_ops] == ["model.layers.1.self_attn.k_proj"]
        # without replays, ops are judged on equal inputs only; what follows the change is named as not separated
        loc = locate(compared)
        assert all(op["method"] == "equal_inputs" for op in loc.introducing_ops)
        assert loc.unresolved
        assert any(w.startswith("hf-decode: the training path's ops were not replayed") for w in loc.warnings)
    finally:
        session.close()
