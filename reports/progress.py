"""The live progress display of a scan on the CLI's stderr console (``PhaseProgress``).

A listener of ``logdiff.phases.Phases``: one transient row per phase with its elapsed time, and
in a counted phase a bar with step k of n and the time remaining. The phase's message is
escaped (``format.safe_text``) and cut to its column, never wrapped; ``rich.progress`` is
imported when a display is made.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from .format import safe_text


class PhaseProgress:
    """Rich progress on the CLI's stderr console: one row per scan phase, with its elapsed time, and a
    bar with step k of n and the time remaining in a counted phase (the attribution rescans).

    It is the listener of ``logdiff.phases.Phases``: called with each update (an object with
    ``phase``, ``message``, ``step``, ``total``). Transient: the rows vanish when the scan ends.
    """

    def __init__(self, console: Console) -> None:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.table import Column

        def fixed(width: int) -> Column:
            return Column(width=width, no_wrap=True, overflow="ellipsis")

        # fixed widths for the phase, its bar and times; the message takes what is left and is cut, never wrapped
        self.progress = Progress(SpinnerColumn(finished_text="✓", table_column=fixed(1)),
                                 TextColumn("{task.fields[phase]}", table_column=fixed(15)),
                                 BarColumn(bar_width=12, table_column=fixed(12)),
                                 TextColumn("{task.fields[count]}", justify="right", table_column=fixed(5)),
                                 TimeElapsedColumn(table_column=fixed(7)), TimeRemainingColumn(table_column=fixed(7)),
                                 TextColumn("{task.description}",
                                            table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
                                 console=console, transient=True, expand=True)
        self._task: Any = None
        self._phase: Any = None

    def __enter__(self) -> "PhaseProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._finish()
        self.progress.stop()

    def _finish(self) -> None:
        if self._task is not None:
            task = self.progress.tasks[-1]
            self.progress.update(self._task, total=task.total or 1, completed=task.total or 1)

    def __call__(self, update: Any) -> None:
        if update.phase != self._phase:
            self._finish()
            self._phase = update.phase
            self._task = self.progress.add_task("", total=None, phase=str(update.phase), count="")
        step, total = update.step, update.total
        counted = isinstance(step, int) and isinstance(total, int) and total > 0
        self.progress.update(self._task, description=safe_text(update.message),
                             total=total if counted else None, completed=step - 1 if counted else 0,
                             count=f"{step}/{total}" if counted else "")
