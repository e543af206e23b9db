"""The frozen base kept in FP8 (E4M3 + one fp32 scale per output row), dequantised only for its matmul.

Why not the libraries' FP8: transformers' FP8 quantizers are inference-only (forced into training they drop the
input gradient), torchao's FP8 training keeps bf16 master weights (no memory saved), and FSDP2 turns parameter
subclasses into plain parameters (the quantisation silently disappears). So the storage here is plain frozen
`uint8` parameters holding E4M3 bit patterns, next to plain fp32 scale parameters:

- FSDP2 shards and all-gathers them like any other parameter, byte for byte: a non-floating parameter is never cast
  by the mixed-precision policy (a `float8` one would be gathered as bf16/fp32), gloo moves `uint8`, and PEFT does
  not cast its LoRA weights to an integer base dtype.
- Scales are per output row (`[out]` for a linear, `[E, out]` for fused experts), so they shard on dim 0 exactly
  with their rows; a block-wise checkpoint (DeepSeek-V3: one scale per 128×128 block) keeps its scales losslessly
  as one per row and column block (`[out, blocks]`, `[E, out, blocks]`: the row blocks spread over their rows, so
  FSDP still cuts scales with their rows), the column block width held by the module (`block`). They are stored
  as the int32 bit patterns of their fp32 values (`scales()` views them back) for the same reason: a
  floating-point parameter would be rounded to `param_dtype` by every bf16 all-gather.
  The hub's static per-tensor / per-expert scales expand to rows losslessly; a bf16/fp32 weight is quantised per
  row (amax / 448).
- The matmul is an autograd Function: forward dequantises into the compute dtype, backward dequantises again for
  the input gradient; no weight gradient, and only the 1-byte weight and its scales are saved for backward. With
  `model.fp8_compute` (`fp8_compute` on each layer, `set_fp8_compute_`) a row-scaled weight is not dequantised at
  all: `rayft.model.fp8_matmul` multiplies its stored bytes in FP8.
- On CUDA the dequantisation is one compiled kernel (`torch.compile` of `_dequantize`): it reads each byte and row
  scale once and writes the compute dtype, where the eager ops write and read fp32 temporaries between them (about
  six times the memory traffic). The values are the same: both multiply in fp32 and round once. Elsewhere, or with
  RAYFT_FP8_FUSED=0, or where compiling fails, or under a torch dispatch mode (selective activation
  checkpointing's, where dynamo compiles nothing), the eager ops run; either way a bounded block of rows at a time.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar, cast

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import LoraLayer, ParamWrapper
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from rayft import environment
from rayft.model import fp8_matmul
from rayft.model.fp8_format import (
    DEQUANT_BLOCK,
    EXPERT_DEQUANT_BUDGET,
    EXPERT_WEIGHTS,
    HOST_QUANTIZE_BLOCK,
    QUANTIZE_BLOCK,
    storage_block,
)
from rayft.model.frozen import held_weights

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
STORAGE = torch.uint8  # E4M3 bit patterns; see the module docstring for why not torch.float8_e4m3fn
SCALE_STORAGE = torch.int32  # fp32 bit patterns of the row scales, never cast by FSDP's mixed precision
FROZEN_DTYPES = ("auto", "float8_e4m3fn", "bfloat16", "float32")
GROUPED_MM_ALIGNMENT = 16  # bytes: grouped_mm needs every operand's strides a multiple of this
T = TypeVar("T")  # what a compiled core returns


def quantize_rows(weight: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 bytes and one fp32 scale per row (last dim reduced), or per row and `block`-wide column block
    (`[..., ceil(columns / block)]`): `weight ≈ bytes.view(E4M3) * block_scales(scale, block, columns)`."""
    scale_shape = _scale_shape(tuple(weight.shape), storage_block(weight.shape[-1], block))
    data = torch.empty(weight.shape, dtype=STORAGE, device=weight.device)
    scale = torch.empty(scale_shape, dtype=torch.float32, device=weight.device)
    quantize_rows_into_(data, scale, weight, block)
    return data, scale


