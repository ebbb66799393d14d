"""Weight versions in captures, and fingerprints at the narrower dtype (issue 32, items 4 and 5).

One in-process vLLM (the bf16 demo Qwen3, ``enforce_eager``) with the plugin's capture installed on its
worker generates three times: with the weights as loaded (version 0), after ``logdiff.sync_vllm_weights``
of a trainer whose two weights changed (version 1), and after a TRL-style sync of the original weights,
one ``load_weights`` call per tensor (version 2: one re-fingerprint, whatever the number of calls). HF
captures of the changed trainer (bf16, and fp32 as TRL trains) on chosen sequences are then compared with
that bundle:

* the trainer against the sequences generated after the sync: no weight cause; against those before it
  (the negative control): the changed weights named stale; against both: one warning line, the changed
  weights treated as differing;
* an fp32 trainer against the bf16 engine: the ``dtype`` cause, no stale weight; the changed weight still
  named stale against the sequences before the sync;
* ``--model`` holding other weights than the training bundle's: one warning line, no replay or
  conformance from it; with the trainer's own weights: used.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHANGED = ("model.layers.0.post_attention_layernorm.weight", "model.layers.1.mlp.down_proj.weight")
BEFORE = [[5, 17, 3, 9, 42, 7], [8, 1, 30, 4, 6]]
AFTER = [[11, 2, 8, 1, 30, 4], [9, 9, 3, 17, 5]]
RESTORED = [[40, 41, 42, 3, 3]]
MAX_TOKENS = 4


def _changed_model(model_dir: Path, dtype: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name in CHANGED:
            model.get_parameter(name).mul_(1.25)
    return model.to(dtype)  # fp32: the bf16 values upcast exactly, as an fp32 trainer holds a bf16 checkpoint


def _generate(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=MAX_TOKENS,
                        ignore_eos=True), use_tqdm=False)  # fmt: skip
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def run(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The engine's bundle over three weight versions, and the sequences generated with each."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    import logdiff
    from logdiff.sources.vllm.capture import install
    from logdiff.sources.vllm.training import checkpoint_tensors

    root = tmp_path_factory.mktemp("weight-versions")
    llm = LLM(model=str(qwen3), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", seed=0,
              max_model_len=48, max_num_seqs=2)
    capture = install(llm.llm_engine.model_executor.driver_worker.worker, root / "infer")
    seqs = {"before": _generate(llm, BEFORE)}
    logdiff.sync_vllm_weights(llm, _changed_model(qwen3, torch.bfloat16))
    seqs["after"] = _generate(llm, AFTER)
    original = AutoModelForCausalLM.from_pretrained(str(qwen3), dtype=torch.bfloat16)
    tensors = checkpoint_tensors(original)

    def per_tensor(model: Any) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(model)
        for name, t in tensors:
            model.load_weights([(name, t)])
        finalize_layerwise_reload(model, llm.llm_engine.model_config)

    with torch.no_grad():
        llm.apply_model(per_tensor)
    assert llm.reset_prefix_cache()
    seqs["restored"] = _generate(llm, RESTORED)
    capture.close()
    yield {"bundle": root / "infer", "seqs": seqs, "tensors": len(tensors), "root": root, "model": qwen3}
    llm = capture = None  # the engine goes with the module
    gc.collect()


def _train(run: dict[str, Any], name: str, which: list[str], dtype: str = "bfloat16") -> Path:
    """An HF capture of the changed trainer (in ``dtype``) scoring the sequences of ``which`` phases."""
    import torch

    import logdiff

    out = run["root"] / name
    if out.exists():
        return out
    model = _changed_model(run["model"], getattr(torch, dtype))
    with logdiff.capture(model, out, "train") as cap, torch.no_grad():
        for phase in which:
            for ids in run["seqs"][phase]:
                cap.logprobs(model(torch.tensor([ids])).logits)
    return out


def _compare(train: Path, infer: Path, **kw: Any) -> dict[str, Any]:
    from logdiff.commands.compare import compare_bundles

    return compare_bundles(train, infer, **kw).to_dict()


def _weight_causes(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in result["causes"] if c["kind"] == "weights"]


@pytest.mark.vllm
def test_the_plugin_numbers_weight_versions(run: dict[str, Any]) -> None:
    from logdiff.records.bundle import Bundle

    bundle = Bundle(run["bundle"])
    part = bundle.ranks[0]
    versions = [part.weight_version(s) for s in range(len(part.steps))]
    assert versions == sorted(versions) and set(versions) == {0, 1, 2}
    # one prefill and MAX_TOKENS - 1 decodes per generate call
    assert [versions.count(v) for v in (0, 1, 2)] == [MAX_TOKENS] * 3
    meta = part.meta
    entries = meta["weight_versions"]
    assert len(entries) == 3 and [e["first_step"] for e in entries] == [0, MAX_TOKENS, 2 * MAX_TOKENS]
    assert entries[2]["loads"] == run["tensors"]  # TRL's per-tensor calls: one version, one re-fingerprint
    v0, v1, v2 = (part.fingerprints(v) for v in range(3))
    assert v0 and len(v0) == len(v1) == len(v2) and all(v0.values())
    assert sorted(n for n in v0 if v0[n] != v1[n]) == sorted(CHANGED)
    assert v2 == v0 and meta["fingerprints"] == v2  # restored; ``fingerprints`` is the current version's
    assert meta["warnings"] == []
    # the whole rollouts, and which version generated each
    assert bundle.sequences() == [*run["seqs"]["before"], *run["seqs"]["after"], *run["seqs"]["restored"]]


@pytest.mark.vllm
def test_compare_judges_the_version_the_matched_sequences_ran_with(run: dict[str, Any]) -> None:
    after = _compare(_train(run, "train-after", ["after"]), run["bundle"])
    assert after["contracts"]["weights"]["differs"] == [] and after["contracts"]["weights"]["verified"] > 0
    assert _weight_causes(after) == [] and after["sequences"]["count"] == len(AFTER)
    assert any(f"{len(BEFORE) + len(RESTORED)} of the inference bundle's" in w for w in after["warnings"])
    assert not any("weight versions" in w for w in after["warnings"])
    # the negative control: the same trainer against the rollouts of the weights before the sync
    before = _compare(_train(run, "train-before", ["before"]), run["bundle"])
    assert sorted(before["contracts"]["weights"]["differs"]) == sorted(CHANGED)
    named = {d for c in _weight_causes(before) for d in c["differs"]}
    assert set(CHANGED) <= named


@pytest.mark.vllm
def test_sequences_of_several_versions_are_one_warning(run: dict[str, Any]) -> None:
    both = _compare(_train(run, "train-both", ["before", "after"]), run["bundle"])
    (line,) = [w for w in both["warnings"] if "weight versions" in w]
    assert line.startswith("infer bundle: the matched sequences ran with 2 weight versions")
    assert f"version 0 in steps 0-{MAX_TOKENS - 1}" in line and f"{len(CHANGED)} weights changed" in line
    assert sorted(both["contracts"]["weights"]["differs"]) == sorted(CHANGED)  # treated as differing


@pytest.mark.vllm
def test_an_fp32_trainer_against_the_bf16_engine_is_a_dtype_cause(run: dict[str, Any]) -> None:
    from logdiff.records.bundle import Bundle

    train = _train(run, "train-fp32-after", ["after"], "float32")
    meta = Bundle(train).meta
    assert set(meta["fingerprints_at"]) == {"bfloat16", "float16"} and meta["contract"]["dtype"] == "float32"
    result = _compare(train, run["bundle"])
    assert [c["kind"] for c in result["causes"] if c["kind"] == "dtype"] == ["dtype"]
    assert _weight_causes(result) == [] and result["contracts"]["weights"]["differs"] == []
    assert result["contracts"]["weights"]["verified"] > 0
    # the negative control: a weight that really changed is still named at fp32 against bf16
    stale = _compare(_train(run, "train-fp32-before", ["before"], "float32"), run["bundle"])
    assert sorted(stale["contracts"]["weights"]["differs"]) == sorted(CHANGED)
    assert {"dtype", "weights"} <= {c["kind"] for c in stale["causes"]}


@pytest.mark.vllm
def test_model_with_other_weights_is_not_used(run: dict[str, Any]) -> None:
    import torch

    train = _train(run, "train-after", ["after"])
    other = _compare(train, run["bundle"], model=run["model"])  # the weights as loaded, not the trainer's
    (line,) = [w for w in other["warnings"] if "--model's weights" in w]
    assert f"{len(CHANGED)} of " in line and "not used for replay or conformance" in line
    assert not any("conformance" in c for c in other["causes"])
    assert not any("conformance not checked" in w for w in other["warnings"])
    # the control: --model holding the trainer's own weights is used
    own = run["root"] / "trainer-model"
    if not own.exists():
        _changed_model(run["model"], torch.bfloat16).save_pretrained(own)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (run["model"] / name).exists():
                (own / name).write_bytes((run["model"] / name).read_bytes())
    used = _compare(train, run["bundle"], model=own)
    assert not any("--model's weights" in w for w in used["warnings"])
    assert not any("conformance not checked" in w for w in used["warnings"])


def test_old_bundles_read_as_version_0(tmp_path: Path) -> None:
    """A bundle written before weight versions: every step version 0, its ``fingerprints`` that version's."""
    import numpy as np

    from logdiff.comparison.bundle_weights import SideWeights, model_warning
    from logdiff.records.bundle import Bundle
    from logdiff.records.bundle_writer import BundleWriter
    from logdiff.records.layout import ParallelLayout

    writer = BundleWriter(tmp_path / "b", "infer", ParallelLayout(), {"fingerprints": {"w": "aa", "v": "bb"}})
    for step in range(2):
        writer.begin_step(np.array([1, 2]), np.array([0, 1]), np.array([step, step]), np.array([1, 1]))
        writer.end_step()
    writer.close()
    manifest = json.loads((tmp_path / "b" / "rank-00000" / "manifest.json").read_text())
    assert all("weight_version" not in step for step in manifest["steps"])
    bundle = Bundle(tmp_path / "b")
    assert bundle.versions_of([((0,), 1)]) == {((0,), 0): [0, 1]}
    assert bundle.ranks[0].fingerprints(0) == {"w": "aa", "v": "bb"} and bundle.ranks[0].fingerprints(1) is None
    side = SideWeights(bundle, [((0,), 0)], "infer")
    assert side.fingerprints("bfloat16") == {"w": "aa", "v": "bb"} and side.warning() is None
    assert model_warning({"w": "aa", "v": "cc"}, side.fingerprints()).startswith(
        "--model's weights are not those the captured step ran with: 1 of 2 weights differ")
    assert model_warning({"w": "aa"}, side.fingerprints()) is None


