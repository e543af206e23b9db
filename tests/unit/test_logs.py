"""The job log at default verbosity: Ray's routine lines dropped on their way into it, every sign of trouble kept.
The lines are Ray 2.60's own, as they reach the driver (worker prefix included); the real job log is checked in
test_job_e2e.py (the reference run) and test_recovery.py (a killed worker)."""

from __future__ import annotations

import pytest

from rayft import logs

CHATTER = [
    "\x1b[36m(RayTrainWorker pid=1796)\x1b[0m Checkpoint successfully created at: Checkpoint(filesystem=local, "
    "path=/x/ray_run/checkpoint-000010)",
    "(RayTrainWorker pid=1836) Reporting training result 1: TrainingReport(checkpoint=Checkpoint(filesystem=local, "
    "path=/x/checkpoint-000010), metrics={'loss': 11.3}, validation=False) from rank 1",
    "(SplitCoordinator pid=2335) Starting execution of Dataset validation_0352R6M8ZXEBUz4mG3PkZO_1. Full logs are in "
    "/tmp/ray/session_x/logs/ray-data",
    "(SplitCoordinator pid=2335) Execution plan of Dataset validation_0352R6M8_1: InputDataBuffer[Input] -> "
    "OutputSplitter[split(2, equal=True)]",
    "(SplitCoordinator pid=2359) ✔️  Dataset train_0352R6KqZVw4EnqUn2LCFZ_1 execution finished in 0.16 seconds",
    "(SplitCoordinator pid=2359) Progress bars disabled. To enable, set "
    "`ray.data.DataContext.get_current().enable_progress_bars = True`.",
    "(TrainController pid=1667) [2026-11-23 06:46:11,472 E 1667 1699] core_worker.cc:2465: Actor with class name: "
    "'PreemptionWatcher' and ID: '9eed' has constructor arguments in the object store and max_restarts > 0. If the "
    "arguments in the object store go out of scope or are lost, the actor restart will fail.",
    "(RayTrainWorker pid=2040) Failed to load /v/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
    "Could not load this library: /v/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so",
    "(RayTrainWorker pid=2040) W1129 12:11:42.919000 14164 torch/utils/_pytree.py:630] <enum 'KernelPreference'> is "
    "an Enum subclass and is now natively supported by torch.compile as an opaque value type. Calling "
    "register_constant() on Enum subclasses is deprecated and will be an error in a future release.",
    "(RayTrainWorker pid=2040) Warning: Detected no triton, on systems without Triton certain kernels will not work",
]
DEPRECATION = [
    "(DatasetManager pid=1927) /v/ray/data/_internal/execution/interfaces/execution_options.py:436: "
    "RayDeprecationWarning: `ExecutionOptions.exclude_resources` is deprecated and will be removed in a future.",
    "(DatasetManager pid=1927)   self.exclude_resources = exclude_resources",
    "\x1b[36m(RayTrainWorker pid=4149)\x1b[0m /v/transformers/modeling_utils.py:3303: FutureWarning: "
    "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing` instead.",
    "\x1b[36m(RayTrainWorker pid=4149)\x1b[0m   warnings.warn(",
]
# What Ray says when something goes wrong: never dropped, whatever the verbosity.
TROUBLE = [
    "(TrainController pid=1667) [FailurePolicy] RETRY",
    "(TrainController pid=1667)   Source: worker group",
    "(TrainController pid=1667)   Error count: 1 (max allowed: 2)",
    "(TrainController pid=1667) Error: Training failed due to worker errors: ActorDiedError: The actor died "
    "unexpectedly before finishing this task.",
    "(raylet) A worker died or was killed while executing a task by an unexpected system error. To troubleshoot the "
    "problem, check the logs for the dead worker. Worker exit type: SYSTEM_ERROR",
    "(raylet) [2026-11-23 07:01:02,000 E 123 456] (raylet) node_manager.cc:3200: 1 Workers (tasks / actors) killed "
    "due to memory pressure (OOM), 0 Workers crashed due to other reasons at node (ID: 8a1b)",
    "(raylet) Spilled 2048 MiB, 12 objects, write throughput 800 MiB/s. Set RAY_verbose_spill_logs=0 to disable "
    "this message.",
    "(TrainController pid=1667) [State Transition] RUNNING -> RESTARTING.",
    "(RayTrainWorker pid=1796) 07:01:00 rayft step 5/42 | epoch 0.36 | loss 11.7853 | lr 3.00e-03",
    "(RayTrainWorker pid=1796) 07:01:00 rayft checkpoint-000010: training paused 0.40 s (state written in 0.39 s)",
    "(RayTrainWorker pid=1796) Traceback (most recent call last):",
    '(RayTrainWorker pid=1796)   File "/x/rayft/train/loop.py", line 70, in train_loop_per_worker',
]


def test_routine_ray_lines_are_dropped_and_trouble_is_kept():
    assert all(logs.is_chatter(line) for line in CHATTER)
    assert not any(logs.is_chatter(line) for line in TROUBLE)
    # a dropped warning takes its source line with it; an indented line after a kept one stays
    assert logs.keep_lines([*CHATTER, *DEPRECATION, *TROUBLE]) == TROUBLE
    assert logs.keep_lines(TROUBLE[:3]) == TROUBLE[:3]


def test_the_driver_prints_only_what_is_kept(monkeypatch):
    """Ray's printer behind the filter: a batch of chatter prints nothing; a mixed batch prints the rest, in order."""
    monkeypatch.delenv(logs.LEVEL_ENV, raising=False)
    printed: list[list[str]] = []
    printer = logs._Filtered(lambda data: printed.append(data["lines"]))
    printer({"lines": CHATTER[:3], "pid": 1796, "is_err": True})
    printer({"lines": [CHATTER[0], TROUBLE[0], CHATTER[1], TROUBLE[4]], "pid": 1796, "is_err": True})
    assert printed == [[TROUBLE[0], TROUBLE[4]]]


@pytest.mark.parametrize("level", ["DEBUG", "debug"])
def test_verbose_keeps_everything(monkeypatch, level):
    """--verbose / RAYFT_LOG_LEVEL=DEBUG: the filter is not installed at all."""
    monkeypatch.setenv(logs.LEVEL_ENV, level)
    assert logs.verbose() and logs.quiet_worker_output() is False


def test_a_cli_console_drops_the_same_chatter_torch_prints_through_its_own_handlers(monkeypatch):
    """torchao's import noise where it is installed: torch's Enum advisory (printed through torch's handler, so
    filtered at its logger) and the lines that reach the root's handlers; anything else passes."""
    import logging

    monkeypatch.delenv(logs.LEVEL_ENV, raising=False)
    logs.quiet_console()
    pytree = logging.getLogger("torch.utils._pytree")
    advisory = logging.makeLogRecord({"msg": CHATTER[-2].split("] ", 1)[1], "name": pytree.name})
    trouble = logging.makeLogRecord({"msg": "something torch needs you to know", "name": pytree.name})
    assert not pytree.filter(advisory) and pytree.filter(trouble)
    for handler in logging.getLogger().handlers:
        assert not handler.filter(logging.makeLogRecord({"msg": CHATTER[-3].split(") ", 1)[1]}))
