"""The progress callback that times phases (logdiff/phases.py) and its rich display (reports/progress.py)."""

from __future__ import annotations

import io

from rich.console import Console

from logdiff.phases import Phases, peak_rss_bytes, silent
from logdiff.reports.progress import PhaseProgress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_phases_time_each_phase_and_sum_recurrences():
    clock, seen = Clock(), []
    p = Phases(seen.append, clock=clock)
    p("loading hf", phase="load")
    clock.now = 2.0
    p("loading vllm", phase="load")               # same phase: the clock keeps running
    clock.now = 5.0
    p("rescan 1 of 2", phase="attribute", step=(1, 2))
    clock.now = 6.5
    p("plain message")                            # no phase: stays in attribute
    clock.now = 7.0
    p("loading again", phase="load")
    clock.now = 8.0
    assert p.close() == {"load": 6.0, "attribute": 2.0}
    assert [(u.phase, u.step, u.total) for u in seen] == [("load", None, None), ("load", None, None),
                                                         ("attribute", 1, 2), ("attribute", None, None),
                                                         ("load", None, None)]
    assert seen[1].started == 0.0 and seen[2].started == 5.0


def test_phases_of_wraps_a_plain_callback_and_keeps_a_phases():
    got: list[str] = []
    p = Phases.of(got.append)
    p("hello", phase="x")
    assert got == ["hello"] and Phases.of(p) is p
    silent("ignored", phase="y", step=(1, 1))
    Phases.of(silent)("nothing", phase="z")       # a silent Phases still times
    assert peak_rss_bytes() > 10 * 2**20


def test_phase_progress_shows_phase_step_and_times():
    buf = io.StringIO()
    with PhaseProgress(Console(file=buf, force_terminal=True, width=120)) as shown:
        p = Phases(shown)
        p("loading hf", phase="load")
        p("attribution rescan 2 of 5: only kernel:rope fixed", phase="attribute", step=(2, 5))
        shown.progress.refresh()
        text = buf.getvalue()
    assert "load" in text and "attribute" in text and "2/5" in text and "0:00:00" in text
    assert "only kernel:rope fixed" in text


def test_costs_are_timed_only_when_on_and_counted_per_part(monkeypatch) -> None:
    import time

    from logdiff import phases

    before = phases.costs_copy()
    with phases.timed("test part"):  # off (no LOGDIFF_COSTS in the test run): nothing is counted
        pass
    assert phases.costs_since(before) == {}
    monkeypatch.setattr(phases, "COSTS_ON", True)
    for _ in range(2):
        with phases.timed("test part"):
            end = time.thread_time() + 0.01
            while time.thread_time() < end:  # CPU, not a sleep: the thread's own clock counts it
                pass
    got = phases.costs_since(before)["test part"]
    assert got["calls"] == 2 and got["cpu_s"] >= 0.02 and got["wall_s"] >= got["cpu_s"] * 0.5
