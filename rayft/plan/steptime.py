"""Predicted seconds per optimizer step of each layout, which layouts communication bounds, and the fastest layout
that fits (`parallel.expert_parallel: auto`).

Compute, per token, for LoRA on a frozen base: forward 2·N (every matrix weight a token meets: N_active, routed
experts counting top_k / E of theirs), backward only the input gradient, 2·N (no weight gradient for frozen
weights), so 4·N_active — not the 6·N of full training. The LoRA matrices get their weight gradients too: 6·N_lora
(expert LoRA counted top_k / E). Attention scores and values add 3·A(s) (A = forward FLOPs at context s).
Activation checkpointing recomputes the forward: + 2·N_active + 2·N_lora + A. Compute time = tokens · FLOPs per
token / (peak · MFU), MFU assumed (`--mfu`), peak = dense bf16 FLOP/s of the GPU; where an FP8 base's frozen
matmuls run in FP8 on their stored bytes (`model.fp8_compute`: `auto` on a GPU with an FP8 peak), their
(4 + 2·ac)·N_fp8 FLOPs (N_fp8: the FP8 weights a token meets) take the GPU's dense FP8 peak instead.

An FP8 or NF4 base is dequantised before each matmul that uses it, once per pass (forward, input gradient,
recompute): every quantised linear whole, and the routed experts a GPU holds that got tokens (uniform routing: each
of the E/k local experts is hit by one of the s · top_k · k token slots its expert-parallel group routes with
probability 1 − (1 − 1/E)^(s·top_k·k)). FP8's compiled kernel reads each E4M3 byte and writes c bytes; NF4's reads
half a byte and a scale per 64 weights (`rayft.model.nf4_format.dequant_bytes_per_weight`). Either runs at the
GPU's memory bandwidth, on the compute stream: dequantisation time adds to compute. The matmul then reads the c
bytes again: a pass moves 1 + 2c bytes per FP8 weight (`pass_bytes_per_weight`). With FP8 matmuls nothing is
dequantised: the forward (and its recompute) reads each byte once, and the input gradient, whose weight CUDA's
kernel wants transposed, copies the bytes first (2 bytes moved) and reads the copy: 3 bytes in that pass, of
which the copy's 2 are the planner's added time. The first layer's projections
of the embeddings need no input gradient, which the count ignores (an upper bound by one of them per pass).

Communication time = bytes over the network / inter-node bandwidth + bytes over NVLink / intra-node bandwidth
(received per GPU, comm.py). FSDP's gathers and gradient reductions run on their own streams, prefetched a layer
ahead, so they overlap compute; the all-to-all of expert parallelism cannot (the experts wait for their tokens)
and adds to it. Predicted step = max(compute + FP8 dequantisation, overlappable comm) + all-to-all; the serial
figure (nothing overlapped) is the upper bound. A layout is communication-bound when its communication alone takes
longer than its compute and dequantisation.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import cast

from rayft.config import Config, ConfigError
from rayft.gpus import GPUS
from rayft.model.flops import HBM_BYTES_PER_S, PEAK_BF16_FLOPS, PEAK_FP8_FLOPS
from rayft.model.frozen import Held, Storage
from rayft.model.nf4_format import dequant_bytes_per_weight as nf4_dequant_bytes
from rayft.plan.comm import MICRO_BATCH, Cluster, CommPlan, Layout, layouts, plan_comm
from rayft.plan.memory import (
    GPU_GIB,
    MemoryPlan,
    compute_bytes,
    fp8_compute,
    plan_memory,
    stored_bytes,
    tokens_per_micro_batch,
)
from rayft.plan.structure import Structure

log = logging.getLogger(__name__)
DEFAULT_MFU = 0.4
DEFAULT_INTER_GBITS = 400.0  # per GPU, each direction (one 400 Gb/s NDR InfiniBand NIC per GPU)


@dataclass(frozen=True)
class Hardware:
    gpu: str  # a name of rayft.gpus.GPUS
    mfu: float = DEFAULT_MFU
    inter_gbits: float = DEFAULT_INTER_GBITS
    intra_gbytes: float | None = None  # None: the GPU's own NVLink (or PCIe) figure

    def __post_init__(self) -> None:
        if self.intra_gbytes is None:
            object.__setattr__(self, "intra_gbytes", GPUS[self.gpu].link_gbytes_per_s)

    @property
    def peak(self) -> float:
        return PEAK_BF16_FLOPS[self.gpu.upper()]

    @property
    def hbm_bytes_per_s(self) -> float:
        return HBM_BYTES_PER_S[self.gpu.upper()]

    @property
    def inter_bytes_per_s(self) -> float:
        """What one GPU receives per second over the network: Gb/s per direction / 8."""
        return self.inter_gbits * 1e9 / 8

    @property
    def intra_bytes_per_s(self) -> float:
        """What one GPU receives per second over NVLink: half the bidirectional GB/s figure."""
        return cast(float, self.intra_gbytes) * 1e9 / 2  # set by __post_init__


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # matmuls and attention at the assumed MFU
    overlapped_comm_s: float  # FSDP gathers, gradient reductions
    all_to_all_s: float
    dequant_s: float = 0.0  # FP8 or NF4 weights dequantised for their matmuls, on the compute stream

    @property
    def comm_s(self) -> float:
        return self.overlapped_comm_s + self.all_to_all_s

    @property
    def busy_s(self) -> float:
        """What the compute stream does: the matmuls and the dequantisation before them."""
        return self.compute_s + self.dequant_s

    @property
    def predicted_s(self) -> float:
        return max(self.busy_s, self.overlapped_comm_s) + self.all_to_all_s

    @property
    def serial_s(self) -> float:
        return self.busy_s + self.comm_s

    @property
    def comm_bound(self) -> bool:
        return self.comm_s > self.busy_s


@dataclass(frozen=True)
class LayoutPlan:
    layout: Layout
    held: Held  # the frozen base's storage
    memory: MemoryPlan
    comm: CommPlan
    time: StepTime

    @property
    def fits(self) -> bool:
        return self.memory.capacity_gib is None or self.memory.total_gib <= self.memory.capacity_gib


def flops_per_token(cfg: Config, s: Structure) -> float:
    """Hardware FLOPs per token of a LoRA step (module docstring), activation recompute included."""
    ac = cfg.recomputes_activations
    lora = s.lora - s.expert_lora + (s.expert_lora * s.top_k / s.num_experts if s.num_experts else 0)
    attention = s.attention_per_position * cfg.data.max_length
    return (4 + 2 * ac) * s.active_base + (6 + 2 * ac) * lora + (3 + ac) * attention


def dequantised_per_micro_batch(cfg: Config, s: Structure, expert_parallel: int = 1, held: Storage = "fp8") -> float:
    """Quantised weight elements one GPU dequantises per micro-batch (module docstring): every pass over the FP8 (or
    NF4) linears and over its E/k routed experts that got tokens."""
    passes = 2 + cfg.recomputes_activations
    quantised, experts = (s.nf4, s.nf4_experts) if held == "nf4" else (s.fp8, s.experts)
    linears = quantised - experts
    hit = 0.0
    if s.num_experts:
        slots = tokens_per_micro_batch(cfg) * s.top_k * expert_parallel
        hit = 1 - (1 - 1 / s.num_experts) ** slots
    return passes * (linears + experts / expert_parallel * hit)


def dequant_bytes(cfg: Config, held: Storage, on_bytes: bool = False) -> float:
    """Bytes of memory traffic per quantised weight and pass on a GPU before its matmul (module docstring): the
    dequantisation kernel's, or with FP8 matmuls the input gradient's transposed copy, averaged over the passes."""
    c = compute_bytes(cfg, True)
    if on_bytes:
        return 2 / (2 + cfg.recomputes_activations)
    return 1 + c if held == "fp8" else nf4_dequant_bytes(stored_bytes(cfg), c)  # FP8: the compiled kernel


def pass_bytes_per_weight(cfg: Config, on_bytes: bool) -> float:
    """The most bytes a pass over an FP8 weight moves (module docstring): dequantised, 1 + 2c (the kernel's 1 + c,
    then the matmul reads c); in FP8, 3 (the input gradient's transposed copy, then the matmul's read)."""
    return 3.0 if on_bytes else 1 + 2 * compute_bytes(cfg, True)


def fp8_active(s: Structure) -> float:
    """FP8 weights a token is multiplied by: every FP8 linear, and top_k / E of the routed experts' stacks."""
    return s.fp8 - s.experts + (s.experts * s.top_k / s.num_experts if s.num_experts else 0)


