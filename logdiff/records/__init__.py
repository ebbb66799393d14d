"""Records: what each side of a run computed, in one format, on disk and in memory.

Every source writes through ``bundle_writer`` and every reader goes through ``bundle``
(which checks each fact a bundle states, ``bundle_input``). Here too: the row stores of a live
scan (``store``), row sketches (``sketch``, ``sketch_device``), where a recorded tensor lives and how
its pieces join (``layout``, ``unshard``, ``stages``), a trainer's batch rows as sequences
(``batching``), and the token sequences every path sees (``sequences``).

Records import nothing above them: only ``logdiff.errors``, ``logdiff.phases`` and ``kernels/``.
"""
