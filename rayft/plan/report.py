"""The layout table `rayft plan` prints for each cluster size: memory, bytes received, step time, the fastest fit."""

from __future__ import annotations

from rayft.config import Config
from rayft.plan.comm import Cluster
from rayft.plan.memory import tokens_per_micro_batch
from rayft.plan.recompute import Recompute
from rayft.plan.steptime import Hardware, LayoutPlan, fastest_fitting, layout_plan, model_flops_per_token
from rayft.plan.structure import Structure
from rayft.plan.ulysses import degree

GB = 1e9
KINDS = (("all_gather", "gather"), ("reduce_scatter", "r-scatter"), ("all_reduce", "all-red"), ("all_to_all", "a2a"))


def format_layouts(cfg: Config, s: Structure, cluster: Cluster, hw: Hardware, plans: list[LayoutPlan]) -> str:
    """One row per layout and frozen-base storage; `*` marks the fastest that fits (what `auto` picks)."""
    m = cfg.train.gradient_accumulation_steps
    tokens = tokens_per_micro_batch(cfg)
    head = [
        f"layouts on {cluster.nodes} node(s) x {cluster.gpus_per_node} GPU (W={cluster.world}), {hw.gpu}: "
        f"{hw.peak / 1e12:.0f} TFLOP/s bf16{_fp8_peak(hw)} at {hw.mfu:.0%} MFU, network {hw.inter_gbits:g} Gb/s "
        f"({hw.inter_bytes_per_s / GB:g} GB/s) and NVLink {hw.intra_gbytes:g} GB/s "
        f"({hw.intra_bytes_per_s / GB:g} GB/s received) per GPU",
        f"{tokens} tokens/GPU per micro-batch{_split(cfg)}, {m} per step, "
        f"{model_flops_per_token(cfg, s) / 1e9:.1f} GFLOP/token "
        "(before recompute); GB received per GPU per step (network: the part over the inter-node links); seconds "
        "per step; AC: the layers recomputed (fsdp.activation_checkpointing); tok/s: all GPUs; MFU as the run "
        "reports it (bf16 peak)",
        *_compute_notes(cfg, hw, plans),
    ]
    columns = ["layout", "base", "GiB/GPU", "fits", "AC", *(label for _, label in KINDS)]
    columns += ["network", "compute", "comm", "step", "serial", "bound", "tok/s", "MFU"]
    widths = [20, 4, 8, 5, 6, 9, 10, 8, 8, 8, 8, 7, 7, 7, 6, 8, 6]
    lines = [*head, _row(columns, widths)]
    best = fastest_fitting(plans)
    for plan in plans:
        lines.append(_row(_cells(plan, cluster, plan is best), widths))
    lines.append(
        f"* fastest that fits: {best.layout.name(cluster)}, {best.memory.frozen} base, activation checkpointing "
        f"{best.recompute.describe()}: {best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu:.0%}"
        if best
        else "* no layout fits: more nodes, a quantised base (FP8, NF4), activation checkpointing or fewer tokens "
        "per micro-batch"
    )
    return "\n".join(lines)


def _cells(plan: LayoutPlan, cluster: Cluster, best: bool) -> list[str]:
    return [
        f"{'*' if best else ' '}{plan.layout.name(cluster)}",
        plan.memory.frozen,
        f"{plan.memory.total_gib:.1f}",
        "yes" if plan.fits else "OOM",
        plan.recompute.short(),
        *(f"{plan.comm.per_step(kind) / GB:.2f}" for kind, _ in KINDS),
        f"{plan.comm.per_step(inter_node=True) / GB:.2f}",
        f"{plan.time.busy_s:.2f}",
        f"{plan.time.comm_s:.2f}",
        f"{plan.time.predicted_s:.2f}",
        f"{plan.time.serial_s:.2f}",
        "comm" if plan.time.comm_bound else "comp",
        f"{plan.tokens_per_s:,.0f}",
        f"{plan.mfu:.0%}",
    ]


def _split(cfg: Config) -> str:
    """How the tokens of a GPU come about under context parallelism; nothing without it."""
    n = degree(cfg)
    return f" (1/{n} of each row: parallel.context_parallel {n}, all-to-alls in a2a)" if n > 1 else ""


def _fp8_peak(hw: Hardware) -> str:
    return f" ({hw.fp8_peak / 1e12:.0f} FP8)" if hw.fp8_peak else ""


def _compute_notes(cfg: Config, hw: Hardware, plans: list[LayoutPlan]) -> list[str]:
    """How a quantised base's compute is counted: FP8 matmuls on the stored bytes, or dequantisation first."""
    notes = []
    if any(hw.multiplies_fp8(cfg, plan.held) for plan in plans):
        notes.append("an FP8 base is multiplied on its stored bytes at the FP8 peak (model.fp8_compute); LoRA in bf16")
    dequantised = sorted({p.held.upper() for p in plans if p.held != "dtype" and not hw.multiplies_fp8(cfg, p.held)})
    if dequantised:
        notes.append(
            f"compute of an {' or '.join(dequantised)} base includes its dequantisation at "
            f"{hw.hbm_bytes_per_s / 1e12:g} TB/s HBM"
        )
    return notes


def _row(cells: list[str], widths: list[int]) -> str:
    """Layout and storage left-aligned, numbers right-aligned."""
    return " ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))


def format_recompute(cfg: Config, s: Structure, plan: LayoutPlan, cluster: Cluster, hw: Hardware) -> str:
    """`fsdp.activation_checkpointing` as asked and as chosen for `plan`'s layout, with what the choice costs and
    saves against no recompute: memory per GPU and seconds per step."""
    asked = cfg.checkpointing
    chosen = plan.recompute
    line = (
        f"activation checkpointing {asked}{' → ' + chosen.describe() if chosen.describe() != asked else ''} "
        f"({plan.layout.name(cluster)}, {plan.memory.frozen} base, {hw.gpu}): {plan.memory.total_gib:.1f} GiB/GPU, "
        f"step {plan.time.predicted_s:.2f} s"
    )
    if chosen.mode == "none":
        return line + " (no layer recomputed)"
    bare = layout_plan(cfg, s, plan.layout, cluster, hw, plan.held, Recompute(s.layers, None))
    return (
        f"{line}; without recompute {bare.memory.total_gib:.1f} GiB/GPU ({'fits' if bare.fits else 'OOM'}), step "
        f"{bare.time.predicted_s:.2f} s: recompute saves {bare.memory.total_gib - plan.memory.total_gib:.1f} GiB "
        f"and costs {plan.time.predicted_s - bare.time.predicted_s:.2f} s a step"
    )
