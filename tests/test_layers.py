"""The project's imports point down and never go round in a circle.

Layers, lowest first: `spec` <- `fast` <- `shadow` <- `conformance` <- {`slotmap`, `benchmarks`} (side by side: neither
imports the other). Inside `slotmap`: {`tiny`, `pictures`, `bench`} <- {`simulate`, `explore`} <- `cli`. A module may
import its own layer and the layers below it, never one above nor a sibling. On top of that no module may
take part in an import cycle, counting every import in the file (inside functions too: a deferred
import still ties the two modules together).

The graph is read from the source with `ast`, not by importing anything, so a new package or module
is covered as soon as it exists.
"""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (package prefix, rank): a module may import modules whose rank is lower, or its own prefix.
LAYERS: tuple[tuple[str, int], ...] = (
    ("spec", 0),
    ("fast", 1),
    ("shadow", 2),  # the shadow checker and vllm_attach: spec beside an existing engine
    ("conformance", 3),
    ("benchmarks", 4),
    ("slotmap", 4),
    ("slotmap.tiny", 4),
    ("slotmap.pictures", 4),
    ("slotmap.bench", 4),
    ("slotmap.simulate", 5),
    ("slotmap.explore", 5),  # the explorer page: a whole run, from pictures' rows of each step
    ("slotmap.cli", 6),
    ("slotmap.__main__", 7),  # `python -m slotmap`: the command line again
)
PACKAGES = ("spec", "fast", "shadow", "conformance", "benchmarks", "slotmap")


def module_names(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of the packages under root."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (they never run)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found |= {id(n) for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Import | ast.ImportFrom)}
    return found


def _imported(module: str, path: Path, type_only: bool) -> Iterator[tuple[str, int]]:
    """(dotted name, line) of everything the file imports; `from a import b` yields `a.b` (b may not be a module)."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if type_only else _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                anchor = here[: len(here) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES, type_only: bool = True) -> dict[str, dict[str, int]]:
    """module -> {project module it imports -> first line}: the longest known prefix of each imported name.

    `type_only=False` leaves out the imports under `if TYPE_CHECKING:`, which never run.
    """
    modules = module_names(root, packages)
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        for name, line in _imported(module, path, type_only):
            prefixes = (name.rsplit(".", cut)[0] for cut in range(name.count(".") + 1))  # longest first
            target = next((p for p in prefixes if p in modules), None)
            if target is not None and target != module:
                graph[module].setdefault(target, line)
    return graph


def layer_of(module: str) -> tuple[str, int]:
    matches = [(prefix, rank) for prefix, rank in LAYERS if module == prefix or module.startswith(prefix + ".")]
    if not matches:
        raise ValueError(f"{module} belongs to no layer: add its package to LAYERS")
    return max(matches, key=lambda m: len(m[0]))


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports of a higher layer, or of a sibling layer of the same rank (e.g. slotmap <-> benchmarks)."""
    bad = []
    for module, targets in graph.items():
        prefix, rank = layer_of(module)
        for target, line in targets.items():
            their_prefix, their_rank = layer_of(target)
            if their_prefix == prefix or their_rank < rank:
                continue
            if module.startswith(their_prefix + ".") and their_prefix == "slotmap":
                continue  # slotmap's parts may use the package's own top-level modules
            bad.append(f"{module} (line {line}) imports {target}: {prefix} may not import {their_prefix}")
    return bad


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter({m: set(t) for m, t in graph.items()}).prepare()
    except graphlib.CycleError as e:
        return list(e.args[1])
    return None


def test_every_import_points_down() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 50 and sum(len(t) for t in graph.values()) > 100  # the scan really read the project
    assert upward_imports(graph) == []


def test_no_import_cycle() -> None:
    assert find_cycle(import_graph(ROOT, type_only=False)) is None


def test_no_import_cycle_even_in_type_annotations() -> None:
    assert find_cycle(import_graph(ROOT)) is None


def test_the_product_never_imports_its_test_suite() -> None:
    graph = import_graph(ROOT)
    for module, targets in graph.items():
        if module.split(".")[0] in ("spec", "fast"):
            assert not [t for t in targets if t.startswith(("conformance", "benchmarks", "slotmap"))], module


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


BASE = {
    "spec/__init__.py": "from spec.types import T\n",
    "spec/types.py": "T = 1\n",
    "fast/__init__.py": "from .pool import Pool\n",
    "fast/pool.py": "from spec.types import T\nPool = T\n",
    "conformance/__init__.py": "",
    "conformance/backends.py": "import fast\n",
    "benchmarks/__init__.py": "",
    "slotmap/__init__.py": "",
    "slotmap/tiny/__init__.py": "",
    "slotmap/tiny/engine.py": "from conformance.backends import *\n",
    "slotmap/cli/__init__.py": "",
    "slotmap/cli/app.py": "def main():\n    from slotmap.tiny import engine\n",
}


def test_a_clean_tree_passes(tmp_path: Path) -> None:
    _write(tmp_path, BASE)
    graph = import_graph(tmp_path)
    assert graph["fast"] == {"fast.pool": 1}  # the relative import resolved
    assert graph["slotmap.cli.app"] == {"slotmap.tiny.engine": 2}  # `from a import b`: the module a.b
    assert upward_imports(graph) == [] and find_cycle(graph) is None


@pytest.mark.parametrize(
    ("name", "text", "culprit"),
    [
        ("fast/backend.py", "from conformance.backends import BackendHandle\n", "fast.backend (line 1) imports"),
        ("spec/batch.py", "def f():\n    import fast.pool\n", "spec.batch (line 2) imports fast.pool"),
        ("slotmap/tiny/model.py", "from slotmap.cli import app\n", "slotmap.tiny.model (line 1) imports slotmap.cli"),
        ("benchmarks/render.py", "import slotmap.tiny.engine\n", "benchmarks.render (line 1) imports slotmap"),
    ],
)
def test_a_planted_upward_import_is_caught(tmp_path: Path, name: str, text: str, culprit: str) -> None:
    _write(tmp_path, {**BASE, name: text})
    bad = upward_imports(import_graph(tmp_path))
    assert len(bad) == 1 and bad[0].startswith(culprit), bad


def test_a_planted_cycle_is_caught(tmp_path: Path) -> None:
    # the shape the pictures once had: explain drew with picture, picture read explain's types (deferred import)
    _write(
        tmp_path,
        {
            **BASE,
            "slotmap/tiny/explain.py": "def draw():\n    from . import picture\n",
            "slotmap/tiny/picture.py": "from slotmap.tiny.explain import draw\n",
        },
    )
    graph = import_graph(tmp_path)
    assert upward_imports(graph) == []
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) == {"slotmap.tiny.explain", "slotmap.tiny.picture"}


def test_a_type_only_cycle_is_seen_only_when_asked(tmp_path: Path) -> None:
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fast.writes import W\n"
    _write(tmp_path, {**BASE, "fast/kernel.py": typed, "fast/writes.py": "from fast.kernel import k\n"})
    assert find_cycle(import_graph(tmp_path, type_only=False)) is None
    assert set(find_cycle(import_graph(tmp_path)) or ()) == {"fast.kernel", "fast.writes"}


def test_a_module_outside_every_layer_is_reported(tmp_path: Path) -> None:
    _write(tmp_path, BASE)
    with pytest.raises(ValueError, match="no layer"):
        layer_of("elsewhere.module")
