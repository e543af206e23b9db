"""Fill an FSDP2-sharded model from safetensors files: each rank reads only the rows it owns.

No rank ever holds the whole checkpoint: every parameter's local shard (dim-0 rows, FSDP2's `Shard(0)`) is read
through a memory-mapped `get_slice`, mapped from the checkpoint's key layout, dequantised from FP8 when the
checkpoint is quantised (static per-tensor or per-expert scales, applied per slice) and cast to the model dtype.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
PEFT_PREFIX = "base_model.model."


class CheckpointKeyError(RuntimeError):
    """A model tensor has no counterpart in the checkpoint: loading must fail, never leave random weights."""


class SafetensorsCheckpoint:
    """Lazy, memory-mapped view over the `*.safetensors` files of a model directory."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            self.weight_map = {}
            for file in sorted(self.directory.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    self.weight_map.update(dict.fromkeys(f.keys(), file.name))
        self._handles: dict[str, object] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor (the whole tensor when it is 0-d)."""
        tensor_slice = self._handle(key).get_slice(key)
        if not tensor_slice.get_shape():
            return self._handle(key).get_tensor(key)
        return tensor_slice[start:stop]

    def shape(self, key: str) -> list[int]:
        return list(self._handle(key).get_slice(key).get_shape())

    def _handle(self, key: str):
        file = self.weight_map[key]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.directory / file), framework="pt")
        return self._handles[file]

    def close(self) -> None:
        self._handles.clear()


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
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def load_sharded_(model: nn.Module, directory: Path) -> None:
    """Copy every base parameter's local shard from the checkpoint and give the LoRA parameters a fresh init."""
    checkpoint = SafetensorsCheckpoint(directory)
    missing = []
    try:
        with torch.no_grad():
            for name, param in model.named_parameters():
                local, start = _local_rows(param)
                if ".lora_" in name:
                    _init_lora_(name, local)
                    continue
                try:
                    key = checkpoint_key(model_param_name(name), checkpoint)
                except CheckpointKeyError:
                    missing.append(model_param_name(name))
                    continue
                if local.numel() == 0:
                    continue
                rows = checkpoint.rows(key, start, start + local.shape[0])
                local.copy_(dequantize(rows, key, checkpoint, start).to(local.dtype))
    finally:
        checkpoint.close()
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointKeyError(f"the checkpoint at {directory} lacks {len(missing)} model tensors: {shown}")


def dequantize(rows: torch.Tensor, key: str, checkpoint: SafetensorsCheckpoint, start: int) -> torch.Tensor:
    """FP8 rows × their static scale: a 0-d per-tensor scale, or one per row of dim 0 ([E,1,1] for experts)."""
    if rows.dtype not in FP8_DTYPES:
        return rows
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
    return rows.to(torch.float32) * scale.to(torch.float32)


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's shard of a parameter and the global row it starts at."""
    if not isinstance(param, DTensor):
        return param.data, 0
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), (offset[0] if offset else 0)


def _init_lora_(name: str, local: torch.Tensor) -> None:
    """PEFT's default init, per shard: A ~ kaiming-uniform (fan-in is the unsharded dim 1), B = 0."""
    if ".lora_B." in name:
        local.zero_()
    else:
        nn.init.kaiming_uniform_(local, a=math.sqrt(5))


@contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """`to_empty` wipes buffers too; computed ones (rotary frequencies) are not in checkpoints: put them back."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    yield
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in saved and buffer.shape == saved[name].shape:
                buffer.copy_(saved[name].to(buffer.device))
