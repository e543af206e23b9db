"""What the safetensors format itself says, which both the driver's header checks (`rayft.model.files`) and the
workers' sharded reader (`rayft.model.weights`) need: kept below both, so that neither imports the other."""

from __future__ import annotations

import torch

# The header's dtype names (safetensors' own spelling) and the torch dtypes they hold.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
