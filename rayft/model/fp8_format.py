"""FP8 facts that need no model: which expert weights are stored in FP8, how much is (de)quantised at once, and
the block shape a checkpoint's scales use. The planner and the driver's checks read them without importing the
FP8 layers (`rayft.model.fp8`), which belong to the workers."""

from __future__ import annotations

import json
import math
from pathlib import Path

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
DEQUANT_BLOCK = 2**26  # elements dequantised in fp32 at once (256 MiB)
QUANTIZE_BLOCK = 2**23  # weights of rows quantised at once on a GPU, in a workspace of 8 bytes a weight (64 MiB)
HOST_QUANTIZE_BLOCK = 2**18  # and on a CPU (1 MiB in fp32): temporaries its caches hold
EXPERT_DEQUANT_BUDGET = 2**28  # elements of routed-expert weights dequantised at once (512 MiB in bf16)


def storage_block(columns: int, block: int | None) -> int | None:
    """The column block width FP8 storage of a `columns`-wide weight keeps: None (one scale per row) when there is
    no block or it spans the row."""
    return block if block and math.ceil(columns / block) > 1 else None


def weight_block(directory: Path) -> tuple[int, int] | None:
    """(rows, columns) of each block of a block-wise FP8 checkpoint's scales: `quantization_config.weight_block_size`
    in its config.json (top level, or its text model's for a VLM wrapper); None for static scales or no config."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    block = quant.get("weight_block_size")
    return (int(block[0]), int(block[1])) if block else None
