"""The repeated blocks of a model (its decoder layers, a vision tower's blocks), found where transformers declares
them, and the model under a PEFT wrapper: what the builder, the sharding and the vision parts all ask for."""

from __future__ import annotations

import peft
from torch import nn


def unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (the model itself when it has none)."""
    return model.get_base_model() if isinstance(model, peft.PeftModel) else model


def declared_blocks(model: nn.Module) -> list[nn.Module]:
    """Every module of a class the model declares as not splittable (`_no_split_modules`), in module order. By
    MRO, not type(m): fully_shard swaps a module's class for a generated `FSDP<Name>` subclass."""
    base = unwrapped(model)
    names = set(getattr(base, "_no_split_modules", None) or [])
    return [m for m in base.modules() if any(c.__name__ in names for c in type(m).__mro__)]
