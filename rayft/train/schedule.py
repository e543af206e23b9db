"""How many steps a run takes, and the optimizer and LR schedule that walk them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import get_scheduler

from rayft.config import Config, ConfigError, TrainConfig


@dataclass(frozen=True)
class Plan:
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


def make_plan(cfg: Config, train_rows: int, validation_rows: int, world_size: int) -> Plan:
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
    return Plan(
        world_size=world_size,
        train_rows=train_rows,
        validation_rows=validation_rows,
        micro_batches_per_epoch=micro,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        warmup_steps=min(warmup, total),
    )


def build_optimizer(model: nn.Module, train: TrainConfig, on_gpu: bool) -> torch.optim.Optimizer:
    """`train.optim` over the trainable (LoRA) parameters; no decay on 1-D tensors (biases, norms)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    lr = train.learning_rate
    if train.optim == "adafactor":  # as transformers' Trainer builds it: the configured LR, no relative steps
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False)
    others = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop}
    if train.optim in others:
        return others[train.optim](groups, lr=lr)
    fused = train.optim == "adamw_torch_fused" and on_gpu
    return torch.optim.AdamW(groups, lr=lr, fused=fused or None)


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig, plan: Plan):
    return get_scheduler(
        train.lr_scheduler_type,
        optimizer,
        num_warmup_steps=plan.warmup_steps,
        num_training_steps=plan.total_steps,
    )