def compute_seconds(cfg: Config, s: Structure, hw: Hardware, on_bytes: bool) -> float:
    """A step's matmuls and attention at the assumed MFU: the FP8 matmuls (`on_bytes`) at the FP8 peak."""
    tokens = cfg.train.gradient_accumulation_steps * tokens_per_micro_batch(cfg)
    flops = flops_per_token(cfg, s)
    fp8 = (4 + 2 * cfg.recomputes_activations) * fp8_active(s) if on_bytes else 0.0
    fp8_time = fp8 / PEAK_FP8_FLOPS[hw.gpu.upper()] if on_bytes else 0.0
    return tokens * ((flops - fp8) / hw.peak + fp8_time) / hw.mfu


def step_time(cfg: Config, s: Structure, comm: CommPlan, hw: Hardware, held: Held = "dtype") -> StepTime:
    m = cfg.train.gradient_accumulation_steps
    on_bytes = fp8_compute(cfg, held, hw.gpu)
    compute = compute_seconds(cfg, s, hw, on_bytes)
    dequant = 0.0
    if held != "dtype":
        dequantised = dequantised_per_micro_batch(cfg, s, comm.layout.expert_parallel, held)
        dequant = m * dequantised * dequant_bytes(cfg, held, on_bytes) / hw.hbm_bytes_per_s
    overlapped = all_to_all = 0.0
    for t in comm.transfers:
        seconds = t.inter_node / hw.inter_bytes_per_s + (t.received - t.inter_node) / hw.intra_bytes_per_s
        seconds *= m if t.per == MICRO_BATCH else 1
        if t.kind == "all_to_all":
            all_to_all += seconds
        else:
            overlapped += seconds
    return StepTime(compute, overlapped, all_to_all, dequant)


