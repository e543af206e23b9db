"""`train.optim`: the optimizers users pick with LoRA (transformers' names) each take a step here; bitsandbytes'
and unknown names are refused with the supported list."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from rayft.config import OPTIMIZERS, Config, ConfigError, TrainConfig
from rayft.train.schedule import build_optimizer


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_supported_optimizer_lowers_the_loss(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    model[0].weight.requires_grad_(False)  # a frozen base matrix: not the optimizer's
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    optimizer = build_optimizer(model, TrainConfig(optim=name, learning_rate=1e-2), on_gpu=False)
    assert all(p.requires_grad for g in optimizer.param_groups for p in g["params"])
    decays = sorted(g["weight_decay"] for g in optimizer.param_groups)
    assert decays == [0.0, 0.01]  # no decay on 1-D tensors (biases, norms)
    losses = []
    for _ in range(20):
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < losses[0], (name, losses)


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("adamw_8bit", "train.optim: adamw_8bit is a bitsandbytes optimizer"),
        ("paged_adamw_32bit", "is a bitsandbytes optimizer"),
        ("adamw_apex_fused", "train.optim: unknown value 'adamw_apex_fused'"),
    ],
)
def test_unsupported_optimizers_are_refused_with_the_supported_ones(name, needle):
    with pytest.raises(ConfigError) as err:
        Config.from_dict({"train": {"optim": name}})
    assert needle in str(err.value) and "adamw_torch_fused, adafactor, sgd" in str(err.value)
    if name.endswith("bit") and importlib.util.find_spec("bitsandbytes") is None:
        assert "(and bitsandbytes is not installed)" in str(err.value)
