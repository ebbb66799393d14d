"""``--depth ops``: every aten or custom op a module runs, on every path.

A ``TorchDispatchMode`` sees each op below autograd, including vLLM's custom
ops (``_C.rms_norm``, the CPU attention kernel). ``OpTracer`` is driven by
the recorder's module hooks: the mode is pushed when the outermost hooked
module starts and popped when it ends (``always_call`` hooks, so also on an
exception), and each op is attributed to the innermost module on the call
stack that is being traced and to every enclosing traced module (inclusive:
the trace of an attention module holds the ops of its projections too, each op tagged
with the innermost module that ran it). Ops the probes themselves run
(comparisons, replays) are not recorded. Each call is tagged with the kind of
step it ran in (``prefill``: some sequence fed more than one token, or
``decode``), so a drill-down can show the call that produced a decode-position
divergence.

Only metadata is kept: op name, argument shapes and dtypes, output shape and
dtype. That is what tells two implementations of one module apart (an fp32
upcast on one side, one fused custom op on the other, a decode-shaped SDPA
call against a prefill-shaped one); numeric differences come from the
module-level comparison and replay. Memory is bounded: per module, only the
first ``max_signatures`` distinct call signatures (the op list of one call,
shapes included) are kept, each with at most ``max_ops`` ops. ``select``
restricts tracing to chosen modules (``--drill``); by default every module is
traced and the drill-down picks the first divergent one afterwards.

``compare_traces`` lines two op lists up and finds where they first part:
a different op, a different dtype, or (same ops throughout) a different shape.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class OpRecord:
    op: str
    args: list[tuple[list[int], str]]  # tensor arguments: (shape, dtype)
    out: list[tuple[list[int], str]]
    module: str = ""  # the innermost module that ran it

    def key(self) -> tuple[str, tuple[str, ...]]:
        return self.op, tuple(d for _, d in self.out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "args": [{"shape": s, "dtype": d} for s, d in self.args],
            "out": [{"shape": s, "dtype": d} for s, d in self.out],
            "module": self.module,
        }


@dataclass
class CallTrace:
    module: str
    step: str = "prefill"  # prefill | decode
    ops: list[OpRecord] = field(default_factory=list)
    truncated: bool = False

    def signature(self) -> tuple:
        return tuple((o.op, tuple(tuple(s) for s, _ in o.out)) for o in self.ops)


def _tensors(obj: Any) -> list[Any]:
    import torch

    out: list[Any] = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            out.extend(_tensors(o))
    elif isinstance(obj, dict):
        for o in obj.values():
            out.extend(_tensors(o))
    return out


def _meta(ts: list[Any]) -> list[tuple[list[int], str]]:
    return [(list(t.shape), str(t.dtype).replace("torch.", "")) for t in ts]


class OpTracer:
    """Per-module op traces, fed by the recorder's hooks."""

    def __init__(self, select: Callable[[str], bool] | None = None, max_signatures: int = 4, max_ops: int = 2048):
        self.select = select or (lambda _name: True)
        self.max_signatures = max_signatures
        self.max_ops = max_ops
        self.traces: dict[str, list[CallTrace]] = {}
        self._signatures: dict[str, set] = {}
        self._calls: list[CallTrace | None] = []
        self._mode: Any = None
        self._depth = 0
        self._names: list[str] = []
        self.step = "prefill"  # set by the recorder at each forward pass
        self.active: Callable[[], bool] = lambda: True

    def _make_mode(self) -> Any:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracer._record(func, args, kwargs or {}, out)
                return out

        return _Mode()

    def _record(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if not self._calls or not self.active():
            return
        rec = None
        for call in self._calls:
            if call is None:
                continue
            if len(call.ops) >= self.max_ops:
                call.truncated = True
                continue
            if rec is None:
                rec = OpRecord(str(func), _meta(_tensors((args, kwargs))), _meta(_tensors(out)), self._names[-1])
            call.ops.append(rec)

    def enter(self, module: str) -> None:
        """A hooked module starts (pre-hook)."""
        if self._depth == 0:
            self._mode = self._make_mode()
            self._mode.__enter__()
        self._depth += 1
        self._names.append(module)
        self._calls.append(CallTrace(module, self.step) if self.select(module) else None)

    def exit(self, module: str) -> None:
        """A hooked module ends (forward hook, also on exceptions)."""
        call = self._calls.pop() if self._calls else None
        if self._names:
            self._names.pop()
        self._depth -= 1
        if self._depth == 0 and self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        if call is None or not call.ops:
            return
        seen = self._signatures.setdefault(call.module, set())
        sig = (call.step, call.signature())
        if sig in seen or len(seen) >= self.max_signatures:
            return
        seen.add(sig)
        self.traces.setdefault(call.module, []).append(call)

    def calls(self, module: str) -> list[CallTrace]:
        return self.traces.get(module, [])


#: aten ops that only rearrange or copy values; a shape difference in them explains nothing
_LAYOUT_OPS = frozenset(
    {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "transpose", "permute", "t", "slice",
     "select", "clone", "contiguous", "detach", "alias", "as_strided", "_to_copy", "copy_", "split", "chunk",
     "split_with_sizes", "cat", "stack", "scalar_tensor", "empty", "zeros", "ones", "full", "fill_"}
)


def compare_traces(a: list[OpRecord], b: list[OpRecord]) -> dict[str, Any] | None:
    """Where two op lists first part; None when ops, dtypes and shapes all match."""
    keys_a = [o.key() for o in a]
    keys_b = [o.key() for o in b]
    if keys_a == keys_b:
        shaped = [i for i, (x, y) in enumerate(zip(a, b)) if x.out != y.out or x.args != y.args]
        if not shaped:
            return None
        # the same ops with other shapes (a decode step against a prefill): name the first op that
        # computes, not a view or copy that only rearranges
        computing = [i for i in shaped if a[i].op.split(".")[1] not in _LAYOUT_OPS]
        i = (computing or shaped)[0]
        return {"index": i, "kind": "shape", "train": a[i].to_dict(), "infer": b[i].to_dict()}
    matcher = difflib.SequenceMatcher(a=keys_a, b=keys_b, autojunk=False)
    for tag, i1, _i2, j1, _j2 in matcher.get_opcodes():
        if tag != "equal":
            return {
                "index": i1,
                "index_infer": j1,
                "kind": "op" if (i1 < len(a) and j1 < len(b) and a[i1].op != b[j1].op) else "dtype_or_missing",
                "train": a[i1].to_dict() if i1 < len(a) else None,
                "infer": b[j1].to_dict() if j1 < len(b) else None,
            }
    return None


def summarize(trace: CallTrace, limit: int = 64) -> dict[str, Any]:
    """A JSON-ready view of one call's ops (the first ``limit``)."""
    return {
        "module": trace.module,
        "step": trace.step,
        "num_ops": len(trace.ops),
        "truncated": trace.truncated or len(trace.ops) > limit,
        "ops": [o.to_dict() for o in trace.ops[:limit]],
    }
