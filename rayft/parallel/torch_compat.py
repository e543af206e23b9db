"""FSDP2 behaviour that differs between the torch releases rayft supports, made the same.

The frozen FP8 base is held in integer parameters (`rayft.model.fp8` says why). FSDP2 learnt to hold those in
torch 2.12: before it, `fully_shard` re-creates every sharded parameter with autograd on (an integer tensor
refuses that) and would cast an integer parameter to the mixed-precision `param_dtype` for its all-gather
(turning E4M3 bit patterns into numbers). `allow_integer_parameters` teaches an older FSDP2 those two rules and
nothing else; everything else (sharding, the mixed-dtype byte all-gather, the copy-out) is that release's own.
A patch rather than another storage: the bytes, the checkpoints and the numbers stay those of the newer torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

INTEGER_PARAMETERS = (2, 12)  # the first torch whose FSDP2 holds integer parameters itself
# The oldest torch rayft runs on, the oldest its CI trains on: FSDP2 over the FP8 base (with the patch below),
# `fully_shard(ignored_params=...)` for expert parallelism, `F.grouped_mm` for MoE experts, FSDP2's collective
# classes the per-step tally wraps.
FLOOR = (2, 11)


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a torch version string (`torch.__version__` by default): '2.11.0+cu130' -> (2, 11)."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch(version: str | None = None) -> None:
    """Refuse a torch below `FLOOR` in one line, before anything is built on it."""
    from rayft.config import ConfigError

    found = version or torch.__version__
    if torch_release(found) < FLOOR:
        floor = ".".join(map(str, FLOOR))
        raise ConfigError(
            f"torch {found} is older than {floor}, the oldest release rayft runs on (FSDP2 over the FP8 frozen "
            f"base, fully_shard's ignored_params for expert parallelism, F.grouped_mm for MoE experts); install "
            f"torch {floor} or later: pip install 'torch>={floor}'"
        )


def needs_integer_parameter_patch(version: str | None = None) -> bool:
    return torch_release(version) < INTEGER_PARAMETERS


def allow_integer_parameters() -> None:
    """Make this torch's FSDP2 hold frozen integer parameters as torch 2.12 does (a no-op there and later, and
    when applied twice)."""
    if not needs_integer_parameter_patch():
        return
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    if getattr(FSDPParam, "_rayft_integer_parameters", False):
        return
    # A deliberate patch of torch's class (its methods replaced, a mark of rayft's own set), which mypy refuses.
    FSDPParam._init_sharded_param = _frozen_if_integer(FSDPParam._init_sharded_param)  # type: ignore[method-assign]
    FSDPParam.to_sharded_post_forward = _frozen_if_integer(FSDPParam.to_sharded_post_forward)  # type: ignore[method-assign]
    FSDPParam.init_dtype_attrs = _never_cast_integers(FSDPParam.init_dtype_attrs)  # type: ignore[method-assign]
    FSDPParam._rayft_integer_parameters = True  # type: ignore[attr-defined]


@contextmanager
def _integer_parameters_frozen() -> Iterator[None]:
    """While FSDP2 builds one parameter: `nn.Parameter(t)` of an integer `t` is created without autograd (the only
    thing an integer tensor allows) instead of failing. FSDP2 sets `requires_grad` from the original right after."""
    saved = nn.Parameter.__dict__["__new__"]  # the staticmethod itself, restored as it was
    original = nn.Parameter.__new__

    def new(cls: type, data: torch.Tensor | None = None, requires_grad: bool = True) -> nn.Parameter:
        if data is not None and not (data.is_floating_point() or data.is_complex()):
            requires_grad = False
        return original(cls, data, requires_grad)

    # A deliberate patch of torch's class, which mypy refuses (and torch types `__new__` as Tensor's generic one).
    nn.Parameter.__new__ = staticmethod(new)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Parameter.__new__ = saved  # type: ignore[method-assign]


def _frozen_if_integer(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _integer_parameters_frozen():
            return method(self, *args, **kwargs)

    return wrapped


def _never_cast_integers(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapped(self: Any, mp_policy: Any) -> None:
        method(self, mp_policy)
        if not self.orig_dtype.is_floating_point:
            self.param_dtype = None  # gathered as the bytes they are

    return wrapped
