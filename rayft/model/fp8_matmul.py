"""FP8 matmuls on the stored bytes of the frozen base (`model.fp8_compute`): the forward and the input-gradient
matmul of an FP8 linear or expert stack read its E4M3 bytes as they are stored, where the dequantised path
(`rayft.model.fp8`) first writes the weight in the compute dtype and then multiplies that.

Every product here is `a · B` with B `[K, N]` a view of the stored bytes and one fp32 scale per row of the
storage. Where the storage's rows are B's columns (a linear's or expert's forward, `x · Wᵀ`), the scales are
`_scaled_mm`'s row-wise `scale_b`. Where they are B's rows, the contraction dimension (the input gradient
`g · W`, and GPT-OSS's transposed experts' forward), no row-wise scale of B can apply them: they are folded,
exactly, into the other operand before it is quantised, `a · (s ⊙ B) = (a ⊙ sᵀ) · B`, and B's scale is one.
The other operand (activations, or output gradients) is quantised per token row to E4M3 with its own scale
(amax / 448) by the storage's quantiser, handed in (`rayft.model.fp8.quantize_activation`: this module imports
nothing of the layers'), which is where this path departs from the dequantised one: E4M3 keeps 3 mantissa bits, a
relative rounding error of at most 2⁻⁴ per element.

CUDA's kernels want the second operand column-major: `Wᵀ` of a row-major `[out, in]` weight is that view, but the
input gradient's `W` is not, and takes a transposed copy of the bytes (1 byte read and 1 written per weight, the
weight's own size in FP8, never in the compute dtype). They also want K and N multiples of 16, row-wise scales
with a bf16 result, and compute capability 8.9 or newer (`supported`): any product that does not meet them runs
the dequantised path instead, with one warning per reason. Weights with block-wise scales (a scale per row and
column block) keep the dequantised path: a block scale varies along the contraction dimension of the forward.

Expert stacks (`grouped`): on CUDA one `torch._scaled_grouped_mm` per weight with the group ends as a device
tensor; elsewhere its reference, one `_scaled_mm` per expert over every row, each row keeping its own expert's
product (`torch.where` on the sorted expert ids). The reference multiplies every row by every expert (E times
the work): it is what the CPU checks run, and like the CUDA kernel it never reads the routed counts on the host.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

E4M3 = torch.float8_e4m3fn
# Rows of an operand in E4M3: (the E4M3 tensor, its fp32 scales [M, 1]); the storage's own (`rayft.model.fp8`).
Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
log = logging.getLogger(__name__)
ALIGNMENT = 16  # CUDA's FP8 kernels: the contraction and output dims a multiple of this
MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer run FP8 tensor-core matmuls
_warned: set[str] = set()


def supported(device: torch.device) -> bool:
    """Whether `device` runs FP8 matmuls: CUDA with compute capability 8.9 or newer (the default of
    `model.fp8_compute`); a CPU runs `_scaled_mm` too, but only when the setting asks for it."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def fp8_compute_on(setting: bool | str, device: torch.device) -> bool:
    """`model.fp8_compute` resolved for a worker on `device`: `auto` is on where the device runs FP8 matmuls."""
    return supported(device) if setting == "auto" else bool(setting)


@functools.cache
def cpu_row_scales() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes a scale per row; older releases (2.11) take one per tensor on the
    CPU (and assert otherwise), CUDA's row-wise kernel notwithstanding. Asked once, of a 16 × 16 product."""
    a = torch.zeros(16, 16, dtype=E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def unfit(device: torch.device, k: int, n: int, out_dtype: torch.dtype) -> str | None:
    """Why a `[M, K] · [K, N]` product in `out_dtype` cannot run as an FP8 matmul on `device` (None: it can)."""
    if device.type != "cuda":
        return None if cpu_row_scales() else f"torch {torch.__version__}'s CPU _scaled_mm takes no row-wise scales"
    if not supported(device):
        return f"compute capability {torch.cuda.get_device_capability(device)} runs no FP8 matmuls (8.9+ does)"
    if k % ALIGNMENT or n % ALIGNMENT:
        return f"CUDA's FP8 matmuls need both dims of a weight a multiple of {ALIGNMENT}, got {k} x {n}"
    if out_dtype != torch.bfloat16:
        return f"CUDA's row-wise FP8 matmuls return bf16, the compute dtype is {out_dtype}"
    return None


def warn_dequantised(reason: str) -> None:
    """Say once per reason that a product runs dequantised although `model.fp8_compute` is on."""
    if reason not in _warned:
        _warned.add(reason)
        log.warning("model.fp8_compute: a frozen FP8 matmul runs dequantised instead: %s", reason)


def operand(a: torch.Tensor, row_scale: torch.Tensor | None, quantize: Quantize) -> tuple[torch.Tensor, torch.Tensor]:
    """`a` `[M, K]` (times `row_scale`, `[K]` or `[M, K]`, folded in fp32 first: the weight's scales that lie on
    the contraction dimension) rounded per row by `quantize`."""
    return quantize(a if row_scale is None else a.to(torch.float32) * row_scale)


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    scale_on_rows: bool,
    out_dtype: torch.dtype,
    quantize: Quantize,
) -> torch.Tensor:
    """`a` `[M, K]` · B, B = `b` (E4M3 `[K, N]`) with its fp32 `scale` on its columns (`[N]`) or, `scale_on_rows`,
    on its rows (`[K]`, folded into `a`); `a` rounded per row by `quantize`."""
    aq, a_scale = operand(a, scale if scale_on_rows else None, quantize)
    if scale_on_rows:
        scale = torch.ones(b.shape[1], dtype=torch.float32, device=b.device)
    if b.device.type == "cuda" and b.stride(0) != 1:
        b = b.t().contiguous().t()  # column-major, as the kernel reads it: a copy of the bytes
    return torch._scaled_mm(aq, b, scale_a=a_scale, scale_b=scale.unsqueeze(0), out_dtype=out_dtype)


