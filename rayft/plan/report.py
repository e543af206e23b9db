"""The layout table `rayft plan` prints for each cluster size: memory, bytes received, step time, the fastest fit."""

from __future__ import annotations

from rayft.config import Config
from rayft.model.flops import PEAK_FP8_FLOPS
from rayft.plan.comm import Cluster
from rayft.plan.memory import fp8_compute, tokens_per_micro_batch
from rayft.plan.steptime import Hardware, LayoutPlan, fastest_fitting, flops_per_token
from rayft.plan.structure import Structure

GB = 1e9
KINDS = (("all_gather", "gather"), ("reduce_scatter", "r-scatter"), ("all_reduce", "all-red"), ("all_to_all", "a2a"))


def format_layouts(cfg: Config, s: Structure, cluster: Cluster, hw: Hardware, plans: list[LayoutPlan]) -> str:
    """One row per layout and frozen-base storage; `*` marks the fastest that fits (what `auto` picks)."""
    m = cfg.train.gradient_accumulation_steps
    tokens = tokens_per_micro_batch(cfg)
    head = [
        f"layouts on {cluster.nodes} node(s) x {cluster.gpus_per_node} GPU (W={cluster.world}), {hw.gpu}: "
        f"{hw.peak / 1e12:.0f} TFLOP/s bf16 at {hw.mfu:.0%} MFU, network {hw.inter_gbits:g} Gb/s "
        f"({hw.inter_bytes_per_s / GB:g} GB/s) and NVLink {hw.intra_gbytes:g} GB/s "
        f"({hw.intra_bytes_per_s / GB:g} GB/s received) per GPU",
        f"{tokens} tokens/GPU per micro-batch, {m} per step, {flops_per_token(cfg, s) / 1e9:.1f} GFLOP/token; "
        "GB received per GPU per step (network: the part over the inter-node links); seconds per step",
    ]
    line = _quantised_line(cfg, hw, plans)
    if line:
        head.append(line)
    columns = [
        "layout",
        "base",
        "GiB/GPU",
        "fits",
        *(label for _, label in KINDS),
        "network",
        "compute",
        "comm",
        "step",
        "serial",
        "bound",
    ]
    widths = [20, 4, 8, 5, 9, 10, 8, 8, 8, 8, 7, 7, 7, 6]
    lines = [*head, _row(columns, widths)]
    best = fastest_fitting(plans)
    for plan in plans:
        mark = "*" if plan is best else " "
        cells = [
            f"{mark}{plan.layout.name(cluster)}",
            plan.memory.frozen,
            f"{plan.memory.total_gib:.1f}",
            "yes" if plan.fits else "OOM",
            *(f"{plan.comm.per_step(kind) / GB:.2f}" for kind, _ in KINDS),
            f"{plan.comm.per_step(inter_node=True) / GB:.2f}",
            f"{plan.time.busy_s:.2f}",
            f"{plan.time.comm_s:.2f}",
            f"{plan.time.predicted_s:.2f}",
            f"{plan.time.serial_s:.2f}",
            "comm" if plan.time.comm_bound else "comp",
        ]
        lines.append(_row(cells, widths))
    lines.append(
        f"* fastest that fits: {best.layout.name(cluster)}, {best.memory.frozen} base"
        if best
        else "* no layout fits: more nodes, a quantised base (FP8, NF4), activation checkpointing or fewer tokens "
        "per micro-batch"
    )
    return "\n".join(lines)


def _row(cells: list[str], widths: list[int]) -> str:
    """Layout and storage left-aligned, numbers right-aligned."""
    return " ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))


def _quantised_line(cfg: Config, hw: Hardware, plans: list[LayoutPlan]) -> str | None:
    """What the compute column adds for a quantised base: its dequantisation, or for FP8 matmuls (`model.fp8_compute`
    on a GPU with an FP8 peak) their peak and the input gradient's transposed copy of the bytes."""
    quantised = sorted({plan.held.upper() for plan in plans} - {"DTYPE"})
    hbm = f"{hw.hbm_bytes_per_s / 1e12:g} TB/s HBM"
    if not any(fp8_compute(cfg, plan.held, hw.gpu) for plan in plans):
        return (
            f"compute of an {' or '.join(quantised)} base includes its dequantisation at {hbm}" if quantised else None
        )
    nf4 = ", and an NF4 base's dequantisation" if "NF4" in quantised else ""
    return (
        f"an FP8 base's frozen matmuls run in FP8 at {PEAK_FP8_FLOPS[hw.gpu.upper()] / 1e12:.0f} TFLOP/s "
        f"(model.fp8_compute), nothing dequantised: its compute includes the input gradient's transposed copy of "
        f"the bytes at {hbm}{nf4}"
    )