def plan_layouts(
    cfg: Config, s: Structure, cluster: Cluster, hw: Hardware, held: Held, candidates: list[Layout] | None = None
) -> list[LayoutPlan]:
    """Memory, bytes moved and step time of every layout on `cluster` (GPU, the frozen base `held` so); an NF4
    base's layouts are those without expert parallelism, which it does not take."""
    if candidates is None:
        candidates = [lo for lo in layouts(cluster, s) if held != "nf4" or lo.expert_parallel == 1]
    out = []
    for layout in candidates:
        memory = _memory(cfg, s, layout, cluster, hw, held)
        comm = plan_comm(cfg, s, layout, cluster, on_gpu=True, held=held)
        out.append(LayoutPlan(layout, held, memory, comm, step_time(cfg, s, comm, hw, held)))
    return out


def _memory(cfg: Config, s: Structure, layout: Layout, cluster: Cluster, hw: Hardware, held: Held) -> MemoryPlan:
    sharded = copy.copy(cfg)  # a layout the planner tries, not the user's: the config's rules are not asked
    sharded.fsdp = dataclasses.replace(cfg.fsdp, shard_size=layout.shard)
    return plan_memory(sharded, s, cluster.world, True, hw.gpu, held=held, expert_parallel=layout.expert_parallel)


def fastest_fitting(plans: list[LayoutPlan]) -> LayoutPlan | None:
    fitting = [p for p in plans if p.fits]
    # ties (compute hides the difference) go to the layout that moves less: it has more slack
    return min(fitting, key=lambda p: (round(p.time.predicted_s, 6), p.time.serial_s)) if fitting else None


def choose_expert_parallel(cfg: Config, s: Structure, cluster: Cluster, hw: Hardware, held: Held) -> int:
    """`parallel.expert_parallel: auto`: the expert-parallel degree of the fastest layout that fits the GPU
    (1: no expert parallelism). Only `fsdp.shard_size` as configured is considered for k = 1."""
    candidates = [Layout(shard=cfg.fsdp.shard_group(cluster.world))]
    if not cfg.fsdp.cpu_offload:  # offloading reaches only FSDP's parameters, never expert-parallel experts
        candidates += [layout for layout in layouts(cluster, s) if layout.expert_parallel > 1]
    best = fastest_fitting(plan_layouts(cfg, s, cluster, hw, held, candidates))
    if best is None:
        raise ConfigError(
            f"parallel.expert_parallel: auto: no layout fits {hw.gpu} ({GPU_GIB[hw.gpu]} GiB) on {cluster.nodes} "
            f"node(s) x {cluster.gpus_per_node} GPU(s); see `rayft plan` for the memory of each"
        )
    return best.layout.expert_parallel


def planned_expert_parallel(cfg: Config, s: Structure, held: Held) -> int:
    """`parallel.expert_parallel: auto`: the planner's fastest layout that fits (`rayft plan` prints the table).
    The cluster is the config's: `ray.workers_per_node` workers on each of `ray.nodes` nodes; the GPU is an H200
    (the target; `rayft plan --gpu` compares others)."""
    cluster = Cluster(nodes=cfg.ray.nodes, gpus_per_node=cfg.ray.workers_per_node)
    k = choose_expert_parallel(cfg, s, cluster, Hardware("h200"), held)
    log.info(
        "parallel.expert_parallel: auto → %d (the planner's fastest layout that fits %d x %d H200)",
        k,
        cluster.nodes,
        cluster.gpus_per_node,
    )
    return k
