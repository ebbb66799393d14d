"""True on-policy training (issue 16): the training switch, the weight sync, and the GRPO example.

The example runs in CI size (two steps, the tiny demo Qwen3) on one vLLM
engine loaded for this module. Properties checked, all bitwise:

* consistent run: trainer logprobs == rollout logprobs before every update
  (ratio exactly 1.0, nothing clipped), the update changed the weights, and
  after the last sync the updated trainer and the synced vLLM agree again;
* negative control for the sync: without it, the next rollout comes from stale
  weights and differs from the updated trainer;
* stock control: stock HF vs stock vLLM differ (skipped with the reason where
  this CPU's stock kernels happen to agree, via ``stock_varies``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "grpo_on_policy.py"
CI_SIZE = ["--prompts", "2", "--group", "4", "--prompt-len", "8", "--response-len", "8", "--lr", "2e-3"]


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("grpo_on_policy", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_qwen3(**config: Any) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, **config)  # fmt: skip
    return Qwen3ForCausalLM(cfg).train()


def test_consistent_training_refuses_dropout() -> None:
    from logdiff import consistent_training
    from logdiff.errors import InputError

    model = _tiny_qwen3(attention_dropout=0.1)
    with pytest.raises(InputError, match="attention_dropout=0.1"):
        consistent_training(model)
    assert model.config._attn_implementation != "logdiff_consistent"  # nothing was installed


def test_consistent_training_handle_installs_and_undoes() -> None:
    """Installed: a train-mode step gives the no-grad inference bits. Undone: the stock forward is back."""
    import torch

    from logdiff import consistent_training, kernels

    model = _tiny_qwen3()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
    handle = consistent_training(model)
    assert handle.active and "linear" in handle.replaced
    lp = kernels.token_log_probs(model(input_ids=ids).logits[:, :-1].float(), ids[:, 1:])
    lp.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        lp_inference = kernels.token_log_probs(model(input_ids=ids).logits[:, :-1].float(), ids[:, 1:])
    assert torch.equal(lp.detach(), lp_inference)
    handle.undo()
    handle.undo()  # idempotent
    assert not handle.active
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, stock)


@pytest.fixture(scope="module")
def example_setup(qwen3: Path) -> Any:
    """The example module and its parsed CI-size args, with an engine pool for this module (released after)."""
    from logdiff.sources.pool import engine_pool

    example = _example()
    args = example.parse_args([str(qwen3), "--steps", "2", *CI_SIZE])
    with engine_pool():
        yield example, args


@pytest.fixture
def example_engine(example_setup: Any) -> Any:
    """(example, args, engine): the pooled vLLM engine, loaded again if a test in between evicted it."""
    example, args = example_setup
    return example, args, example.open_engine(args)


@pytest.mark.vllm
def test_grpo_example_is_on_policy(example_engine: Any, tmp_path: Path, stock_varies: Any) -> None:
    example, args, engine = example_engine
    out = tmp_path / "steps.json"
    assert example.main([args.model, "--steps", "2", *CI_SIZE, "--json", str(out)], engine=engine) == 0
    result = json.loads(out.read_text())
    consistent, stock = result["runs"]["consistent"], result["runs"]["stock"]
    assert len(consistent["steps"]) == len(stock["steps"]) == 2
    for s in consistent["steps"]:
        assert s["max_abs_diff"] == 0.0
        assert s["ratio_min"] == s["ratio_max"] == 1.0
        assert s["mismatch_clip_fraction"] == 0.0 and s["mismatch_fraction"] == 0.0
        assert s["params_changed"] > 0 and s["wall_s"] > 0
    assert consistent["after_last_sync_max_abs_diff"] == 0.0
    for s in stock["steps"]:
        assert set(s) >= {"max_abs_diff", "ratio_min", "ratio_max", "mismatch_clip_fraction", "wall_s"}
    stock_varies(
        all(s["max_abs_diff"] == 0.0 for s in stock["steps"]),
        "stock HF and stock vLLM gave bitwise-equal logprobs on every step",
    )
    assert any(s["ratio_min"] != 1.0 or s["ratio_max"] != 1.0 for s in stock["steps"])


@pytest.mark.vllm
def test_without_the_sync_the_rollout_is_stale(example_engine: Any) -> None:
    """Negative control: skip the sync and the next rollout differs from the updated trainer."""
    example, _, engine = example_engine
    args = example.parse_args([str(example_engine[1].model), "--steps", "1", "--no-sync", *CI_SIZE])
    run = example.run_one("consistent", engine, Path(args.model), args)
    assert run["steps"][0]["max_abs_diff"] == 0.0  # before the update: the engine held the same weights
    assert run["steps"][0]["params_changed"] > 0
    assert run["after_last_sync_max_abs_diff"] > 0.0


@pytest.mark.vllm
def test_sync_refuses_inside_consistent_mode(example_engine: Any) -> None:
    """A reload inside consistent_vllm would replace its patched GEMMs, and its exit would restore stale ones."""
    from transformers import AutoModelForCausalLM

    from logdiff import sync_vllm_weights
    from logdiff.sources.vllm.consistent import consistent_vllm

    example, args, engine = example_engine
    policy = AutoModelForCausalLM.from_pretrained(args.model)
    with consistent_vllm(engine.llm), pytest.raises(RuntimeError, match="leave consistent_vllm"):
        sync_vllm_weights(engine.llm, policy)


def _hf_step_engine(model: Path, grad: bool) -> Any:
    from logdiff.sources.base import EngineSpec
    from logdiff.sources.hf import HFForward

    return HFForward(EngineSpec(str(model), "bfloat16", options=(("grad", True),) if grad else ()))


def test_grad_option_runs_a_training_step_with_the_inference_bits(qwen3: Path) -> None:
    """``--set train.grad=true``: train mode, autograd and a backward; under consistent mode the same bits."""
    from types import SimpleNamespace

    import numpy as np

    seqs = [SimpleNamespace(prompt_ids=[5, 9, 33, 7], response_ids=[12, 40, 41]),
            SimpleNamespace(prompt_ids=[8, 2], response_ids=[99, 3, 17, 4, 60])]  # fmt: skip
    step, plain = _hf_step_engine(qwen3, True), _hf_step_engine(qwen3, False)
    seen: list[bool] = []
    step.model.lm_head.register_full_backward_hook(lambda m, gi, go: seen.append(m.training))
    with step.consistent(), plain.consistent():
        got, want = step.score(seqs)[0], plain.score(seqs)[0]
    assert seen == [True]  # one backward per batch, in train mode
    assert not step.model.training and all(p.grad is None for p in step.model.parameters())
    assert step.effective_options()["grad"] is True and plain.effective_options()["grad"] is False
    for a, b in zip(got.logprobs, want.logprobs):
        assert np.array_equal(a, b)


def test_grad_option_refuses_dropout(tmp_path: Path) -> None:
    from logdiff.errors import InputError

    model = _tiny_qwen3(attention_dropout=0.1)
    model.save_pretrained(tmp_path)
    engine = _hf_step_engine(tmp_path, True)
    seq = type("S", (), {"prompt_ids": [1, 2], "response_ids": [3, 4]})()
    with pytest.raises(InputError, match="dropout"):
        engine.score([seq])


@pytest.mark.vllm
def test_scan_with_grad_verifies_the_training_step(qwen3: Path, stock_varies: Any) -> None:
    """A consistent scan whose training path runs a real step (train mode, backward) equals vLLM bitwise."""
    import logdiff

    small = {"num_sequences": 2, "prompt_len": 8, "response_len": 8, "depth": "logprobs", "train_set": {"grad": True}}
    consistent = logdiff.scan(qwen3, infer=["vllm"], consistent=True, **small)
    assert consistent["verdict"] == "consistent" and consistent["logprobs"]["abs_diff_max"] == 0.0
    train_path = next(p for p in consistent["paths"] if p["role"] == "train")
    assert train_path["settings"]["grad"] is True
    stock = logdiff.scan(qwen3, infer=["vllm"], **small)
    stock_varies(stock["logprobs"]["abs_diff_max"] == 0.0, "stock HF (train mode) and stock vLLM agreed bitwise")
    assert stock["verdict"] != "consistent"


@pytest.mark.parametrize("item,fragment", [
    ("train.grad=1", "train.grad=1: must be true or false"),
    ("infer.grad=true", "grad is an option of hf, not used by hf-decode"),
])  # fmt: skip
def test_bad_grad_option_exit_2_before_loading(tmp_path: Path, item: str, fragment: str) -> None:
    from tests.test_bad_inputs import FAST, error, invoke

    code, out = invoke("scan", tmp_path / "not-loaded", "--infer", "hf-decode", *FAST, "--set", item)
    assert code == 2 and fragment in error(out), out
