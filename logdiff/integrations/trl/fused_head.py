"""The temperature TRL's trainer really scores with: the one inside its fused LM head.

TRL 1.16's ``GRPOTrainer.__init__`` replaces the model's forward with a fused LM head
(``trl/trainer/utils.py``, ``add_fused_lm_head``) that divides the logits by the temperature
it was given then, held in the forward's closure. ``trainer.temperature`` is a copy: code that
changes it later (a per-step schedule) changes what vLLM samples with, not what the trainer
applies. So the in-loop capture declares the head's own value, and the one way to change it
(``fused_head_temperature(model, t)``) sets that value where the head reads it.
"""

from __future__ import annotations

from typing import Any


def _cell(model: Any) -> Any:
    """The closure cell of the fused head's ``temperature``, or None (no fused head on this model).

    The head may sit under wrappers of the forward (accelerate's mixed-precision ``convert_outputs_to_fp32``,
    which also keeps ``_original_forward``; ``functools.wraps`` chains): they are followed through ``__wrapped__``,
    ``__func__`` and the functions their closures hold, a few levels deep."""
    todo = [getattr(model, "forward", None), getattr(model, "_original_forward", None)]
    seen: set[int] = set()
    for _ in range(64):
        if not todo:
            break
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        fn = getattr(fn, "__func__", fn)
        code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
        if code is not None and code.co_name == "_fused_forward":  # functools.wraps renames it "forward"
            return dict(zip(code.co_freevars, closure)).get("temperature")
        todo.append(getattr(fn, "__wrapped__", None))
        for cell in closure:
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(value):
                todo.append(value)
    return None


def fused_head_temperature(model: Any, value: float | None = None) -> float | None:
    """The temperature ``model``'s TRL fused head divides the logits by (None: no fused head); with ``value``,
    set it first (a ValueError where the model has no fused head to set it on)."""
    cell = _cell(model)
    if value is not None:
        if cell is None:
            raise ValueError("this model has no TRL fused LM head (trl.trainer.utils.add_fused_lm_head) to set a "
                             f"temperature on (its forward: {getattr(model, 'forward', None)!r})")
        cell.cell_contents = float(value)
    return None if cell is None else float(cell.cell_contents)


def applied_temperature(trainer: Any, model: Any) -> float:
    """What the trainer's scoring divides the logits by: its fused head's value, else ``trainer.temperature``."""
    head = fused_head_temperature(model)
    return head if head is not None else float(getattr(trainer, "temperature", 1.0))
