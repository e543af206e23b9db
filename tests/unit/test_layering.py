"""The package's layers point one way: config → data + model → parallel → train → launch. The planner predicts a
run from the model side alone, so nothing under `rayft/plan` may import the training loop's modules."""

from __future__ import annotations

import ast
from pathlib import Path

import rayft

PACKAGE = Path(rayft.__file__).parent


def rayft_imports(path: Path) -> set[str]:
    """The rayft modules `path` imports (absolute imports; rayft uses no relative ones)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return {n for n in names if n == "rayft" or n.startswith("rayft.")}


def test_the_planner_imports_nothing_from_the_training_loop():
    plan = {str(p.relative_to(PACKAGE)): rayft_imports(p) for p in (PACKAGE / "plan").rglob("*.py")}
    into_train = {path: sorted(n for n in names if n.startswith("rayft.train")) for path, names in plan.items()}
    assert {path: names for path, names in into_train.items() if names} == {}
    assert any("rayft.model.flops" in names for names in plan.values()), "the check sees the planner's imports"


def test_no_function_in_the_package_is_longer_than_a_screen():
    """A function that does four jobs is four functions: none in rayft/ runs over 60 lines, and the worker's entry
    point, the story of a run, stays short."""
    long = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60 or (node.name == "train_loop_per_worker" and lines > 40):
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = lines
    assert long == {}
