"""Who may import whom (../shared/design.md), held on the source: no import circles, and the layers.

Every module of the four packages (``logdiff`` = logdiff/, ``logdiff.kernels`` = kernels/,
``logdiff.probes`` = probes/, ``logdiff.reports`` = reports/: pyproject's package-dir) is parsed
with ``ast``, never imported, and every import of one of our modules is an edge: at module level,
inside a function (a lazy import is a dependency all the same), under ``if TYPE_CHECKING``, relative
ones resolved, and ``from pkg import name`` an edge to the submodule ``pkg.name`` where there is one
(to ``pkg`` itself otherwise). A package's ``__init__`` running before its submodules is not an edge.
New modules are picked up as the directories are scanned.

1. No circles: the strongly connected components of the graph are single modules; a failure
   names one circle, module by module.
2. The layers follow the flow, sources -> records -> comparison -> diagnosis -> reports (docs/design.md).
   A module's layer is the longest name in ``LAYERS`` it equals or lies under (``EXACT`` first); a
   module named nowhere is an error (``test_every_module_has_a_layer``). Each layer imports only
   ``MAY_IMPORT``, which is everything below it and nothing above:

   ==========  ======================================================================  =========================
   layer       modules                                                                 may import
   ==========  ======================================================================  =========================
   kernels     kernels/                                                                nothing of ours
   reports     reports/ (renders the result dict)                                      nothing of ours
   leaves      ``errors``, ``version``, ``isa``, ``phases``                            leaves
   records     ``logdiff.records`` (bundles, writer, stores, sketches, un-sharding)    + kernels
   probes      probes/ (hooks, sessions, architecture adapters)                        + records
   interface   ``logdiff.sources`` (default names), ``sources.base`` (the protocol)    + probes
   source      every folder under ``logdiff.sources`` (hf, vllm, megatron, msprobe,    + interface, reports
               the staged checkpoint, rollout dumps)
   registry    ``sources.registry`` (lists the sources), ``sources.pool``              + source
   comparison  ``logdiff.comparison`` (pairing, metrics, locate, the result)           interface, registry and
                                                                                       below, no source
   diagnosis   ``logdiff.diagnosis``                                                   + comparison
   entry       ``logdiff.commands``, ``logdiff.integrations``, ``logdiff.demo``        anything but top
   top         the ``logdiff`` package (the public API) and ``logdiff.cli``            anything
   ==========  ======================================================================  =========================

   So the comparison imports no source except through the protocol (``sources.base``) and the
   registry, which lists the implementations and is imported by none of them; sources never import
   the comparison, the diagnosis or a command; the diagnosis takes its settings as data, never the
   scan's config class; an architecture adapter (probes/arch/) never imports the package root.
3. A source is one folder: it imports no other source folder, except the crossings in
   ``CROSSINGS``, each with its reason (every one listed must still exist, so the table shrinks as
   they are removed).

What it cannot see: an import by a computed name (``importlib.import_module(f"...{x}")``). Two
registries use one: ``kernels/registry.py`` (the catalogue; no kernel imports it) and
``probes/arch/base.py`` (``FAMILIES``), whose family modules import ``base`` back for ``register``:
the circle design.md forbids, not yet split (a registry module importing the families, as
``logdiff/sources/registry.py`` does for the engines).

Negative controls: a planted package with a circle through a relative, lazy ``from pkg import
submodule`` import is found (and the same package without the back edge is not); a planted
comparison -> engine edge and a planted source -> scan edge are reported; the parser sees the lazy,
relative and ``TYPE_CHECKING`` imports the real code holds.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: modules that are their layer by their exact name only (their submodules are placed by ``LAYERS``)
EXACT = {"logdiff": "top", "logdiff.sources": "interface"}
#: layer -> the names it holds (each name and everything under it; the longest name wins)
LAYERS = {
    "kernels": ("logdiff.kernels",),
    "reports": ("logdiff.reports",),
    "leaves": ("logdiff.errors", "logdiff.version", "logdiff.isa", "logdiff.phases"),
    "records": ("logdiff.records",),
    "probes": ("logdiff.probes",),
    "interface": ("logdiff.sources.base",),
    "source": ("logdiff.sources",),
    "registry": ("logdiff.sources.registry", "logdiff.sources.pool"),
    "comparison": ("logdiff.comparison",),
    "diagnosis": ("logdiff.diagnosis",),
    "entry": ("logdiff.commands", "logdiff.integrations", "logdiff.demo"),
    "top": ("logdiff.cli",),
}
ALL = frozenset(LAYERS)
_BELOW_SOURCES = {"interface", "probes", "records", "leaves", "kernels"}
MAY_IMPORT = {
    "kernels": {"kernels"},
    "reports": {"reports"},
    "leaves": {"leaves"},
    "records": {"records", "leaves", "kernels"},
    "probes": {"probes", "records", "leaves", "kernels"},
    "interface": _BELOW_SOURCES,
    "source": {"source", "reports", *_BELOW_SOURCES},
    "registry": {"registry", "source", *_BELOW_SOURCES},
    "comparison": {"comparison", "registry", "reports", *_BELOW_SOURCES},
    "diagnosis": {"diagnosis", "comparison", "registry", "reports", *_BELOW_SOURCES},
    "entry": ALL - {"top"},
    "top": ALL,
}
#: (source folder, another source folder it imports) -> why; each must still exist
CROSSINGS = {
    ("logdiff.sources.vllm_ascend", "logdiff.sources.vllm"): "vllm-ascend is the vllm engine on Ascend's platform",
    ("logdiff.sources.vllm", "logdiff.sources.vllm_ascend"):
        "vllm's consistent mode picks its NPU backend (vllm_ascend.consistent) by platform",
    ("logdiff.sources.msprobe", "logdiff.sources.hf"):
        "an HF TP msprobe dump is placed by the plan logdiff's own HF TP capture runs (tensor_parallel.tp_plan)",
    ("logdiff.sources.msprobe", "logdiff.sources.vllm"):
        "a vLLM TP msprobe dump is placed by the layer types sources/vllm/placements.py declares, not a copy",
}


# ------------------------------------------------------------------------------------------- the graph


def packages(root: Path = ROOT) -> dict[str, Path]:
    """Our top-level packages and their folders: pyproject's ``[tool.setuptools.package-dir]`` (read with a
    regular expression: ``tomllib`` is Python 3.11+, the project 3.10+), ``logdiff`` first."""
    text = (root / "pyproject.toml").read_text()
    section = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert section, "pyproject.toml has no [tool.setuptools.package-dir]"
    dirs = dict(re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', section.group(1), re.M))
    assert dirs.get("logdiff") == "logdiff", dirs
    return {"logdiff": root / "logdiff", **{k: root / v for k, v in dirs.items() if k != "logdiff"}}


def modules(roots: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's ``__init__``), for every ``.py`` under each root."""
    out: dict[str, tuple[Path, bool]] = {}
    for package, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            init = parts[-1] == "__init__"
            out[".".join([package, *(parts[:-1] if init else parts)])] = (path, init)
    return out


