"""The GPUs rayft knows by name: what `rayft plan` sizes a run by, and what the logged MFU divides by. Vendor
figures for the SXM parts (dense bf16 and FP8, no sparsity); memory is the total the device reports to torch, a
little less than the marketed size. Kept free of torch so that the command line can offer the names without
importing it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    memory_gib: float  # torch.cuda.get_device_properties(...).total_memory
    bf16_tflops: float  # dense tensor-core peak
    hbm_tbytes_per_s: float  # memory bandwidth: what the FP8 dequantisation kernel is bound by
    link_gbytes_per_s: float  # NVLink per GPU, both directions together as NVIDIA quotes it (PCIe where none)
    fp8_tflops: float | None = None  # dense FP8 tensor-core peak; None: no FP8 tensor cores (capability < 8.9)


# Ordered so that a device name matches its own entry first ("NVIDIA GH200 480GB" holds "H200").
GPUS: dict[str, Gpu] = {
    "b200": Gpu(178.4, 2250, 8.0, 1800, 4500),
    "gh200": Gpu(94.5, 989, 4.0, 900, 1979),  # the 96 GB HBM3 part
    "h200": Gpu(139.8, 989, 4.8, 900, 1979),
    "h800": Gpu(79.6, 989, 3.35, 400, 1979),
    "h100": Gpu(79.6, 989, 3.35, 900, 1979),
    "a800": Gpu(79.3, 312, 2.0, 400),
    "a100": Gpu(79.3, 312, 2.0, 600),  # the 80 GB part
    "l40s": Gpu(44.4, 362, 0.864, 64, 733),  # PCIe 4.0 x16, no NVLink
}


def gpu_named(kind: str) -> str | None:
    """The name in GPUS of a GPU as Ray's `accelerator_type` calls it ("H100", "A100-80G", "GH200"), None for one
    the planner does not know."""
    kind = kind.upper()
    return next((name for name in GPUS if kind == name.upper() or kind.startswith(name.upper() + "-")), None)
