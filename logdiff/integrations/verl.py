"""logdiff inside verl 0.9 (read against verl 0.9.1): the trainer's old-log-prob pass and the vLLM rollout.

**Train side.** verl 0.9.1 computes the "old" logprobs (the ones its importance ratio compares with the
rollout's) in ``ActorRolloutRefWorker.compute_log_prob`` (verl/workers/engine_workers.py:703) ->
``TrainingWorker.infer_batch`` (:398) -> ``BaseEngine.infer_batch`` (verl/workers/engine/base.py:134, under
``torch.no_grad``) -> ``FSDPEngine.forward_backward_batch`` (workers/engine/fsdp/transformer_impl.py:724) ->
``FSDPEngineWithLMHead.forward_step`` (:1549) per micro-batch: ``prepare_model_inputs`` (:1145),
``self.module(**model_inputs, use_cache=False)`` under autocast, ``prepare_model_outputs`` (:1332). One call,
on the actor's engine (``worker.actor.engine``) once it is built::

    from logdiff.integrations import verl as logdiff_verl

    logdiff_verl.instrument_engine(worker.actor.engine, "logdiff-runs", every=10)

wraps that engine's ``infer_batch`` and ``forward_step`` (on the instance; the training pass,
``train_batch``, is never touched): every ``every``-th log-prob pass (``k``: 1, 1 + every, ...; the
``k``-th ``infer_batch`` of this engine, verl's global step when the run did not resume) runs inside
``logdiff.capture(engine.module, DIR/step-{k:06d}/train, role="train")`` on every rank, so each micro-batch's
forward is one capture step, split into its sequences as verl fed them (``use_remove_padding=True``, the
default: one packed row, ``position_ids`` restarting per sequence, ``attention_mask=None``; without it, right
padded rows with their attention mask). After each micro-batch's forward, the logprobs verl computed
(``model_output["log_probs"]``: jagged, per sequence ``prompt + response`` long, entry ``t`` the logprob of
token ``t + 1`` at the rollout temperature, from ``logprobs_from_logits``, or the fused kernel's
``output.log_probs``, which never calls ``lm_head``) go to ``Capture.token_logprobs`` with the token ids they
were gathered at: the bundle holds verl's own numbers, and ``logdiff compare`` reads them first. Nothing
verl returns changes: the hooks copy, the wrapper returns what verl's own methods return.

Refused (``ValueError``, before anything is wrapped): Ulysses sequence parallel (a rank sees a slice of the
packed row and the heads of all of it) and verl's FSDP1 strategy (``strategy: fsdp``, verl's default: its
``FlatParameter`` wrappers rename every module, so no boundary would match): run the captured steps with
``actor_rollout_ref.actor.strategy=fsdp2`` and ``ulysses_sequence_parallel_size=1``.

**Rollout side.** verl 0.9.1 runs vLLM as an ``AsyncLLM`` server (``vLLMHttpServer``, a Ray actor;
workers/rollout/vllm_rollout/vllm_async_server.py:329: ``distributed_executor_backend="mp"``) whose engine
core and workers are processes of their own. logdiff's vLLM plugin (``LOGDIFF_CAPTURE=DIR``) records every
worker's forwards; ``rollout_env`` gives the environment, ``hydra_overrides`` the command-line settings
(the environment through Ray's job ``runtime_env``, ``actor_rollout_ref.rollout.enforce_eager=True`` so the
module hooks fire, ``calculate_log_probs=True`` so vLLM takes the logprobs it reports, and this module's
``ray_setup_hook``, which calls ``instrument_worker`` in the actor's
process when ``LOGDIFF_VERL_CAPTURE`` is set).

This module never imports verl (``ray_setup_hook`` waits for the process to import it): logdiff does not depend
on verl.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

VERL_VERSION_READ = "0.9.1"
ENV_TRAIN = "LOGDIFF_VERL_CAPTURE"  # the actor's log-prob passes are captured under this directory
ENV_EVERY = "LOGDIFF_VERL_EVERY"  # every N-th pass (default 1)
ENV_WINDOW = "LOGDIFF_CAPTURE_WINDOW"  # decoder layers kept whole (the vLLM plugin reads it too)
ENV_ROLLOUT = "LOGDIFF_CAPTURE"  # the vLLM plugin's switch (logdiff/sources/vllm/capture.py)
_WRAPPED = "_logdiff_verl"

log = logging.getLogger("logdiff")


# ---- verl's data: a TensorDict (or a plain dict in tests) ------------------------------------------------------


def _get(data: Any, key: str, default: Any = None) -> Any:
    """``tu.get_non_tensor_data``: the value at ``key`` unwrapped from tensordict's ``NonTensorData``."""
    try:
        value = data.get(key, default)
    except (KeyError, TypeError):
        return default
    while type(value).__name__ in ("NonTensorData", "NonTensorStack") and hasattr(value, "data"):
        value = value.data
    return value


