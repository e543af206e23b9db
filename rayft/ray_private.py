"""The private Ray APIs rayft reaches into, each behind one function here and nowhere else.

Each is a convenience, never needed for a correct run: where a Ray release has moved one, its function returns None
and the caller carries on without it (slower start, a less precise refusal, a noisier log). So that such a move is
seen at once rather than as a quiet slowdown, `tests/unit/test_ray_private.py` asks for every one of them on the Ray
that `constraints.txt` pins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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
