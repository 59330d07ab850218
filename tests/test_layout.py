"""The house rules that keep the code readable: the modules import one another one way only (imports inside functions
included), and never inside a function to dodge a cycle; model.py stands alone; each module has its mirrored tests;
every relative link in README.md and docs/*.md leads somewhere."""
import ast
import glob
import os
import re

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # the house rules: the full suite checks them, the fast tier need not

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


def test_tests_mirror_the_files():
    """tests/test_<module>.py per module, its torchrun tests in test_<module>_distributed.py; besides them only this
    file and the GPU script's CPU check."""
    tests = sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, "tests"))
                   if name.startswith("test_") and name.endswith(".py"))
    allowed = {f"test_{m}" for m in MODULES} | {f"test_{m}_distributed" for m in MODULES}
    allowed |= {"test_layout", "test_gpu_h200", "test_train_gpt2_slurm"}
    assert set(tests) <= allowed, sorted(set(tests) - allowed)
    assert {f"test_{m}" for m in MODULES} <= set(tests), sorted({f"test_{m}" for m in MODULES} - set(tests))


def headings_anchors(markdown):
    """The anchors GitHub makes of a page's headings: lowercase, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", markdown, re.MULTILINE):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return anchors


def without_code(markdown):
    return re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)


def test_every_relative_link_in_the_docs_resolves():
    pages = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    assert len(pages) > 1
    broken = []
    for page in pages:
        with open(page, encoding="utf-8") as f:
            text = without_code(f.read())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):  # [text](target) and ![alt](target)
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(resolved):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such file)")
            elif anchor:
                with open(resolved, encoding="utf-8") as f:
                    if anchor not in headings_anchors(f.read()):
                        broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_every_row_of_the_faults_table_names_tests_that_exist():
    """docs/faults.md's last column: at least one `test_file.py::test_name` a row, each defined in that file."""
    with open(os.path.join(ROOT, "docs", "faults.md"), encoding="utf-8") as f:
        rows = [line for line in f if line.startswith("| ") and not line.startswith("| what happens")]
    missing = []
    for row in rows:
        named = re.findall(r"`(test_\w+\.py)::(test_\w+)`", row.rstrip().rstrip("|").rsplit("|", 1)[1])
        if not named:
            missing.append(f"{row[:60]}...: no test named")
        for file, test in named:
            with open(os.path.join(ROOT, "tests", file), encoding="utf-8") as f:
                if not re.search(rf"^def {test}\(", f.read(), re.M):
                    missing.append(f"{file}::{test}: no such test")
    assert rows and not missing, missing


# The shape a reader can hold in their head. The limits are the ones nanoGPT's files meet with room to spare.
# Every top-level script together, the Slurm script included: a ceiling that stops growth, at the
# total of today's behaviour (docs/development.md says where the lines went).
LINE_BUDGET = 5115
WIDE = 100  # characters
MOST_WIDE_LINES = 0.08
MOST_INLINE_CONDITIONALS = 2.5  # `a if c else b`, per 100 lines
LONGEST_FUNCTION = 80  # lines


def top_level_scripts():
    names = [name for name in os.listdir(ROOT) if name.endswith((".py", ".sbatch"))]
    return sorted(os.path.join(ROOT, name) for name in names)


# The two files a researcher edits, each short enough to read in one sitting.
RESEARCH_FILES = {"model": 400, "train_gpt2": 800}


@pytest.mark.parametrize("module", RESEARCH_FILES)
def test_the_research_files_stay_short(module):
    with open(os.path.join(ROOT, module + ".py"), encoding="utf-8") as f:
        lines = len(f.readlines())
    assert lines <= RESEARCH_FILES[module], f"{module}.py: {lines} lines, at most {RESEARCH_FILES[module]}"
    # The run's safety and the file formats live beside them (checkpoint.py, run_dir.py, hf_files.py).
    text = open(os.path.join(ROOT, module + ".py"), encoding="utf-8").read()
    for machinery in ("fsync", "flock", "renameat2", "safetensors", "dcp.", "huggingface_hub"):
        assert machinery not in text, f"{module}.py uses {machinery}"


def test_the_scripts_stay_within_the_line_budget():
    lines = {os.path.basename(path): len(open(path, encoding="utf-8").readlines())
             for path in top_level_scripts()}
    assert sum(lines.values()) <= LINE_BUDGET, lines


@pytest.mark.parametrize("module", MODULES)
def test_each_script_reads_like_nanogpt(module):
    with open(os.path.join(ROOT, module + ".py"), encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines()
    wide = [n for n, line in enumerate(lines, 1) if len(line) > WIDE]
    assert len(wide) <= MOST_WIDE_LINES * len(lines), f"{module}.py: {len(wide)} lines over {WIDE}"
    tree = ast.parse(text)
    inline = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.IfExp)]
    limit = MOST_INLINE_CONDITIONALS * len(lines) / 100
    assert len(inline) <= limit, f"{module}.py: inline conditionals at lines {inline}"
    functions = [node for node in ast.walk(tree)
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    long = [f"{f.name} ({f.end_lineno - f.lineno + 1} lines)" for f in functions
            if f.end_lineno - f.lineno + 1 > LONGEST_FUNCTION]
    assert not long, f"{module}.py: functions over {LONGEST_FUNCTION} lines: {long}"
