"""Predicted seconds per optimizer step of each layout, which layouts communication bounds, and the fastest layout
that fits (`parallel.expert_parallel: auto`).

Compute, per token, for LoRA on a frozen base: forward 2·N (every matrix weight a token meets: N_active, routed
experts counting top_k / E of theirs), backward only the input gradient, 2·N (no weight gradient for frozen
weights), so 4·N_active — not the 6·N of full training. The LoRA matrices get their weight gradients too: 6·N_lora
(expert LoRA counted top_k / E). Attention scores and values add 3·A(k) (A = forward FLOPs of a query attending k
keys; causal, k = (s + 1) / 2 for a full-length document: a causal kernel skips the masked blocks, and packed
documents attend fewer). Activation checkpointing recomputes the forward of the share f of the layers it covers
(`rayft.plan.recompute`: 1 full, 0 none, K / L every n-th layer): + f · (2·N_active + 2·N_lora + A). Compute time =
tokens · FLOPs per token / (peak · MFU), MFU assumed (`--mfu`), peak = dense bf16 FLOP/s of the GPU; with the FP8
base multiplied on its stored bytes (`model.fp8_compute`: `torch._scaled_mm` / `_scaled_grouped_mm`) its matmuls
(forward, input gradient, recompute: (4 + 2f) · N_fp8_active) run at the dense FP8 peak instead, LoRA and the rest
at bf16's.

With context parallelism over n ranks (`parallel.context_parallel`) a rank's tokens are its 1/n of the packed
row, through every matmul, and it runs H/n heads of attention over the whole row: the row's attention FLOPs / n,
which is A((s + 1) / 2) per token of its share with s the whole row's length.

Predicted throughput = W · m · s / predicted step; predicted MFU as the run reports it (`rayft.model.flops`): model
FLOPs per token (4·N_active + 6·N_lora + 3·A, no recompute) · tokens/s per GPU / the bf16 peak.

Without FP8 compute, an FP8 or NF4 base is dequantised before each matmul that uses it, once per pass (forward,
input gradient, recompute): every quantised linear whole, and the routed experts a GPU holds that got tokens
(uniform routing: each
of the E/k local experts is hit by one of the s · top_k · k token slots its expert-parallel group routes with
probability 1 − (1 − 1/E)^(s·top_k·k)). FP8's compiled kernel reads each E4M3 byte and writes c bytes; NF4's reads
half a byte and a scale per 64 weights (`rayft.model.nf4_format.dequant_bytes_per_weight`). Either runs at the
GPU's memory bandwidth, on the compute stream: dequantisation time adds to compute. The first layer's projections
of the embeddings need no input gradient, which the count ignores (an upper bound by one of them per pass).

Communication time = bytes over the network / inter-node bandwidth + bytes over NVLink / intra-node bandwidth
(received per GPU, comm.py). FSDP's gathers and gradient reductions run on their own streams, prefetched a layer
ahead, so they overlap compute; the all-to-alls of expert parallelism (the experts wait for their tokens) and of
context parallelism (attention waits for its heads) cannot, and add to it. Predicted step = max(compute + FP8
dequantisation, overlappable comm) + all-to-all; the serial figure (nothing overlapped) is the upper bound. A
layout is communication-bound when its communication alone takes longer than its compute and dequantisation.
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
    choose_recompute,
    compute_bytes,
    plan_memory,
    stored_bytes,
    tokens_per_micro_batch,
)
from rayft.plan.recompute import Recompute
from rayft.plan.structure import Structure
from rayft.plan.ulysses import degree

log = logging.getLogger(__name__)
DEFAULT_MFU = 0.4
DEFAULT_INTER_GBITS = 400.0  # per GPU, each direction (one 400 Gb/s NDR InfiniBand NIC per GPU)


@dataclass(frozen=True)
class Hardware:
    gpu: str  # a name of rayft.gpus.GPUS
    mfu: float = DEFAULT_MFU
    inter_gbits: float = DEFAULT_INTER_GBITS
    intra_gbytes: float | None = None  # None: the GPU's own NVLink (or PCIe) figure
    fp8_compute: bool | None = None  # None: the config's `model.fp8_compute` (`fp8_compute`)

    def __post_init__(self) -> None:
        if self.intra_gbytes is None:
            object.__setattr__(self, "intra_gbytes", GPUS[self.gpu].link_gbytes_per_s)

    @property
    def peak(self) -> float:
        return PEAK_BF16_FLOPS[self.gpu.upper()]

    @property
    def fp8_peak(self) -> float | None:
        """Dense FP8 FLOP/s; None for a GPU without FP8 tensor cores."""
        return PEAK_FP8_FLOPS.get(self.gpu.upper())

    def multiplies_fp8(self, cfg: Config, held: Held) -> bool:
        """Whether an FP8 base's matmuls run on its stored bytes here (`fp8_compute`, unless this hardware says)."""
        asked = fp8_compute(cfg, self.gpu) if self.fp8_compute is None else self.fp8_compute
        return held == "fp8" and asked and self.fp8_peak is not None

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
    recompute: Recompute
    tokens_per_step: int = 0  # every GPU's tokens of one optimizer step
    model_flops: float = 0.0  # per token, as the run's MFU counts them (no recompute)
    peak: float = 0.0  # the GPU's dense bf16 FLOP/s, what MFU divides by

    @property
    def fits(self) -> bool:
        return self.memory.capacity_gib is None or self.memory.total_gib <= self.memory.capacity_gib

    @property
    def tokens_per_s(self) -> float:
        """Predicted tokens a second, all GPUs together."""
        return self.tokens_per_step / self.time.predicted_s if self.time.predicted_s else 0.0

    @property
    def mfu(self) -> float:
        """Predicted MFU as the run reports it (module docstring)."""
        per_gpu = self.tokens_per_s / self.memory.world_size
        return per_gpu * self.model_flops / self.peak if self.peak else 0.0


