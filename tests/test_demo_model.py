"""The bundled demo-model builder: loads, tokenizes, trains, reproduces.

Every check has a control that would fail if the thing broke: trained
against untrained weights, same seed against another seed, a demo
directory against a foreign one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from logdiff.demo import (  # noqa: E402
    DEMO_VOCAB_SIZE,
    METADATA_FILE,
    SUPPORTED_DEMO_ARCHS,
    build_demo_model,
    read_demo_metadata,
    tiny_config,
)
from logdiff.demo.corpus import load_corpus  # noqa: E402
from logdiff.demo.tokenizer import CHAT_TEMPLATE, train_tokenizer  # noqa: E402
from logdiff.demo.train import TrainSettings  # noqa: E402

STEPS = 20  # enough to move the loss clearly (the builds made here; ``built`` holds the session's)
# Small batches keep a build to a few seconds; the pipeline is the default one. One thread:
# the suite shares two cores with other work, where a second torch thread mostly spin-waits.
FAST = TrainSettings(seq_len=64, batch_size=4, peak_lr=3e-3, warmup_steps=5, eval_sequences=8, threads=1)


def build(path, arch, **kwargs):
    """build_demo_model with the fast test settings."""
    return build_demo_model(path, arch, settings=FAST, **kwargs)


@pytest.fixture(scope="module")
def built(demo_model) -> dict[str, Path]:
    """One demo model per arch: the session's own (conftest.py's ``demo_model``: the default settings, seed 0,
    ``TEST_TRAIN_STEPS`` steps, cached), which the rest of the suite builds and reads anyway; so the builder is
    checked on what it built for every other test, and no model is trained twice for it."""
    return {arch: demo_model(arch) for arch in SUPPORTED_DEMO_ARCHS}


@pytest.fixture(scope="module")
def untrained(tmp_path_factory) -> Path:
    """The negative control: the same qwen3 build with zero training steps."""
    return build(tmp_path_factory.mktemp("demo0") / "qwen3", "qwen3", seed=0, max_steps=0)


def _heldout_ids(tokenizer, n_tokens: int = 1024) -> torch.Tensor:
    """Held-out stdlib text (never trained on), tokenized with the model's own tokenizer."""
    corpus = load_corpus()
    text = "\n".join(f.text for f in corpus.heldout)[:20000]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
    return torch.tensor(ids).view(8, -1)


