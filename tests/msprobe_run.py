"""Real msprobe dumps of the demo Qwen3 made on the CPU, beside logdiff's own captures of the same runs.

msprobe's ``PrecisionDebugger`` is a process-wide singleton that keeps its hooks, so each side runs in a
subprocess of its own (``python tests/msprobe_run.py vllm|hf ...``), with the config ``logdiff
msprobe-config`` wrote for that side. Each msprobe step is one run, and logdiff's own capture records the very
same run (both hook the same modules in one forward: the same bits, by construction):

* vLLM (in-process, ``enforce_eager``, bf16, greedy): step 0 generates from ``PROMPTS`` with the weights as
  loaded (logdiff bundle ``vllm-clean``); then ``STALE`` is multiplied by ``STALE_FACTOR`` and synced into the
  engine (``logdiff.sync_vllm_weights``) and step 1 generates again (``vllm-stale``). The sequences (prompt and
  response ids) go to ``sequences.json``.
* HF (bf16, one right-padded teacher-forced forward of those sequences per step): step 0 as loaded
  (``hf-clean``), step 1 with every RMSNorm's eps set to ``EPS`` (``hf-eps``: a one-sided eps, which the
  effective contract reads off the modules), step 2 as loaded again (``hf-again``: the negative control).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

PROMPTS = [[17, 301, 2048, 77, 1500, 9, 640, 3333], [88, 1024, 5, 919, 2222, 70]]
MAX_TOKENS = 4
STALE = "model.layers.2.self_attn.o_proj.weight"
STALE_FACTOR = 1.25
EPS = 0.5
VLLM_STEPS = {"clean": 0, "stale": 1}
HF_STEPS = {"clean": 0, "eps": 1, "again": 2}
PAD = 0


def _run_vllm(model: Path, config: Path, out: Path) -> None:
    import torch
    from msprobe.pytorch import PrecisionDebugger
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    import logdiff
    from logdiff.records.sketch import Window
    from logdiff.sources.vllm.capture import recording

    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", seed=0,
              max_model_len=64, max_num_seqs=4)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    debugger = PrecisionDebugger(config_path=str(config))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    sequences = {}
    for run in VLLM_STEPS:
        if run == "stale":
            trainer = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16)
            with torch.no_grad():
                trainer.get_parameter(STALE).mul_(STALE_FACTOR)
            logdiff.sync_vllm_weights(llm, trainer)
        with recording(runner, out / f"vllm-{run}", Window.parse("all")):
            llm.apply_model(lambda m: debugger.start(model=m))
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            debugger.stop()
            debugger.step()
        sequences[run] = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    (out / "sequences.json").write_text(json.dumps(sequences))


def _run_hf(model: Path, config: Path, out: Path) -> None:
    import torch
    from msprobe.pytorch import PrecisionDebugger
    from transformers import AutoModelForCausalLM

    import logdiff

    seqs = json.loads((out / "sequences.json").read_text())["clean"]
    L = max(map(len, seqs))
    ids = torch.tensor([s + [PAD] * (L - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs])
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16).eval()
    norms = [m for m in hf.modules() if hasattr(m, "variance_epsilon")]
    debugger = PrecisionDebugger(config_path=str(config))
    for run in HF_STEPS:
        eps = EPS if run == "eps" else float(hf.config.rms_norm_eps)
        for m in norms:
            m.variance_epsilon = eps
        with logdiff.capture(hf, out / f"hf-{run}", "train", window="all") as cap, torch.no_grad():
            debugger.start(model=hf)
            cap.logprobs(hf(input_ids=ids, attention_mask=mask).logits)
            debugger.stop()
            debugger.step()


def run_side(side: str, model: Path, config: Path, out: Path, timeout: float = 600) -> None:
    """Run one side's dumps and captures in a subprocess (msprobe's debugger is one per process)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([sys.executable, __file__, side, str(model), str(config), str(out)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    if proc.returncode:
        raise RuntimeError(f"the {side} msprobe run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def make_runs(model: Path, root: Path, write_config: Any) -> dict[str, Path]:
    """Both sides' dumps and captures under ``root``; ``write_config(side, config_path, dump_path)`` writes each
    side's msprobe config (the test does it through ``logdiff msprobe-config``). Returns the paths by name:
    ``vllm-dump``, ``hf-dump`` (msprobe roots), ``vllm-{run}``, ``hf-{run}`` (logdiff bundles)."""
    paths: dict[str, Path] = {}
    for side in ("vllm", "hf"):  # vLLM first: HF scores the sequences it generated
        config, dump = root / f"{side}-msprobe.json", root / f"{side}-dump"
        write_config(side, config, dump)
        run_side(side, model, config, root)
        paths[f"{side}-dump"] = dump
    for run in VLLM_STEPS:
        paths[f"vllm-{run}"] = root / f"vllm-{run}"
    for run in HF_STEPS:
        paths[f"hf-{run}"] = root / f"hf-{run}"
    return paths


def step_dir(dump: Path, step: int) -> Path:
    """An msprobe dump's step directory (``DUMP/step{N}``), which ``logdiff compare`` reads as a dump."""
    return Path(dump) / f"step{step}"


if __name__ == "__main__":
    side, model_dir, config_path, out_dir = sys.argv[1:5]
    (_run_vllm if side == "vllm" else _run_hf)(Path(model_dir), Path(config_path), Path(out_dir))