def fp8_compute(cfg: Config, gpu: str) -> bool:
    """`model.fp8_compute`, the runtime's key (true, false, or auto / null: on where the GPU has FP8 tensor cores,
    compute capability 8.9 and up): whether a frozen FP8 base is multiplied on its stored bytes. The one place the
    planner reads it; a config without the key reads as auto."""
    asked = getattr(cfg.model, "fp8_compute", None)
    return gpu.upper() in PEAK_FP8_FLOPS if asked in (None, "auto") else bool(asked)


def _expert_lora_active(s: Structure) -> float:
    return s.lora - s.expert_lora + (s.expert_lora * s.top_k / s.num_experts if s.num_experts else 0)


def _fp8_active(s: Structure) -> float:
    """Frozen FP8 weights a token is multiplied by: the FP8 linears, and top_k / E of the routed experts."""
    return s.fp8 - s.experts + (s.experts * s.top_k / s.num_experts if s.num_experts else 0)


def flops_per_token(cfg: Config, s: Structure, recompute: Recompute | None = None, fp8: bool = False) -> float:
    """Hardware FLOPs per token of a LoRA step (module docstring), `recompute` (default: the config's as it stands)
    included; with `fp8`, only the FP8 base's matmuls (forward, input gradient, recompute)."""
    f = (recompute or Recompute.of(cfg, s.layers)).share
    if fp8:
        return (4 + 2 * f) * _fp8_active(s)
    attention = s.attention_per_position * (cfg.data.max_length + 1) / 2
    return (4 + 2 * f) * s.active_base + (6 + 2 * f) * _expert_lora_active(s) + (3 + f) * attention


def model_flops_per_token(cfg: Config, s: Structure) -> float:
    """FLOPs per token as the run's MFU counts them: no recompute (`rayft.model.flops.FlopModel.per_token_lora`)."""
    return flops_per_token(cfg, s, Recompute(s.layers, None))


def dequantised_per_micro_batch(
    cfg: Config, s: Structure, expert_parallel: int = 1, held: Storage = "fp8", recompute: Recompute | None = None
) -> float:
    """Quantised weight elements one GPU dequantises per micro-batch (module docstring): every pass over the FP8 (or
    NF4) linears and over its E/k routed experts that got tokens."""
    passes = 2 + (recompute or Recompute.of(cfg, s.layers)).share
    quantised, experts = (s.nf4, s.nf4_experts) if held == "nf4" else (s.fp8, s.experts)
    linears = quantised - experts
    hit = 0.0
    if s.num_experts:
        slots = tokens_per_micro_batch(cfg) * s.top_k * expert_parallel
        hit = 1 - (1 - 1 / s.num_experts) ** slots
    return passes * (linears + experts / expert_parallel * hit)


def pass_bytes_per_weight(cfg: Config, on_bytes: bool) -> float:
    """The most bytes a pass over an FP8 weight moves: dequantised, 1 + 2c (the kernel's 1 + c, then the matmul reads
    c); on its bytes (`model.fp8_compute`), 3 (CUDA's kernel reads the input gradient's weight column-major: a
    transposed copy, 1 byte read and 1 written, then the matmul's read)."""
    return 3.0 if on_bytes else 1 + 2 * compute_bytes(cfg, True)


def dequant_bytes(cfg: Config, held: Storage) -> float:
    """Bytes of memory traffic per quantised weight dequantised on a GPU (module docstring)."""
    c = compute_bytes(cfg, True)
    return 1 + c if held == "fp8" else nf4_dequant_bytes(stored_bytes(cfg), c)  # FP8: the compiled kernel


