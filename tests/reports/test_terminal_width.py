"""Every line of the terminal summary fits the console's width (issue 25).

The summary of each saved result (data/sample_result.json, data/demo_scan_result.json) and of a
synthetic worst case (a very long model path, boundary and path names, six paths, a mixed verdict
with MoE routing, a recorded rollout, NaN/inf and long warnings) is rendered with a rich Console of
80 and of 120 columns (record=True, export_text) and each line's display width is measured with
``rich.cells.cell_len``, so a wide character counts as the two cells it takes. Then the facts that
must survive the fitting are looked for: the verdict, the gap's numbers, the first divergence's
boundary (whole when it fits, else its head and tail). The checker is shown to catch a line one
cell too long. ``--quiet`` is the documented exception: one line, never wrapped, for logs and grep.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest
from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

from logdiff.reports.fitting import fit, middle
from logdiff.reports.format import fmt_num
from logdiff.reports.groups import group_causes
from logdiff.reports.terminal import print_summary, verdict_line

DATA = Path(__file__).with_name("data")
WIDTHS = [80, 120]
SAVED = ["sample_result", "demo_scan_result", "demo_scan_v2"]

LONG_MODEL = ("/mnt/shared/checkpoints/实验-qwen3-moe-30b-a3b-bf16-with-a-very-long-experiment-name-2025-06-01/"
              "global_step_1200/actor/huggingface")
LONG_BOUNDARY = ("model.language_model.decoder.layers.47.block_sparse_moe.experts.shared_expert."
                 "gate_up_proj.quantized_linear")
PATH_NAMES = ["hf-fsdp2-trainer-with-activation-checkpointing-and-sequence-packing", "vllm-decode-cuda-graphs-tp8",
              "vllm-prefill", "sglang-decode-radix-cache-disabled", "sglang-prefill", "megatron-core-te-fp8"]


def render(result: dict, width: int, quiet: bool = False) -> str:
    console = Console(record=True, no_color=True, width=width, file=io.StringIO())
    print_summary(result, console, quiet=quiet)
    return console.export_text()


def overflowing(text: str, width: int) -> list[tuple[int, str]]:
    """The lines of ``text`` wider than ``width`` cells, with their widths."""
    return [(cell_len(line), line) for line in text.splitlines() if cell_len(line) > width]


def saved(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


def synthetic(sample: dict) -> dict:
    """The sample made as long as a real setup gets: every name long, six paths, everything shown."""
    r = copy.deepcopy(sample)
    r["verdict"] = "mixed"
    r["model"] = LONG_MODEL
    r["paths"] = [{"name": name, "role": "train" if i == 0 else "infer", "engine": name.split("-")[0],
                   "mode": "decode" if "decode" in name else "prefill", "version": "0.32.0.dev1234+g0123abcd"}
                  for i, name in enumerate(PATH_NAMES)]
    metrics = r["pairs"][0]["metrics"]
    r["pairs"] = [{"train": PATH_NAMES[0], "infer": name, "metrics": dict(metrics)} for name in PATH_NAMES[1:]]
    r["first_divergence"] = {"boundary": LONG_BOUNDARY, "layer": 47, "position": 1234, "max_abs_diff": 0.0312,
                             "inputs_equal": False}
    r["timings"] = {"load:" + PATH_NAMES[0]: 92.0, "attribute-shapley-sampled-levers": 1322.5,
                    "score:" + PATH_NAMES[1]: 61.0, "sample": 17.0}
    r["peak_rss_bytes"] = 96 * 2**30
    r["warnings"] = [(f"{LONG_BOUNDARY}.weight_scale_inv_and_its_companion_tensors_were_not_aligned is fused in "
                      "vLLM's FusedMoE and cannot be aligned per expert; it is compared at the parent instead")]
    r["non_finite"] = {"summary": f"NaN first at {LONG_BOUNDARY} on {PATH_NAMES[3]} (position 1234, 17 tokens)"}
    r["rollout_replay"] = {"reproduced": False, "summary": "the recorded rollout logprobs differ from today's "
                           f"{PATH_NAMES[1]} replay: max |Δ| 0.5, mean 0.01, 3 of 4096 tokens beyond 0.1"}
    r["moe"] = {"layers": [{"boundary": f"model.language_model.decoder.layers.{n}.block_sparse_moe.gate",
                            "flips": n, "flip_rate": n / 100} for n in range(48)],
                "tokens_flipped_any_layer": 0.25, "class": "framework_difference",
                "kinds": ["router_softmax_precision", "renormalize_topk_mismatch"],
                "replay": {"before": {"abs_diff_mean": 0.01}, "after": {"abs_diff_mean": 0.001}}}
    causes = copy.deepcopy(r["causes"])
    for i, cause in enumerate(causes):
        cause["boundary"] = LONG_BOUNDARY.replace("47", str(47 - i))
        cause["family"] = f"{cause['kind']}_with_a_much_longer_family_name"
        cause["fix"] = "set attention_backend=FLASHINFER_WITH_DETERMINISTIC_REDUCTION_AND_A_FIXED_SPLIT_KV " * 3
    r["causes"] = causes
    r["cause_groups"] = group_causes(causes)
    return r


@pytest.fixture
def long_result(sample_json) -> dict:
    return synthetic(sample_json)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", SAVED)
def test_saved_results_fit(name, width):
    result = saved(name)
    text = render(result, width)
    assert overflowing(text, width) == [], text
    lp, fd = result["logprobs"], result["first_divergence"]
    assert f"logdiff: {result['verdict']}" in text
    assert f"max|Δlogprob| {fmt_num(lp['abs_diff_max'])}  mean {fmt_num(lp['abs_diff_mean'])}" in text
    # at 80 and at 120 the names fit whole: nothing is shortened, only moved to a line of its own
    if result["schema_version"] >= 2:   # where the boundary starts to differ, and apart where it differs most
        worst = fd["worst"]
        assert f"first divergence {fd['boundary']} @ position {fd['position']}" in text
        assert (f"first divergence: {fd['boundary']} (layer {fd['layer']}) starts at position {fd['position']}, "
                f"sequence {fd['sequence']}; largest |Δ| {fmt_num(worst['max_abs_diff'])} at position "
                f"{worst['position']} (response token {worst['response_index']}), sequence {worst['sequence']}; "
                "inputs bitwise equal") in " ".join(text.split())
    else:                               # version 1 recorded only where it differs most: never shown as the first
        assert f"first divergence {fd['boundary']}  " in text and "@ position" not in text
        assert (f"first divergence: {fd['boundary']} (layer {fd['layer']}): largest |Δ| "
                f"{fmt_num(fd['max_abs_diff'])} at position {fd['position']}, sequence {fd['sequence']};") \
            in " ".join(text.split())
        assert "starts at" not in text
    assert f"{len(result['causes'])} causes" in text
    assert "…" not in text.split("Causes:")[0]
    for path in result["paths"]:
        assert f"{path['name']} ({path['engine']} {path['version']}, {path['mode']})" in text


@pytest.mark.parametrize("name", SAVED)
def test_verdict_breaks_between_fields_at_80_columns(name):
    result = saved(name)
    lines = render(result, 80).splitlines()
    assert lines[0].startswith(f"logdiff: {result['verdict']}  max|Δlogprob| ")
    assert lines[0].endswith("(hf vs vllm)")                                     # verdict + gap
    assert lines[1].startswith("  first divergence model.layers.0.")             # first divergence + causes
    assert lines[1].endswith(f"{len(result['causes'])} causes")


def test_a_wide_console_keeps_the_verdict_on_one_line(sample_json):
    first = render(sample_json, 140).splitlines()[0]
    assert first == verdict_line(sample_json).plain


@pytest.mark.parametrize("width", WIDTHS)
def test_long_names_fit_and_stay_recognisable(long_result, width):
    text = render(long_result, width)
    assert overflowing(text, width) == [], text
    assert "logdiff: mixed" in text
    assert f"max|Δlogprob| {fmt_num(long_result['logprobs']['abs_diff_max'])}" in text
    assert "(incomplete)" not in text and "warning: non-finite values" in text
    for line in text.splitlines():
        if "first divergence" in line:                                           # the boundary: head … tail
            assert "model." in line and "…" in line and "quantized_linear" in line, line
    head_lines = text.split("Causes:")[0]
    assert "/mnt/shared/" in head_lines and "actor/huggingface" in head_lines      # the model path's ends
    assert "vllm-decode-cuda-graphs-tp8 (vllm" in head_lines                       # a short enough name is whole
    assert "megatron-core-te-fp8 (megatron 0.32.0.dev1234+g0123abcd, prefill)" in head_lines
    assert "moe routing:" in text and "routing replay: mean |Δ| 0.01 → 0.001" in text
    assert "Key metrics" in text and "recorded rollout:" in text
    trainer = f"{PATH_NAMES[0]} (hf 0.32.0.dev1234+g0123abcd, prefill)"            # 106 cells
    worst = "worst model.language_model.decoder.layers.47.block_sparse_moe.gate: 47%"
    if width == 120:                                                               # nothing lost that fits
        assert trainer in head_lines and worst in text
        assert f"(hf-fsdp2-trainer-…and-sequence-packing vs {PATH_NAMES[1]})" in head_lines
    else:
        assert trainer not in head_lines and "hf-fsdp2-trainer-…" in head_lines


@pytest.mark.parametrize("width", WIDTHS)
def test_incomplete_result_fits(long_result, width):
    long_result["complete"] = False
    text = render(long_result, width)
    assert overflowing(text, width) == [], text
    assert "logdiff: mixed (incomplete)" in text and "stopped early" in text


def test_middle_keeps_head_and_tail():
    name = "model.layers.0.self_attn.rope_q"
    assert middle(name, 40) == name
    for width in (12, 16, 20, 25, 30):
        short = middle(name, width)
        assert cell_len(short) <= width and short.startswith("model") and short.endswith("rope_q"), short
        assert short.count("…") == 1
    assert middle(name, 20) == "model.…attn.rope_q"
    wide = middle("/模型/" * 10 + "final", 15)                                   # wide characters count as 2
    assert cell_len(wide) <= 15 and wide.endswith("final")


def test_fit_breaks_between_fields_and_wraps_prose():
    fields = [("", Text("a" * 30)), ("  ", Text("b" * 30)), (", ", Text("c" * 30))]
    lines = [line.plain for line in fit(fields, 80)]
    assert lines == ["a" * 30 + "  " + "b" * 30 + ",", "  " + "c" * 30]
    prose = [("", Text("word " * 40 + "x" * 200))]
    lines = [line.plain for line in fit(prose, 80)]
    assert all(cell_len(line) <= 80 for line in lines) and lines[0].startswith("word word")
    assert "…" in lines[-1] and lines[-1].strip().startswith("x") and lines[-1].endswith("x")


def test_the_checker_catches_a_line_one_cell_too_long(sample_json):
    console = Console(record=True, no_color=True, width=80, file=io.StringIO())
    print_summary(sample_json, console)
    console.print(Text("x" * 81), soft_wrap=True)                                # one cell over
    text = console.export_text()
    assert [width for width, _ in overflowing(text, 80)] == [81]
    assert overflowing("界" * 40, 80) == [] and overflowing("界" * 40 + "x", 80) != []   # cells, not characters


def starts_a_command(text: str) -> list[str]:
    """The lines a CI runner would read as a workflow command (it ignores leading whitespace)."""
    return [line for line in text.splitlines() if line.lstrip().startswith(("::", "##"))]


@pytest.mark.parametrize("width", WIDTHS)
def test_wrapping_never_starts_a_line_with_a_ci_command(long_result, width):
    """A result's strings cannot start a line of their own (format.terminal_safe), and wrapping must not
    give them one either: ``::error::`` stays joined to the word or field before it."""
    long_result["warnings"].append("word " * ((width - 10) // 5) + "::error::injected here")
    long_result["paths"][2]["name"] = "::error::path"
    long_result["timings"]["::warning::phase"] = 600.0
    text = render(long_result, width)
    assert starts_a_command(text) == [] and overflowing(text, width) == [], text
    assert "word ::error::injected" in text and "::error::path" in text and "::warning::phase" in text
    # negative control: the checker sees a command behind an indent ...
    assert starts_a_command("ok\n  ::error::x") == ["  ::error::x"]
    # ... and here plain greedy breaking would give "::error::injected" a line of its own
    head = "warning: " + " ".join(["word"] * 14)
    assert cell_len(head) <= 80 < cell_len(head + " ::error::injected")
    lines = [line.plain for line in fit([("", Text(head + " ::error::injected"))], 80)]
    assert lines == ["warning: " + " ".join(["word"] * 13), "  word ::error::injected"]


@pytest.mark.parametrize("name", SAVED)
def test_quiet_is_the_one_long_line_for_logs(name):
    """--quiet prints the verdict as one line, never wrapped or shortened (documented: for logs and grep)."""
    result = saved(name)
    text = render(result, 80, quiet=True)
    assert text.count("\n") == 1 and text.rstrip("\n") == verdict_line(result).plain
    assert overflowing(text, 80)                                                 # longer than 80: by design
    assert f"first divergence {result['first_divergence']['boundary']}" in text
