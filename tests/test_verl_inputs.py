"""logdiff inside verl 0.9 (logdiff/integrations/verl.py), on verl 0.9.1's own input layouts.

verl cannot be imported here (it needs CUDA, Ray, tensordict), so its old-log-prob path is rebuilt below from
its source, step for step, on the demo Qwen3 (bf16): the rollout batch as the trainer holds it (prompts left
padded, responses right padded, ``position_ids = clip(cumsum(mask) - 1, 0)``: verl/utils/model.py:240), turned
into the engine's no-padding layout by ``left_right_2_no_padding`` (verl/workers/utils/padding.py:23: jagged
``input_ids``/``position_ids`` from ``unpad_input``'s ``cu_seqlens``), cut into micro-batches, and each run
through ``FSDPEngineWithLMHead.forward_step`` (verl/workers/engine/fsdp/transformer_impl.py:1549):
``prepare_model_inputs`` (:1145; with ``use_remove_padding`` one packed row, ``position_ids`` restarting per
sequence, ``attention_mask=None``; without it right padded rows and their mask), the model with
``use_cache=False``, ``prepare_model_outputs`` (:1332: logits divided by the temperature, then
``logprobs_from_logits`` with ``torch.roll(input_ids, -1)`` as labels; on a machine without flash-attn that is
``logprobs_from_logits_v2``, verl/utils/torch_functional.py:173). No FSDP, no Ulysses, no autocast, no fused
kernels: the layouts and the arithmetic are verl's, the wrapping is logdiff's.

Checked: ``instrument_engine`` captures each sequence as itself in both layouts (the bundle's sequences are the
unpadded ``prompt + response`` ids), leaves verl's logprobs bit for bit as they were, records them as the
bundle's ``token_logprobs``; ``logdiff compare`` of the packed capture against the right-padded one pairs every
sequence and measures the gap the two layouts' own logprobs show. Negative control: a mis-packed row (positions
that do not restart, no ``cu_seqlens``) merges each micro-batch into one sequence, which the bundle and the
pairing count show.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# (prompt, response) token ids; prompts left padded to 6, responses right padded to 5, as verl's rollout batch
ROLLOUTS = [([11, 12, 13, 14], [21, 22, 23, 24, 25]), ([31, 32, 33, 34, 35, 36], [41, 42]),
            ([51, 52], [61, 62, 63]), ([71, 72, 73], [81, 82, 83, 84]), ([91, 92, 93, 94, 95], [5])]
MICRO = 3  # micro_batch_size_per_gpu: micro-batches of 3 and 2 sequences
TEMPERATURE = 0.7  # rollout.temperature, which verl's meta_info carries to the log-prob pass
PAD = 0


# ---- verl 0.9.1's data, rebuilt ------------------------------------------------------------------------------


def _rollout_batch(rollouts: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    """The padded batch ``_compute_old_log_prob`` starts from (verl/trainer/ppo/ray_trainer.py:1290)."""
    import torch

    p_len, r_len = max(len(p) for p, _ in rollouts), max(len(r) for _, r in rollouts)
    prompts = torch.tensor([[PAD] * (p_len - len(p)) + p for p, _ in rollouts])
    responses = torch.tensor([r + [PAD] * (r_len - len(r)) for _, r in rollouts])
    mask = torch.tensor([[0] * (p_len - len(p)) + [1] * len(p) + [1] * len(r) + [0] * (r_len - len(r))
                         for p, r in rollouts])
    return {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": mask, "response_mask": mask[:, p_len:],
            "position_ids": torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0)}


def _left_right_2_no_padding(batch: dict[str, Any]) -> dict[str, Any]:
    """verl/workers/utils/padding.py:23, with ``unpad_input``'s pure-torch fallback
    (verl/utils/attention_utils.py:37: ``cu_seqlens`` int32, indices of the mask's ones)."""
    import torch
    import torch.nn.functional as F

    data = dict(batch)
    input_ids, mask, position_ids = data.pop("input_ids"), data["attention_mask"], data["position_ids"]
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    data["input_ids"] = torch.nested.nested_tensor_from_jagged(input_ids.flatten()[indices], offsets=cu_seqlens)
    data["position_ids"] = torch.nested.as_nested_tensor(
        [position_ids[i][mask[i].bool()] for i in range(mask.shape[0])], layout=torch.jagged)
    data["loss_mask"] = data["response_mask"]
    return data


def _data(rollouts: list[tuple[list[int], list[int]]], use_remove_padding: bool, fused: bool = False) -> dict[str, Any]:
    """``infer_batch``'s data: the micro-batches ``prepare_micro_batches`` cuts (contiguous, of ``MICRO``), each
    with the non-tensor keys ``TrainingWorker.infer_batch`` (engine_workers.py:398) and the trainer assign."""
    micro = []
    for lo in range(0, len(rollouts), MICRO):
        mb = _left_right_2_no_padding(_rollout_batch(rollouts[lo: lo + MICRO]))
        mb.update(temperature=TEMPERATURE, use_remove_padding=use_remove_padding, use_fused_kernels=fused,
                  pad_token_id=PAD, calculate_entropy=True, compute_loss=False)
        micro.append(mb)
    return {"micro_batches": micro, "temperature": TEMPERATURE, "use_remove_padding": use_remove_padding,
            "use_fused_kernels": fused}


class VerlEngine:
    """``FSDPEngineWithLMHead``'s log-prob path (verl 0.9.1, transformer_impl.py:724-779 and 1145-1593) for
    ``pad_mode=NO_PADDING``, ``sp_size=1``, no static pad, no fused kernels, no distillation, on CPU.

    ``packing="none"``: a mis-specified packing (the negative control): the packed row's positions run on across
    sequences (``arange(total)``), as if ``position_ids`` were not restarted, and no ``cu_seqlens``."""

    use_ulysses_sp = False

    def __init__(self, module: Any, packing: str = "verl"):
        self.module, self.packing = module, packing
        self.fused = getattr(module, "_verl_fused", False)

    # BaseEngine.infer_batch (workers/engine/base.py:134) and forward_backward_batch (:724) -------------------
    def infer_batch(self, data: Any, loss_function: Any = None) -> Any:
        import torch

        with torch.no_grad():
            return self.forward_backward_batch(data, loss_function, forward_only=True)

    def forward_backward_batch(self, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        outputs = [self.forward_step(mb, loss_function=loss_function, forward_only=forward_only)[1]
                   for mb in data["micro_batches"]]
        # postprocess_batch_func (workers/engine/utils.py:158): the micro-batches' jagged outputs, concatenated
        return {"log_probs": [t for o in outputs for t in o["model_output"]["log_probs"].unbind()]}

    # FSDPEngineWithLMHead ------------------------------------------------------------------------------------
    def prepare_model_inputs(self, micro_batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        import torch

        temperature = micro_batch["temperature"]
        temperature_is_one = not isinstance(temperature, torch.Tensor) and float(temperature) == 1.0
        input_ids, position_ids = micro_batch["input_ids"], micro_batch["position_ids"]
        temperature = torch.tensor([temperature] * input_ids.shape[0]).to(torch.float32)
        output_args: dict[str, Any] = {"temperature_is_one": temperature_is_one}
        if micro_batch["use_remove_padding"]:
            seqlens = input_ids.offsets().diff()
            temperature_rmpad = torch.repeat_interleave(temperature, seqlens, dim=0).unsqueeze(0)  # expand_as_nested
            input_ids_rmpad = input_ids.values().unsqueeze(0)  # (1, total_nnz)
            position_ids_rmpad = position_ids.values().unsqueeze(0)
            if self.packing == "none":
                position_ids_rmpad = torch.arange(input_ids_rmpad.shape[1])[None]
            input_ids_rmpad_rolled = torch.roll(input_ids_rmpad, shifts=-1, dims=1)
            output_args.update(pad_size=0, input_ids_rmpad_rolled=input_ids_rmpad_rolled.squeeze(0),
                               temperature_rmpad=temperature_rmpad.squeeze(0))
            model_inputs = {"input_ids": input_ids_rmpad, "attention_mask": None, "position_ids": position_ids_rmpad}
            if micro_batch["use_fused_kernels"]:  # extra_args (:1314-1328)
                model_inputs.update(temperature=micro_batch["temperature"], return_dict=True,
                                    shift_labels=output_args["input_ids_rmpad_rolled"].unsqueeze(0))
            return model_inputs, output_args
        batch_size = input_ids.shape[0]
        max_seq_len = int(input_ids.offsets().diff().max().item())
        output_args["input_ids_rmpad_rolled"] = torch.roll(input_ids.values(), shifts=-1, dims=0)
        output_args["temperature"] = temperature
        padded = torch.nested.to_padded_tensor(input_ids, padding=micro_batch["pad_token_id"],
                                               output_size=(batch_size, max_seq_len))
        positions = torch.nested.to_padded_tensor(position_ids, padding=0, output_size=(batch_size, max_seq_len))
        lengths = input_ids.offsets().diff()  # build_attention_mask_from_nested (padding.py)
        mask = (torch.arange(max_seq_len)[None] < lengths[:, None]).to(torch.int32)
        return {"input_ids": padded, "attention_mask": mask, "position_ids": positions}, output_args

    def prepare_model_outputs(self, output: Any, output_args: dict[str, Any], micro_batch: dict[str, Any]) -> Any:
        import torch

        input_ids = micro_batch["input_ids"]
        cu_seqlens = input_ids.offsets()
        if micro_batch["use_remove_padding"] and micro_batch["use_fused_kernels"]:
            log_probs = output.log_probs.squeeze(0)  # (:1366)
        elif micro_batch["use_remove_padding"]:
            logits_rmpad = output.logits.squeeze(0)
            if not output_args["temperature_is_one"]:  # _scale_logits_by_temperature (:98)
                logits_rmpad = logits_rmpad / output_args["temperature_rmpad"].unsqueeze(-1).clamp(min=1e-8).to(
                    logits_rmpad.dtype)
            log_probs = _logprobs_from_logits_v2(logits_rmpad, output_args["input_ids_rmpad_rolled"])
        else:
            logits = output.logits
            if not output_args["temperature_is_one"]:
                logits = logits / output_args["temperature"][:, None, None].clamp(min=1e-8).to(logits.dtype)
            lengths = cu_seqlens.diff()
            logits_rmpad = torch.cat([logits[b, : int(n)] for b, n in enumerate(lengths)])  # torch.nested.narrow
            log_probs = _logprobs_from_logits_v2(logits_rmpad, output_args["input_ids_rmpad_rolled"])
        return {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs, cu_seqlens)}

    def forward_step(self, micro_batch: dict[str, Any], loss_function: Any, forward_only: bool) -> Any:
        import torch

        model_inputs, output_args = self.prepare_model_inputs(micro_batch)
        raw_output = self.module(**model_inputs, use_cache=False)
        model_output = self.prepare_model_outputs(raw_output, output_args, micro_batch)
        return torch.tensor(1.0), {"model_output": model_output, "loss": 1.0, "metrics": {}}


def _forward_with_torch_backend(self: Any, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None,
                                use_cache: Any = None, return_dict: Any = None, temperature: float = 1.0,
                                shift_labels: Any = None, **kwargs: Any) -> Any:
    """verl's fused-kernel forward (verl/models/transformers/dense_common.py:71, its torch backend without flash-attn:
    utils/experimental/torch_functional.py:36): the decoder, then the logprobs from ``lm_head.weight``; ``lm_head``
    itself is never called. (One chunk: these batches are shorter than its 512-token chunks.)"""
    import types

    import torch

    hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=use_cache)[0]
    labels = shift_labels if shift_labels is not None else torch.roll(input_ids, shifts=-1, dims=-1)
    logits = ((hidden @ self.lm_head.weight.t()) / temperature).to(torch.float32)
    log_probs = logits.log_softmax(dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return types.SimpleNamespace(log_probs=log_probs, entropy=None)


def _logprobs_from_logits_v2(logits: Any, labels: Any) -> Any:
    """verl/utils/torch_functional.py:173: logsumexp for float32/64, a per-row log_softmax + gather for bf16."""
    import torch
    import torch.nn.functional as F

    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    return torch.stack([F.log_softmax(row, dim=-1).gather(-1, label.unsqueeze(-1)).squeeze(-1)
                        for row, label in zip(logits, labels, strict=True)])


# ---- captured --------------------------------------------------------------------------------------------------


def _sequences() -> list[list[int]]:
    return [p + r for p, r in ROLLOUTS]


@pytest.fixture(scope="module")
def model(qwen3: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(qwen3), dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def fused_model(qwen3: Path) -> Any:
    """The demo Qwen3 with verl's fused-kernel forward (``apply_monkey_patch`` with ``use_fused_kernels``)."""
    import types

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(qwen3), dtype=torch.bfloat16).eval()
    model.forward = types.MethodType(_forward_with_torch_backend, model)
    model._verl_fused = True
    return model


@pytest.fixture(scope="module")
def runs(model: Any, fused_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each layout run plain and instrumented: its bundle, verl's logprobs both times, the ``EngineCapture``."""
    from logdiff.integrations import verl as logdiff_verl

    root = tmp_path_factory.mktemp("verl")
    out: dict[str, Any] = {}
    for name, rmpad, packing in (("packed", True, "verl"), ("padded", False, "verl"), ("mispacked", True, "none"),
                                 ("fused", True, "verl")):
        module = fused_model if name == "fused" else model
        fused = name == "fused"
        plain = VerlEngine(module, packing).infer_batch(_data(ROLLOUTS, rmpad, fused))["log_probs"]
        engine = VerlEngine(module, packing)
        state = logdiff_verl.instrument_engine(engine, root / name, every=2, strict=True)
        passes = [engine.infer_batch(_data(ROLLOUTS, rmpad, fused))["log_probs"] for _ in range(3)]  # 1, 3 captured
        out[name] = {"bundle": root / name / "step-000001" / "train", "plain": plain, "passes": passes,
                     "state": state, "root": root / name}
    return out


def _compare(train: Path, infer: Path) -> dict[str, Any]:
    from logdiff.reports.schema import validate_result

    from logdiff.commands.compare import compare_bundles

    result = compare_bundles(train, infer).to_dict()
    validate_result(result)
    return result


@pytest.mark.parametrize("name", ["packed", "padded", "fused"])
def test_every_sequence_is_captured_as_itself(runs, name: str) -> None:
    from logdiff.records.bundle import Bundle

    run = runs[name]
    bundle = Bundle(run["bundle"])
    assert bundle.sequences() == _sequences()
    assert bundle.num_steps == 2  # one step per micro-batch forward
    meta = bundle.meta["verl"]
    assert meta["use_remove_padding"] is (name != "padded") and meta["temperature"] == TEMPERATURE
    assert meta["use_fused_kernels"] is (name == "fused")
    assert meta["pass"] == 1
    # every=2: passes 1 and 3 captured, pass 2 not
    assert run["state"].calls == 3 and not run["state"].errors
    assert [p.parent.name for p in run["state"].captured] == ["step-000001", "step-000003"]
    assert not (run["root"] / "step-000002").exists()
    assert Bundle(run["root"] / "step-000003" / "train").sequences() == _sequences()


@pytest.mark.parametrize("name", ["packed", "padded", "mispacked", "fused"])
def test_verl_numbers_are_unchanged(runs, name: str) -> None:
    import torch

    run = runs[name]
    for passed in run["passes"]:
        assert len(passed) == len(run["plain"])
        assert all(torch.equal(a, b) for a, b in zip(passed, run["plain"]))


@pytest.mark.parametrize("name", ["packed", "padded", "fused"])
def test_the_bundle_holds_verls_own_logprobs(runs, name: str) -> None:
    """The ``token_logprobs`` ``compare`` reads are verl's ``log_probs`` (entry t of a sequence scores token t+1;
    each sequence's last entry, which scores the next sequence's first token, is left out)."""
    from logdiff.comparison import bundle_feed
    from logdiff.comparison.pairing import match_sequences
    from logdiff.records.bundle import Bundle

    bundle = Bundle(runs[name]["bundle"])
    names = {n for step in range(bundle.num_steps) for n in bundle.names(step)}
    assert "token_logprobs" in names
    matching = match_sequences(bundle.sequence_table(), bundle.sequence_table())
    scores, _ = bundle_feed.feed_side(bundle, matching.train, matching.ids, None, "train", "hf")
    got = [[float(v) for v, h in zip(lp, has) if h] for lp, has in zip(scores.logprobs, scores.has)]
    want = [t.float()[:-1].tolist() for t in runs[name]["plain"]]
    assert sorted(map(tuple, got)) == sorted(map(tuple, want))


def test_packed_against_padded_pairs_every_sequence(runs) -> None:
    result = _compare(runs["packed"]["bundle"], runs["padded"]["bundle"])
    n = len(ROLLOUTS)
    assert result["sequences"]["count"] == n
    assert result["logprobs"]["num_tokens"] == sum(len(s) - 1 for s in _sequences())
    assert not any("no partner" in w for w in result["warnings"])
    gap = max(float((a.double()[:-1] - b.double()[:-1]).abs().max())
              for a, b in zip(runs["packed"]["plain"], runs["padded"]["plain"]))
    assert result["logprobs"]["abs_diff_max"] == pytest.approx(gap, rel=1e-6, abs=1e-12)
    assert not any(w.startswith("position_ids") for w in result["warnings"])


def test_fused_kernels_record_no_logits_and_pair_with_the_logits_path(runs) -> None:
    """verl's fused kernels never call ``lm_head``: the bundle has every decoder boundary and no logits, its
    ``token_logprobs`` are the kernel's; against the packed logits-path capture every sequence pairs, and the
    gap is the two heads' own difference (a bf16 log-softmax of tempered bf16 logits against float32)."""
    from logdiff.records.bundle import Bundle

    fused, normal = Bundle(runs["fused"]["bundle"]), Bundle(runs["packed"]["bundle"])
    names = {n for step in range(fused.num_steps) for n in fused.names(step)}
    assert "token_logprobs" in names and not names & {"logits", "log_softmax"}
    assert {n for n in normal.names(0) if n.startswith("model.")} <= names
    result = _compare(runs["fused"]["bundle"], runs["packed"]["bundle"])
    assert result["sequences"]["count"] == len(ROLLOUTS)
    assert result["first_divergence"] is None  # the same decoder, the same packed row: every boundary equal
    assert not any("no partner" in w for w in result["warnings"])
    gap = max(float((a.double()[:-1] - b.double()[:-1]).abs().max())
              for a, b in zip(runs["fused"]["plain"], runs["packed"]["plain"]))
    assert result["logprobs"]["abs_diff_max"] == pytest.approx(gap, rel=1e-6, abs=1e-12)


def test_mispacked_rows_merge_sequences_and_the_pairing_says_so(runs) -> None:
    """Negative control: positions running on across the packed row and no ``cu_seqlens``: each micro-batch is one
    sequence in the bundle (2, not 5), and against the right-padded capture only the first sequence of each
    micro-batch (a prefix of the merged one) finds a partner."""
    from logdiff.records.bundle import Bundle

    seqs = _sequences()
    merged = Bundle(runs["mispacked"]["bundle"]).sequences()
    assert merged == [[t for s in seqs[:MICRO] for t in s], [t for s in seqs[MICRO:] for t in s]]
    result = _compare(runs["mispacked"]["bundle"], runs["padded"]["bundle"])
    assert result["sequences"]["count"] == 2
    (line,) = [w for w in result["warnings"] if "no partner" in w]
    assert line.startswith("3 of 7 sequences found no partner")
    assert "0 of the training bundle's 2, 3 of the inference bundle's 5" in line


# ---- the pieces on their own -----------------------------------------------------------------------------------


def test_micro_batch_logprobs_layouts() -> None:
    import torch

    from logdiff.integrations.verl import micro_batch_logprobs

    mb = _left_right_2_no_padding(_rollout_batch(ROLLOUTS[:2]))
    values = torch.arange(mb["input_ids"].values().shape[0], dtype=torch.float32)
    lp = torch.nested.nested_tensor_from_jagged(values, mb["input_ids"].offsets())
    rows, start, ids = micro_batch_logprobs({**mb, "use_remove_padding": True}, lp)
    assert start == 1 and rows.shape == (1, 16) and ids[0].tolist() == [t for s in _sequences()[:2] for t in s][1:]
    rows, start, ids = micro_batch_logprobs({**mb, "use_remove_padding": False, "pad_token_id": PAD}, lp)
    assert start == 1 and rows.shape == (2, 8)
    assert rows[0].tolist() == list(range(8)) and rows[1].tolist() == [9.0, 10, 11, 12, 13, 14, 15, 0]
    assert ids[1].tolist() == _sequences()[1][1:] + [PAD]
    with pytest.raises(ValueError, match="nested"):
        micro_batch_logprobs({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, lp)
    with pytest.raises(ValueError, match="log_probs for"):
        micro_batch_logprobs(mb, torch.zeros(3))


def test_refused_engines_and_idempotence(tmp_path: Path) -> None:
    from logdiff.integrations import verl as logdiff_verl

    class FullyShardedDataParallel:  # verl's FSDP1 wrapper, by name
        pass

    with pytest.raises(ValueError, match="strategy=fsdp2"):
        logdiff_verl.instrument_engine(VerlEngine(FullyShardedDataParallel()), tmp_path)
    sp = VerlEngine(object())
    sp.use_ulysses_sp = True
    with pytest.raises(ValueError, match="Ulysses"):
        logdiff_verl.instrument_engine(sp, tmp_path)
    with pytest.raises(ValueError, match="verl engine"):
        logdiff_verl.instrument_engine(object(), tmp_path)
    engine = VerlEngine(object())
    first = logdiff_verl.instrument_engine(engine, tmp_path)
    assert logdiff_verl.instrument_engine(engine, tmp_path) is first
    first.remove()
    assert "infer_batch" not in vars(engine) and "forward_step" not in vars(engine)


def test_a_failed_capture_does_not_stop_verl(model: Any, tmp_path: Path) -> None:
    """Not strict (the default): a capture that cannot start is logged and verl runs on, its numbers as they were."""
    import torch

    from logdiff.integrations import verl as logdiff_verl

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no room")

    engine = VerlEngine(model)
    state = logdiff_verl.instrument_engine(engine, tmp_path, capture=broken)
    got = engine.infer_batch(_data(ROLLOUTS[:2], True))["log_probs"]
    want = VerlEngine(model).infer_batch(_data(ROLLOUTS[:2], True))["log_probs"]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(state.errors) == 1 and "no room" in state.errors[0] and not state.captured


def test_rollout_env_and_overrides(tmp_path: Path) -> None:
    from logdiff.integrations import verl as logdiff_verl

    assert logdiff_verl.rollout_env(tmp_path) == {"LOGDIFF_CAPTURE": str(tmp_path / "rollout")}
    assert logdiff_verl.rollout_env(tmp_path, window="all")["LOGDIFF_CAPTURE_WINDOW"] == "all"
    over = logdiff_verl.hydra_overrides(tmp_path, every=5)
    assert f"+ray_kwargs.ray_init.runtime_env.env_vars.LOGDIFF_CAPTURE={tmp_path / 'rollout'}" in over
    assert f"+ray_kwargs.ray_init.runtime_env.env_vars.LOGDIFF_VERL_CAPTURE={tmp_path}" in over
    assert "+ray_kwargs.ray_init.runtime_env.env_vars.LOGDIFF_VERL_EVERY=5" in over
    assert "actor_rollout_ref.rollout.enforce_eager=True" in over
    assert "actor_rollout_ref.actor.strategy=fsdp2" in over
    assert ("+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook="
            "logdiff.integrations.verl.ray_setup_hook") in over
    assert logdiff_verl.hydra_overrides(tmp_path, train=False) == [
        f"+ray_kwargs.ray_init.runtime_env.env_vars.LOGDIFF_CAPTURE={tmp_path / 'rollout'}",
        "actor_rollout_ref.rollout.enforce_eager=True", "actor_rollout_ref.rollout.calculate_log_probs=True"]


def test_ray_setup_hook_instruments_the_actor_worker_when_verl_is_imported(tmp_path: Path) -> None:
    """In a fresh process (as a Ray worker): the hook patches ``ActorRolloutRefWorker.init_model`` once the process
    imports ``verl.workers.engine_workers`` (a stand-in package here), keeping the method's attributes (verl's
    ``@register`` dispatch marks), and instruments the actor's engine only."""
    pkg = tmp_path / "site" / "verl" / "workers"
    pkg.mkdir(parents=True)
    (tmp_path / "site" / "verl" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine_workers.py").write_text(textwrap.dedent("""
        class Engine:
            use_ulysses_sp = False
            def __init__(self):
                self.module = object()
            def infer_batch(self, data, loss_function=None):
                return data
            def forward_step(self, micro_batch, loss_function, forward_only):
                return 1.0, {}

        class TrainingWorker:
            def __init__(self):
                self.engine = Engine()

        def register(fn):
            fn.dispatch_mark = "ONE_TO_ALL"
            return fn

        class ActorRolloutRefWorker:
            def __init__(self, role):
                self.role, self.actor = role, None
            @register
            def init_model(self):
                if "actor" in self.role:
                    self.actor = TrainingWorker()
                return "built"
    """))
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path / 'site')!r})
        from logdiff.integrations.verl import ray_setup_hook
        ray_setup_hook()
        assert "verl.workers.engine_workers" not in sys.modules
        from verl.workers.engine_workers import ActorRolloutRefWorker
        assert ActorRolloutRefWorker.init_model.dispatch_mark == "ONE_TO_ALL"
        w = ActorRolloutRefWorker("actor_rollout")
        assert w.init_model() == "built"
        state = vars(w.actor.engine)["_logdiff_verl"]
        assert state.every == 3 and str(state.out_dir) == {str(tmp_path / 'runs')!r}
        assert "infer_batch" in vars(w.actor.engine)
        r = ActorRolloutRefWorker("rollout")
        assert r.init_model() == "built" and r.actor is None
        print("ok")
    """)
    env = {**os.environ, "LOGDIFF_VERL_CAPTURE": str(tmp_path / "runs"), "LOGDIFF_VERL_EVERY": "3"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    # without the variable the hook does nothing
    env.pop("LOGDIFF_VERL_CAPTURE")
    quiet = script.replace("ray_setup_hook()", "ray_setup_hook(); import sys as s; "
                           "assert not any(type(f).__name__ == '_AfterImport' for f in s.meta_path); raise SystemExit")
    done = subprocess.run([sys.executable, "-c", quiet], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


def test_logdiff_does_not_import_verl() -> None:
    import importlib

    importlib.import_module("logdiff.integrations.verl")
    assert "verl" not in sys.modules
    assert np.isfinite(1.0)