def _targets(node: ast.Import | ast.ImportFrom, name: str, init: bool, known: Iterable[str]) -> list[str]:
    """The module names one import statement in module ``name`` reaches."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = name.split(".") if init else name.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([node.module] if node.module else [])])
    subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
    return subs + ([base] if len(subs) < len(node.names) else [])


def _owner(target: str, known: dict[str, tuple[Path, bool]]) -> str | None:
    """The module of ours ``target`` names (``logdiff.x.attr`` -> ``logdiff.x``), or None."""
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


def import_graph(roots: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere in its source (module level, functions, TYPE_CHECKING)."""
    known = modules(roots)
    graph: dict[str, set[str]] = {}
    for name, (path, init) in known.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, name, init, known):
                    owner = _owner(target, known)
                    if owner is not None and owner != name:
                        edges.add(owner)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module, as ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; our graph is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_shortest_circle(graph, set(c)) for c in components]


def _shortest_circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest circle through the component's first module, by breadth-first search inside it."""
    start = min(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & component):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"no circle through {start} in its component")  # pragma: no cover


def layer_of(module: str) -> str:
    if module in EXACT:
        return EXACT[module]
    best, layer = "", "unplaced"
    for name, names in LAYERS.items():
        for prefix in names:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, layer = prefix, name
    return layer


