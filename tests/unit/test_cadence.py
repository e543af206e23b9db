"""When the loop looks at Ray's drain notice (`ray.preemption`, `ray.preemption_check_steps`): each look is a
barrier across the workers, so the steps it happens after are exactly these, on every rank."""

from __future__ import annotations

import pytest

from rayft.config import Config
from rayft.train.checkpoint_dir import Progress
from rayft.train.loop import Cadence
from rayft.train.steps import StepPlan

PLAN = StepPlan(
    world_size=2,
    train_rows=80,
    validation_rows=0,
    micro_batches_per_epoch=20,
    steps_per_epoch=10,
    total_steps=10,
    warmup_steps=0,
)


def looks(**sections) -> list[int]:
    cfg = Config.from_dict({"model": {"model_name_or_path": "m"}, "data": {"dataset_name_or_path": "d"}, **sections})
    cadence = Cadence(cfg.train, cfg.ray, PLAN)
    return [step for step in range(1, PLAN.total_steps + 1) if cadence.preemption_check_due(Progress(step=step))]


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({}, list(range(1, 10))),  # every step but the last, which ends in the run's own checkpoint
        ({"ray": {"preemption_check_steps": 4}}, [4, 8]),
        ({"ray": {"preemption": "ignore"}}, []),
        ({"train": {"save_strategy": "no"}}, []),  # a run that keeps no checkpoint saves none on a notice either
    ],
)
def test_the_drain_notice_is_looked_at_after_these_steps(sections, expected):
    assert looks(**sections) == expected
