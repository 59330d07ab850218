"""The house rules that keep the code readable: at most nine top-level files, none over about 900 lines (no total
budget: a fix or a behaviour is never traded for lines); the modules import one another one way only (imports inside
functions included), and never inside a function to dodge a cycle; model.py stands alone; the training loop fits on a
screen and no function grows past about 120 lines."""
import ast
import os

import pytest

from conftest import ROOT

MODULES = sorted(name[:-3] for name in os.listdir(ROOT) if name.endswith(".py"))


def parse(module):
    with open(os.path.join(ROOT, module + ".py"), encoding="utf-8") as f:
        return ast.parse(f.read())


def imported(tree):
    """The top-level package names imported anywhere in `tree`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def project_imports(module):
    """The project modules `module` imports anywhere in its file."""
    return imported(parse(module)) & set(MODULES) - {module}


def test_imports_have_no_cycle():
    graph = {module: project_imports(module) for module in MODULES}
    state = {}

    def visit(module, path):
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", f"import cycle: {' -> '.join(path + [module])}"
        state[module] = "open"
        for dependency in sorted(graph[module]):
            visit(dependency, path + [module])
        state[module] = "done"

    for module in MODULES:
        visit(module, [])


def test_bottom_floor_modules_import_nothing_above_them():
    for module in ("atomic_io", "model"):  # model.py loads and exports HF GPT-2 on its own
        assert not project_imports(module), (module, project_imports(module))
    assert project_imports("tokenizer") <= {"atomic_io"}  # it publishes the HF tokenizer files


def test_no_project_import_inside_a_function():
    for module in MODULES:
        for node in ast.walk(parse(module)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert not imported(node) & set(MODULES), f"{module}.{node.name} imports {imported(node)}"


def line_counts():
    lines = {}
    for module in MODULES:
        with open(os.path.join(ROOT, module + ".py"), encoding="utf-8") as f:
            lines[module] = sum(1 for _ in f)
    return lines


def test_at_most_nine_files():
    assert len(MODULES) <= 9, MODULES


# strict: once every file fits, this xfail turns into a failure that says to drop the marker
@pytest.mark.xfail(strict=True, reason="train_gpt2.py is still over about 900 lines")
def test_no_file_is_over_about_900_lines():
    lines = line_counts()
    assert max(lines.values()) <= 900, lines


def function_lengths():
    for module in MODULES:
        for node in ast.walk(parse(module)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{module}.{node.name}", node.end_lineno - node.lineno + 1


def test_the_training_loop_fits_on_a_screen_and_no_function_is_long():
    lengths = dict(function_lengths())
    assert lengths["train_gpt2.train"] <= 100
    long = {name: n for name, n in lengths.items() if n > 120}
    assert not long, long


def test_tests_mirror_the_files():
    """tests/test_<module>.py per module, its torchrun tests in test_<module>_distributed.py; besides them only this
    file and the GPU script's CPU check."""
    tests = sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, "tests"))
                   if name.startswith("test_") and name.endswith(".py"))
    allowed = {f"test_{m}" for m in MODULES} | {f"test_{m}_distributed" for m in MODULES}
    allowed |= {"test_layout", "test_gpu_h200"}
    assert set(tests) <= allowed, sorted(set(tests) - allowed)
    assert {f"test_{m}" for m in MODULES} <= set(tests), sorted({f"test_{m}" for m in MODULES} - set(tests))
