"""The start-up profile: where the seconds before the first optimizer step go.

Users iterate on configs, and every `ray job submit`, every `rayft eval` and every test pays the start-up again,
so it is measured stage by stage rather than guessed: the driver times its stages (imports, preflight parts, Ray
connect/start, the data pipeline's execution), hands them to the workers, and rank 0 adds its own (worker group
and process group start, model build + load, tokenizer, first batch, first step). The whole profile is one log
line at the first step and the `startup` field of metrics.jsonl's first row.

Stdlib only: imported first thing by the driver, before torch and Ray, so that its clock starts early.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Stage names in the order a run passes them (what the log line and the JSON list).
DRIVER_STAGES = ("launch", "preflight_tokenizer", "preflight_data", "preflight_model", "ray_start", "data_plan")
WORKER_STAGES = (
    "worker_group_start",
    "model_build_load",
    "tokenizer",
    "resume",
    "reference",
    "first_batch",
    "first_step",
)


def process_start_time() -> float:
    """Wall-clock time this process was launched (Linux /proc; else now): the profile's origin, so that
    interpreter start and imports count too, as a user waiting for the first step sees them."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class Profile:
    """Named stage durations (seconds) plus the wall-clock origin they are counted from."""

    def __init__(self, origin: float | None = None, stages: dict[str, float] | None = None):
        self.origin = process_start_time() if origin is None else origin
        self.stages: dict[str, float] = dict(stages or {})

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.time()
        try:
            yield
        finally:
            self.add(name, time.time() - started)

    def add(self, name: str, seconds: float) -> None:
        self.stages[name] = round(self.stages.get(name, 0.0) + max(0.0, seconds), 3)

    def since_origin(self, at: float | None = None) -> float:
        return round((time.time() if at is None else at) - self.origin, 3)

    def to_dict(self) -> dict[str, Any]:
        return {"origin": self.origin, "stages": dict(self.stages)}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Profile:
        data = data or {}
        return cls(data.get("origin"), data.get("stages"))

    def line(self, total: float | None = None) -> str:
        """`start-up 21.4 s to the first step: imports 2.1 | preflight_data 0.3 | ...` (in run order)."""
        order = [*DRIVER_STAGES, *WORKER_STAGES]
        names = sorted(self.stages, key=lambda n: order.index(n) if n in order else len(order))
        parts = " | ".join(f"{n} {self.stages[n]:.1f}" for n in names)
        head = f"start-up {total:.1f} s to the first step" if total is not None else "start-up so far"
        return f"{head}: {parts} (s)"