def source_folder(module: str) -> str | None:
    """The source folder a module belongs to (``logdiff.sources.hf``, ``logdiff.sources.msprobe``), or None."""
    if layer_of(module) != "source":
        return None
    return ".".join(module.split(".")[:3])


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every edge the layers or the one-folder rule forbid, one line each."""
    out = []
    for module in sorted(graph):
        layer = layer_of(module)
        if layer == "unplaced":
            out.append(f"{module} lies in no layer: place its folder in LAYERS (and docs/design.md)")
            continue
        for target in sorted(graph[module]):
            if layer_of(target) not in MAY_IMPORT[layer]:
                out.append(f"{module} ({layer}) imports {target} ({layer_of(target)}); "
                           f"{layer} may import only {', '.join(sorted(MAY_IMPORT[layer]))}")
            mine, theirs = source_folder(module), source_folder(target)
            if mine and theirs and mine != theirs and (mine, theirs) not in CROSSINGS:
                out.append(f"{module} imports {target}: a source is one folder and touches no other source")
    return out


def crossings(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(source_folder(m), source_folder(t)) for m, ts in graph.items() for t in ts
            if source_folder(m) and source_folder(t) and source_folder(m) != source_folder(t)}


# ------------------------------------------------------------------------------------------- the checks


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(packages())


def test_no_import_circles(graph: dict[str, set[str]]) -> None:
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_layers(graph: dict[str, set[str]]) -> None:
    found = violations(graph)
    assert not found, "imports across the layers of design.md:\n" + "\n".join(found)


def test_every_listed_name_and_crossing_exists(graph: dict[str, set[str]]) -> None:
    """A name in the tables that matches no module, or a crossing that no longer exists, is stale."""
    names = [*EXACT, *(n for names in LAYERS.values() for n in names)]
    stale = [n for n in names if not any(m == n or m.startswith(n + ".") for m in graph)]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"
    gone = set(CROSSINGS) - crossings(graph)
    assert not gone, f"CROSSINGS lists crossings that no longer exist (remove them): {sorted(gone)}"


def test_the_parser_sees_lazy_relative_and_type_checking_imports(graph: dict[str, set[str]]) -> None:
    """Edges the real code holds only inside a function, only relatively, or only for type checking."""
    assert "logdiff.comparison.bundle_feed" in graph["logdiff.commands.scan"]  # lazy, in ``_score``
    assert "logdiff.kernels.attention_backward" in graph["logdiff.kernels.attention"]  # relative and lazy
    assert "logdiff.diagnosis.distribution" in graph["logdiff.diagnosis.truncation"]  # under TYPE_CHECKING
    assert "logdiff.records.ulps" in graph["logdiff.records.store"]  # lazy, in ``PathStore.emit``
    assert "logdiff.sources.hf" in graph["logdiff.sources.registry"]  # the registry lists the engines
    for package in packages():  # every folder of pyproject's package-dir was scanned, not only logdiff/
        assert package in graph and any(m.startswith(package + ".") for m in graph), package


def test_control_a_planted_circle_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "planted"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from planted.sub import b\n")
    (pkg / "sub" / "b.py").write_text("import os\n\n\ndef f():\n    from .. import c\n    return c\n")
    (pkg / "c.py").write_text("def g():\n    from planted import a\n    return a.b\n")
    roots = {"planted": pkg}
    found = circles(import_graph(roots))
    assert found == [["planted.a", "planted.sub.b", "planted.c", "planted.a"]]
    (pkg / "c.py").write_text("def g():\n    import os\n    return os\n")  # the back edge removed
    graph = import_graph(roots)
    assert circles(graph) == [] and graph["planted.sub.b"] == {"planted.c"}


def test_control_planted_layer_crossings_are_reported(graph: dict[str, set[str]]) -> None:
    planted = {k: set(v) for k, v in graph.items()}
    planted["logdiff.comparison.locate"].add("logdiff.sources.hf")  # the comparison naming a source
    planted["logdiff.sources.msprobe.convert"].add("logdiff.commands.scan")  # a source importing a command
    planted["logdiff.sources.msprobe.convert"].add("logdiff.comparison.metrics")  # a source importing the comparison
    planted["logdiff.sources.msprobe.convert"].add("logdiff.sources.megatron.recording")  # a source touching another
    planted["logdiff.records.bundle"].add("logdiff.probes.session")  # records importing the probes above them
    planted["logdiff.diagnosis.diagnose"].add("logdiff.commands.config")  # the diagnosis taking the scan's config
    planted["logdiff.probes.arch.deepseek_v2"].add("logdiff")  # an adapter importing the package root
    planted["logdiff.comparison.result"].add("logdiff.diagnosis.classify")  # the comparison importing the diagnosis
    planted["logdiff.stray"] = set()  # a module in no stage folder
    found = violations(planted)
    expected = ["logdiff.comparison.locate (comparison) imports logdiff.sources.hf (source)",
                "logdiff.sources.msprobe.convert (source) imports logdiff.commands.scan (entry)",
                "logdiff.sources.msprobe.convert (source) imports logdiff.comparison.metrics (comparison)",
                "logdiff.sources.msprobe.convert imports logdiff.sources.megatron.recording: a source is one folder",
                "logdiff.records.bundle (records) imports logdiff.probes.session (probes)",
                "logdiff.diagnosis.diagnose (diagnosis) imports logdiff.commands.config (entry)",
                "logdiff.probes.arch.deepseek_v2 (probes) imports logdiff (top)",
                "logdiff.comparison.result (comparison) imports logdiff.diagnosis.classify (diagnosis)",
                "logdiff.stray lies in no layer"]
    for line in expected:
        assert any(f.startswith(line) for f in found), (line, found)
    assert len(found) == len(expected) + len(violations(graph))
    planted["logdiff.sources.base"].add("logdiff.sources.registry")  # the protocol importing its registry
    assert any({"logdiff.sources.base", "logdiff.sources.registry"} <= set(c) for c in circles(planted))


def test_the_root_holds_only_the_api_the_cli_and_leaves() -> None:
    """logdiff/ itself: the public API, the CLI and the leaves; every other module lives in its stage's folder."""
    root = {p.stem for p in (ROOT / "logdiff").glob("*.py")}
    assert root == {"__init__", "cli", *(name.split(".")[1] for name in LAYERS["leaves"])}, sorted(root)
