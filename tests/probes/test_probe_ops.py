"""Op traces: a dispatch mode driven by module hooks, and where two traces part."""

from __future__ import annotations

import torch

from logdiff.probes.ops import OpTracer, compare_traces


class Block(torch.nn.Module):
    def __init__(self, upcast: bool):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.upcast = upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return torch.relu(y.double()).to(x.dtype) if self.upcast else torch.relu(y)


def _trace(block: Block, x: torch.Tensor, step: str = "prefill") -> OpTracer:
    tracer = OpTracer()
    tracer.step = step
    names = {id(m): n or "block" for n, m in block.named_modules()}
    hooks = []
    for m in block.modules():
        hooks.append(m.register_forward_pre_hook(lambda mod, a: tracer.enter(names[id(mod)])))
        hooks.append(m.register_forward_hook(lambda mod, a, o: tracer.exit(names[id(mod)]), always_call=True))
    try:
        with torch.no_grad():
            block(x)
    finally:
        for h in hooks:
            h.remove()
    return tracer


def test_traces_are_inclusive_and_tagged_with_the_innermost_module() -> None:
    t = _trace(Block(upcast=False), torch.randn(2, 4))
    outer = t.calls("block")[0]
    inner = t.calls("lin")[0]
    assert outer.step == "prefill"
    assert [o.op for o in inner.ops] == [o.op for o in outer.ops if o.module == "lin"]
    assert any(o.op.startswith("aten.relu") and o.module == "block" for o in outer.ops)
    assert torch._C._len_torch_dispatch_stack() == 0  # the mode was popped


def test_identical_runs_do_not_part_and_an_upcast_is_found() -> None:
    torch.manual_seed(0)
    plain, upcast = Block(False), Block(True)
    upcast.load_state_dict(plain.state_dict())
    x = torch.randn(3, 4)
    a = _trace(plain, x).calls("block")[0].ops
    assert compare_traces(a, _trace(plain, x).calls("block")[0].ops) is None
    diff = compare_traces(a, _trace(upcast, x).calls("block")[0].ops)
    assert diff is not None and diff["kind"] in ("op", "dtype_or_missing")
    shaped = compare_traces(a, _trace(plain, torch.randn(5, 4)).calls("block")[0].ops)
    assert shaped is not None and shaped["kind"] == "shape"


def test_signatures_are_bounded() -> None:
    tracer = OpTracer(max_signatures=2)
    block = Block(False)
    for n in range(1, 5):
        tracer.enter("block")
        with torch.no_grad():
            block.lin.forward(torch.randn(n, 4))
        tracer.exit("block")
    assert len(tracer.calls("block")) == 2
