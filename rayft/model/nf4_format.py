"""NF4 facts that need no model: the format's block sizes, which weights it can hold and what it costs. The planner
and the driver's checks read them without importing the NF4 layers (`rayft.model.nf4`), which belong to the
workers."""

from __future__ import annotations

import math

BLOCK = 64  # weights per absmax scale
SCALER_BLOCK = 256  # block scales per double-quantisation factor
GROUP = BLOCK * SCALER_BLOCK  # weights per factor: a weight's element count must be a multiple of it
DEQUANT_ROWS_BLOCK = 2**24  # elements dequantised at once


def storage_bytes(weights: int, matrices: int) -> float:
    """Bytes NF4 holds `weights` weights of `matrices` matrices in (an expert counts as a matrix): half a byte a
    weight, an int8 scaler a block, an fp32 factor a group and an fp32 mean a matrix."""
    return weights * (0.5 + 1 / BLOCK + 4 / GROUP) + 4 * matrices


def dequant_bytes_per_weight(quant: int, compute: int) -> float:
    """Memory traffic per weight of the compiled dequantisation a GPU runs (`rayft.model.nf4.dequantize`): one
    kernel reads each code (half a byte a weight) and its block's scale (`quant` bytes per 64 weights) and writes
    the weight in the `compute` dtype; a `compute` dtype wider than `quant` is converted to after the kernel, which
    writes `quant`."""
    kernel = 0.5 + quant / BLOCK
    return kernel + compute if compute <= quant else kernel + quant + quant + compute


def fits(shape: tuple[int, ...]) -> bool:
    """Whether a weight of `shape` has NF4 storage: its rows whole blocks, its element count whole groups."""
    return shape[-1] % BLOCK == 0 and math.prod(shape) % GROUP == 0
