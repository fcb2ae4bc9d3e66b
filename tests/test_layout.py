"""memfit/ is a library of leaf tools: no import cycle, no memfit import hidden inside a function to dodge one, and
never an import of a script."""

import ast
from pathlib import Path

from conftest import ROOT

MODULES = {p.stem: p for p in (ROOT / "memfit").glob("*.py") if p.stem != "__init__"}


def _memfit_imports(path: Path) -> list[tuple[str, bool]]:
    """(imported memfit module, whether the import is at module level) for every memfit import in the file."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] in ("memfit", "finetune", "pretrain")
        ):
            found.append((node.module, id(node) in top_level))
        elif isinstance(node, ast.Import):
            found += [(a.name, id(node) in top_level) for a in node.names if a.name.split(".")[0] == "memfit"]
    return found


def test_no_memfit_import_is_hidden_inside_a_function():
    hidden = {name: [m for m, top in _memfit_imports(path) if not top] for name, path in MODULES.items()}
    assert {name: mods for name, mods in hidden.items() if mods} == {}


def test_memfit_never_imports_a_script():
    for name, path in MODULES.items():
        assert all(m.split(".")[0] == "memfit" for m, _ in _memfit_imports(path)), name


def test_memfit_has_no_import_cycle():
    graph = {name: {m.split(".")[1] for m, _ in _memfit_imports(path) if "." in m} for name, path in MODULES.items()}

    def visit(node: str, stack: list[str]) -> None:
        assert node not in stack, " -> ".join(stack + [node])
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, stack + [node])

    for module in graph:
        visit(module, [])
