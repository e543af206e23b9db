"""The functions Ray Train runs on each worker, as the driver hands them to `TorchTrainer`.

Ray pickles a function of an importable module by its name, so the driver can pass these without importing the
worker stack (the model, FSDP2, expert parallelism, PEFT): each imports its loop when a worker calls it. That keeps
`rayft validate` and the driver's start as light as the checks they run.
"""

from __future__ import annotations

from typing import Any


def train_worker(loop_config: dict[str, Any]) -> None:
    """One worker's training run (`rayft.train.loop.train_loop_per_worker`)."""
    from rayft.train.loop import train_loop_per_worker

    train_loop_per_worker(loop_config)


def eval_worker(loop_config: dict[str, Any]) -> None:
    """One worker's share of `rayft eval` (`rayft.train.loop.eval_loop_per_worker`)."""
    from rayft.train.loop import eval_loop_per_worker

    eval_loop_per_worker(loop_config)
