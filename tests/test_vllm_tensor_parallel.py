"""``--set infer.tensor_parallel_size=2``: vLLM's own tensor parallel, its workers in processes of their own.

At ``--depth logprobs`` the scan runs with it as with any vLLM option (the engine reports the size it
ran); what needs the model in this process (module probes, consistent mode) is refused before anything
loads (tests/test_cli_inputs.py). The workers' modules are captured by the plugin instead
(tests/test_capture_vllm.py, tests/test_rl_step_capture.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_logprobs_scan_runs_on_two_vllm_workers(qwen3: Path) -> None:
    from logdiff.commands.config import ScanConfig
    from logdiff.commands.scan import scan
    from logdiff.sources.pool import engine_pool

    with engine_pool():  # its own engines, shut down after: the workers go with them
        result = scan(ScanConfig(model=qwen3, num_sequences=3, prompt_len=10, response_len=8, depth="logprobs",
                                 infer_set={"tensor_parallel_size": 2})).to_dict()
    vllm = next(p for p in result["paths"] if p["engine"] == "vllm")
    assert vllm["settings"]["tensor_parallel_size"] == 2
    metrics = result["logprobs"]
    assert metrics["num_tokens"] == 3 * 8 and np.isfinite(metrics["abs_diff_max"])