def quantize_rows_into_(data: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, block: int | None) -> None:
    """`quantize_rows(weight, block)` into `data` (uint8, `weight`'s shape) and `scale` (fp32): each row, or each
    `block` columns of it, divided in fp32 by its absolute maximum / 448 (at least fp32's smallest normal),
    clamped to ±448 and rounded to E4M3.

    Computed on `weight`'s device (loading puts it on `data`'s), a block of rows at a time in one fp32 workspace
    that every block reuses (two buffers: 8 bytes a weight of the block): on a GPU `QUANTIZE_BLOCK` weights, on a
    CPU `HOST_QUANTIZE_BLOCK`, which its caches hold. A CPU pays for temporaries made per operation more than for
    the arithmetic: each lands in freshly mapped pages, a page fault per 4 KiB."""
    rows = weight.detach().reshape(-1, weight.shape[-1])
    count, columns = rows.shape
    width = storage_block(columns, block) or columns
    blocks = -(-columns // width)
    out, out_scale = data.view(rows.shape).view(E4M3), scale.view(count, blocks)  # views: writes fill the storage
    limit = HOST_QUANTIZE_BLOCK if rows.device.type == "cpu" else QUANTIZE_BLOCK
    step = max(1, min(count, limit // columns))
    # A partial last column block is padded with zeros, which change no maximum and divide to zero.
    work = torch.zeros(2, step, blocks * width, dtype=torch.float32, device=rows.device)
    for lo in range(0, count, step):
        n = min(step, count - lo)
        w, t = work[0, :n], work[1, :n]
        w[:, :columns].copy_(rows[lo : lo + n])
        s = torch.amax(torch.abs(w, out=t).view(n, blocks, width), dim=-1)
        s.div_(E4M3_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
        torch.div(w.view(n, blocks, width), s.unsqueeze(-1), out=t.view(n, blocks, width))
        out[lo : lo + n].copy_(t.clamp_(-E4M3_MAX, E4M3_MAX)[:, :columns])
        out_scale[lo : lo + n].copy_(s)


def quantize_activation(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An operand of an FP8 matmul (`rayft.model.fp8_matmul`: activations, output gradients) `[M, K]` in E4M3 per
    row: (the E4M3 tensor, its fp32 scales `[M, 1]`). Where the dequantisation is compiled (`fuses`: CUDA) this is
    one kernel too, reading the operand once and writing its bytes; elsewhere `quantize_rows`, a bounded block of
    rows at a time. Both divide in fp32 by the same scale: the same bytes."""
    return fused_or_eager("FP8 activation quantisation", rowwise_e4m3, (a,), eager=_rowwise_e4m3_blocks)


def rowwise_e4m3(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The elementwise core: each row of `a` divided in fp32 by its amax / 448 (at least fp32's smallest normal),
    clamped to ±448 and rounded to E4M3, as `quantize_rows` does."""
    rows = a.to(torch.float32)
    scale = (rows.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (rows / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def _rowwise_e4m3_blocks(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    data, scale = quantize_rows(a)
    return data.view(E4M3), scale.unsqueeze(-1)


def block_scales(scale: torch.Tensor, block: int | None, columns: int) -> torch.Tensor:
    """Row scales (`[..., rows]`) or row and column-block scales (`[..., rows, blocks]`) broadcast to a weight's
    `[..., rows, columns]`."""
    if block is None:
        return scale.unsqueeze(-1)
    return scale.repeat_interleave(block, dim=-1)[..., :columns]


def _dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int | None) -> torch.Tensor:
    """E4M3 bytes × their scales, multiplied in fp32 and rounded once to `dtype`: the elementwise core."""
    scale = block_scales(scale.to(torch.float32), block, data.shape[-1])
    return (data.view(E4M3).to(torch.float32) * scale).to(dtype)


@functools.cache
def compiled(core: Callable[..., T]) -> Callable[..., T]:
    """An elementwise (de)quantisation `core` compiled into one kernel; dynamic shapes, so every linear and expert
    stack shares it."""
    return cast("Callable[..., T]", torch.compile(core, dynamic=True, fullgraph=True))


_fusing: dict[str, bool] = {}  # device type → whether the compiled kernel is used there (a failed compile: never again)


def fuses(device: torch.device) -> bool:
    """Whether `dequantize_rows` runs the compiled kernel on `device`: on CUDA unless RAYFT_FP8_FUSED=0 says no;
    `fused_dequantization` sets it for a device type (tests, benchmarks)."""
    if device.type not in _fusing:
        _fusing[device.type] = device.type == "cuda" and bool(environment.value(environment.FP8_FUSED))
    return _fusing[device.type]


@contextmanager
def fused_dequantization(device_type: str, on: bool) -> Iterator[None]:
    """Within: `dequantize_rows` on `device_type` compiled (`on`) or eager, whatever the default there."""
    before = _fusing.get(device_type)
    _fusing[device_type] = on
    try:
        yield
    finally:
        if before is None:
            _fusing.pop(device_type, None)
        else:
            _fusing[device_type] = before


def dequantize_rows(
    data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int | None = None
) -> torch.Tensor:
    """The weight in `dtype`: E4M3 bytes × their row (and `block`-wide column block) scales, multiplied in fp32
    (exactly the checkpoint's value, as a bf16 load rounds it), a bounded block of rows at a time: compiled, each
    block is one kernel; eager, the fp32 temporaries stay those of one block next to a 128-expert stack, wherever
    the eager ops run instead of the kernel."""
    if dtype == torch.float32 or data.numel() <= DEQUANT_BLOCK:
        return _dequantize_block(data, scale, dtype, block)
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    step = max(1, DEQUANT_BLOCK // (data[0].numel()))
    for lo in range(0, data.shape[0], step):
        out[lo : lo + step] = _dequantize_block(data[lo : lo + step], scale[lo : lo + step], dtype, block)
    return out


def _dequantize_block(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int | None) -> torch.Tensor:
    return fused_or_eager("FP8 dequantisation", _dequantize, (data, scale), dtype, block)


def fused_or_eager(
    kind: str,
    core: Callable[..., T],
    tensors: tuple[torch.Tensor, ...],
    *args: object,
    eager: Callable[..., T] | None = None,
) -> T:
    """`core(*tensors, *args)`: the compiled kernel where it is used (`fuses`), else the eager ops (`eager`, the
    same values by other ops, where given). Under a torch dispatch mode (selective activation checkpointing runs
    each layer's forward and recompute in one) dynamo compiles nothing: the eager ops run there, and the kernel
    stays on for every other call."""
    device = tensors[0].device
    if fuses(device) and _get_current_dispatch_mode() is None:
        try:
            # Detached: dynamo keeps a parameter's shape static, one compile per weight shape (its limit is 8).
            kernel: Callable[..., T] = compiled(core)  # functools.cache keeps no type parameter
            return kernel(*(t.detach() for t in tensors), *args)
        except Exception as error:  # no compiler for this device (e.g. no Triton): the eager ops, from now on
            logging.getLogger(__name__).warning("%s stays eager: compiling it failed (%s)", kind, error)
            _fusing[device.type] = False
    return (eager or core)(*tensors, *args)


def scales(storage: torch.Tensor) -> torch.Tensor:
    """The fp32 row scales held in an int32 scale parameter (a view: writing to it fills the parameter)."""
    if storage.dtype != SCALE_STORAGE:
        raise TypeError(f"FP8 row scales are stored as {SCALE_STORAGE}, got {storage.dtype}")
    return storage.view(torch.float32)


def rows_scale(scale: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """A checkpoint's static scale for a slice of rows (0-d per tensor, `[n,1,1]` per expert, `[n]`/`[n,1]` per
    row) as one fp32 scale per row of a weight slice of `shape` (rows = every dim but the last)."""
    rows = tuple(shape[:-1])
    s = scale.to(torch.float32)
    while s.ndim and s.shape[-1] == 1:
        s = s.squeeze(-1)
    return s.reshape(*s.shape, *([1] * (len(rows) - s.ndim))).expand(rows).contiguous()


def on_bytes(
    wanted: bool, block: int | None, device: torch.device, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype
) -> bool:
    """Whether a weight of `shape` (`[..., rows, columns]`) multiplies on its stored bytes (`rayft.model.fp8_matmul`):
    `model.fp8_compute` on (`wanted`), row scales (block scales stay dequantised) and a product the device runs
    (else the dequantised path, said once per reason)."""
    if not wanted or block is not None:
        return False
    reason = fp8_matmul.unfit(device, shape[-1], shape[-2], dtype)
    if reason is not None:
        fp8_matmul.warn_dequantised(reason)
    return reason is None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `x` runs in: autocast's where it is on, else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class FrozenLinear(torch.autograd.Function):
    """y = x · Wᵀ for a frozen weight held quantised: W = `dequantize(*storage, dtype)` in the compute dtype, no
    weight gradient, and only the quantised storage saved for backward (dequantised again there)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dequantize: Callable[..., torch.Tensor], *storage: torch.Tensor
    ) -> torch.Tensor:
        dtype = _compute_dtype(x)
        ctx.save_for_backward(*storage)
        ctx.dtype, ctx.input_dtype, ctx.dequantize, ctx.stored = dtype, x.dtype, dequantize, len(storage)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dtype), dequantize(*storage, dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        unused = (None,) * (1 + ctx.stored)  # saved tensors are unpacked once: activation checkpointing allows no more
        if not ctx.needs_input_grad[0]:
            return (None, *unused)
        with torch.autocast(grad.device.type, enabled=False):
            dx = grad.to(ctx.dtype) @ ctx.dequantize(*ctx.saved_tensors, ctx.dtype)
        return (dx.to(ctx.input_dtype), *unused)


class ExpertChunk(NamedTuple):
    """Experts dequantised together: their ids, their rows of the expert-sorted input, and the group ends."""

    experts: torch.Tensor  # [n] expert ids: a whole layer's, or (chunked on the host) those with rows
    span: tuple[int, int] | None  # (first, end) when the ids are a contiguous range: the weights are a view
    start: int  # first row
    end: int  # one past the last row
    offs: torch.Tensor  # [n] int32 group ends, relative to `start`

    def select(self, stacked: torch.Tensor) -> torch.Tensor:
        """These experts' entries of a per-expert tensor: a view for a contiguous range, else a (1-byte) copy."""
        return stacked[self.span[0] : self.span[1]] if self.span else stacked.index_select(0, self.experts)


def expert_chunks(counts: list[int], per_expert: int, device: torch.device) -> list[ExpertChunk]:
    """The experts that received rows in this micro-batch (`counts`: rows per expert, in expert order), in chunks
    of at most `EXPERT_DEQUANT_BUDGET // per_expert` experts (`per_expert`: elements of one expert's weight), so
    the dequantised weights alive at once are those of one chunk: an expert with no rows is never dequantised, and
    a 128-expert layer never holds its whole stack in the compute dtype. Every chunk's expert ids and group ends
    reach the device in one copy (from pinned memory, without the host waiting, on a GPU), not two per chunk."""
    per_chunk = max(1, EXPERT_DEQUANT_BUDGET // per_expert)
    active = [e for e, n in enumerate(counts) if n]
    groups = [active[i : i + per_chunk] for i in range(0, len(active), per_chunk)]
    ends = [list(itertools.accumulate(counts[e] for e in ids)) for ids in groups]
    host = torch.tensor(
        [*active, *itertools.chain.from_iterable(ends)], dtype=torch.long, pin_memory=device.type == "cuda"
    )
    on_device = host.to(device, non_blocking=True)
    ids_of, ends_of = on_device[: len(active)], on_device[len(active) :].to(torch.int32)
    chunks, row, first = [], 0, 0
    for ids, chunk_ends in zip(groups, ends, strict=True):
        last = first + len(ids)
        chunks.append(
            ExpertChunk(
                experts=ids_of[first:last],
                span=(ids[0], ids[-1] + 1) if ids[-1] - ids[0] == len(ids) - 1 else None,
                start=row,
                end=row + chunk_ends[-1],
                offs=ends_of[first:last],
            )
        )
        row, first = row + chunk_ends[-1], last
    return chunks


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert of `ids` (int64 `[num_experts]`), computed on the device: `torch.bincount` sizes its output
    from the largest id, a host sync on a GPU."""
    return torch.zeros(num_experts, dtype=torch.long, device=ids.device).index_add_(0, ids, torch.ones_like(ids))


def _grouped_chunks(
    x: torch.Tensor,
    storage: tuple[torch.Tensor, ...],
    expert: GroupedWeight,
    chunks: list[ExpertChunk],
    transpose: bool,
) -> torch.Tensor:
    """Σ over chunks of grouped_mm(x rows of the chunk, W of its experts), W = `expert.dequantize` of the chunk's
    entries of every `storage` tensor, one chunk dequantised at a time; `transpose` multiplies by Wᵀ (forward)
    rather than W (input gradient)."""
    dequantize, parts = expert.dequantize, []
    for chunk in chunks:
        weight = dequantize(*(chunk.select(t) for t in storage), x.dtype)
        rhs = weight.transpose(-2, -1) if transpose else weight
        parts.append(F.grouped_mm(x[chunk.start : chunk.end].contiguous(), rhs, offs=chunk.offs))
        del weight, rhs
    return torch.cat(parts) if parts else x.new_zeros(0, expert.shape[1] if transpose else expert.shape[2])


class GroupedWeight(NamedTuple):
    """How an expert weight is made from its storage: `dequantize(*storage entries, dtype)` gives the chosen experts'
    weights; `shape` is the whole stack's `[E, rows, columns]`."""

    dequantize: Callable[..., torch.Tensor]
    shape: tuple[int, int, int]


class _FrozenGroupedLinear(torch.autograd.Function):
    """Per expert group g: y_g = x_g · W_gᵀ, or x_g · W_g for `[E, in, out]` weights (rows of x sorted by expert),
    W = `expert.dequantize(*storage)` a chunk of experts at a time (`QuantisedExperts._chunks`); no weight gradient;
    saves only the quantised storage (and the chunks' small index tensors)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        expert: GroupedWeight,
        chunks: list[ExpertChunk],
        transposed: bool,
        *storage: torch.Tensor,
    ) -> torch.Tensor:
        dtype = _compute_dtype(x)
        ctx.save_for_backward(*storage)
        ctx.dtype, ctx.input_dtype, ctx.expert = dtype, x.dtype, expert
        ctx.chunks, ctx.transposed, ctx.stored = chunks, transposed, len(storage)
        with torch.autocast(x.device.type, enabled=False):
            return _grouped_chunks(x.to(dtype), storage, expert, chunks, transpose=not transposed)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        unused = (None,) * (3 + ctx.stored)  # saved tensors are unpacked once (see FrozenLinear)
        if not ctx.needs_input_grad[0]:
            return (None, *unused)
        with torch.autocast(grad.device.type, enabled=False):
            dx = _grouped_chunks(
                grad.to(ctx.dtype), ctx.saved_tensors, ctx.expert, ctx.chunks, transpose=ctx.transposed
            )
        return (dx.to(ctx.input_dtype), *unused)


def _scale_shape(weight_shape: tuple[int, ...], block: int | None) -> tuple[int, ...]:
    """A weight's scale storage: one per row, or per row and column block."""
    rows = tuple(weight_shape[:-1])
    return rows if block is None else (*rows, math.ceil(weight_shape[-1] / block))


def frozen_parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    """Uninitialised storage of a frozen base, filled from a checkpoint or by quantising."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class QuantisedLinear(nn.Linear):
    """A frozen linear layer whose weight is held quantised (FP8 here, NF4 in `rayft.model.nf4`; the subclass says
    how: `_register_storage_`, `storage`, `_dequantize`). It is an `nn.Linear` (`in_features`, `out_features`,
    `weight`, `bias`) so PEFT wraps it with LoRA as usual; `compute_dtype` is the dtype its weight is dequantised to
    when no autocast says otherwise (PEFT reads that attribute for quantised bases; `adopt_lora_` then keeps LoRA
    fp32). The bias stays in the compute dtype."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        compute_dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        nn.Module.__init__(self)  # nn.Linear.__init__ would allocate a float weight
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, compute_dtype
        self._register_storage_(device)
        # torch infers nn.Linear's bias as a Parameter; nn.Linear itself registers None without one
        self.bias = frozen_parameter((out_features,), compute_dtype, device) if bias else None  # type: ignore[assignment]

    def _register_storage_(self, device: torch.device | str | None) -> None:
        raise NotImplementedError

    def storage(self) -> tuple[torch.Tensor, ...]:
        """The tensors the weight is held in, as `_dequantize` takes them."""
        raise NotImplementedError

    def _dequantize(self) -> Callable[..., torch.Tensor]:
        """`(*storage, dtype) -> weight`."""
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Frozen storage is filled from a checkpoint or by quantising, never initialised."""

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._dequantize()(*self.storage(), dtype or self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._on_bytes(x)
        if out is None:
            # torch leaves autograd.Function.apply unannotated
            out = FrozenLinear.apply(x, self._dequantize(), *self.storage())  # type: ignore[no-untyped-call]
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _on_bytes(self, x: torch.Tensor) -> torch.Tensor | None:
        """x · Wᵀ as a matmul on the stored bytes, where this storage has one; None: dequantise."""
        return None


class Fp8Linear(QuantisedLinear):
    """A frozen linear layer stored as E4M3 bytes (`weight`, uint8 `[out, in]`) + fp32 row scales (`weight_scale`,
    `[out]`, or `[out, ceil(in / block)]` per `block`-wide column block, held as int32 bits: `scales()`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        compute_dtype: torch.dtype,
        device: torch.device | str | None = None,
        block: int | None = None,
    ) -> None:
        self.block = storage_block(in_features, block)
        self.fp8_compute = False  # `model.fp8_compute`: FP8 matmuls on the stored bytes (`set_fp8_compute_`)
        super().__init__(in_features, out_features, bias, compute_dtype, device)

    def _register_storage_(self, device: torch.device | str | None) -> None:
        self.weight = frozen_parameter((self.out_features, self.in_features), STORAGE, device)
        scale_shape = _scale_shape((self.out_features, self.in_features), self.block)
        self.weight_scale = frozen_parameter(scale_shape, SCALE_STORAGE, device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype, block: int | None = None) -> Fp8Linear:
        """The FP8 layer for `linear`; its values quantised per row (and column block) unless it is on the meta
        device."""
        device = linear.weight.device
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype, device, block)
        if device.type != "meta":
            with torch.no_grad():
                quantize_rows_into_(layer.weight, scales(layer.weight_scale), linear.weight, layer.block)
                if linear.bias is not None:
                    layer.bias.copy_(linear.bias)
        return layer

    def storage(self) -> tuple[torch.Tensor, ...]:
        return self.weight, scales(self.weight_scale)

    def _dequantize(self) -> Callable[..., torch.Tensor]:
        return functools.partial(dequantize_rows, block=self.block)

    def _on_bytes(self, x: torch.Tensor) -> torch.Tensor | None:
        dtype = _compute_dtype(x)
        if not on_bytes(self.fp8_compute, self.block, x.device, self.weight.shape, dtype):
            return None
        with torch.autocast(x.device.type, enabled=False):
            # torch leaves autograd.Function.apply unannotated
            out: torch.Tensor = fp8_matmul.ScaledFrozenLinear.apply(  # type: ignore[no-untyped-call]
                x, dtype, quantize_activation, self.weight, scales(self.weight_scale)
            )
        return out

    def extra_repr(self) -> str:
        blocks = f"+{self.block}-column_block_scales" if self.block else "+row_scales"
        return f"{super().extra_repr()}, storage=float8_e4m3fn{blocks}"


class QuantisedExperts(nn.Module):
    """Fused routed experts (transformers' `@use_experts_implementation` layouts) whose `gate_up_proj` and
    `down_proj` are held quantised (FP8 here, NF4 in `rayft.model.nf4`; the subclass says how: `_store_`,
    `_storage`, `_weight`), in `[E, 2I, H]` / `[E, H, I]` or GPT-OSS's transposed `[E, H, 2I]` / `[E, I, H]`, with
    GPT-OSS's biases kept in the compute dtype. The forward is transformers' `grouped_mm` one, dequantising only the
    experts the micro-batch routed rows to, a bounded chunk at a time; the gate is the experts module's own
    `_apply_gate` (concatenated gate‖up with its activation, or GPT-OSS's interleaved, clamped one), called on a
    weightless copy of that module.

    LoRA on the experts (PEFT `target_parameters`) arrives through `Fp8ParamWrapper`, which hands this module the
    low-rank factors: the update is applied as activations (x·Bᵀ·Aᵀ per expert group), never as a weight-sized
    delta — with a quantised base PEFT's own path would fold the delta into the stored weight."""

    kind = "quantised"  # named in messages

    def __init__(self, experts: nn.Module, compute_dtype: torch.dtype) -> None:
        super().__init__()
        unsupported = [
            flag
            for flag, bad in (("has_gate", False), ("has_post_expert_norm", True))
            if getattr(experts, flag, not bad) == bad
        ]
        if unsupported:
            raise ValueError(
                f"{type(experts).__name__}: {self.kind} experts support no {', '.join(unsupported)} layout"
            )
        self.num_experts, self.compute_dtype = cast(int, experts.num_experts), compute_dtype
        self.is_transposed = bool(getattr(experts, "is_transposed", False))  # PEFT reads it: [E, in, out] when True
        self._apply_gate = cast("Callable[[torch.Tensor], torch.Tensor]", _weightless(experts)._apply_gate)
        self.shapes = {name: tuple(getattr(experts, name).shape) for name in EXPERT_WEIGHTS}
        device = cast(nn.Parameter, experts.gate_up_proj).device
        for name in EXPERT_WEIGHTS:
            self._store_(name, getattr(experts, name))
            bias = getattr(experts, f"{name}_bias", None) if getattr(experts, "has_bias", False) else None
            if bias is not None:
                self.register_parameter(f"{name}_bias", frozen_parameter(tuple(bias.shape), compute_dtype, device))
                if device.type != "meta":
                    getattr(self, f"{name}_bias").data.copy_(bias.detach())
        self.lora_factors: dict[str, list[tuple[torch.Tensor, torch.Tensor, float]]] = {}

    def _store_(self, name: str, weight: torch.Tensor) -> None:
        """Register `name`'s storage parameters, quantising `weight` unless it is on the meta device."""
        raise NotImplementedError

    def _storage(self, name: str) -> tuple[torch.Tensor, ...]:
        """The tensors `name` is held in, each `[E, ...]`, as `_weight(name).dequantize` takes them."""
        raise NotImplementedError

    def _weight(self, name: str) -> GroupedWeight:
        raise NotImplementedError

    def dequantized_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._weight(name).dequantize(*self._storage(name), dtype or self.compute_dtype)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        routed = hidden_states[perm // top_k]
        counts = expert_counts(expert_ids, self.num_experts)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)  # every expert's group end, on the device
        dtype = _compute_dtype(routed)
        # Products on the stored bytes read no chunks: the routed counts stay on the device.
        on_bytes = all(self._on_bytes(name, routed.device, dtype) for name in EXPERT_WEIGHTS)
        chunks = self._chunks(counts, offs, routed.shape[0]) if not on_bytes else {n: [] for n in EXPERT_WEIGHTS}
        gate_up = self._project("gate_up_proj", routed, offs, chunks["gate_up_proj"], expert_ids)
        out = self._project("down_proj", self._apply_gate(gate_up), offs, chunks["down_proj"], expert_ids)
        out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(out.dtype)
        unsorted = torch.empty_like(out)
        unsorted[perm] = out
        return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)

    def _chunks(self, counts: torch.Tensor, offs: torch.Tensor, rows: int) -> dict[str, list[ExpertChunk]]:
        """Each weight's dequantisation chunks. When the whole layer fits one chunk, every expert is dequantised
        (the empty ones too) with the group ends as a device tensor: no host sync. Otherwise the experts with rows
        are chunked on the host (`counts.tolist()`, the one sync): a 128-expert stack never lives whole in the
        compute dtype, and experts without rows are skipped."""
        per_expert = {name: math.prod(self.shapes[name][1:]) for name in EXPERT_WEIGHTS}
        if all(self.num_experts <= max(1, EXPERT_DEQUANT_BUDGET // n) for n in per_expert.values()):
            ids = torch.arange(self.num_experts, device=offs.device)
            whole = [ExpertChunk(ids, (0, self.num_experts), 0, rows, offs)]
            return dict.fromkeys(EXPERT_WEIGHTS, whole)
        host_counts = counts.tolist()
        return {name: expert_chunks(host_counts, n, offs.device) for name, n in per_expert.items()}

    def _on_bytes(self, name: str, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether expert weight `name` multiplies on its stored bytes (`Fp8Experts`); else it is dequantised."""
        return False

    def _frozen_product(
        self, name: str, x: torch.Tensor, offs: torch.Tensor, chunks: list[ExpertChunk], expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """x · the frozen weight `name` per expert group: on the stored bytes, or dequantised a chunk at a time."""
        dtype = _compute_dtype(x)
        out: torch.Tensor  # torch leaves autograd.Function.apply unannotated
        if self._on_bytes(name, x.device, dtype):
            with torch.autocast(x.device.type, enabled=False):
                out = fp8_matmul.ScaledFrozenGrouped.apply(  # type: ignore[no-untyped-call]
                    x, dtype, self.is_transposed, expert_ids, offs, quantize_activation, *self._storage(name)
                )
            return out
        out = _FrozenGroupedLinear.apply(  # type: ignore[no-untyped-call]
            x, self._weight(name), chunks, self.is_transposed, *self._storage(name)
        )
        return out

    def _project(
        self, name: str, x: torch.Tensor, offs: torch.Tensor, chunks: list[ExpertChunk], expert_ids: torch.Tensor
    ) -> torch.Tensor:
        out = self._frozen_product(name, x, offs, chunks, expert_ids)
        bias = getattr(self, f"{name}_bias", None)
        if bias is not None:
            out = out + bias[expert_ids].to(out.dtype)
        for lhs, rhs, scaling in self.lora_factors.get(name, ()):
            # ΔW = s·lhs·rhs in the weight's layout: x·ΔWᵀ = s·(x·rhsᵀ)·lhsᵀ, or transposed x·ΔW = s·(x·lhs)·rhs
            first, second = (lhs, rhs) if self.is_transposed else (rhs.transpose(-2, -1), lhs.transpose(-2, -1))
            first, second = _rank_aligned(first.to(out.dtype), second.to(out.dtype))
            down = F.grouped_mm(x.to(out.dtype).contiguous(), first.contiguous(), offs=offs)
            out = out + scaling * F.grouped_mm(down, second.contiguous(), offs=offs)
        return out


class Fp8Experts(QuantisedExperts):
    """Routed experts stored in FP8: `gate_up_proj` uint8 `[E, 2I, H]` + `gate_up_proj_scale` `[E, 2I]`,
    `down_proj` uint8 `[E, H, I]` + `down_proj_scale` `[E, H]` (GPT-OSS's transposed layouts: scales per row of
    dim 1 likewise), or per row and column block (`blocks`)."""

    kind = "FP8"

    def __init__(self, experts: nn.Module, compute_dtype: torch.dtype, block: int | None = None) -> None:
        self.blocks = {name: storage_block(getattr(experts, name).shape[-1], block) for name in EXPERT_WEIGHTS}
        self.fp8_compute = False  # `model.fp8_compute`: FP8 matmuls on the stored bytes (`set_fp8_compute_`)
        super().__init__(experts, compute_dtype)

    def _store_(self, name: str, weight: torch.Tensor) -> None:
        """Register `name` as E4M3 storage + its scales, quantising `weight` unless it is on the meta device."""
        shape, block = tuple(weight.shape), self.blocks[name]
        self.register_parameter(name, frozen_parameter(shape, STORAGE, weight.device))
        scale_storage = frozen_parameter(_scale_shape(shape, block), SCALE_STORAGE, weight.device)
        self.register_parameter(f"{name}_scale", scale_storage)
        if weight.device.type != "meta":
            with torch.no_grad():
                quantize_rows_into_(getattr(self, name), self.scale(name), weight, block)

    def scale(self, name: str) -> torch.Tensor:
        """The fp32 row scales of expert weight `name` (`[E, out]`)."""
        return scales(getattr(self, f"{name}_scale"))

    def _storage(self, name: str) -> tuple[torch.Tensor, ...]:
        return getattr(self, name), self.scale(name)

    def _weight(self, name: str) -> GroupedWeight:
        return GroupedWeight(functools.partial(dequantize_rows, block=self.blocks[name]), self.shapes[name])

    def _on_bytes(self, name: str, device: torch.device, dtype: torch.dtype) -> bool:
        return on_bytes(self.fp8_compute, self.blocks[name], device, self.shapes[name], dtype)


def _rank_aligned(first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The LoRA factors `first` `[E, in, r]` and `second` `[E, r, out]` with the rank padded with zeros to a
    multiple of `GROUPED_MM_ALIGNMENT` bytes: the low-rank activations x·first are `r` wide, and grouped_mm refuses
    rows whose stride is not aligned (a bf16 row of rank 4 is 8 bytes). The padded columns of `first` and rows of
    `second` are zero, so they add exact zeros to every sum; the pad's backward slices the gradient back to the
    factors' own shape, so only the real factors are trained."""
    pad = -first.shape[-1] % (GROUPED_MM_ALIGNMENT // first.element_size())
    if not pad:
        return first, second
    return F.pad(first, (0, pad)), F.pad(second, (0, 0, 0, pad))


class Fp8ParamWrapper(ParamWrapper):
    """PEFT's expert LoRA over an `Fp8Experts`: instead of parametrizing the weight with `W + ΔW` (which for a
    float8/uint8 base re-quantises the sum or casts the factors to the base dtype), it lends the base its factors
    for the forward. Everything else — the adapter weights, their names, saving — is PEFT's."""

    @contextmanager
    def _activate_lora(self, active_adapters: list[str]) -> Iterator[None]:
        base = cast(QuantisedExperts, self.get_base_layer())  # `adopt_lora_` gives this class to those alone
        factors = [self.lora_factors(a) for a in active_adapters if a in self.lora_A]
        if factors:
            base.lora_factors[self.parameter_name] = factors
        try:
            yield
        finally:
            base.lora_factors.pop(self.parameter_name, None)

    def lora_factors(self, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(lhs, rhs, scaling) with ΔW = scaling · lhs · rhs in the weight's own layout (PEFT's `get_delta_factors`
        without its cast to the uint8 storage dtype), in the adapter's dtype: `[E, out, r]`·`[E, r, in]`, or for a
        transposed `[E, in, out]` weight `[E, in, r]`·`[E, r, out]`."""
        e = self.num_experts
        lora_a, lora_b = cast(nn.Linear, self.lora_A[adapter]), cast(nn.Linear, self.lora_B[adapter])
        a = lora_a.weight.reshape(e, -1, lora_a.weight.shape[-1])  # [E, r, A's in]
        b = lora_b.weight
        b = b.reshape(b.shape[0], -1, e).permute(2, 0, 1)  # [E, B's out, r]
        if not self._did_swap_in_out_features:  # PEFT kept [E, in, out]: A reads dim 1, B writes dim 2
            return a.transpose(-2, -1), b.transpose(-2, -1), self.scaling[adapter]
        return b, a, self.scaling[adapter]

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise NotImplementedError("FP8 expert weights cannot take a merged LoRA: merge into a dequantised model")


def _weightless(module: nn.Module) -> nn.Module:
    """A shallow copy of `module` without its parameters: its methods (an experts module's `_apply_gate`) and
    settings (GPT-OSS's `alpha`, `limit`) without keeping its full-precision weights alive."""
    shell = copy.copy(module)
    shell._parameters = {}
    return shell


def fp8_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if isinstance(module, (Fp8Linear, Fp8Experts)):
            yield name, module


def fp8_scale_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Full name of every FP8 storage parameter of `model` → its row-scale parameter (loading fills both at once)."""
    out = {}
    for module_name, module in fp8_layers(model):
        prefix = f"{module_name}." if module_name else ""
        names = ("weight",) if isinstance(module, Fp8Linear) else EXPERT_WEIGHTS
        for name in names:
            out[prefix + name] = getattr(module, "weight_scale" if name == "weight" else f"{name}_scale")
    return out


def fp8_block(model: nn.Module, name: str) -> int | None:
    """The column block width of FP8 storage parameter `name` (a full name in `model`); None: one scale per row."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    return module.block if isinstance(module, Fp8Linear) else cast(Fp8Experts, module).blocks[attr]


def to_fp8_(layers: list[nn.Module], compute_dtype: torch.dtype, block: int | None = None) -> int:
    """Swap, inside each of `layers` (the decoder layers), every linear and fused-experts module for its FP8 form,
    on the meta device (no memory) or quantising real weights; `block`: the column block width of the checkpoint's
    block-wise scales, kept as they are. Call before LoRA and FSDP; returns the count."""
    swapped = 0
    for layer in layers:
        for parent in list(layer.modules()):
            for child_name, child in list(parent.named_children()):
                if not held_weights(child, "fp8"):
                    continue
                if type(child) is nn.Linear:
                    setattr(parent, child_name, Fp8Linear.from_linear(child, compute_dtype, block))
                else:
                    setattr(parent, child_name, Fp8Experts(child, compute_dtype, block))
                swapped += 1
    return swapped


def set_fp8_compute_(model: nn.Module, on: bool) -> int:
    """`model.fp8_compute`: every FP8 linear and expert stack of `model` multiplies on its stored bytes (`on`) or
    dequantises first; returns how many were set. Either way the storage is the same, so the setting can change
    between steps."""
    layers = [cast(Fp8Linear | Fp8Experts, module) for _, module in fp8_layers(model)]
    for module in layers:
        module.fp8_compute = on
    return len(layers)


def adopt_lora_(model: nn.Module) -> None:
    """After PEFT wrapped the model: expert LoRA over quantised experts (FP8, NF4) goes through `Fp8ParamWrapper`
    (PEFT's own path would add the update to the integer storage, and train nothing), and every adapter over an
    FP8 base is fp32, as PEFT keeps it next to a bf16 base: the trainable weights and their
    AdamW state are the master copy (FSDP's mixed precision casts them for compute), and at LoRA learning rates most
    updates to a bf16 weight would fall below its ulp and be lost."""
    for module in model.modules():
        base = module.get_base_layer() if isinstance(module, LoraLayer) else None
        if not isinstance(base, (QuantisedLinear, QuantisedExperts)):
            continue
        if isinstance(module, ParamWrapper):
            module.__class__ = Fp8ParamWrapper
        lora = cast(LoraLayer, module)  # it has a base layer: a LoRA layer
        for adapters in (lora.lora_A, lora.lora_B):
            for name in list(adapters):
                adapters[name] = adapters[name].to(torch.float32)


def frozen_storage_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the frozen base by storage kind (`fp8`, `scales`, `other`): what the plan and the tests count."""
    out = {"fp8": 0, "scales": 0, "other": 0}
    for name, param in model.named_parameters():
        if param.requires_grad:
            continue
        fp8 = param.dtype == STORAGE
        kind = "fp8" if fp8 else "scales" if name.endswith("_scale") else "other"
        out[kind] += param.numel() * param.element_size()
    return out
