"""Fill an FSDP2-sharded model from safetensors files: each rank reads only the rows it owns.

No rank ever holds the whole checkpoint: every parameter's local shard (dim-0 rows, FSDP2's `Shard(0)`) is read
as exactly those bytes of the file, mapped from the checkpoint's key layout, dequantised from FP8 when the
checkpoint is quantised (static per-tensor or per-expert scales, applied per slice) and cast to the model dtype.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from rayft.model.fp8 import fp8_scale_params, quantize_rows, rows_scale

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CHUNK_BYTES = 32 * 2**20  # fp32-equivalent size of the rows read (and dequantised) at once
PEFT_PREFIX = "base_model.model."


class CheckpointKeyError(RuntimeError):
    """A model tensor has no counterpart in the checkpoint: loading must fail, never leave random weights."""


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in the file


class SafetensorsCheckpoint:
    """Reads row ranges of the tensors in a model directory's `*.safetensors` files.

    Only the headers are parsed up front; `rows()` reads exactly the requested bytes with `readinto` into the
    destination tensor — no mmap, so a rank's resident memory holds its own rows only, not the file pages it
    touched, and a network volume serves just those byte ranges.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.entries: dict[str, _Entry] = {}
        for file in sorted(self.directory.glob("*.safetensors")):
            with open(file, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            for key, info in header.items():
                if key != "__metadata__":
                    start = 8 + header_len + info["data_offsets"][0]
                    self.entries[key] = _Entry(file, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), start)
        self._files: dict[Path, BinaryIO] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    @property
    def weight_map(self) -> dict[str, str]:
        return {key: entry.file.name for key, entry in self.entries.items()}

    def shape(self, key: str) -> list[int]:
        return list(self.entries[key].shape)

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor along dim 0 (the whole tensor when it is 0-d)."""
        entry = self.entries[key]
        if not entry.shape:
            out, first = torch.empty((), dtype=entry.dtype), 0
        else:
            out, first = torch.empty((stop - start, *entry.shape[1:]), dtype=entry.dtype), start
        row_bytes = out[0].numel() * out.element_size() if out.ndim else 0
        buffer = memoryview(out.view(torch.uint8).numpy() if out.ndim else out.reshape(1).view(torch.uint8).numpy())
        f = self._files.get(entry.file) or self._files.setdefault(entry.file, open(entry.file, "rb"))  # noqa: SIM115
        f.seek(entry.offset + first * row_bytes)
        done = 0
        while done < len(buffer):
            n = f.readinto(buffer[done:])
            if not n:
                raise CheckpointKeyError(f"{entry.file} ends inside tensor '{key}' (truncated download?)")
            done += n
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def checkpoint_key(name: str, checkpoint: SafetensorsCheckpoint) -> str:
    """Where a text model's tensor lives in the checkpoint: plain causal LM, llava-style VLM wrapper
    (`language_model.model.*`, `language_model.lm_head.*`) or transformers-5 wrapper (`model.language_model.*`)."""
    body = name.removeprefix("model.")
    for candidate in (name, f"language_model.{name}", f"model.language_model.{body}"):
        if candidate in checkpoint:
            return candidate
    raise CheckpointKeyError(f"'{name}' is not in the checkpoint at {checkpoint.directory}")


def model_param_name(name: str) -> str:
    """The base model's own name for a parameter of the PEFT-wrapped model."""
    return re.sub(r"(\.base_layer)+\.", ".", name.removeprefix(PEFT_PREFIX))  # nested wrappers: experts


