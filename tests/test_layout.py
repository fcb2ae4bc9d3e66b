"""memfit/ is a library of leaf tools: no import cycle, no memfit import hidden inside a function to dodge one, and
never an import of a script."""

import ast
from pathlib import Path

import pytest

from conftest import ROOT

MODULES = {
    ".".join(p.relative_to(ROOT).with_suffix("").parts): p
    for p in (ROOT / "memfit").rglob("*.py")
    if p.stem != "__init__" and "__pycache__" not in p.parts
}
"""Every module of memfit/, by its dotted name (``memfit.training.loading``)"""

WINGS = ("memfit", "memfit.training", "memfit.observatory", "memfit.settings", "memfit.prediction", "memfit.failure")
"""memfit/'s wings from the bottom up: a module imports from its own wing and those below it, never from one above.
``memfit`` itself holds what every wing uses (the flags' dataclasses, errors, files written whole, memory probes,
progress lines, the trace reader) and the two commands (``python -m memfit.compare``, ``python -m memfit.torchrun``),
which sit above every wing"""

COMMANDS = ("memfit.compare", "memfit.torchrun")


def _wing(module: str) -> int:
    if module in COMMANDS:
        return len(WINGS)
    package = module.rsplit(".", 1)[0]
    return WINGS.index(package)


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


def test_comparing_saved_runs_imports_neither_torch_nor_lightning():
    """``python -m memfit.compare`` reads a run's files only: it took 7 s to start, importing torch and Lightning
    through the ledger's phase names and memory's byte formatting; now about a second."""
    import subprocess
    import sys

    probe = "import sys, memfit.compare; print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]


def test_memfit_has_no_import_cycle():
    graph = {name: {m for m, _ in _memfit_imports(path) if m in MODULES} for name, path in MODULES.items()}

    def visit(node: str, stack: list[str]) -> None:
        assert node not in stack, " -> ".join(stack + [node])
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, stack + [node])

    for module in graph:
        visit(module, [])


def test_the_run_and_what_reads_it_during_training_import_no_part_of_the_estimator():
    """A run's settings (memfit.settings.run) and the instruments around its step are read by every run; the estimator
    (the fake step, the estimate, the planner and its searches) only by --estimate and an out-of-memory explanation."""
    graph = {name: {m for m, _ in _memfit_imports(path) if m in MODULES} for name, path in MODULES.items()}

    def reached(module: str) -> set[str]:
        seen, todo = set(), [module]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    estimator = {module for module in MODULES if module.startswith("memfit.prediction.")}
    for module in ("memfit.settings.run", "memfit.settings.instruments"):
        assert reached(module) & estimator == set(), module


def test_each_wing_imports_only_from_itself_and_the_wings_below_it():
    """The wings are floors: a flag's trip through them goes down, never back up (``WINGS``). Every module is in a
    wing, and every import of one module by another goes to the same wing or a lower one."""
    upward = [
        f"{name} -> {imported}"
        for name, path in MODULES.items()
        for imported, _ in _memfit_imports(path)
        if imported in MODULES and _wing(imported) > _wing(name)
    ]
    assert upward == []


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
    names = [module.rsplit(".", 1)[1] for module in sorted(MODULES)]
    assert [m for m in names if not re.search(rf"\b{m}\b", layout)] == []


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


@pytest.mark.slow
def test_every_extended_entry_is_a_test_the_suite_collects():
    """conftest.py's EXTENDED names tests by node id: a renamed test or parameter id would leave its entry naming
    nothing, and the test it meant would run in the default tier unseen (four entries had drifted so)."""
    import subprocess
    import sys

    from conftest import EXTENDED

    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    ids = {line.strip() for line in collected.stdout.splitlines() if "::" in line}
    assert sorted(EXTENDED - ids) == []
