"""Which frozen matrices of a decoder layer a quantised base (FP8 or NF4) holds. The swaps (`rayft.model.fp8.to_fp8_`,
`rayft.model.nf4.to_nf4_`) and the planner read this one rule, so the plan counts exactly what a job stores; it
imports no layer of the workers'."""

from __future__ import annotations

from typing import Literal, cast

from torch import nn

from rayft.model.fp8_format import EXPERT_WEIGHTS
from rayft.model.nf4_format import fits

Storage = Literal["fp8", "nf4"]  # a quantised base's storage
# How the frozen base is held: in `model.torch_dtype` ("dtype"), or its decoder matrices in a quantised Storage.
Held = Literal["dtype", "fp8", "nf4"]


def fused_experts(module: nn.Module) -> bool:
    """Whether `module` holds routed experts as fused 3-D weights (transformers' `@use_experts_implementation`)."""
    stacks = [getattr(module, n, None) for n in EXPERT_WEIGHTS]
    return all(isinstance(p, nn.Parameter) and p.ndim == 3 for p in stacks)


def held_weights(module: nn.Module, storage: Storage) -> list[nn.Parameter]:
    """The weights of `module` that `storage` holds: a plain linear's weight or a fused-experts module's stacks. NF4
    takes a module only when it can block every one of them (each expert on its own); the others stay as they are."""
    if type(module) is nn.Linear:  # subclasses carry behaviour a swap would lose
        weights = [cast(nn.Parameter, module.weight)]  # a Linear's weight is always registered as a Parameter
    elif fused_experts(module):
        weights = [getattr(module, n) for n in EXPERT_WEIGHTS]
    else:
        return []
    if storage == "nf4" and not all(fits(tuple(w.shape[-2:])) for w in weights):
        return []
    return weights


def frozen_matrices(layer: nn.Module, storage: Storage) -> list[nn.Parameter]:
    """The frozen matrices of a (PEFT-wrapped) decoder layer that `storage` holds, LoRA's own left out; each once,
    though PEFT's wrappers of an experts module reach its stacks too."""
    out: dict[int, nn.Parameter] = {}
    for name, module in layer.named_modules():
        if ".lora_" in f".{name}":
            continue
        out.update((id(p), p) for p in held_weights(module, storage) if not p.requires_grad)
    return list(out.values())