def test_versions_of_the_matched_steps_only(tmp_path: Path) -> None:
    """Steps carry their version; a side's fingerprints are those of its matched sequences' versions."""
    import numpy as np

    from logdiff.comparison.bundle_weights import MIXED, SideWeights
    from logdiff.records.bundle import Bundle
    from logdiff.records.bundle_writer import BundleWriter
    from logdiff.records.layout import ParallelLayout

    versions = [{"fingerprints": {"w": "aa", "v": "bb"}}, {"fingerprints": {"w": "aa", "v": "cc"}}]
    writer = BundleWriter(tmp_path / "b", "infer", ParallelLayout(), {"weight_versions": versions,
                          "fingerprints": versions[1]["fingerprints"]})  # fmt: skip
    for step, version in enumerate([0, 0, 1]):
        writer.begin_step(np.array([1, 2]), np.array([0, 1]), np.array([step, step]), np.array([1, 1]),
                          {"weight_version": version})
        writer.end_step()
    writer.close()
    bundle = Bundle(tmp_path / "b")
    assert SideWeights(bundle, [((0,), 2)], "infer").fingerprints() == {"w": "aa", "v": "cc"}
    assert SideWeights(bundle, [((0,), 0), ((0,), 1)], "infer").fingerprints() == {"w": "aa", "v": "bb"}
    mixed = SideWeights(bundle, [((0,), 0), ((0,), 2)], "infer")
    prints = mixed.fingerprints()
    assert prints["w"] == "aa" and prints["v"].startswith(MIXED)
    assert mixed.warning() == ("infer bundle: the matched sequences ran with 2 weight versions (version 0 in steps "
                               "0; version 1 in steps 2), and 1 weights changed between them (e.g. v): those are "
                               "treated as differing; to judge one version's weights, compare only its sequences "
                               "(capture the trainer on them)")
