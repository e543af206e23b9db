"""The frozen base kept in NF4 (QLoRA's 4-bit NormalFloat), dequantised only for its matmul.

The format is QLoRA's, value for value as torchao's `to_nf4` produces it: blocks of 64 weights (in row-major order)
scaled by their absolute maximum and rounded to the nearest of 16 NormalFloat levels, two 4-bit codes a byte; the
block maxima "double quantised": their mean subtracted, then int8 codes in groups of 256 blocks, each group with one
factor. A weight costs 4.127 bits.

Why not torchao's `NF4Tensor` itself: it is a 2-D tensor subclass (routed experts are 3-D), and the FP8 base
(`rayft.model.fp8`) already holds its quantised storage as plain frozen integer parameters that FSDP2 shards and
all-gathers byte for byte on every supported torch (`rayft.parallel.torch_compat`). NF4 takes the same road:

- `weight`: the codes, uint8 `[out, in / 2]`; `weight_scalers`: int8 `[out, in / 64]`, a code per block, so both
  shard on dim 0 with their rows;
- `weight_factors`: one per group of 256 blocks, `[numel / 16384]`, and `weight_mean`: `[1]`, each held as the int32
  bits of an fp32 value (a floating-point parameter would be rounded by FSDP's mixed-precision all-gather). FSDP2
  splits these unevenly across ranks (padding the last); it all-gathers every parameter whole before the matmul,
  where only the whole tensor is read.

The arithmetic runs in the dtype the weight was quantised in (`quant_dtype`, the model's dtype), as in torchao, so
the stored codes and the dequantised weight are torchao's bit for bit; the matmul then runs in the compute dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, cast

import torch
from torch import nn

from rayft.model.fp8 import (
    SCALE_STORAGE,
    GroupedWeight,
    QuantisedExperts,
    QuantisedLinear,
    frozen_parameter,
    fused_or_eager,
)
from rayft.model.frozen import fused_experts, held_weights
from rayft.model.nf4_format import BLOCK, DEQUANT_ROWS_BLOCK, GROUP, SCALER_BLOCK, fits

# The 16 NormalFloat levels: quantiles of N(0, 1) scaled to [-1, 1] with an exact zero (the QLoRA paper), to four
# decimals as torchao tabulates them, so that codes and values are torchao's.
LEVELS = (
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
)  # fmt: skip
QUANTIZE_CHUNK = 2**20  # elements compared against the 16 levels at once (the comparison holds 16 × as many)


class Nf4Parts(NamedTuple):
    """A weight in NF4: its codes and scalers, with their factors and mean as `quant_dtype` values in fp32."""

    codes: torch.Tensor  # uint8 [out, in / 2]: two 4-bit codes a byte, the first in the high nibble
    scalers: torch.Tensor  # int8 [out, in / 64]
    factors: torch.Tensor  # fp32 [numel / 16384]
    mean: torch.Tensor  # fp32 [1]


def levels(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(LEVELS, dtype=dtype, device=device)


@torch.no_grad()
def quantize(weight: torch.Tensor) -> Nf4Parts:
    """A 2-D weight in NF4, computed in its own dtype (a bf16 weight's scales are bf16 values)."""
    if not fits(weight.shape):
        raise ValueError(
            f"NF4 needs rows of whole {BLOCK}-blocks and a multiple of {GROUP} weights, got {weight.shape}"
        )
    absmax = block_absmax(weight)
    scalers, factors, mean = double_quantize(absmax)
    rows = weight.shape[0]
    return Nf4Parts(encode(weight, absmax).view(rows, -1), scalers.view(rows, -1), factors, mean)


def block_absmax(weight: torch.Tensor) -> torch.Tensor:
    """The absolute maximum of each 64-weight block, in row-major order (a row's blocks are its own)."""
    return weight.detach().contiguous().view(-1, BLOCK).abs().max(dim=1).values


def double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole weight's block maxima as int8 scalers, with the fp32 factor of each group of 256 and their mean.
    Needs every block of the weight: the mean is over all of them."""
    mean = absmax.mean()
    centred = (absmax - mean).view(-1, SCALER_BLOCK)
    factors = 256 / (2 * centred.abs().max(dim=1).values)
    scalers = (centred * factors[:, None]).round().clamp(-128, 127).to(torch.int8).flatten()
    return scalers, factors.to(torch.float32), mean.to(torch.float32).view(1)


def encode(weight: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """Each weight's nearest level (ties to the lower) after dividing by its block's maximum, two codes a byte
    (the first in the high nibble), flat; rows of a weight are encoded on their own, given their blocks' maxima."""
    scaled = (weight.detach().contiguous().view(-1, BLOCK) / absmax[:, None]).flatten()
    table = levels(weight.dtype, weight.device)
    codes = torch.empty(scaled.numel(), dtype=torch.uint8, device=weight.device)
    for lo in range(0, scaled.numel(), QUANTIZE_CHUNK):
        chunk = scaled[lo : lo + QUANTIZE_CHUNK]
        codes[lo : lo + QUANTIZE_CHUNK] = (chunk[:, None] - table).abs().min(dim=-1).indices.to(torch.uint8)
    return (codes[::2] << 4) | codes[1::2]


def dequantize(parts: Nf4Parts, quant_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The weight `[..., out, in]` in `dtype` (a leading dim: a stack of experts, each quantised on its own):
    level × (scaler / factor + mean), computed in `quant_dtype`. The block scales are made first (a value per 64
    weights); then, where the compiled kernel is used (`rayft.model.fp8.fuses`: CUDA), one kernel reads the codes
    and writes the weight, and elsewhere the eager ops run a bounded block of rows at a time (their int64 indices
    take 8 bytes a weight)."""
    codes, mean = parts.codes, parts.mean.to(quant_dtype)
    columns = codes.shape[-1] * 2
    unscaled = (parts.scalers.reshape(-1, SCALER_BLOCK) / parts.factors.reshape(-1, 1).to(quant_dtype)).to(quant_dtype)
    scales = (unscaled.view(mean.numel(), -1) + mean.view(-1, 1)).view(-1, columns // BLOCK)  # a row's blocks
    table = levels(quant_dtype, codes.device)
    flat = codes.reshape(-1, columns // 2)
    # Into a wider dtype only after the kernel: compiled, a quant_dtype product on its way to a wider output would
    # not be rounded to quant_dtype first (torch 2.11), where the eager ops round it.
    into = dtype if dtype.itemsize <= quant_dtype.itemsize else quant_dtype
    kind, tensors = "NF4 dequantisation", (flat, scales, table)
    weight = fused_or_eager(kind, _scaled_levels, tensors, into, eager=_scaled_levels_in_blocks)
    return weight.to(dtype).view(*codes.shape[:-1], columns)


def _scaled_levels(codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of codes `[rows, in / 2]` as their levels × their block's scale `[rows, in / 64]`, multiplied in the
    table's dtype, then in `dtype`: the elementwise core."""
    blocks = codes.view(codes.shape[0], -1, BLOCK // 2)  # [rows, in / 64, 32]: each block's codes
    shifts = 4 - 4 * torch.arange(2, dtype=torch.uint8, device=codes.device)  # 4, 0: the high nibble first (made
    # on the device: a tensor from a host list would be a copy the host waits for)
    values = table[((blocks[..., None] >> shifts) & 0xF).long()]  # [rows, in / 64, 32, 2]: broadcast, no copies
    return (values * scales[..., None, None]).to(dtype).view(codes.shape[0], -1)


def _scaled_levels_in_blocks(
    codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`_scaled_levels` as eager ops, a bounded block of rows at a time."""
    out = torch.empty((codes.shape[0], codes.shape[1] * 2), dtype=dtype, device=codes.device)
    step = max(1, DEQUANT_ROWS_BLOCK // out.shape[1])
    for lo in range(0, codes.shape[0], step):
        out[lo : lo + step] = _scaled_levels(codes[lo : lo + step], scales[lo : lo + step], table, dtype)
    return out


STORAGE_SUFFIXES = ("", "_scalers", "_factors", "_mean")  # a weight `w` is held as w, w_scalers, w_factors, w_mean


def storage_shapes(shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each storage parameter of a weight `[..., out, in]` (a leading dim: a stack of experts)."""
    *stack, rows, columns = shape
    return [
        ((*stack, rows, columns // 2), torch.uint8),
        ((*stack, rows, columns // BLOCK), torch.int8),
        ((*stack, rows * columns // GROUP), SCALE_STORAGE),
        ((*stack, 1), SCALE_STORAGE),
    ]


def storage_of(module: nn.Module, name: str) -> tuple[torch.Tensor, ...]:
    """The storage parameters of a module's NF4 weight `name`."""
    return tuple(getattr(module, name + suffix) for suffix in STORAGE_SUFFIXES)


def store_(storage: tuple[torch.Tensor, ...], parts: Nf4Parts) -> None:
    """Copy quantised `parts` into storage tensors (their factors and mean as int32 bits)."""
    for target, values in zip(storage, parts, strict=True):
        (target if target.dtype == values.dtype else target.view(values.dtype)).copy_(values.view(target.shape))


def _dequantize_stored(
    codes: torch.Tensor,
    scalers: torch.Tensor,
    factors: torch.Tensor,
    mean: torch.Tensor,
    dtype: torch.dtype,
    *,
    quant_dtype: torch.dtype,
) -> torch.Tensor:
    """`dequantize` of a layer's parameters (factors and mean as their int32 bits), for `FrozenLinear`."""
    parts = Nf4Parts(codes, scalers, factors.view(torch.float32), mean.view(torch.float32))
    return dequantize(parts, quant_dtype, dtype)


def _register_storage_(module: nn.Module, name: str, shape: tuple[int, ...], device: torch.device | str | None) -> None:
    for suffix, (part_shape, dtype) in zip(STORAGE_SUFFIXES, storage_shapes(shape), strict=True):
        module.register_parameter(name + suffix, frozen_parameter(part_shape, dtype, device))


class Nf4Linear(QuantisedLinear):
    """A frozen linear layer stored in NF4 (see the module docstring for its four parameters), made by `from_linear`;
    `quant_dtype` is the dtype its scales are computed in (the weight's)."""

    quant_dtype: torch.dtype
    weight_scalers: nn.Parameter  # registered by `_register_storage_`, with `weight`
    weight_factors: nn.Parameter
    weight_mean: nn.Parameter

    def _register_storage_(self, device: torch.device | str | None) -> None:
        _register_storage_(self, "weight", (self.out_features, self.in_features), device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype) -> Nf4Linear:
        """The NF4 layer for `linear`, quantised in its weight's dtype unless it is on the meta device."""
        weight = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype, weight.device)
        layer.quant_dtype = weight.dtype
        if weight.device.type != "meta":
            with torch.no_grad():
                store_(layer.storage(), quantize(weight))
                if linear.bias is not None:
                    layer.bias.copy_(linear.bias)
        return layer

    def storage(self) -> tuple[torch.Tensor, ...]:
        return storage_of(self, "weight")

    def _dequantize(self) -> Callable[..., torch.Tensor]:
        return functools.partial(_dequantize_stored, quant_dtype=self.quant_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, storage=nf4+double_quantised_scales"


class Nf4Experts(QuantisedExperts):
    """Routed experts held in NF4, each expert's matrix quantised on its own (QLoRA's per-tensor format, a tensor
    being one expert): `gate_up_proj` uint8 `[E, 2I, H / 2]` with `gate_up_proj_scalers` `[E, 2I, H / 64]`,
    `_factors` `[E, 2I·H / 16384]` and `_mean` `[E, 1]`, `down_proj` likewise. Every storage tensor shards on the
    experts, so a rank holds (and a sharded load quantises) whole experts."""

    kind = "NF4"

    def __init__(self, experts: nn.Module, compute_dtype: torch.dtype) -> None:
        self.quant_dtype = cast(nn.Parameter, experts.gate_up_proj).dtype
        super().__init__(experts, compute_dtype)

    def _store_(self, name: str, weight: torch.Tensor) -> None:
        _register_storage_(self, name, tuple(weight.shape), weight.device)
        # PEFT sizes expert LoRA from the parameter's shape, or from `ds_shape` where the stored tensor is not the
        # weight's (its hook for DeepSpeed's partitioned parameters): the codes hold two weights a byte.
        getattr(self, name).ds_shape = weight.shape
        if weight.device.type != "meta":
            with torch.no_grad():
                for expert, storage in enumerate(zip(*self._storage(name), strict=True)):
                    store_(storage, quantize(weight[expert]))

    def _storage(self, name: str) -> tuple[torch.Tensor, ...]:
        return storage_of(self, name)

    def _weight(self, name: str) -> GroupedWeight:
        return GroupedWeight(functools.partial(_dequantize_stored, quant_dtype=self.quant_dtype), self.shapes[name])


def to_nf4_(layers: list[nn.Module], compute_dtype: torch.dtype) -> tuple[int, int]:
    """Swap, inside each of `layers` (the decoder layers), every linear and fused-experts module whose weights have
    NF4 storage (`fits`, per expert for experts) for its NF4 form, quantising its real weights (or on the meta
    device). Call before LoRA and FSDP. Returns how many were swapped and how many stay in their dtype (a shape
    NF4 cannot block)."""
    swapped = kept = 0
    for layer in layers:
        for parent in list(layer.modules()):
            for child_name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    nf4: Callable[[torch.dtype], nn.Module] = functools.partial(Nf4Linear.from_linear, child)
                elif fused_experts(child):
                    nf4 = functools.partial(Nf4Experts, child)
                else:
                    continue
                if held_weights(child, "nf4"):
                    setattr(parent, child_name, nf4(compute_dtype))
                    swapped += 1
                else:
                    kept += 1
    return swapped, kept
