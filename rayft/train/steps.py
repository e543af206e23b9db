"""How many steps a run takes: fixed on the driver from the dataset's row counts, so every worker agrees on it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rayft.config import Config, ConfigError, warmup_too_long


@dataclass(frozen=True)
class StepPlan:
    """Step arithmetic fixed on the driver, so every worker agrees on it (and on when to report).

    A fixed-size run splits the records between its workers; its data position counts each rank's micro-batches.
    An elastic run (`global_micro_per_step` set) reads them in one global order, each step taking the next
    `global_micro_per_step` micro-batches whatever the group's size, so its position counts global micro-batches
    and means the same at every size.
    """

    world_size: int
    train_rows: int
    validation_rows: int
    micro_batches_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    global_micro_per_step: int | None = None
    # An elastic run's evaluation: the validation batches every group size scores (a multiple of each size).
    eval_batches: int | None = None

    @property
    def has_validation(self) -> bool:
        if self.eval_batches is not None:
            return self.eval_batches > 0
        return self.validation_rows >= self.world_size

    def no_validation(self) -> str:
        """Why the run has no validation data to evaluate on (when `has_validation` is false)."""
        if self.eval_batches is not None:
            return (
                f"{self.validation_rows} validation records make fewer batches (train.per_device_eval_batch_size) "
                "than every group size the run may take splits evenly"
            )
        return f"{self.validation_rows} validation records for {self.world_size} workers"

    @property
    def global_order(self) -> bool:
        return self.global_micro_per_step is not None

    def accumulation(self, world_size: int, configured: int) -> int:
        """Micro-batches per worker per step for a group of `world_size` (config checks refused sizes that leave
        a remainder)."""
        return self.global_micro_per_step // world_size if self.global_micro_per_step else configured


def plan_steps(cfg: Config, train_rows: int, validation_rows: int, world_size: int) -> StepPlan:
    t = cfg.train
    if cfg.ray.elastic or cfg.parallel.context_parallel > 1:  # context parallel: each group reads the same rows
        return _global_plan(cfg, train_rows, validation_rows, world_size)
    rows_per_worker = train_rows // world_size  # streaming_split(equal=True) drops the remainder
    if rows_per_worker == 0:
        raise ConfigError(
            f"data: {train_rows} training records cannot feed ray.num_workers={world_size} workers; "
            "use more data or fewer workers"
        )
    micro = math.ceil(rows_per_worker / t.per_device_train_batch_size)
    steps_per_epoch = math.ceil(micro / t.gradient_accumulation_steps)
    return _plan(cfg, world_size, train_rows, validation_rows, micro, steps_per_epoch)


def _global_plan(cfg: Config, train_rows: int, validation_rows: int, world_size: int) -> StepPlan:
    """An elastic or context-parallel run's plan: whole global batches only, so every step splits evenly at every
    size (the rows after an epoch's last whole batch are left out of that epoch); evaluation on the validation
    batches that split evenly at every size, so its loss too is the same whatever the size. A context-parallel
    run's global batch counts its data-parallel ranks (the groups), each reading the same rows."""
    t = cfg.train
    every_size = math.lcm(*cfg.ray.sizes()) // cfg.parallel.context_parallel  # data-parallel ranks
    eval_batches = validation_rows // t.per_device_eval_batch_size // every_size * every_size
    global_micro = t.gradient_accumulation_steps * world_size // cfg.parallel.context_parallel  # data-parallel ranks
    steps_per_epoch = train_rows // (global_micro * t.per_device_train_batch_size)
    if steps_per_epoch == 0:
        raise ConfigError(
            f"data: {train_rows} training records do not make one global batch of "
            f"{global_micro * t.per_device_train_batch_size} rows (ray.num_workers {world_size} × "
            f"{t.gradient_accumulation_steps} accumulation × {t.per_device_train_batch_size} per device); "
            "use more data or a smaller batch"
        )
    plan = _plan(cfg, world_size, train_rows, validation_rows, steps_per_epoch * global_micro, steps_per_epoch)
    return replace(plan, global_micro_per_step=global_micro, eval_batches=eval_batches)


def _plan(cfg: Config, world_size: int, train_rows: int, validation_rows: int, micro: int, steps: int) -> StepPlan:
    t = cfg.train
    total = t.max_steps if t.max_steps > 0 else steps * t.num_train_epochs
    if 0 < total <= t.warmup_steps:  # with max_steps the config refused it; the records' count is known only here
        raise ConfigError(
            warmup_too_long(
                t.warmup_steps,
                f"the run's {total} steps ({t.num_train_epochs} epoch(s) of {steps}: {train_rows:,} training examples, "
                f"{world_size} workers × {t.per_device_train_batch_size} per device × "
                f"{t.gradient_accumulation_steps} accumulation)",
            )
        )
    warmup = t.warmup_steps if t.warmup_steps > 0 else math.ceil(t.warmup_ratio * total)
    return StepPlan(
        world_size=world_size,
        train_rows=train_rows,
        validation_rows=validation_rows,
        micro_batches_per_epoch=micro,
        steps_per_epoch=steps,
        total_steps=total,
        warmup_steps=min(warmup, total),
    )
