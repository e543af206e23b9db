"""Every private Ray API rayft uses is where the pinned Ray keeps it (`rayft.ray_private`), and nothing else in the
package reaches into Ray's private modules: a Ray upgrade that moves one fails here by name, not as a quiet loss."""

from __future__ import annotations

import ast
import inspect
import json
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
    _assert_checkpoint_registry_read_and_rewritten()
    (option,) = ray_private.no_prestarted_workers()  # a private keyword ray.init takes out of its **kwargs
    assert f'kwargs.pop("{option}"' in inspect.getsource(ray.init)


def _assert_checkpoint_registry_read_and_rewritten() -> None:
    """A registry as this Ray's checkpoint manager saves it (ranked by score: not in report order): read newest
    first, and rewritten without one checkpoint into a snapshot the manager's own loader takes, its latest then the
    newest left; a snapshot it cannot read is None, never an exception."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
        _CheckpointManagerState,
        _TrainingResultState,
    )

    def result(step: int, loss: float) -> _TrainingResultState:
        return _TrainingResultState(checkpoint_dir_name=f"checkpoint-{step:06d}", metrics={"eval_loss": loss})

    ranked = [result(2, 0.9), result(3, 0.8), result(1, 0.7)]  # worst first, as Ray keeps them
    state = _CheckpointManagerState(
        checkpoint_results=ranked,
        checkpoint_report_indices=[1, 2, 0],
        latest_checkpoint_result=result(3, 0.8),
        pending_training_results=[],
        pending_validation_specs=[],
        current_report_index=3,
        validated_checkpoint_dir_names=["checkpoint-000003"],
        timed_out_validation_checkpoint_dir_names=[],
        failed_validation_checkpoint_dir_names=[],
    )
    snapshot = state.json().encode()
    assert ray_private.registered_checkpoints(snapshot) == [
        "checkpoint-000003",
        "checkpoint-000002",
        "checkpoint-000001",
    ]
    rewritten = ray_private.unregister_checkpoints(snapshot, {"checkpoint-000003"})
    assert rewritten is not None
    after = _CheckpointManagerState.parse_obj(json.loads(rewritten))
    assert after.latest_checkpoint_result.checkpoint_dir_name == "checkpoint-000002"
    assert [r.checkpoint_dir_name for r in after.checkpoint_results] == ["checkpoint-000002", "checkpoint-000001"]
    assert after.checkpoint_report_indices == [1, 0] and after.validated_checkpoint_dir_names == []
    assert after.ray_version == ray.__version__ and after.current_report_index == 3
    assert ray_private.registered_checkpoints(b"{}") is None and ray_private.unregister_checkpoints(b"[", set()) is None


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
