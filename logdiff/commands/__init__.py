"""What each command runs, end to end: the top of the flow.

``scan`` (two live sides in one process), ``compare`` (two capture bundles), ``check`` (a result as CI
gates), ``doctor``, and their pieces: the scan's settings (``config``, ``options``, ``overrides``,
``override_types``), the batch-invariance and rollout-reproduction probes, and the files a run writes
(``outputs``). The CLI parses arguments and calls these; the diagnosis receives its settings as data.
"""