def micro_batch_logprobs(micro_batch: Any, log_probs: Any) -> tuple[Any, int, Any]:
    """verl's per-token ``log_probs`` of one micro-batch in the layout of the forward that computed them, for
    ``Capture.token_logprobs``: ``(logprobs [rows, n], start, token_ids [rows, n])``.

    ``micro_batch["input_ids"]`` is the jagged (nested) tensor ``left_right_2_no_padding`` builds
    (verl/workers/utils/padding.py:23: ``prompt + response`` per sequence, no pads); ``log_probs`` the jagged
    ``model_output["log_probs"]`` of the same lengths, entry ``t`` of a sequence scoring its token ``t + 1``
    (``torch.roll(input_ids, -1)`` as labels: the last entry of each sequence scores the next sequence's first
    token, and ``Capture.token_logprobs`` leaves such a pair out, since the two columns are different sequences).

    * ``use_remove_padding`` (default True): the forward's ``input_ids`` are ``input_ids.values()[None]``, one row
      (a static or sequence-parallel pad after it, if any, is past the scored columns): ``[1, total - 1]`` from
      ``start=1``;
    * otherwise the forward's rows are ``to_padded_tensor(input_ids, pad_token_id)``, ``[batch, max_len]``:
      ``[batch, max_len - 1]`` from ``start=1``, the pads' columns zero (the attention mask leaves them out).
    """
    import torch

    ids = micro_batch["input_ids"]
    if not getattr(ids, "is_nested", False):
        raise ValueError("verl micro-batch: input_ids is not a nested (jagged) tensor; verl 0.9 feeds its engine "
                         "the no-padding layout of left_right_2_no_padding")
    values = log_probs.values() if getattr(log_probs, "is_nested", False) else log_probs.reshape(-1)
    flat, offsets = ids.values(), ids.offsets()
    if values.shape[0] != flat.shape[0]:
        raise ValueError(f"verl micro-batch: {values.shape[0]} log_probs for {flat.shape[0]} tokens")
    if _get(micro_batch, "use_remove_padding", True):
        return values[:-1].detach()[None], 1, flat[1:][None]
    lengths = offsets.diff().tolist()
    width = max(lengths)
    pad = int(_get(micro_batch, "pad_token_id", 0))
    lp = torch.zeros(len(lengths), width - 1, dtype=values.dtype, device=values.device)
    fed = torch.nested.to_padded_tensor(ids, padding=pad, output_size=(len(lengths), width))
    for b, (lo, n) in enumerate(zip(offsets[:-1].tolist(), lengths)):
        lp[b, : n - 1] = values[lo : lo + n - 1].detach()
    return lp, 1, fed[:, 1:]


# ---- the train side -----------------------------------------------------------------------------------------


