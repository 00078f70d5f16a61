"""llmft reads one way: commands on top of a library whose imports point down, with no cycles, and a planner that
answers without torch. A new upward import, an import hidden in a function, or torch at `import llmft.plan` fails here."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llmft"

# Lower layers never import higher ones. Commands import the library and llmft.command, never one another;
# llmft.cli reaches them by name (importlib), so `llmft plan` never imports train's dependencies.
LAYERS = {"errors": 0, "planning": 1, "data": 2, "checkpoint": 3, "training": 4, "command": 5, "launch": 5}
COMMANDS = {
    "train",
    "prepare",
    "plan",
    "infer",
    "eval",
    "report",
    "tiny",
    "demo",
    "tracking",
    "prebuild",
    "export",
    "push",
    "stop",
}
TOP = {"cli": 7}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    first = module.split(".")[1] if module.count(".") else ""
    if first in LAYERS:
        return LAYERS[first]
    if first in COMMANDS:
        return 6
    if first in TOP:
        return TOP[first]
    raise AssertionError(f"{module} belongs to no layer: add it to tests/test_layers.py")


def llmft_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported llmft module, line, at module level) for every import of an llmft module in `path`."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "llmft":
            base = node.module
            for alias in node.names:  # `from llmft.planning import memory` imports the module llmft.planning.memory
                candidate = PACKAGE.parent / Path(*f"{base}.{alias.name}".split("."))
                sub = candidate.with_suffix(".py").exists() or (candidate / "__init__.py").exists()
                names.append(f"{base}.{alias.name}" if sub else base)
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.split(".")[0] == "llmft"]
        found += [(name, node.lineno, id(node) in top_level) for name in names if name != "llmft"]
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_every_module_has_a_layer():
    for module in MODULES:
        if module != "llmft":
            layer_of(module)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "llmft"))
def test_imports_point_down_and_sit_at_the_top(module):
    here = layer_of(module)
    for imported, line, top in llmft_imports(MODULES[module]):
        where = f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {imported}"
        assert top, f"{where} inside a function: llmft's own imports go at the top of the file"
        there = layer_of(imported)
        assert there <= here, f"{where}, a higher layer"
        if here == 6:
            assert there < 6, f"{where}: commands do not import commands; move what they share into the library"


def test_no_import_cycles():
    graph = {m: {i for i, _, _ in llmft_imports(p)} & set(MODULES) for m, p in MODULES.items()}
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_checker_sees_upward_and_hidden_imports(tmp_path):
    """The rules above catch what they claim to: an upward import and one inside a function."""
    bad = tmp_path / "bad.py"
    bad.write_text("from llmft.training import metrics\n\ndef f():\n    from llmft.planning import batch\n")
    found = llmft_imports(bad)
    assert ("llmft.training.metrics", 1, True) in found and ("llmft.planning.batch", 4, False) in found
    assert layer_of("llmft.training.metrics") > layer_of("llmft.planning.batch")


@pytest.mark.parametrize("module", ["llmft.plan", "llmft.planning.run_plan", "llmft.cli"])
def test_planning_imports_no_torch(module):
    """`llmft plan` answers on a login node in a blink: importing the planner must not load torch (seconds)."""
    code = f"import sys, {module}; heavy = [m for m in ('torch', 'transformers', 'deepspeed', 'trl') if m in sys.modules]; print(heavy)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"import {module} loaded {out}"


def test_every_user_error_shares_one_base():
    """Each command catches LlmftError alone; an error class outside it would escape as a traceback."""
    import importlib

    from llmft.errors import LlmftError

    outside = []
    for module in sorted(MODULES):
        mod = importlib.import_module(module)
        for name, obj in vars(mod).items():
            if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == module:
                if not issubclass(obj, LlmftError):
                    outside.append(f"{module}.{name}")
    assert not outside, f"error classes outside LlmftError: {outside}"


def test_no_function_is_longer_than_a_screenful():
    """A reader follows any step in one view: no function in llmft longer than 100 lines."""
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


STARTS_A_PROCESS_GROUP = ("init_process_group(", "init_distributed(", "deepspeed.initialize(")


def test_every_script_that_starts_a_process_group_destroys_it():
    """A process that exits with a live gloo group can abort at exit (SIGABRT, "terminate called without an active
    exception"), and torchrun reports such a rank as failed. So every file of llmft, its tests and its benchmarks that
    starts a group also ends it (destroy_process_group, or transformers' Trainer.end(), which calls it). Ending the
    group is not enough on its own: its gloo threads outlive destroy_process_group() (DeepSpeed keeps references to
    its groups), which is why llmft.train's ranks and tests/test_zero_checkpoint.py's writer, whose 3-rank run aborted
    so in CI, also leave without interpreter finalization (llmft.command.exit_process)."""
    root = PACKAGE.parent
    missing = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(root / "tests").glob("*.py"), *(root / "bench").glob("*.py")]):
        text = path.read_text()
        if path.name != "test_layers.py" and any(start in text for start in STARTS_A_PROCESS_GROUP):
            if "destroy_process_group(" not in text and ".end()" not in text:
                missing.append(str(path.relative_to(root)))
    assert not missing, f"these start a process group and never destroy it: {missing}"


@pytest.mark.parametrize("command", sorted(COMMANDS | {"cli"}))
def test_every_command_runs_as_a_module(command):
    """`python -m llmft.X` is how the Slurm script and users start each command: each keeps its entry point."""
    tree = ast.parse(MODULES[f"llmft.{command}"].read_text())
    mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert mains, f"llmft/{command}.py has no `if __name__ == '__main__':` entry point"


def test_the_code_is_formatted_by_the_tool():
    """Formatting and import order are ruff's (pyproject.toml); `make format` fixes what this finds."""
    root = PACKAGE.parent
    paths = ["llmft", "tests", "bench", "inference"]
    fmt = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *paths], cwd=root, capture_output=True, text=True
    )
    assert fmt.returncode == 0, f"run `make format`:\n{fmt.stdout}{fmt.stderr}"
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", *paths], cwd=root, capture_output=True, text=True)
    assert lint.returncode == 0, f"run `make format`:\n{lint.stdout}{lint.stderr}"
