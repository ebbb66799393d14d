"""The README's demo figures are what the demo prints (issue 52).

README.md quotes the demo's figures in one marked block, a table between
``<!-- demo-figures: ... -->`` and ``<!-- /demo-figures -->`` whose opening line names where they
were measured (the hardware key and the torch, transformers and vLLM versions). Every row is
rendered again here from a result.json; a README row that differs, a row this test does not
render, or a rendered row the README lacks is a failure. CPU numerics depend on the machine
(docs/portability.md), so the comparison with a live demo scan runs where the block's machine and
versions are this one's and is skipped elsewhere, naming both; the block's form and the
comparison's power to fail (a planted drift) are checked everywhere.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"<!-- demo-figures: (?P<where>.*?) -->\n(?P<table>.*?)<!-- /demo-figures -->", re.DOTALL)
MEASURED_ON = ("hardware", "torch", "transformers", "vllm")
FAMILIES = {"rope": "RoPE", "rms_norm": "RMSNorm", "attention": "attention"}
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
LABELS = (
    "verdict",
    "tokens compared",
    r"max / mean \|Δ logprob\|",
    "first divergence",
    "causes",
    "conformance, worse side",
    "share of the mean gap",
    "closed by all together",
    r"mean \|Δ logprob\| with one family fixed alone",
    "interaction",
)


def _pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%".replace("-", "−")


def figures(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The block's rows, (label, value), rendered from a demo result: the primary pair's gap and the attribution."""
    metrics, att, first = result["pairs"][0]["metrics"], result["attribution"], result["first_divergence"]
    causes, groups = result["causes"], result["cause_groups"]
    levers = sorted(att["levers"], key=lambda lever: -lever["share"])
    family = [lever["lever"].removeprefix("kernel:") for lever in levers]
    name = [FAMILIES.get(f, f) for f in family]
    worst, bound = {}, {}
    for c in causes:
        for side in (c.get("conformance") or {}).values():
            worst[c["family"]] = max(worst.get(c["family"], 0.0), side["error"])
            bound[c["family"]] = max(bound.get(c["family"], 0.0), side["bound"])
    responses = sorted(set(result["sequences"]["response_lens"]))
    per_sequence = f"{responses[0]}" if len(responses) == 1 else f"{responses[0]}–{responses[-1]}"
    classes = sorted({c["class"] for c in causes})
    values = (
        f"`{result['verdict']}`",
        f"{metrics['num_tokens']} ({result['sequences']['count']} sequences × {per_sequence} response tokens)",
        f"{metrics['abs_diff_max']:.4g} / {metrics['abs_diff_mean']:.4g}",
        f"`{first['boundary']}` (layer {first['layer']}), inputs {'bitwise equal' if first['inputs_equal'] else 'differ'}",
        f"{len(causes)} introducing ops in {len(groups)} families, "
        + (f"all `{classes[0]}`" if len(classes) == 1 else ", ".join(f"`{c}`" for c in classes)),
        ", ".join(f"{n} {worst[f]:.3g}" for n, f in zip(name, family))
        + f" units of {DTYPES.get(result['dtype'], result['dtype'])} spacing (bounds "
        + ", ".join(f"{bound[f]:.3g}" for f in family) + ")",
        ", ".join(f"{n} {_pct(lever['share'])}" for n, lever in zip(name, levers)),
        _pct(att["closed"], 0),
        ", ".join(f"{n} {lever['alone_abs_diff_mean']:.3g}" for n, lever in zip(name, levers))
        + f" (none fixed: {att['baseline']:.3g})",
        _pct(att["interaction"], 0),
    )
    return list(zip(LABELS, values))


