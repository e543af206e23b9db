"""A bf16 or block-wise FP8 checkpoint loaded into FP8 storage (`model.frozen_dtype: float8_e4m3fn`): quantised on
the device each weight lives on, a bounded block of rows at a time on a CPU, and bit for bit the E4M3 quantisation
per row (or per row and column block) that this file computes its own way, column block by column block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures.devices import DEVICES
from fixtures.fp8_bytes import decode_e4m3, raw_tensor_bytes
from safetensors.torch import save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rayft.model.fp8 import Fp8Linear, quantize_rows_into_, scales, to_fp8_
from rayft.model.fp8_format import HOST_QUANTIZE_BLOCK
from rayft.model.weights import load_sharded_

E4M3_MAX = 448.0
# Rows of weights: 4 host blocks of rows; a row wider than a host block; a partial 64-column block; a row of 1024.
SHAPES = [(1024, 1024), (3, HOST_QUANTIZE_BLOCK + 192), (40, 200), (24, 1024)]


def _weights() -> list[torch.Tensor]:
    """bf16 weights with an all-zero row, rows of large and of subnormal-making magnitude, and repeated values."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for rows, columns in SHAPES:
        w = torch.randn(rows, columns, generator=generator)
        w[0] = 0.0
        w[1] *= 1e4
        w[-1] *= 1e-6
        out.append(w.to(torch.bfloat16))
    out[-1][2] = out[-1][2].round()  # small integers: ties of E4M3 rounding
    return out


def _e4m3_reference(weight: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 bytes and fp32 scales of `weight`: each row's columns `block` at a time (the whole row when one block
    spans it) divided in fp32 by their absolute maximum / 448 (at least fp32's smallest normal), clamped to ±448 and
    rounded to E4M3; the scales `[rows]`, or `[rows, blocks]`."""
    w = weight.to(torch.float32)
    width = block if block is not None and block < w.shape[1] else w.shape[1]
    codes, row_scales = [], []
    for lo in range(0, w.shape[1], width):
        part = w[:, lo : lo + width]
        scale = torch.clamp(part.abs().amax(dim=1) / E4M3_MAX, min=torch.finfo(torch.float32).tiny)
        codes.append(torch.clamp(part / scale[:, None], -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn))
        row_scales.append(scale)
    stacked = torch.stack(row_scales, dim=1)
    return torch.cat(codes, dim=1).view(torch.uint8), stacked.squeeze(1) if width == w.shape[1] else stacked


class Temporaries(TorchDispatchMode):
    """The device and element count of every fp32 tensor the ops within make: where the quantisation ran and how
    large its temporaries were."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [
            (t.device.type, t.numel())
            for t in tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32
        ]
        return out


def _fp8_model(count: int, block: int | None, device: str) -> nn.Sequential:
    """Linears of SHAPES held in FP8 on `device` (`block`-wide column block scales), as a job swaps them on the meta
    device and materialises them before loading."""
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(c, r, bias=False, dtype=torch.bfloat16) for r, c in SHAPES[:count]))
    assert to_fp8_([model], torch.bfloat16, block) == count
    return model.to_empty(device=device)


@pytest.mark.parametrize("block", [None, 64])
@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_checkpoint_is_quantised_where_it_lives_bit_for_bit(tmp_path: Path, device: str, block: int | None):
    weights = _weights()
    save_file({f"{i}.weight": w for i, w in enumerate(weights)}, str(tmp_path / "model.safetensors"))
    model = _fp8_model(len(weights), block, device)
    with Temporaries() as seen:
        load_sharded_(model, tmp_path)
    for i, weight in enumerate(weights):
        layer = model[i]
        assert isinstance(layer, Fp8Linear)
        codes, row_scales = _e4m3_reference(weight, block)
        assert torch.equal(layer.weight.cpu(), codes), i
        assert torch.equal(scales(layer.weight_scale).cpu(), row_scales), i
    assert {where for where, _ in seen.made} == {torch.device(device).type}  # quantised where the weight lives
    if device == "cpu":  # a host block of rows at a time (a row wider than a block alone), in a workspace of two
        assert max(n for _, n in seen.made) <= 2 * max(HOST_QUANTIZE_BLOCK, *(c for _, c in SHAPES)), max(seen.made)


def _block_fp8_checkpoint(directory: Path, weight: torch.Tensor, block: tuple[int, int]) -> None:
    """`weight` as a block-wise FP8 checkpoint (DeepSeek-V3's layout): E4M3 bytes and one fp32 `weight_scale_inv`
    per `block` of rows × columns, with its `quantization_config`."""
    rows, columns = weight.shape
    grid = weight.float().reshape(rows // block[0], block[0], columns // block[1], block[1])
    scale = grid.abs().amax(dim=(1, 3)) / E4M3_MAX
    codes = (grid / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, columns)
    save_file({"0.weight": codes, "0.weight_scale_inv": scale}, str(directory / "model.safetensors"))
    quantization = {"quant_method": "fp8", "weight_block_size": list(block)}
    (directory / "config.json").write_text(json.dumps({"quantization_config": quantization}))


@pytest.mark.parametrize("device", DEVICES)
def test_block_fp8_that_storage_cannot_keep_is_requantised_where_it_lives_bit_for_bit(tmp_path: Path, device: str):
    """Block scales 16 columns wide cannot be kept by per-row storage: the file's values (its E4M3 bytes × their
    block's scale) are quantised per row, on the weight's device."""
    _block_fp8_checkpoint(tmp_path, _weights()[0], (16, 16))
    model = _fp8_model(1, None, device)
    with Temporaries() as seen:
        load_sharded_(model, tmp_path)
    info, raw = raw_tensor_bytes(tmp_path / "model.safetensors", "0.weight")
    _, scale_raw = raw_tensor_bytes(tmp_path / "model.safetensors", "0.weight_scale_inv")
    file_scale = torch.frombuffer(bytearray(scale_raw), dtype=torch.float32).reshape(64, 64)
    expanded = file_scale.double().repeat_interleave(16, dim=0).repeat_interleave(16, dim=1)
    values = (torch.from_numpy(decode_e4m3(raw, info["shape"])) * expanded).float()  # exact in fp64, rounded once
    codes, row_scales = _e4m3_reference(values, None)
    assert torch.equal(model[0].weight.cpu(), codes)
    assert torch.equal(scales(model[0].weight_scale).cpu(), row_scales)
    assert {where for where, _ in seen.made} == {torch.device(device).type}


@pytest.mark.parametrize("block", [None, 64])
def test_routed_expert_stacks_quantise_each_row_as_the_reference(block: int | None):
    """A `[E, out, in]` stack (as `Fp8Experts` holds one) quantises each expert's rows as a matrix of them."""
    stack = torch.randn(3, 300, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    columns = stack.shape[-1] // block if block else 1
    data = torch.empty(stack.shape, dtype=torch.uint8)
    scale = torch.empty((*stack.shape[:-1], columns) if block else stack.shape[:-1])
    quantize_rows_into_(data, scale, stack, block)
    for expert in range(stack.shape[0]):
        codes, row_scales = _e4m3_reference(stack[expert], block)
        assert torch.equal(data[expert], codes) and torch.equal(scale[expert], row_scales), expert
