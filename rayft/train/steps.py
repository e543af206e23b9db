"""How many steps a run takes: fixed on the driver from the dataset's row counts, so every worker agrees on it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rayft.config import Config, ConfigError


@dataclass(frozen=True)
class StepPlan:
    """Step arithmetic fixed on the driver, so every worker agrees on it (and on when to report)."""

    world_size: int
    train_rows: int
    validation_rows: int
    micro_batches_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int

    @property
    def has_validation(self) -> bool:
        return self.validation_rows >= self.world_size


def plan_steps(cfg: Config, train_rows: int, validation_rows: int, world_size: int) -> StepPlan:
    t = cfg.train
    rows_per_worker = train_rows // world_size  # streaming_split(equal=True) drops the remainder
    if rows_per_worker == 0:
        raise ConfigError(
            f"data: {train_rows} training records cannot feed ray.num_workers={world_size} workers; "
            "use more data or fewer workers"
        )
    micro = math.ceil(rows_per_worker / t.per_device_train_batch_size)
    steps_per_epoch = math.ceil(micro / t.gradient_accumulation_steps)
    total = t.max_steps if t.max_steps > 0 else steps_per_epoch * t.num_train_epochs
    warmup = t.warmup_steps if t.warmup_steps > 0 else math.ceil(t.warmup_ratio * total)
    return StepPlan(
        world_size=world_size,
        train_rows=train_rows,
        validation_rows=validation_rows,
        micro_batches_per_epoch=micro,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        warmup_steps=min(warmup, total),
    )
