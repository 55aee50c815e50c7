"""The package map of docs/architecture.md, enforced: imports point one way.

    cli -> processes -> serve / train -> tenant -> client -> protocol <- base
                                         tenant -> base (an in-process executor)
                     model, adapters, decoding below all of them

Every `import` in symbiont/ counts, deferred ones inside functions included, because a
deferred import is still a dependency; only the arrows' direction is checked, not cost.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "symbiont"

# What each top-level part of symbiont may import (besides itself). Only `tenant` (which
# opens the executor in this process or reaches a serve-base) and `cli` import `base`.
BELOW = {"model", "adapters", "decoding", "kernels"}
ALLOWED: dict[str, set[str]] = {
    "util": set(),  # lazy namespaces, the rate meter: importable from anywhere
    "model": set(),
    "decoding": {"model"},
    "adapters": {"model"},
    "protocol": {"model"},
    "kernels": set(),  # symbiont's CPU kernels (C++ built on the machine): torch only
    "base": {"protocol", "model", "kernels"},
    "client": {"protocol"} | BELOW,
    "tenant": {"client", "protocol", "base"} | BELOW,
    "train": {"tenant", "client", "protocol"} | BELOW,
    "jobs": {"train", "tenant", "client", "protocol"} | BELOW,
    "serve": {"jobs", "tenant", "client", "protocol"} | BELOW,
    "processes": {"tenant", "client", "protocol"} | BELOW,
    "delta": {"model", "util"},  # compressed deltas of full fine-tunes (issue 16)
    "cli": {"processes", "serve", "jobs", "train", "tenant", "client", "protocol", "base"} | BELOW,
    "assets": set(),
    "__main__": {"cli"},
}
ALLOWED["cli"] |= {"delta"}  # `symbiont delta` (issue 16)
ALLOWED["serve"] |= {"delta"}  # `symbiont serve --delta` (issue 16)


def part_of(path: Path) -> str:
    """'symbiont/serve/http/api.py' -> 'serve'; 'symbiont/decoding.py' -> 'decoding'."""
    first = path.relative_to(PACKAGE).parts[0]
    return first.removesuffix(".py")


def imported_parts(path: Path) -> list[tuple[int, str]]:
    """(line, part) for every `symbiont.<part>` this file imports; 'ROOT' for the package root."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "symbiont":  # `from symbiont import x`: x is a part or a name
                names = [f"symbiont.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name == "symbiont":
                found.append((node.lineno, "ROOT"))
            elif name.startswith("symbiont."):
                found.append((node.lineno, name.split(".")[1]))
    return found


def all_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "assets" not in p.parts)


def dependency_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in all_modules():
        for _, target in imported_parts(path):
            if target != part_of(path):
                graph[part_of(path)].add(target)
    return graph


def test_every_part_of_the_package_is_on_the_map():
    parts = {part_of(p) for p in all_modules()} - {"__init__"}
    assert parts <= set(ALLOWED), f"add {sorted(parts - set(ALLOWED))} to ALLOWED and the docs"


def test_imports_point_one_way():
    wrong = []
    for path in all_modules():
        me = part_of(path)
        if me == "__init__":
            continue  # the package root re-exports the public names (lazily)
        for line, target in imported_parts(path):
            if target == "ROOT":
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports the package root")
            elif target != me and target != "util" and target not in ALLOWED[me]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} {me} -> {target}")
    assert not wrong, "imports against the map in docs/architecture.md:\n" + "\n".join(wrong)


def test_no_cycle_between_parts():
    graph = dependency_graph()
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path, node, nxt]))
            if nxt not in seen:
                visit(nxt, [*path, node])
        seen[node] = 2

    for node in sorted(graph):
        if node not in seen:
            visit(node, [])


def test_the_map_in_the_docs_names_every_part():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = [
        part
        for part in ALLOWED
        if part not in ("__main__", "assets")
        and not re.search(rf"^  {re.escape(part)}(/|\.py) ", text, re.MULTILINE)
    ]
    assert not missing, f"the package tree in docs/architecture.md lacks {missing}"
