"""A job log a person can read: rank 0's start-up summary, progress, eval and save lines, warnings and errors.

Ray prints a lot about itself into the job log: a Ray Data execution plan with a start and a finish line per
dataset execution (one per evaluation), "Checkpoint successfully created" and "Reporting training result …" from
every worker for every save, Ray-internal deprecation warnings. At the default verbosity those lines are dropped
where every worker's output reaches the job log (the driver's log printer), by exact patterns of known chatter;
everything else passes, so nothing Ray says about trouble (worker death, OOM, restarts, spilling, failure policy
decisions) is ever hidden. `--verbose` or RAYFT_LOG_LEVEL=DEBUG keeps all of it; the session's log files on the
nodes always keep all of it.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable
from typing import Any

from rayft import environment, ray_private

LEVEL_ENV = environment.LOG_LEVEL.name

# Ray's routine output, one pattern per kind of line (matched anywhere in the line, after the worker prefix).
CHATTER = tuple(
    re.compile(p)
    for p in (
        r"Checkpoint successfully created at: Checkpoint\(",  # Ray Train, every worker, every save
        r"Reporting training result \d+: TrainingReport\(",  # Ray Train, every worker, every report
        r"Starting execution of Dataset \S+\.",  # Ray Data, every execution (each evaluation, each epoch)
        r"Execution plan of Dataset \S+:",
        r"Dataset \S+ execution finished in [\d.]+ seconds",
        r"Progress bars disabled\. To enable, set",
        r"registers for logging while another dataset .* is also logging",
        r"Estimated parquet (encoding ratio|reader batch size)",
        r"has constructor arguments in the object store and max_restarts > 0",  # an advisory about Ray's own actors
        r"RayDeprecationWarning: `ExecutionOptions\.exclude_resources` is deprecated",  # Ray Train's own call
        r"FutureWarning: `is_gradient_checkpointing` is deprecated",  # PEFT's own call, on every model it wraps
        # torchao, where it is installed, imported by transformers in every process: its optional kernels built
        # for another torch, and torch's advisory about the enums it registers. rayft uses none of it.
        r"Failed to load \S*torchao\S*\.so: Could not load this library",
        r"<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile",
        r"Detected no triton, on systems without Triton certain kernels will not work",
    )
)
# Python warnings print the source line after the message: it goes with a hidden warning. Lines may carry the
# worker prefix (`(RayTrainWorker pid=12)`, colour codes) where they are printed.
_CONTINUATION = re.compile(r"^(?:\x1b\[[\d;]*m)*(?:\([^()]*\)(?:\x1b\[[\d;]*m)*)?\s{2,}\S")


def verbose() -> bool:
    """--verbose (the CLI sets RAYFT_LOG_LEVEL=DEBUG) or RAYFT_LOG_LEVEL=DEBUG in the job's environment."""
    return bool(environment.value(environment.LOG_LEVEL) == "DEBUG")


def is_chatter(line: str) -> bool:
    return any(p.search(line) for p in CHATTER)


def keep_lines(lines: list[str]) -> list[str]:
    """The lines worth a person's attention: chatter dropped, with the source line of a dropped warning."""
    kept: list[str] = []
    dropped_warning = False
    for line in lines:
        if dropped_warning and _CONTINUATION.match(line):
            dropped_warning = False
            continue
        dropped_warning = False
        if is_chatter(line):
            dropped_warning = "Warning: " in line
            continue
        kept.append(line)
    return kept


def quiet_worker_output() -> bool:
    """Filter the workers' output on its way into this driver's log (Ray's log printer, after `ray.init`). Returns
    whether the filter is installed: not in verbose mode, nor where Ray's printer is not where 2.60 keeps it (then
    the log stays complete rather than wrong)."""
    if verbose():
        return False
    return ray_private.swap_worker_output_printer(lambda p: p if isinstance(p, _Filtered) else _Filtered(p))


class _Filtered:
    """Ray's log printer behind keep_lines()."""

    def __init__(self, printer: Callable[[dict[str, Any]], None]):
        self.printer = printer

    def __call__(self, data: dict[str, Any]) -> None:
        lines = data.get("lines")
        if isinstance(lines, list) and data.get("pid") != "autoscaler":
            kept = keep_lines(lines)
            if not kept:
                return
            data = {**data, "lines": kept}
        self.printer(data)


def quiet_ray_data_here() -> None:
    """This process's own Ray Data executions (a big source counted on the driver): no plan/start/finish lines on
    its console (Ray Data's log file keeps them)."""
    import ray.data

    ray.data.DataContext.get_current().print_on_execution_start = verbose()
    if verbose():
        return
    for handler in logging.getLogger("ray.data").handlers:
        console = type(handler).__name__ == "PlainRayHandler"
        if console and not any(isinstance(f, ChatterFilter) for f in handler.filters):
            handler.addFilter(ChatterFilter())


class ChatterFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not is_chatter(record.getMessage())


def quiet_console() -> None:
    """This process's own log lines on its console (a CLI's): known chatter dropped, as in the job log."""
    if verbose():
        return
    # the root's handlers, and torch's advisories, which torch prints through handlers of its own
    for filtered in [*logging.getLogger().handlers, logging.getLogger("torch.utils._pytree")]:
        if not any(isinstance(f, ChatterFilter) for f in filtered.filters):
            filtered.addFilter(ChatterFilter())


def quiet_worker_rank(rank: int) -> None:
    """In a training worker: Python's warnings from rank 0 only (every rank runs the same code, so the others'
    would repeat rank 0's; Ray's dedup misses them when the ranks get there seconds apart). rayft's own warnings
    and errors, and exceptions, come from every rank as before."""
    if verbose() or rank == 0:
        return
    warnings.simplefilter("ignore")