def _next_token_stats(model_dir: Path) -> tuple[float, float]:
    """(held-out loss, mean argmax probability) of a saved model, measured independently of the build."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = _heldout_ids(tok)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
    loss = -logp.gather(-1, ids[:, 1:, None]).mean().item()
    return loss, logp.exp().max(-1).values.mean().item()


# --- configs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", SUPPORTED_DEMO_ARCHS)
def test_tiny_config_makes_a_small_model(arch):
    cfg = tiny_config(arch, 512, num_hidden_layers=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    assert cfg.num_hidden_layers == 2 and cfg.vocab_size == 512
    assert n_params < 10_000_000
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 512)


def test_tiny_config_moe_routes_top2_over_a_few_experts():
    cfg = tiny_config("qwen3-moe", 4096)
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.mlp_only_layers == []  # every layer is sparse


def test_unsupported_arch_names_the_supported_ones(tmp_path):
    from logdiff.errors import InputError

    with pytest.raises(InputError, match="qwen3, llama, qwen3-moe"):
        tiny_config("gpt2", 4096)
    with pytest.raises(InputError, match="supported"):
        build(tmp_path / "m", "falcon", max_steps=0)
    assert not (tmp_path / "m").exists()


# --- tokenizer -----------------------------------------------------------------------------------

def test_tokenizer_training_is_deterministic():
    texts = [f.text for f in load_corpus().train[:20]]
    a = train_tokenizer(texts, vocab_size=1024).to_str()
    b = train_tokenizer(texts, vocab_size=1024).to_str()
    other = train_tokenizer(texts[1:], vocab_size=1024).to_str()
    assert a == b
    assert a != other  # control: different text gives a different tokenizer


@pytest.mark.parametrize("arch", SUPPORTED_DEMO_ARCHS)
def test_tokenizer_round_trips_text(built, arch):
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built[arch])
    cfg = AutoConfig.from_pretrained(built[arch])
    text = "def f(x):\n    return {'ß': x ** 2}  # 日本語 ✓\t\r\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges happened: not one id per byte
    assert len(tok) == DEMO_VOCAB_SIZE == cfg.vocab_size
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id)
    assert tok.convert_ids_to_tokens([0, 1, 2, 3, 4]) == ["<|pad|>", "<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_chat_template_renders_chatml(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["qwen3"])
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "argparse"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n"
                    "<|im_start|>user\nargparse<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids["input_ids"]) if isinstance(ids, dict) else list(ids)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 2
    assert tok.decode(ids) == text
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt != text and not no_prompt.endswith("assistant\n")
    assert tok.chat_template == CHAT_TEMPLATE


# --- the built models ----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", SUPPORTED_DEMO_ARCHS)
def test_demo_model_loads_in_transformers_as_bf16(built, arch):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built[arch])
    expected = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3-moe": "Qwen3MoeForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM", "llama3": "LlamaForCausalLM",
                "mixtral": "MixtralForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                "gemma3": "Gemma3ForCausalLM", "glm4-moe": "Glm4MoeForCausalLM",
                "deepseek-v2": "DeepseekV2ForCausalLM", "deepseek-v3": "DeepseekV3ForCausalLM",
                "gpt-oss": "GptOssForCausalLM"}[arch]
    assert type(model).__name__ == expected
    assert model.dtype == torch.bfloat16
    assert model.config.tie_word_embeddings is (arch in ("gemma2", "gemma3"))  # vLLM's Gemma 2 always ties
    with safe_open(str(built[arch] / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    out = model.float()(input_ids=torch.tensor([[3, 100, 200, 4]]))
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("arch", SUPPORTED_DEMO_ARCHS)
def test_metadata_describes_the_build(built, demo_model, arch):
    meta = read_demo_metadata(built[arch])
    assert meta["arch"] == arch and meta["seed"] == 0
    assert meta["steps"] == demo_model.steps == len(meta["loss_curve"]) and meta["stopped_by"] == "max_steps"
    assert meta["tokenizer"]["training_files"] == meta["corpus"]["train_files"] == len(load_corpus().train)
    assert meta["final_loss"] < meta["loss_curve"][0]
    assert meta["heldout_after"]["loss"] < meta["heldout_before"]["loss"]


@pytest.mark.parametrize("arch", SUPPORTED_DEMO_ARCHS)
def test_training_makes_distributions_peaked(built, untrained, arch):
    trained_loss, trained_peak = _next_token_stats(built[arch])
    control_loss, control_peak = _next_token_stats(untrained)
    # control: random init is near uniform over 4096 ids (loss ~ ln 4096 = 8.3, argmax p ~ 1e-3)
    assert control_loss > 8.0 and control_peak < 0.005
    assert trained_loss < control_loss - 0.5
    assert trained_peak > 5 * control_peak


def test_build_is_deterministic_for_seed_and_steps(tmp_path):
    first = build(tmp_path / "first", "qwen3", seed=0, max_steps=STEPS)
    again = build(tmp_path / "again", "qwen3", seed=0, max_steps=STEPS)
    other_seed = build(tmp_path / "seed1", "qwen3", seed=1, max_steps=STEPS)
    same = (first / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == same
    assert (again / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
    assert (other_seed / "model.safetensors").read_bytes() != same  # control: the comparison can fail


def test_time_limited_build_is_reproduced_by_its_step_count(tmp_path):
    timed = build(tmp_path / "timed", "llama", seed=3, train_seconds=0.5)
    meta = read_demo_metadata(timed)
    assert meta["stopped_by"] == "time" and meta["steps"] >= 1
    replay = build(tmp_path / "replay", "llama", seed=3, max_steps=meta["steps"])
    assert (replay / "model.safetensors").read_bytes() == (timed / "model.safetensors").read_bytes()
    shorter = build(tmp_path / "shorter", "llama", seed=3, max_steps=meta["steps"] - 1)
    assert (shorter / "model.safetensors").read_bytes() != (timed / "model.safetensors").read_bytes()


# --- the output directory ------------------------------------------------------------------------

def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    from logdiff.errors import InputError

    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(InputError, match="not a logdiff demo model"):
        build(target, "qwen3", max_steps=0)
    assert (target / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging directory left behind


def test_rebuilds_over_a_previous_demo_model(untrained, tmp_path):
    target = tmp_path / "m"
    build(target, "llama", max_steps=0)
    build(target, "qwen3", max_steps=0)
    assert json.loads((target / METADATA_FILE).read_text())["arch"] == "qwen3"
    assert (target / "model.safetensors").read_bytes() == (untrained / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
