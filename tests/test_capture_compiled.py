"""A compiled vLLM engine (no ``enforce_eager``): its module hooks never fire, and ``compare`` says so in one line.

vLLM compiles its model (torch.compile; CUDA graphs on a GPU) unless built with ``enforce_eager=True``, as TRL
and verl build it by default. The plugin capture then records the logits only. It writes what it saw into the
bundle's metadata (``compilation``: vLLM's config; ``hooks_fired``, ``hookless_steps``, ``recorded_steps``:
what the steps held), and ``logdiff compare`` turns it into exactly one warning naming the fix.

* The real thing (``vllm``, ``slow``): the demo Qwen3 on vLLM's CPU build, compiled (its default here,
  ``DYNAMO_TRACE_ONCE``; about a minute to compile), against the same engine with ``enforce_eager=True``
  (the negative control: every boundary recorded, no warning). Both run, one after the other, in one
  subprocess with ``LOGDIFF_CAPTURE``, as a rollout worker would.
* Without vLLM: ``compilation_of`` read from configs shaped like vLLM's, and the warning from bundle
  metadata as the compiled run writes it (the same keys the real run is checked to write), against a plain
  pair of HF captures that must not warn.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from hf_bundles import capture_hf as _capture

FIX = "LLM(..., enforce_eager=True)"
#: ``python -c SCRIPT MODEL MODE OUT [MODE OUT ...]``: one engine per mode (``compiled`` or ``eager``), one after
#: another in one process (importing vLLM costs more than the eager run), each captured into its OUT
#: (``LOGDIFF_CAPTURE`` is read when an engine loads its model) and shut down before the next
SCRIPT = """
import os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
from vllm.distributed import parallel_state
for mode, out in zip(sys.argv[2::2], sys.argv[3::2]):
    os.environ["LOGDIFF_CAPTURE"] = out
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=mode == "eager", seed=0,
              max_model_len=48, max_num_seqs=2)
    llm.generate([{"prompt_token_ids": [5, 17, 3, 9, 42, 7]}, {"prompt_token_ids": [8, 1, 30, 4]}],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()  # the worker's shutdown closes its capture
    del llm
    parallel_state.cleanup_dist_env_and_memory()
"""
IDS = [[5, 17, 3, 9, 42, 7, 11, 2], [8, 1, 30, 4, 6, 19, 23]]


class _Mode:
    def __init__(self, name: str):
        self.name = name


def _runner(mode: str, graphs: str, eager: bool) -> SimpleNamespace:
    config = SimpleNamespace(compilation_config=SimpleNamespace(mode=_Mode(mode), cudagraph_mode=_Mode(graphs)))
    return SimpleNamespace(vllm_config=config, model_config=SimpleNamespace(enforce_eager=eager))


def test_compilation_is_read_from_the_runner_config() -> None:
    from logdiff.sources.vllm.capture import compilation_of

    eager = compilation_of(_runner("NONE", "NONE", True))
    assert eager == {"mode": "NONE", "cudagraph_mode": "NONE", "enforce_eager": True, "compiled": False}
    assert compilation_of(_runner("DYNAMO_TRACE_ONCE", "NONE", False))["compiled"] is True  # torch.compile
    assert compilation_of(_runner("NONE", "FULL", False))["compiled"] is True  # CUDA graphs alone
    assert compilation_of(SimpleNamespace())["compiled"] is None  # a runner without the config: unknown


def _set_meta(bundle: Path, meta: dict) -> None:
    for manifest in bundle.glob("rank-*/manifest.json"):
        data = json.loads(manifest.read_text())
        data["meta"].update(meta)
        manifest.write_text(json.dumps(data))


def _compiled_warnings(result: dict) -> list[str]:
    return [w for w in result["warnings"] if "compiled" in w]


#: the metadata a compiled run writes (the real run below checks it writes these keys and values)
COMPILED_META = {"engine": "vllm", "hooks_fired": False, "hookless_steps": 5, "recorded_steps": 5,
                 "compilation": {"mode": "DYNAMO_TRACE_ONCE", "cudagraph_mode": "NONE", "enforce_eager": False,
                                 "compiled": True}}


def test_compare_warns_once_from_the_bundle_metadata(demo_model: Callable[[str], Path], tmp_path: Path) -> None:
    from logdiff.commands.compare import compare_bundles

    model = demo_model("qwen3")
    train = _capture(model, tmp_path / "train", "train", [[ids] for ids in reversed(IDS)])
    infer = _capture(model, tmp_path / "infer", "infer", [[ids] for ids in IDS])
    assert _compiled_warnings(compare_bundles(train, infer).to_dict()) == []  # the plain pair: no warning
    compiled = tmp_path / "compiled"
    shutil.copytree(infer, compiled)
    _set_meta(compiled, COMPILED_META)
    (warning,) = _compiled_warnings(compare_bundles(train, compiled).to_dict())
    assert warning.startswith("infer bundle: vllm ran its model compiled (mode DYNAMO_TRACE_ONCE), so its module hooks")
    assert "(5 of 5 steps recorded logits only)" in warning and FIX in warning
    assert "actor_rollout_ref.rollout.enforce_eager=True" in warning and "\n" not in warning
    # the config alone says so too; hooks that did fire (a step with module boundaries) say otherwise
    _set_meta(compiled, {"hooks_fired": None})
    assert len(_compiled_warnings(compare_bundles(train, compiled).to_dict())) == 1
    _set_meta(compiled, {"hooks_fired": True, "hookless_steps": 0})
    assert _compiled_warnings(compare_bundles(train, compiled).to_dict()) == []


def _vllm_bundles(model: Path, outs: dict[str, Path]) -> dict[str, Path]:
    """One capture bundle per mode (``compiled``, ``eager``) of vLLM's in-process engine, from one subprocess: a
    rollout worker's process, with ``LOGDIFF_CAPTURE`` set from its start."""
    env = {**os.environ, "LOGDIFF_CAPTURE": str(next(iter(outs.values()))), "LOGDIFF_CAPTURE_WINDOW": "all",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    args = [str(a) for mode_out in outs.items() for a in mode_out]
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(model), *args], capture_output=True, text=True,
                         timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return outs


@pytest.mark.vllm
@pytest.mark.slow
def test_a_compiled_engine_is_detected_and_an_eager_one_is_not(demo_model: Callable[[str], Path],
                                                              tmp_path: Path) -> None:
    from logdiff.commands.compare import compare_bundles
    from logdiff.records.bundle import Bundle

    model = demo_model("qwen3")
    bundles = _vllm_bundles(model, {"compiled": tmp_path / "compiled", "eager": tmp_path / "eager"})
    compiled, eager = Bundle(bundles["compiled"]), Bundle(bundles["eager"])
    # what the steps held: logits only when compiled, every boundary when eager
    assert all(set(compiled.names(s)) <= {"logits", "log_softmax"} for s in range(compiled.num_steps))
    assert all("model.layers.0.self_attn.q_proj" in eager.names(s) for s in range(eager.num_steps))
    meta, control = compiled.meta, eager.meta
    assert meta["compilation"]["compiled"] is True and meta["compilation"]["enforce_eager"] is False
    assert meta["hooks_fired"] is False and meta["hookless_steps"] == meta["recorded_steps"] == compiled.num_steps
    assert set(COMPILED_META) <= set(meta) and set(COMPILED_META["compilation"]) == set(meta["compilation"])
    assert control["compilation"]["compiled"] is False and control["compilation"]["enforce_eager"] is True
    assert control["hooks_fired"] is True and control["hookless_steps"] == 0
    # compare: one line for the compiled engine, none for the eager one (the same training capture)
    train = _capture(model, tmp_path / "train", "train", [[ids] for ids in compiled.sequences()])
    (warning,) = _compiled_warnings(compare_bundles(train, compiled.root).to_dict())
    assert warning.startswith("infer bundle: vllm ran its model compiled") and FIX in warning
    assert _compiled_warnings(compare_bundles(train, eager.root).to_dict()) == []
