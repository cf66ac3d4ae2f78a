"""The tree's shape: no import circle between modules (function-level imports included), and no module over
400 lines. The layer contract itself is import-linter's (.importlinter, run by `make test`)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
# installed name -> source directory (setup.py's package_dir)
PACKAGES = {"moe_plugins": ROOT / "moe_plugins", "moe_plugins.patches": ROOT / "patches",
            "moe_plugins.recipes": ROOT / "recipes"}
MAX_LINES = 400


def modules() -> Dict[str, Path]:
    out: Dict[str, Path] = {}
    for pkg, base in PACKAGES.items():
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg] + parts)] = path
    return out


def imports_of(name: str, path: Path, known: Dict[str, Path]) -> Set[str]:
    """The project modules ``name`` imports anywhere in its body (a package import counts as its __init__)."""
    is_pkg = path.name == "__init__.py"
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - (0 if is_pkg else 1) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import circle as a list of modules (empty when there is none): depth-first search."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    known = modules()
    # a package's __init__ importing its own submodules is how packages re-export; the circle that matters is
    # between modules, so edges into a package's own __init__ from its submodules are dropped
    graph = {}
    for name, path in known.items():
        deps = imports_of(name, path, known)
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    assert find_cycle(graph) == []


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_architecture_note_stays_short():
    """docs/architecture.md (the layers and one MoE call's path) stays under 150 lines, as #22 asks."""
    lines = (ROOT / "docs" / "architecture.md").read_text().splitlines()
    assert len(lines) < 150, len(lines)
