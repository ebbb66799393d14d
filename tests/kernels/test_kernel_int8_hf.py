"""The trainer's side of consistent mode against an INT8 rollout, without vLLM: ``--set
train.consistent_quantization=int8-w8a8`` makes the HF training path's linears (all but ``lm_head``) run
``fake_quant_linear`` under ``--consistent`` (and only there), batch-invariantly, with a straight-through
backward under ``grad``; a bad value is refused before anything loads."""

from __future__ import annotations

import pytest
import torch

from logdiff.errors import InputError
from logdiff.sources.base import EngineSpec


def _engine(model, **options):
    from logdiff.sources.hf import HFForward

    return HFForward(EngineSpec(model_dir="unused", options=tuple(options.items())), model=model)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_the_option_quantizes_the_trainers_linears_in_consistent_mode_only(tiny_model):
    from logdiff.kernels.int8 import fake_quant_linear
    from logdiff.sources.hf.consistent import consistent_hf

    model = tiny_model("qwen3", torch.bfloat16)
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    engine = _engine(model, consistent_quantization="int8-w8a8")
    stock = _logits(model, ids)
    with engine.consistent():
        quantized = _logits(model, ids)
        x = torch.randn(5, 64).bfloat16()
        q_proj = model.model.layers[0].self_attn.q_proj
        assert torch.equal(q_proj(x), fake_quant_linear(x, q_proj.weight))  # a targeted linear
        rows_alone = torch.cat([_logits(model, ids[i : i + 1]) for i in range(3)])
    assert torch.equal(quantized, rows_alone)  # batch-invariant
    with consistent_hf(model):
        plain = _logits(model, ids)
    assert not torch.equal(quantized, plain)  # the quantization acts
    assert torch.equal(_logits(model, ids), stock)  # and is undone: the option does nothing outside
    with _engine(model).consistent():
        assert torch.equal(_logits(model, ids), plain)  # without the option: consistent mode as before


def test_lm_head_stays_unquantized(tiny_model):
    from logdiff.sources.hf.consistent_quant import targeted_linears

    model = tiny_model("qwen3", torch.bfloat16)
    names = [n for n, _ in targeted_linears(model, "int8-w8a8")]
    assert "lm_head" not in names and len(names) == 7 * model.config.num_hidden_layers


def test_a_training_step_through_the_quantized_forward_has_gradients(tiny_model):
    from logdiff.sources.hf.consistent import consistent_hf
    from logdiff.sources.hf.consistent_quant import consistent_quantized

    model = tiny_model("qwen3", torch.float32)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with consistent_hf(model), consistent_quantized(model, "int8-w8a8"):
        loss = model(ids).logits.float().logsumexp(-1).mean()
        loss.backward()
    grads = [p.grad for p in model.parameters()]
    try:
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert float(model.model.layers[0].mlp.down_proj.weight.grad.abs().sum()) > 0  # straight through
    finally:
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("value", ["fp8-block", 8, True])
def test_a_bad_value_is_refused_before_loading(value):
    from logdiff.commands.options import validate_side

    with pytest.raises(InputError, match="consistent_quantization"):
        validate_side("train", ["hf"], {"consistent_quantization": value})
    validate_side("train", ["hf"], {"consistent_quantization": "int8-w8a8"})
    with pytest.raises(InputError, match="not used by"):
        validate_side("infer", ["vllm"], {"consistent_quantization": "int8-w8a8"})
