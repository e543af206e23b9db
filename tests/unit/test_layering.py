"""The package's layers point one way: config → data + model → parallel → train → launch. `LAYERS` states the
order, lowest first; a module may import from its own layer and the ones below, never from above, and no two parts
import each other (a circle). Imports inside functions and under TYPE_CHECKING count: they are the same dependency,
paid later. The planner predicts a run from the model side alone, so nothing under `rayft/plan` may import the
training loop's modules."""

from __future__ import annotations

import ast
import subprocess
import sys
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


# The parts of the package (a top-level module, or a subpackage as one), lowest layer first. A new part goes where
# its imports put it; a part that needs one above it is in the wrong place, or the fact it needs is.
LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(layer.split()) for layer in (
    "trl_names gpus ray_private ray_auth startup demo",  # leaves: facts and probes that import nothing of rayft
    "schema",  # how a config section is checked
    "kube",  # what Kubernetes and KubeRay accept, and the k8s section checked against it
    "config environment",  # what a user can say, in a file or in the environment
    "config_import placement hub file_checks logs cache decisions",
    "model data limits",
    "parallel plan export",
    "train",
    "workers preflight deploy",
    "launch",
    "cli",
))  # fmt: skip


def part_of(module: str) -> str:
    """`rayft.model.fp8` → `model`; `rayft.config` → `config`."""
    return module.split(".")[1]


def part_imports() -> dict[tuple[str, str], set[str]]:
    """(importing part, imported part) → the files of the first that import the second, other parts only."""
    edges: dict[tuple[str, str], set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.name == "__init__.py" and len(relative.parts) == 1:
            continue
        mine = relative.parts[0].removesuffix(".py")
        for module in rayft_imports(path):
            if module != "rayft" and (theirs := part_of(module)) != mine:
                edges.setdefault((mine, theirs), set()).add(str(relative))
    return edges


def layer_of(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


def test_every_part_of_the_package_has_a_layer():
    parts = {
        p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()
    }
    placed = set().union(*LAYERS)
    assert parts - {"__init__"} == placed, (
        f"not in LAYERS: {sorted(parts - placed - {'__init__'})}; gone: {sorted(placed - parts)}"
    )


def test_no_part_imports_one_above_it():
    upward = {edge: sorted(files) for edge, files in part_imports().items() if layer_of(edge[1]) > layer_of(edge[0])}
    assert upward == {}


def test_no_two_parts_import_each_other_through_any_path():
    reach: dict[str, set[str]] = {}
    for a, b in part_imports():
        reach.setdefault(a, set()).add(b)
    changed = True
    while changed:  # the transitive closure: small enough to grow until it stops
        changed = False
        for seen in reach.values():
            more = set().union(*(reach.get(b, set()) for b in seen)) - seen
            if more:
                seen |= more
                changed = True
    circles = sorted(a for a, seen in reach.items() if a in seen)
    assert circles == [], f"parts that reach themselves through their imports: {circles}"


def module_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def test_no_two_modules_import_each_other_through_any_path():
    """Within a part too: a circle of modules hidden by imports inside functions is still one (each needs the
    other loaded to work)."""
    modules = {module_of(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in rayft_imports(path) if m in modules and m != name} for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                circles.append([*path[path.index(other) :], other])
            elif other not in state:
                visit(other, [*path, other])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == [], circles


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


DRIVER_MODULES = ("rayft.launch", "rayft.preflight", "rayft.cli")
WORKER_MODULES = ("rayft.train.loop", "rayft.parallel.parallelize", "rayft.parallel.expert", "rayft.parallel.alltoall",
                  "rayft.model.fp8", "peft")  # fmt: skip


def test_the_driver_imports_no_worker_module():
    """`rayft validate` and the driver load the checks, not the model stack: importing the driver's modules leaves
    the worker's modules (and PEFT) unimported, in a fresh interpreter. A check imports what it needs when it runs;
    Ray gets the worker's entry points by name (`rayft.workers`)."""
    probe = (
        "import sys\n"
        f"for name in {DRIVER_MODULES!r}:\n"
        "    __import__(name)\n"
        f"print(sorted(m for m in {WORKER_MODULES!r} if m in sys.modules))\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          cwd=PACKAGE.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    loaded, saw_torch = done.stdout.strip().splitlines()[-2:]
    assert loaded == "[]", f"the driver's modules import worker modules: {loaded}"
    assert saw_torch == "True", "the probe imported the driver's modules (which use torch for the checks)"


def test_no_module_keeps_run_state_in_a_global():
    """The run's layout (where each rank runs, the meshes cut from it) is built once at set-up and handed on
    (`rayft.parallel.layout`): no function in the package rebinds a module-level name."""
    rebinding = {
        f"{path.relative_to(PACKAGE)}:{node.lineno}": node.names
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Global)
    }
    assert rebinding == {}


def test_the_formatter_is_skipped_only_for_tables():
    """`ruff format` lays out the code; `# fmt: skip` stays only on a constant table (an upper-case name bound to a
    literal dict, tuple or list, or a dict built from one) that reads better aligned."""
    elsewhere = []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        tables = set()
        for node in ast.walk(ast.parse(source)):
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if (
                isinstance(node, ast.Assign | ast.AnnAssign)
                and isinstance(target, ast.Name)
                and target.id.isupper()
                and isinstance(node.value, ast.Dict | ast.DictComp | ast.Tuple | ast.List)
            ):
                tables |= set(range(node.lineno, node.end_lineno + 1))
        for number, line in enumerate(source.splitlines(), 1):
            if "# fmt: skip" in line and number not in tables:
                elsewhere.append(f"{path.relative_to(PACKAGE)}:{number}")
    assert elsewhere == []


def test_no_forward_is_replaced_at_run_time():
    """An objective computes its loss outside the model (`rayft.train.objectives`), from what the model's own call
    returns: nothing in the package assigns a module's `forward`, by attribute or `setattr`, nor binds a method to
    an instance (`types.MethodType`)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            assigned = any(isinstance(t, ast.Attribute) and t.attr == "forward" for t in targets)
            set_by_name = (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "setattr"
                and len(node.args) > 1
                and getattr(node.args[1], "value", None) == "forward"
            )
            bound = isinstance(node, ast.Attribute | ast.Name) and "MethodType" in (
                getattr(node, "attr", None),
                getattr(node, "id", None),
            )
            if assigned or set_by_name or bound:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == [], found


def test_the_driver_enters_preflight_once_for_its_checks(fixtures, tmp_path, capsys):
    """Preflight is the ordered list of the checks, entered once; what the driver reads of its result is data, not
    more calls into it. Traced on `rayft validate`, the driver's path without a cluster: into rayft/preflight.py
    from outside it, the checks and the run a config would continue (nothing else)."""
    from conftest import run_cli, tiny_config, write_yaml

    preflight_py = str(PACKAGE / "preflight.py")
    entered: list[str] = []

    def trace(frame, event, arg):
        code, caller = frame.f_code, frame.f_back
        outside = caller is not None and caller.f_code.co_filename != preflight_py
        imported = code.co_name == "<module>"
        if event == "call" and code.co_filename == preflight_py and outside and not imported:
            entered.append(code.co_name)

    config = write_yaml(tmp_path / "job.yaml", tiny_config(fixtures, tmp_path / "out"))
    sys.setprofile(trace)
    try:
        result = run_cli(capsys, "validate", "--config", str(config))
    finally:
        sys.setprofile(None)
    assert result.rc == 0, result.err
    assert entered == ["preflight", "check_continued_run"], entered
