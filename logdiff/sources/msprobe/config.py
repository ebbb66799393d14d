"""The msprobe config that gives a dump ``logdiff compare`` can read, the first time (``logdiff msprobe-config``).

A usable dump needs: task ``tensor`` (rows to align; ``statistics`` with summary_mode ``md5`` is a same-or-not
gate at most), level ``L0`` (module boundaries; HF applies RoPE in plain code, so only ``mix`` holds it: ``mix``
is offered for HF alone, since on vLLM's attention it dumps the paged KV cache: docs/msprobe.md), the forward
only, and a ``list`` of modules that keeps the embedding (its input is the token ids), the decoder layers (HF:
the attention mask and positions; vLLM: the positions), the final norm (vLLM: the last layer's residual stream)
and the head (HF ``lm_head``, vLLM ``logits_processor``). msprobe matches each ``list`` item as a substring of
the entry name (``Module.model.layers.3.mlp.Qwen3MLP.forward.0``), so a layer is ``model.layers.N.`` (the
trailing dot keeps layer 3 from matching layer 30).

This module only builds the dict; the CLI writes it (``logdiff.commands.outputs``: atomically, exit 4 on failure).
"""

from __future__ import annotations

from typing import Any

from logdiff.errors import InputError

SIDES = ("hf", "vllm")
LEVELS = ("L0", "mix")
#: the module that holds each side's logits
HEADS = {"hf": "lm_head", "vllm": "logits_processor"}


def parse_ints(text: str | None, what: str) -> list[int] | None:
    """``"0,3"`` -> ``[0, 3]`` (sorted, unique); None or ``"all"`` -> None; anything else one line."""
    if text is None or text.strip().lower() == "all":
        return None
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise InputError(f"{what} {text!r}: give comma-separated integers, e.g. 0,3 (or 'all')") from None
    if not values or values[0] < 0:
        raise InputError(f"{what} {text!r}: give non-negative integers, e.g. 0,3 (or 'all')")
    return values


def modules(side: str, layers: list[int] | None) -> list[str]:
    """The ``list`` of module-name substrings: the embedding, the layers (all, or ``layers``), the norm, the head."""
    if side not in SIDES:
        raise InputError(f"--side {side!r}: choose hf (transformers, the training side) or vllm (in-process)")
    blocks = ["model.layers."] if layers is None else [f"model.layers.{n}." for n in layers]
    return ["model.embed_tokens", *blocks, "model.norm", HEADS[side]]


def msprobe_config(side: str, dump_path: str, *, layers: list[int] | None = None, steps: list[int] | None = None,
                   statistics: bool = False, level: str = "L0") -> dict[str, Any]:
    """The msprobe config JSON (as a dict) for ``side``'s dump into ``dump_path``. ``steps`` None: every step.
    ``level`` ``mix`` (HF only) adds the tensor ops inside each module: HF's RoPE, which L0 cannot see."""
    if not str(dump_path).strip():
        raise InputError("--dump-path is empty: give the directory msprobe writes the dump into")
    if level not in LEVELS:
        raise InputError(f"--level {level!r}: choose L0 (module boundaries) or mix (HF only: its RoPE too)")
    if level == "mix" and side == "vllm":
        raise InputError("--level mix with --side vllm would dump the whole paged KV cache at every attention call "
                         "(gigabytes); vLLM's RoPE is a module, so L0 holds it (docs/msprobe.md)")
    task = "statistics" if statistics else "tensor"
    selection: dict[str, Any] = {"scope": [], "list": modules(side, layers), "data_mode": ["forward"]}
    if statistics:
        selection["summary_mode"] = "md5"
    return {"task": task, "dump_path": str(dump_path), "rank": [], "step": list(steps or []), "level": level,
            "extra_info": True, "async_dump": False, task: selection}


def usage(side: str, path: str) -> str:
    """One line: how to dump with the config at ``path``."""
    if side == "hf":
        run = "d.start(model=model); model(input_ids, attention_mask=mask); d.stop(); d.step()"
    else:
        run = ("llm = LLM(..., enforce_eager=True); llm.apply_model(lambda m: d.start(model=m)); llm.generate(...); "
               "d.stop(); d.step()")
    return (f"wrote {path}: d = msprobe.pytorch.PrecisionDebugger(config_path={str(path)!r}); {run}; then "
            "logdiff compare HF_DUMP VLLM_DUMP --model MODEL (docs/msprobe.md)")