class EngineCapture:
    """The wrapping ``instrument_engine`` put on one verl engine: which passes it captures and where.

    ``calls``: the log-prob passes (``infer_batch`` calls) seen; ``captured``: the bundle directories written;
    ``errors``: what went wrong in a capture (``strict=False`` logs it and lets verl run on); ``remove()`` puts
    the engine's own methods back.
    """

    def __init__(self, engine: Any, out_dir: str | Path, every: int = 1, steps: Iterable[int] | None = None,
                 window: int | str | None = 2, fingerprints: bool = True, strict: bool = False,
                 capture: Callable[..., Any] | None = None):
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.engine, self.out_dir, self.every = engine, Path(out_dir), int(every)
        self.steps = None if steps is None else {int(s) for s in steps}
        self.window, self.fingerprints, self.strict = window, fingerprints, strict
        self._capture_fn = capture  # logdiff.capture unless a test gives another
        self.calls = 0
        self.captured: list[Path] = []
        self.errors: list[str] = []
        self.active: Any = None  # the running pass's Capture
        self.micro_batches = 0

    def wanted(self, k: int) -> bool:
        return k in self.steps if self.steps is not None else (k - 1) % self.every == 0

    def step_dir(self, k: int) -> Path:
        return self.out_dir / f"step-{k:06d}" / "train"

    # the wrappers ------------------------------------------------------------------------------------------

    def infer_batch(self, original: Callable[..., Any], data: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        k = self.calls
        if not self.wanted(k) or self.active is not None:
            return original(data, *args, **kwargs)
        cap = self._open(k, data)
        if cap is None:
            return original(data, *args, **kwargs)
        self.active, self.micro_batches = cap, 0
        try:
            out = original(data, *args, **kwargs)
        finally:
            self.active = None
            self._close(cap, k)
        return out

    def forward_step(self, original: Callable[..., Any], micro_batch: Any, *args: Any, **kwargs: Any) -> Any:
        cap = self.active
        result = original(micro_batch, *args, **kwargs)
        if cap is None:
            return result
        self.micro_batches += 1
        try:
            _, output = result
            log_probs = (output.get("model_output") or {}).get("log_probs")
            if log_probs is not None:  # None: distillation_only, or a value head
                lp, start, token_ids = micro_batch_logprobs(micro_batch, log_probs)
                cap.token_logprobs(lp, start=start, token_ids=token_ids)
        except Exception as e:  # noqa: BLE001 - a capture that fails must not stop verl unless strict
            self._fail(f"micro-batch {self.micro_batches} of pass {self.calls}: {type(e).__name__}: {e}")
        return result

    # the capture -------------------------------------------------------------------------------------------

    def _open(self, k: int, data: Any) -> Any:
        try:
            capture = self._capture_fn
            if capture is None:
                from logdiff.sources.hf.capture import capture
            cap = capture(self.engine.module, self.step_dir(k), role="train", window=self.window,
                          fingerprints=self.fingerprints)
            cap.__enter__()
            cap.writer.meta_update({"verl": self._settings(k, data)})
            return cap
        except Exception as e:  # noqa: BLE001
            self._fail(f"pass {k}: no capture ({type(e).__name__}: {e})")
            return None

    def _close(self, cap: Any, k: int) -> None:
        try:
            cap.__exit__(None, None, None)
            self.captured.append(self.step_dir(k))
        except Exception as e:  # noqa: BLE001
            self._fail(f"pass {k}: the capture did not close ({type(e).__name__}: {e})")

    def _settings(self, k: int, data: Any) -> dict[str, Any]:
        """What the bundle's reader needs to know about how verl computed the recorded logprobs."""
        temperature = _get(data, "temperature", None)
        if hasattr(temperature, "tolist"):
            temperature = temperature.tolist()
        return {"version_read": VERL_VERSION_READ, "pass": k,
                "use_remove_padding": _get(data, "use_remove_padding", None),
                "use_fused_kernels": _get(data, "use_fused_kernels", None),
                "temperature": temperature,
                "strategy": _strategy(self.engine)}

    def _fail(self, msg: str) -> None:
        self.errors.append(msg)
        if self.strict:
            raise RuntimeError(f"logdiff verl capture: {msg}")
        log.warning("logdiff verl capture: %s", msg)

    def remove(self) -> None:
        for name in ("infer_batch", "forward_step"):
            self.engine.__dict__.pop(name, None)
        self.engine.__dict__.pop(_WRAPPED, None)


def _strategy(engine: Any) -> str | None:
    config = getattr(engine, "engine_config", None)
    return getattr(config, "strategy", None)


def _check_engine(engine: Any) -> None:
    module = getattr(engine, "module", None)
    if module is None or not callable(getattr(engine, "infer_batch", None)) \
            or not callable(getattr(engine, "forward_step", None)):
        raise ValueError("instrument_engine: expected a verl engine (FSDPEngineWithLMHead: .module, .infer_batch, "
                         f".forward_step), got {type(engine).__name__}")
    if getattr(engine, "use_ulysses_sp", False):
        raise ValueError("instrument_engine: Ulysses sequence parallel is not captured (each rank holds a slice of "
                         "the packed row); run the captured steps with ulysses_sequence_parallel_size=1")
    if type(module).__name__ == "FullyShardedDataParallel":
        raise ValueError("instrument_engine: verl's FSDP1 strategy ('fsdp', its default) renames every module "
                         "(_fsdp_wrapped_module), so no boundary would be recorded; run the captured steps with "
                         "actor_rollout_ref.actor.strategy=fsdp2 (and ref.strategy=fsdp2)")


def instrument_engine(engine: Any, out_dir: str | Path, every: int = 1, steps: Iterable[int] | None = None,
                      window: int | str | None = 2, fingerprints: bool = True, strict: bool = False,
                      capture: Callable[..., Any] | None = None) -> EngineCapture:
    """Capture every ``every``-th log-prob pass of a verl 0.9 engine (``FSDPEngineWithLMHead``) into
    ``out_dir/step-{k:06d}/train`` (this rank's part; every rank calls it), with verl's own per-token logprobs.

    ``steps``: the passes to capture (1-based), instead of ``every``. ``window``, ``fingerprints``: as
    ``logdiff.capture``'s. ``strict``: raise when a capture fails (default: log it, keep ``errors``, and let
    verl run on). Returns the ``EngineCapture`` (``remove()`` undoes it); a second call on the same engine
    returns the first's.
    """
    _check_engine(engine)
    existing = vars(engine).get(_WRAPPED)
    if existing is not None:
        return existing
    state = EngineCapture(engine, out_dir, every, steps, window, fingerprints, strict, capture)
    infer_batch, forward_step = engine.infer_batch, engine.forward_step  # bound: verl's own methods

    def wrapped_infer_batch(data: Any, *args: Any, **kwargs: Any) -> Any:
        return state.infer_batch(infer_batch, data, *args, **kwargs)

    def wrapped_forward_step(micro_batch: Any, *args: Any, **kwargs: Any) -> Any:
        return state.forward_step(forward_step, micro_batch, *args, **kwargs)

    engine.infer_batch, engine.forward_step = wrapped_infer_batch, wrapped_forward_step
    engine.__dict__[_WRAPPED] = state
    return state


def instrument_worker(worker: Any, out_dir: str | Path, every: int = 1, **options: Any) -> EngineCapture:
    """``instrument_engine`` on an ``ActorRolloutRefWorker``'s actor engine (``worker.actor.engine``: the
    ``TrainingWorker`` that ``compute_log_prob`` calls), after its ``init_model``."""
    actor = getattr(worker, "actor", None)
    engine = getattr(actor, "engine", None)
    if engine is None:
        raise ValueError("instrument_worker: the worker has no actor engine yet (call it after init_model, on a "
                         "worker whose role includes 'actor')")
    return instrument_engine(engine, out_dir, every=every, **options)


# ---- the rollout side and the run's settings --------------------------------------------------------------


def rollout_env(out_dir: str | Path, window: int | str | None = None) -> dict[str, str]:
    """The environment of verl's rollout servers that turns on logdiff's vLLM plugin: every worker of every
    vLLM engine that sees it writes its forwards to ``out_dir/rollout`` (role ``infer``) for the engine's
    lifetime, with a weight version per sync (verl's ``_update_weights`` calls the model's ``load_weights``)."""
    env = {ENV_ROLLOUT: str(Path(out_dir) / "rollout")}
    if window is not None:
        env[ENV_WINDOW] = str(window)
    return env


def hydra_overrides(out_dir: str | Path, every: int = 1, window: int | str | None = None,
                    rollout: bool = True, train: bool = True) -> list[str]:
    """The ``python -m verl.trainer.main_ppo`` overrides of a captured run (verl 0.9.1's config keys): the rollout
    environment and the train-side switch through Ray's job ``runtime_env`` (``ray_kwargs.ray_init.runtime_env``,
    merged over verl's own in verl/trainer/main_ppo.py:62-72), ``ray_setup_hook`` as the job's
    ``worker_process_setup_hook``, an eager vLLM engine (the module hooks never fire in compiled code), rollout
    logprobs requested (``calculate_log_probs``: vLLM then takes the ``processed_logprobs`` it reports, at the
    rollout temperature as verl's own; the plugin records them) and FSDP2 for the actor (FSDP1 renames the
    modules)."""
    env: dict[str, str] = {}
    if rollout:
        env.update(rollout_env(out_dir, window))
    if train:
        env[ENV_TRAIN] = str(out_dir)
        env[ENV_EVERY] = str(every)
        if window is not None:
            env[ENV_WINDOW] = str(window)
    out = [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}={v}" for k, v in env.items()]
    if train:
        out += ["+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=logdiff.integrations.verl.ray_setup_hook",
                "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2",
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1"]
    if rollout:  # eager: module hooks fire; logprobs requested: vLLM takes its processed logprobs, recorded too
        out += ["actor_rollout_ref.rollout.enforce_eager=True", "actor_rollout_ref.rollout.calculate_log_probs=True"]
    return out


_TARGET = "verl.workers.engine_workers"


def patch_worker_class(cls: Any, out_dir: str | Path, every: int = 1, **options: Any) -> None:
    """Make ``cls.init_model`` (verl's ``ActorRolloutRefWorker``) end with ``instrument_worker`` on workers whose
    role has an actor. ``functools.wraps`` keeps verl's ``@register`` dispatch attributes on the wrapper."""
    import functools

    init_model = cls.init_model
    if getattr(init_model, _WRAPPED, False):
        return

    @functools.wraps(init_model)
    def init_model_and_instrument(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = init_model(self, *args, **kwargs)
        if "actor" in str(getattr(self, "role", "")):
            try:
                instrument_worker(self, out_dir, every=every, **options)
            except Exception as e:  # noqa: BLE001 - a refused capture must not stop the run
                log.warning("logdiff verl capture: not instrumented (%s: %s)", type(e).__name__, e)
        return out

    setattr(init_model_and_instrument, _WRAPPED, True)
    cls.init_model = init_model_and_instrument


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` once ``name`` has been imported by the process itself (nothing is imported here)."""

    def __init__(self, name: str, then: Callable[[Any], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then, finder = spec.loader.exec_module, self.then, self

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            then(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def ray_setup_hook() -> None:
    """Ray's ``worker_process_setup_hook`` for a captured verl run: with ``LOGDIFF_VERL_CAPTURE=DIR`` set, once the
    process imports ``verl.workers.engine_workers``, its ``ActorRolloutRefWorker.init_model`` ends with
    ``instrument_worker(self, DIR, every=LOGDIFF_VERL_EVERY)``. Imports nothing heavy (every Ray worker runs
    it, vLLM's server actors included)."""
    out_dir = os.environ.get(ENV_TRAIN)
    if not out_dir:
        return
    every = int(os.environ.get(ENV_EVERY) or 1)
    window = os.environ.get(ENV_WINDOW) or 2

    def patch(module: Any) -> None:
        patch_worker_class(module.ActorRolloutRefWorker, out_dir, every=every, window=window)

    if _TARGET in sys.modules:
        patch(sys.modules[_TARGET])
    elif not any(isinstance(f, _AfterImport) and f.name == _TARGET for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_TARGET, patch))