def grouped(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    scale_on_rows: bool,
    expert_ids: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    quantize: Quantize,
) -> torch.Tensor:
    """Per expert group: rows of `a` `[M, K]` (sorted by expert: `expert_ids` `[M]`, group ends `offs` `[E]`) ·
    B_e, B = `b` (E4M3 `[E, K, N]`) with its fp32 `scale` on each expert's columns (`[E, N]`) or, `scale_on_rows`,
    its rows (`[E, K]`, folded into each row of `a` by that row's expert); `a` rounded per row by `quantize`."""
    aq, a_scale = operand(a, scale[expert_ids] if scale_on_rows else None, quantize)
    if scale_on_rows:
        scale = torch.ones(b.shape[0], b.shape[2], dtype=torch.float32, device=b.device)
    if b.device.type == "cuda":
        if b.stride(-2) != 1:
            b = b.transpose(-2, -1).contiguous().transpose(-2, -1)
        return torch._scaled_grouped_mm(aq, b, a_scale.squeeze(-1), scale.contiguous(), offs=offs, out_dtype=out_dtype)
    return per_expert_reference(aq, a_scale, b, scale, expert_ids, out_dtype)


def per_expert_reference(
    aq: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    expert_ids: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`torch._scaled_grouped_mm`'s values by one `_scaled_mm` per expert: every row times every expert, each row
    keeping its own expert's product; the group sizes never leave the device."""
    out = aq.new_zeros(aq.shape[0], b.shape[2], dtype=out_dtype)
    mine = expert_ids.unsqueeze(-1)
    for e in range(b.shape[0]):
        product = torch._scaled_mm(aq, b[e], scale_a=a_scale, scale_b=scale[e].unsqueeze(0), out_dtype=out_dtype)
        out = torch.where(mine == e, product, out)
    return out


class ScaledFrozenLinear(torch.autograd.Function):
    """y = x · Wᵀ on the stored bytes of a frozen row-scaled FP8 weight (`data` uint8 `[out, in]`, `scale` fp32
    `[out]`); the input gradient g · W likewise; no weight gradient. Saves only the storage."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dtype: torch.dtype, quantize: Quantize, data: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(data, scale)
        ctx.dtype, ctx.input_dtype, ctx.quantize = dtype, x.dtype, quantize
        rows = x.reshape(-1, x.shape[-1])
        out = matmul(rows, data.view(E4M3).t(), scale, False, dtype, quantize)
        return out.view(*x.shape[:-1], data.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        unused = (None,) * 4
        if not ctx.needs_input_grad[0]:
            return (None, *unused)
        data, scale = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        dx = matmul(rows, data.view(E4M3), scale, True, ctx.dtype, ctx.quantize)
        return (dx.view(*grad.shape[:-1], data.shape[1]).to(ctx.input_dtype), *unused)


class ScaledFrozenGrouped(torch.autograd.Function):
    """Per expert group: x_g · W_gᵀ (`[E, out, in]` storage, scales `[E, out]`) or, `transposed`, x_g · W_g
    (`[E, in, out]`, scales `[E, in]`), on the stored bytes; the input gradient likewise; no weight gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        dtype: torch.dtype,
        transposed: bool,
        expert_ids: torch.Tensor,
        offs: torch.Tensor,
        quantize: Quantize,
        data: torch.Tensor,
        scale: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(expert_ids, offs, data, scale)
        ctx.dtype, ctx.input_dtype, ctx.transposed, ctx.quantize = dtype, x.dtype, transposed, quantize
        b = data.view(E4M3)
        b = b if transposed else b.transpose(-2, -1)
        return grouped(x, b, scale, transposed, expert_ids, offs, dtype, quantize)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        unused = (None,) * 7
        if not ctx.needs_input_grad[0]:
            return (None, *unused)
        expert_ids, offs, data, scale = ctx.saved_tensors
        b = data.view(E4M3)
        b = b.transpose(-2, -1) if ctx.transposed else b
        dx = grouped(grad, b, scale, not ctx.transposed, expert_ids, offs, ctx.dtype, ctx.quantize)
        return (dx.to(ctx.input_dtype), *unused)