def readme_block(text: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """(where the figures were measured, the table's rows) of the README's demo-figures block."""
    m = _BLOCK.search(text)
    assert m, "README.md has no <!-- demo-figures: ... --> block"
    where = dict(part.strip().split(" ", 1) for part in m["where"].split(";"))
    rows = []
    for line in m["table"].strip().splitlines()[2:]:                       # past the header and its rule
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        assert len(cells) == 2, f"a demo-figures row is `| label | value |`: {line!r}"
        rows.append((cells[0], cells[1]))
    return where, rows


def drift(quoted: list[tuple[str, str]], rendered: list[tuple[str, str]]) -> list[str]:
    """Every way the quoted rows differ from the rendered ones, one line each."""
    found = [f"{label}: README {dict(quoted)[label]!r}, demo {value!r}"
             for label, value in rendered if label in dict(quoted) and dict(quoted)[label] != value]
    found += [f"{label}: not in the README" for label, _ in rendered if label not in dict(quoted)]
    found += [f"{label}: quoted, but no test renders it" for label, _ in quoted if label not in dict(rendered)]
    return found


def _machine() -> dict[str, str]:
    from logdiff.commands.baselines import hardware_key
    from logdiff.comparison.environment import environment

    env = environment()
    return {"hardware": hardware_key(env), **{k: str(env.get(k)) for k in MEASURED_ON[1:]}}


def test_the_block_names_its_machine_and_quotes_the_rendered_rows() -> None:
    where, rows = readme_block(README.read_text(encoding="utf-8"))
    assert tuple(where) == MEASURED_ON
    assert tuple(label for label, _ in rows) == LABELS


def _result(share_rope: float = 0.401) -> dict[str, Any]:
    """A small result of the demo's shape, for the comparison's own checks."""
    levers = [{"lever": "kernel:rope", "share": share_rope, "alone_abs_diff_mean": 0.0037},
              {"lever": "kernel:attention", "share": 1 - share_rope, "alone_abs_diff_mean": 0.004}]
    conf = {"train": {"error": 1.1, "bound": 4.0}, "infer": {"error": 0.8, "bound": 4.0}}
    causes = [{"family": "rope", "class": "operator_path", "conformance": conf},
              {"family": "attention", "class": "operator_path", "conformance": conf}]
    return {"verdict": "operator_path", "dtype": "bfloat16", "sequences": {"count": 2, "response_lens": [4, 4]},
            "pairs": [{"metrics": {"num_tokens": 8, "abs_diff_max": 0.03, "abs_diff_mean": 0.0035}}],
            "first_divergence": {"boundary": "model.layers.0.self_attn.rope_q", "layer": 0, "inputs_equal": True},
            "causes": causes, "cause_groups": [{}, {}],
            "attribution": {"levers": levers, "closed": 1.0, "interaction": -1.15, "baseline": 0.0035}}


def test_a_drifted_figure_a_missing_row_and_an_unchecked_row_are_caught() -> None:
    quoted = figures(_result())
    assert drift(quoted, figures(_result())) == []
    assert dict(quoted)["share of the mean gap"] == "attention 59.9%, RoPE 40.1%"
    assert dict(quoted)["interaction"] == "−115%"
    moved = drift(quoted, figures(_result(share_rope=0.47)))
    assert moved == ["share of the mean gap: README 'attention 59.9%, RoPE 40.1%', demo 'attention 53.0%, RoPE 47.0%'"]
    assert drift(quoted[:-1], figures(_result())) == ["interaction: not in the README"]
    assert drift([*quoted, ("the scan took", "18 s")], figures(_result())) == [
        "the scan took: quoted, but no test renders it"]


@pytest.mark.vllm
@pytest.mark.slow
def test_the_readme_quotes_the_demo_scans_figures(request: pytest.FixtureRequest) -> None:
    """Against this session's demo scan (tests/conftest.py's demo_scan), on the machine the figures name."""
    where, quoted = readme_block(README.read_text(encoding="utf-8"))
    here = _machine()
    if here != where:
        pytest.skip(f"the README's demo figures were measured on {where}; this is {here}: "
                    "run scripts/demo.sh on such a machine to check them")
    result = request.getfixturevalue("demo_scan")
    assert drift(quoted, figures(result)) == [], "README.md's demo-figures block should read:\n" + "\n".join(
        f"| {label} | {value} |" for label, value in figures(result))
