"""The optimizer and the LR schedule that walk a run's steps (`rayft.train.steps`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from transformers import get_scheduler

from rayft.config import TrainConfig
from rayft.train.steps import StepPlan

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler


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

        # transformers leaves Adafactor's __init__ unannotated
        return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False)  # type: ignore[no-untyped-call]
    others: dict[str, Callable[..., torch.optim.Optimizer]] = {
        "sgd": torch.optim.SGD,
        "adagrad": torch.optim.Adagrad,
        "rmsprop": torch.optim.RMSprop,
    }
    if train.optim in others:
        return others[train.optim](groups, lr=lr)
    fused = train.optim == "adamw_torch_fused" and on_gpu
    return torch.optim.AdamW(groups, lr=lr, fused=fused or None)


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig, plan: StepPlan) -> LRScheduler:
    return cast(  # transformers' get_scheduler has no return annotation
        "LRScheduler",
        get_scheduler(
            train.lr_scheduler_type,
            optimizer,
            num_warmup_steps=plan.warmup_steps,
            num_training_steps=plan.total_steps,
        ),
    )
