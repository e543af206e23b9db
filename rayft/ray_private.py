"""The private Ray APIs rayft reaches into, each behind one function here and nowhere else.

Each is a convenience, never needed for a correct run: where a Ray release has moved one, its function returns None
and the caller carries on without it (slower start, a less precise refusal, a noisier log). So that such a move is
seen at once rather than as a quiet slowdown, `tests/unit/test_ray_private.py` asks for every one of them on the Ray
that `constraints.txt` pins.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast


def data_actor_starters() -> list[Callable[[], Any]] | None:
    """Functions that ask Ray Data for its two cluster-wide actors (the autoscaling coordinator, the stats actor),
    which otherwise start on first use."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )
        from ray.data._internal.stats import get_or_create_stats_actor
    except ImportError:
        return None
    return [get_or_create_autoscaling_coordinator, get_or_create_stats_actor]


def cluster_state() -> Any | None:
    """Ray's global state accessor, whose `get_cluster_config()` holds the autoscaler's declared node groups."""
    try:
        from ray._private.state import state
    except ImportError:
        return None
    return state if hasattr(state, "get_cluster_config") else None


def worker_output_dispatcher() -> Any | None:
    """The dispatcher that hands the workers' output to the driver's log printer (its `handlers` list, `_lock`)."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher
    except ImportError:
        return None
    dispatcher = global_worker_stdstream_dispatcher
    return dispatcher if hasattr(dispatcher, "handlers") and hasattr(dispatcher, "_lock") else None


Printer = Callable[[dict[str, Any]], None]


def swap_worker_output_printer(swap: Callable[[Printer], Printer]) -> bool:
    """Put `swap(printer)` in place of the printer of the workers' output in the driver's log (Ray's
    `ray_print_logs` handler). True when it now prints through a new printer; False where `swap` kept the one there,
    or where this Ray keeps its printer elsewhere."""
    dispatcher = worker_output_dispatcher()
    if dispatcher is None:
        return False
    with dispatcher._lock:
        for i, (name, printer) in enumerate(dispatcher.handlers):
            if name == "ray_print_logs" and (swapped := swap(printer)) is not printer:
                dispatcher.handlers[i] = (name, swapped)
                return True
    return False


def worker_bundle(scaling: Any) -> dict[str, float] | None:
    """The resources Ray Train asks of each worker under a `ScalingConfig`, its defaults filled in (a GPU with
    `use_gpu`, else a CPU; zero amounts left out)."""
    bundle = getattr(scaling, "_resources_per_worker_not_none", None)
    return dict(bundle) if isinstance(bundle, dict) else None


def no_prestarted_workers() -> dict[str, Any]:
    """`ray.init` options that stop a new local Ray from starting idle worker processes ahead of the first driver
    (its private `_system_config`)."""
    return {"_system_config": {"prestart_worker_first_driver": False}}


def _checkpoint_registry(snapshot: bytes) -> Any | None:
    """Ray Train's own reading of a run's `checkpoint_manager_snapshot.json` (its private pydantic state); None
    where this Ray keeps the registry elsewhere, or the snapshot is not one its class reads."""
    try:
        from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState
    except ImportError:
        return None
    try:
        parse = getattr(_CheckpointManagerState, "model_validate", None) or _CheckpointManagerState.parse_obj
        state = parse(json.loads(snapshot))  # pydantic 2's name, else 1's (Ray's models are either)
    except Exception:  # pydantic's ValidationError, a JSON error: Ray itself would refuse this snapshot
        return None
    ranked = len(state.checkpoint_results) == len(state.checkpoint_report_indices)
    pending = len(state.pending_training_results) == len(state.pending_validation_specs)
    return state if ranked and pending else None  # the pairs Ray asserts when it loads a snapshot


def registered_checkpoints(snapshot: bytes) -> list[str] | None:
    """The checkpoint directory names a run's snapshot registers, newest first: in the order Ray registered them
    (its report indices), not its ranking by score, so the first is the one Ray resumes from (its latest)."""
    state = _checkpoint_registry(snapshot)
    if state is None:
        return None
    order = sorted(zip(state.checkpoint_report_indices, state.checkpoint_results, strict=True), key=lambda p: -p[0])
    return [result.checkpoint_dir_name for _, result in order]


def unregister_checkpoints(snapshot: bytes, names: set[str]) -> bytes | None:
    """The snapshot without the checkpoints `names` (as if Ray had never registered them): gone from its ranked
    list, its pending validations and its validation verdicts; its latest, the one a new fit() hands the workers,
    is then the newest checkpoint left. None where this Ray's snapshot cannot be read (see `_checkpoint_registry`)."""
    state = _checkpoint_registry(snapshot)
    if state is None:
        return None
    registered = zip(state.checkpoint_report_indices, state.checkpoint_results, strict=True)
    kept = [(i, r) for i, r in registered if r.checkpoint_dir_name not in names]
    state.checkpoint_results = [r for _, r in kept]
    state.checkpoint_report_indices = [i for i, _ in kept]
    state.latest_checkpoint_result = max(kept, key=lambda pair: pair[0])[1] if kept else None
    validating = zip(state.pending_training_results, state.pending_validation_specs, strict=True)
    pending = [(r, spec) for r, spec in validating if r.checkpoint_dir_name not in names]
    state.pending_training_results = [r for r, _ in pending]
    state.pending_validation_specs = [spec for _, spec in pending]
    for verdicts in ("validated", "timed_out_validation", "failed_validation"):
        key = f"{verdicts}_checkpoint_dir_names"
        setattr(state, key, [name for name in getattr(state, key) if name not in names])
    dump = getattr(state, "model_dump_json", None) or state.json
    return cast(str, dump()).encode()
