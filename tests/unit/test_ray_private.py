"""Every private Ray API rayft uses is where the pinned Ray keeps it (`rayft.ray_private`), and nothing else in the
package reaches into Ray's private modules: a Ray upgrade that moves one fails here by name, not as a quiet loss."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import ray
from ray.train import ScalingConfig

from rayft import ray_private

PACKAGE = Path(ray_private.__file__).parent


def test_every_private_api_is_where_this_ray_keeps_it():
    starters = ray_private.data_actor_starters()
    assert starters is not None and all(callable(f) for f in starters) and len(starters) == 2
    assert callable(ray_private.cluster_state().get_cluster_config)
    dispatcher = ray_private.worker_output_dispatcher()
    assert dispatcher is not None and isinstance(dispatcher.handlers, list)
    # Ray Train's defaults for a worker's resources, as its docs state them: a GPU with use_gpu, else a CPU.
    assert ray_private.worker_bundle(ScalingConfig(num_workers=2)) == {"CPU": 1}
    assert ray_private.worker_bundle(ScalingConfig(num_workers=2, use_gpu=True)) == {"GPU": 1}
    declared = ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"CPU": 8, "memory": 0})
    assert ray_private.worker_bundle(declared) == {"CPU": 8, "GPU": 1}
    (option,) = ray_private.no_prestarted_workers()  # a private keyword ray.init takes out of its **kwargs
    assert f'kwargs.pop("{option}"' in inspect.getsource(ray.init)


def private_imports(path: Path) -> list[str]:
    """Modules under `ray._private`, `ray._raylet` or any `ray.*._internal` that `path` imports."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return [n for n in names if n.split(".")[0] == "ray" and any(p.startswith("_") for p in n.split(".")[1:])]


def test_no_other_module_imports_a_private_ray_api():
    found = {
        str(p.relative_to(PACKAGE)): private_imports(p) for p in PACKAGE.rglob("*.py") if p.name != "ray_private.py"
    }
    assert {path: names for path, names in found.items() if names} == {}
    assert private_imports(Path(ray_private.__file__)), "the check itself finds the private imports it is there for"