def load_sharded_(model: nn.Module, directory: Path) -> None:
    """Copy every base parameter's local shard from the checkpoint and give the LoRA parameters a fresh init."""
    checkpoint = SafetensorsCheckpoint(directory)
    missing = []
    fp8_scales = fp8_scale_params(model)  # FP8 storage: its scales are filled together with its bytes
    filled_with_weight = {id(p) for p in fp8_scales.values()}
    try:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if id(param) in filled_with_weight:
                    continue
                local, start = _local_rows(param)
                if ".lora_" in name:
                    _init_lora_(name, local, param.shape, start)
                    continue
                base_name = model_param_name(name)
                try:
                    key = checkpoint_key(base_name, checkpoint)
                except CheckpointKeyError:
                    missing.append(base_name)
                    continue
                if name in fp8_scales:
                    _load_fp8_(local, _local_rows(fp8_scales[name]), start, key, checkpoint)
                    continue
                # Bounded chunks of rows: the temporaries (raw rows, their fp32 dequantisation) stay a fixed size
                # however large the tensor (a 128-expert fused weight is GBs).
                step = max(1, CHUNK_BYTES // max(1, 4 * local[0].numel()))
                for lo in range(0, local.shape[0], step):
                    hi = min(lo + step, local.shape[0])
                    local[lo:hi].copy_(
                        dequantize(checkpoint.rows(key, start + lo, start + hi), key, checkpoint, start + lo)
                    )
    finally:
        checkpoint.close()
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointKeyError(f"the checkpoint at {directory} lacks {len(missing)} model tensors: {shown}")


def _load_fp8_(
    data: torch.Tensor, scale: tuple[torch.Tensor, int], start: int, key: str, checkpoint: SafetensorsCheckpoint
) -> None:
    """Fill FP8 storage (E4M3 bytes + row scales, `rayft.model.fp8`) with rows [start, start + len): an E4M3
    checkpoint's bytes as they are (its static scale spread over the rows), anything else quantised per row."""
    scale_local, scale_start = scale
    if scale_start != start or scale_local.shape[0] != data.shape[0]:
        raise RuntimeError(f"'{key}': its FP8 row scales are sharded unlike its rows ({scale_start} vs {start})")
    if not data.shape[0]:
        return  # an uneven FSDP shard can be empty
    step = max(1, CHUNK_BYTES // max(1, 4 * data[0].numel()))
    for lo in range(0, data.shape[0], step):
        hi = min(lo + step, data.shape[0])
        rows = checkpoint.rows(key, start + lo, start + hi)
        if rows.dtype == torch.float8_e4m3fn:
            data[lo:hi].copy_(rows.view(data.dtype))
            scale_local[lo:hi].copy_(rows_scale(fp8_scale(rows, key, checkpoint, start + lo), rows.shape))
        else:
            q, s = quantize_rows(dequantize(rows, key, checkpoint, start + lo))
            data[lo:hi].copy_(q)
            scale_local[lo:hi].copy_(s)


def dequantize(rows: torch.Tensor, key: str, checkpoint: SafetensorsCheckpoint, start: int) -> torch.Tensor:
    """FP8 rows × their static scale: a 0-d per-tensor scale, or one per row of dim 0 ([E,1,1] for experts)."""
    if rows.dtype not in FP8_DTYPES:
        return rows
    return rows.to(torch.float32) * fp8_scale(rows, key, checkpoint, start).to(torch.float32)


def fp8_scale(rows: torch.Tensor, key: str, checkpoint: SafetensorsCheckpoint, start: int) -> torch.Tensor:
    """The static scale of FP8 `rows` (from row `start`): 0-d per tensor, or the rows' own ([n,1,1] per expert)."""
    scale_key = next(
        (k for k in (f"{key}_scale_inv", f"{key.rsplit('.', 1)[0]}.weight_scale_inv") if k in checkpoint), None
    )
    if scale_key is None:
        raise CheckpointKeyError(f"FP8 tensor '{key}' has no '{key}_scale_inv' / 'weight_scale_inv' scale")
    scale_shape = checkpoint.shape(scale_key)
    if math.prod(scale_shape) == 1:
        scale = checkpoint.rows(scale_key, 0, 1).reshape(())
    elif scale_shape[0] == checkpoint.shape(key)[0] and math.prod(scale_shape[1:]) == 1:
        scale = checkpoint.rows(scale_key, start, start + rows.shape[0])
    else:
        raise CheckpointKeyError(
            f"'{scale_key}' has shape {scale_shape}: only static per-tensor or per-expert FP8 scales are supported "
            "(block-wise FP8 checkpoints are not)"
        )
    return scale


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's shard of a parameter and the global row it starts at."""
    if not isinstance(param, DTensor):
        return param.data, 0
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), (offset[0] if offset else 0)


def _init_lora_(name: str, local: torch.Tensor, shape: torch.Size, start: int) -> None:
    """PEFT's default init: A ~ kaiming-uniform, B = 0. Every rank draws the whole (small) A from the same seeded
    stream and keeps its rows, so the adapter starts the same however the weights are sharded or replicated."""
    if ".lora_B." in name:
        local.zero_()
        return
    full = torch.empty(shape, dtype=local.dtype, device=local.device)
    nn.init.kaiming_uniform_(full, a=math.sqrt(5))
    local.copy_(full[start : start + local.shape[0]])


@contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """`to_empty` wipes buffers too; computed ones (rotary frequencies) are not in checkpoints: put them back."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    yield
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in saved and buffer.shape == saved[name].shape:
                buffer.copy_(saved[name].to(buffer.device))
