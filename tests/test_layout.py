"""memfit/ is a library of leaf tools: no import cycle, no memfit import hidden inside a function to dodge one, and
never an import of a script."""

import ast
from pathlib import Path

import pytest

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


def test_the_run_and_what_reads_it_during_training_import_no_part_of_the_estimator():
    """A run's settings (memfit.run) and the instruments around its step are read by every run; the estimator (the fake
    step, the estimate, the planner and its searches) only by --estimate and an out-of-memory explanation."""
    graph = {name: {m.split(".")[1] for m, _ in _memfit_imports(path) if "." in m} for name, path in MODULES.items()}

    def reached(module: str) -> set[str]:
        seen, todo = set(), [module]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    estimator = {"fake_step", "estimate", "planner", "limits", "estimate_report"}
    for module in ("run", "instruments"):
        assert reached(module) & estimator == set(), module


@pytest.mark.slow
def test_memfit_is_this_checkouts_package_alone(tmp_path):
    """memfit/ has an __init__.py: a module that exists only in another memfit/ folder on the path (an older
    checkout, an installed copy) is not imported, as it would be from a namespace package merged across folders."""
    import subprocess
    import sys

    (tmp_path / "memfit").mkdir()
    (tmp_path / "memfit" / "ghost.py").write_text("")
    code = "import memfit, importlib.util; print(memfit.__file__, importlib.util.find_spec('memfit.ghost'))"
    env = {"PYTHONPATH": f"{ROOT}:{tmp_path}", "PATH": "/usr/bin:/bin"}
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.split() == [str(ROOT / "memfit" / "__init__.py"), "None"], finished.stdout


def test_the_design_pages_layout_names_every_memfit_module():
    """docs/design.md's layout is where a newcomer finds which module does what: each module of memfit/ is named there
    (a module added without a line fails here)."""
    import re

    layout = (ROOT / "docs/design.md").read_text().split("## Layout", 1)[1]
    assert [m for m in sorted(MODULES) if not re.search(rf"\b{m}\b", layout)] == []


def test_the_tests_page_names_every_test_file():
    """docs/tests.md's table says what each test file covers: every tests/test_*.py is in it."""
    page = (ROOT / "docs/tests.md").read_text()
    assert [p.name for p in sorted((ROOT / "tests").glob("test_*.py")) if p.name not in page] == []


def test_a_fast_test_that_runs_a_recipe_fails_and_says_to_mark_it_slow():
    """The tiers are marked where each test is written; a test of the fast tier that starts a recipe (run_script,
    run_in_process, script_summary, lora_run) fails, naming the mark it lacks."""
    from conftest import _runs_a_recipe

    with pytest.raises(pytest.fail.Exception, match="mark it @pytest.mark.slow"):
        _runs_a_recipe("finetune/lora.py")