def step_time(
    cfg: Config, s: Structure, comm: CommPlan, hw: Hardware, held: Held = "dtype", recompute: Recompute | None = None
) -> StepTime:
    """Seconds of one optimizer step (module docstring) with `recompute` (default: the config's as it stands)."""
    recompute = recompute or Recompute.of(cfg, s.layers)
    m, tokens = cfg.train.gradient_accumulation_steps, tokens_per_micro_batch(cfg)
    on_fp8 = hw.multiplies_fp8(cfg, held)
    fp8 = flops_per_token(cfg, s, recompute, fp8=True) if on_fp8 else 0.0
    seconds_per_token = (flops_per_token(cfg, s, recompute) - fp8) / hw.peak + fp8 / cast(float, hw.fp8_peak or 1)
    compute = m * tokens * seconds_per_token / hw.mfu
    dequant = 0.0
    if held != "dtype" and not on_fp8:
        dequantised = dequantised_per_micro_batch(cfg, s, comm.layout.expert_parallel, held, recompute)
        dequant = m * dequantised * dequant_bytes(cfg, held) / hw.hbm_bytes_per_s
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
    base's layouts are those without expert parallelism, which it does not take; with context parallelism only FSDP
    over every worker (what the config combines it with), and none where N does not divide the workers."""
    if candidates is None:
        candidates = [lo for lo in layouts(cluster, s) if held != "nf4" or lo.expert_parallel == 1]
        if degree(cfg) > 1:
            fsdp = Layout(shard=cluster.world)
            candidates = [fsdp] if cluster.world % degree(cfg) == 0 else []
    return [layout_plan(cfg, s, layout, cluster, hw, held) for layout in candidates]


def layout_plan(
    cfg: Config,
    s: Structure,
    layout: Layout,
    cluster: Cluster,
    hw: Hardware,
    held: Held,
    recompute: Recompute | None = None,
) -> LayoutPlan:
    """One layout's memory, bytes and time with `recompute`, by default what `fsdp.activation_checkpointing` asks
    for or, `auto`, chooses for this layout's memory."""
    sharded = copy.copy(cfg)  # a layout the planner tries, not the user's: the config's rules are not asked
    sharded.fsdp = dataclasses.replace(cfg.fsdp, shard_size=layout.shard)
    k, fp8 = layout.expert_parallel, hw.multiplies_fp8(cfg, held)
    recompute = recompute or choose_recompute(sharded, s, cluster.world, True, hw.gpu, held, k, fp8)
    memory = plan_memory(sharded, s, cluster.world, True, hw.gpu, held, k, recompute, fp8)
    comm = plan_comm(cfg, s, layout, cluster, on_gpu=True, held=held, recompute=recompute)
    time = step_time(cfg, s, comm, hw, held, recompute)
    tokens = cluster.world * cfg.train.gradient_accumulation_steps * tokens_per_micro_batch(cfg)
    return LayoutPlan(layout, held, memory, comm, time, recompute, tokens, model_flops_per_token(cfg, s), hw.peak)


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


def config_layout(cfg: Config, k: int) -> tuple[Cluster, Layout]:
    """The cluster and layout the config trains on: `ray.workers_per_node` workers a node, as many nodes as its
    fewest workers fill (an elastic run's smallest group holds the largest shares), `fsdp.shard_size` and k, the
    expert-parallel degree (`parallel.expert_parallel` as preflight decided it)."""
    per_node = cfg.ray.workers_per_node
    cluster = Cluster(nodes=max(1, cfg.ray.fewest_workers // per_node), gpus_per_node=per_node)
    layout = Layout.expert(k, cluster) if k > 1 else Layout(shard=cfg.fsdp.shard_group(cluster.world))
    return cluster, layout


def planned_recompute(cfg: Config, s: Structure, held: Held, gpu: str | None, k: int) -> Recompute:
    """`fsdp.activation_checkpointing: auto` (or selective without its period) decided for the job's `gpu` (None:
    CPU workers or a GPU the planner does not know: the config's fallback) on its layout with k, the expert-parallel
    degree preflight decided; the caller hands the choice to the workers."""
    asked = cfg.checkpointing
    if gpu is None:
        chosen = Recompute.of(cfg, s.layers)
    else:
        cluster, layout = config_layout(cfg, k)
        (plan,) = plan_layouts(cfg, s, cluster, Hardware(gpu), held, [layout])
        chosen = plan.recompute
    if asked != chosen.mode or asked == "selective":
        where = gpu or "no GPU capacity known"
        log.info("fsdp.activation_checkpointing: %s → %s (%s)", asked, chosen.describe(), where)
    return chosen
