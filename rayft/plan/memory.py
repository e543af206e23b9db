"""Per-GPU memory plan of a run, from the model's structure on the meta device (no weights needed).

Formula (bytes per GPU, world W = nodes × GPUs per node, s = tokens per micro-batch, h = hidden, V = vocab,
c = bytes of the compute dtype, p = bytes of the stored weights):
  sharded weights      P_total · p / W
  gathered layers      (1 + forward_prefetch) · P_layer · c      (every layer when reshard_after_forward is off)
  gathered root        P_root · c                                 (embeddings + head stay gathered after forward)
  LoRA                 P_lora · (4 param + 4 grad + 8 Adam) / W
  activations          K · s · h · c  (inputs of the K recomputed layers)  +  (L − K) · one layer's working set
                       + one layer's working set while a recomputed one runs (K > 0); K = L with full activation
                       checkpointing, 0 without, ceil(L / n) recomputing every n-th layer (`rayft.plan.recompute`)
      a layer's working set = s · h · 17c (attention/norms/MLP, flash attention: no s² term)
                              + s · top_k · moe_intermediate · 3c (routed experts' gate/up/act)
  logits + loss        s · V · (c + 8)    (logits, fp32 log-softmax, fp32 gradient)
  runtime overhead     2 GiB on GPU (CUDA context, NCCL buffers, allocator slack); not counted on CPU
With the frozen base in FP8 (`model.frozen_dtype`), the F decoder matrices (linears, routed experts; R rows) count
1 byte + a 4-byte scale per row instead of p (sharded) or c (gathered), and one FP8 tensor at a time is dequantised
for its matmul: + D · c + its fp32 block (≤ 256 MiB) + D bytes (experts gathered when not one range), D =
the largest linear or one chunk of a layer's experts (≤ EXPERT_DEQUANT_BUDGET elements, `dequantised_at_once`).
With the frozen base in NF4, the N matrices NF4 can block (M of them, an expert counting as one) count 0.5 + 1/64 +
4/16384 bytes a weight + 4 a matrix, sharded and gathered alike, and the largest of them is dequantised for its
matmul: + D · c + a block of ≤ 2^24 of its values twice in p (levels, scaled) + its codes gathered (experts).
Expert parallelism over k workers (rayft.parallel.expert): the routed experts E/k whole per GPU (P_experts · p / k,
FP8: 1 byte + row scales), the rest sharded over the S GPUs of a node (`fsdp.shard_size` as the planner sets it;
whole with one GPU a node; its layers and root gathered as above when sharded), LoRA (P_lora_rest / S +
P_lora_experts / k) · 16, the
largest dequantised FP8 tensor / k, + one exchange's token buffers 2 · s · top_k · h · c (send and receive), and
+ K_moe · 2 · s · top_k · h · c: the outputs of both exchanges (dispatch and combine) of every recomputed one of the
L_moe MoE layers (K_moe = ceil(K · L_moe / L)), which the checkpoint policy keeps until the backward so that the
recompute does not exchange again (`rayft.parallel.alltoall.checkpoint_context`).
With the FP8 base multiplied on its stored bytes (`model.fp8_compute`) nothing is dequantised: the transient is
the largest FP8 tensor's bytes once more (its transpose for the input gradient): the largest linear, or a layer's
whole local expert stack, which the grouped kernel takes at once (no chunks). On a one-rank shard group FSDP
leaves the quantised storage to the layers (`rayft.parallel.parallelize.unsharded_storage`): a gathered layer is
only its other parameters.
Expert LoRA on a base not quantised (PEFT's `W + BA` of every local expert, `rayft.model.fp8` applies it as
activations for FP8 and NF4): each MoE layer not recomputed keeps its experts' W + BA for backward,
max(L_moe − K_moe, 1) · P_experts_layer / k · c.
Context parallelism over N ranks (`rayft.plan.ulysses`): s is a rank's 1/N of the packed row, so every activation
above is its share (attention's heads layout too: s·(H/N)·d bytes = (s/N)·H·d); a layer's working set adds the
copies of k and v repeated where their heads do not divide N, (repeat − 1) · s · H_kv · (d_qk + d_v) · c; + one
exchange's buffers 2 · s · max(H · d_qk, H_kv · repeat · d_qk) · c (the chunks sent and received).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

from rayft.config import Config
from rayft.gpus import GPUS
from rayft.model.fp8_format import DEQUANT_BLOCK, EXPERT_DEQUANT_BUDGET
from rayft.model.frozen import Held
from rayft.model.loss import chunk_rows
from rayft.model.nf4_format import DEQUANT_ROWS_BLOCK
from rayft.model.nf4_format import storage_bytes as nf4_storage_bytes
from rayft.plan.recompute import Recompute, choose
from rayft.plan.structure import Structure
from rayft.plan.ulysses import degree, exchanged, repeated_kv_bytes

GIB = 2**30
GPU_GIB = {name: gpu.memory_gib for name, gpu in GPUS.items()}  # usable memory the device reports
RUNTIME_OVERHEAD_GIB = 2.0


@dataclass(frozen=True)
class MemoryPlan:
    world_size: int
    rows: list[tuple[str, float]]  # (component, GiB per GPU)
    gpu: str | None
    frozen: str = "bf16"  # how the frozen base is stored: bf16, fp32, fp8 or nf4
    recompute: str = ""  # the layers recomputed in backward (`Recompute.short`)

    @property
    def total_gib(self) -> float:
        return sum(gib for _, gib in self.rows)

    @property
    def capacity_gib(self) -> float | None:
        return GPU_GIB.get(self.gpu) if self.gpu else None


def compute_bytes(cfg: Config, on_gpu: bool) -> int:
    """c: bytes per element of gathered weights and activations (bf16 on GPU with train.bf16, else fp32)."""
    return 2 if (on_gpu and cfg.train.bf16 and cfg.fsdp.param_dtype in ("auto", "bfloat16")) else 4


def stored_bytes(cfg: Config) -> int:
    """p: bytes per element of the stored frozen weights (`model.torch_dtype`)."""
    return 4 if cfg.model.torch_dtype == "float32" else 2


def base_bytes(cfg: Config, s: Structure, held: Held) -> float:
    """The frozen base as `held`: `model.torch_dtype`, or its decoder matrices in FP8 with fp32 row scales, or those
    NF4 can block in NF4."""
    p = stored_bytes(cfg)
    if held == "nf4":
        return (s.total - s.nf4) * p + nf4_storage_bytes(s.nf4, s.nf4_matrices)
    return (s.total - s.fp8) * p + s.fp8 + 4 * s.fp8_rows if held == "fp8" else s.total * p


def tokens_per_micro_batch(cfg: Config) -> int:
    """s: tokens each GPU runs per micro-batch (padded rows: max_length each); with context parallelism its 1/N of
    them, the row padded to a multiple of N first (`rayft.parallel.context`)."""
    return -(-cfg.data.max_length * cfg.train.per_device_train_batch_size // degree(cfg))


def plan_memory(
    cfg: Config,
    s: Structure,
    world_size: int,
    on_gpu: bool,
    gpu: str | None = None,
    held: Held = "dtype",
    expert_parallel: int = 1,
    recompute: Recompute | None = None,
    fp8_compute: bool = False,
) -> MemoryPlan:
    """The plan with the frozen base `held` in `torch_dtype`, or its decoder matrices in FP8, or in NF4 (without
    expert parallelism, which NF4 storage does not take); the layers `recompute` says recomputed (by default what
    the config says as it stands: `Recompute.of`); an FP8 base multiplied on its bytes with `fp8_compute`.

    With `expert_parallel` k > 1 each GPU holds E/k routed experts of every MoE layer whole (never gathered) and the
    rest of the model over the `fsdp.shard_size` workers of a node (rayft.parallel.expert), whole with one."""
    recompute = recompute or Recompute.of(cfg, s.layers)
    c, p, tokens = compute_bytes(cfg, on_gpu), stored_bytes(cfg), tokens_per_micro_batch(cfg)
    shards = cfg.fsdp.shard_group(world_size)
    # logits in the compute dtype + fp32 logits + fp32 log-probs: for every token, or one chunk with the fused loss
    logit_rows = min(tokens, chunk_rows(s.vocab, on_gpu)) if cfg.train.fused_loss else tokens
    stored = base_bytes(cfg, s, held)
    layer = _gathered_layer(s, c, held, storage_gathered=shards > 1 or cfg.fsdp.cpu_offload)
    if expert_parallel > 1:
        weights = _expert_parallel_weights(cfg, s, shards, c, p, held, stored, layer, expert_parallel)
    else:
        gathered_layers = 1 + cfg.fsdp.forward_prefetch if cfg.fsdp.reshards() else s.layers
        weights = [
            (f"sharded weights (/{shards})", stored / shards),
            (f"gathered layers ({gathered_layers} x {_count(s.largest_layer)})", gathered_layers * layer),
            ("gathered root (embeddings, head)", s.root * c),
            (f"LoRA params+grads+AdamW (/{shards})", s.lora * 16 / shards),
        ]
    rows = [*weights, _activations(s, tokens, c, recompute, degree(cfg))]
    rows.append(("logits + loss", logit_rows * s.vocab * (c + 8)))
    rows += _all_to_all(s, tokens, c, recompute) if expert_parallel > 1 else _context_buffers(s, tokens, c, degree(cfg))
    if s.expert_lora and held == "dtype":
        rows.append(_expert_lora_merged(s, c, recompute, expert_parallel))
    if held == "fp8" and fp8_compute:
        # the grouped kernel takes a layer's local stack whole (`rayft.model.fp8_matmul`): its bytes transposed
        local = max(1, s.num_experts // expert_parallel) * s.fp8_expert_numel
        rows.append(("FP8 weight transposed for its input gradient", max(s.fp8_linear_largest, local)))
    elif held == "fp8":
        dequantised = dequantised_at_once(s, expert_parallel)
        # its compute-dtype copy, the fp32 block it is made in, and (experts not in one range) their bytes gathered
        transient = dequantised * c + min(dequantised, DEQUANT_BLOCK) * 4 + (dequantised if s.fp8_expert_numel else 0)
        rows.append(("FP8 weight dequantised for its matmul", transient))
    if held == "nf4":
        dequantised = dequantised_at_once(s)  # the largest linear or expert chunk
        # its compute-dtype copy, the experts' codes gathered and, where the eager ops run (not on a GPU, where one
        # kernel writes the weight), a block's int64 indices and the levels looked up
        block = 0 if on_gpu else min(dequantised, DEQUANT_ROWS_BLOCK) * (8 + p)
        gathered = nf4_storage_bytes(dequantised, 1) if s.fp8_expert_numel else 0
        rows.append(("NF4 weight dequantised for its matmul", dequantised * c + block + gathered))
    if on_gpu:
        rows.append(("CUDA/NCCL/allocator overhead", RUNTIME_OVERHEAD_GIB * GIB))
    frozen = held if held != "dtype" else ("fp32" if p == 4 else "bf16")
    return MemoryPlan(world_size, [(name, b / GIB) for name, b in rows], gpu, frozen, recompute.short())


def _gathered_layer(s: Structure, c: int, held: Held, storage_gathered: bool = True) -> float:
    """Bytes of the largest decoder layer as FSDP gathers it: its quantised matrices as stored, the rest in c. On a
    one-rank shard group FSDP leaves the quantised storage alone (`rayft.parallel.parallelize.unsharded_storage`):
    `storage_gathered` False, only the rest is gathered."""
    if held == "nf4":
        return (s.largest_layer - s.nf4_layer) * c + (nf4_storage_bytes(s.nf4_layer, 0) if storage_gathered else 0)
    if held == "fp8":
        return (s.largest_layer - s.fp8_layer) * c + (s.fp8_layer + 4 * s.fp8_layer_rows if storage_gathered else 0)
    return s.largest_layer * c


def activation_bytes(cfg: Config, s: Structure, on_gpu: bool, recompute: Recompute | None = None) -> float:
    """What a GPU keeps for backward (the activations row): its tokens' share of the row under context
    parallelism, with the repeated k and v that N does not divide."""
    recompute = recompute or Recompute.of(cfg, s.layers)
    return _activations(s, tokens_per_micro_batch(cfg), compute_bytes(cfg, on_gpu), recompute, degree(cfg))[1]


def _activations(s: Structure, tokens: int, c: int, recompute: Recompute, n: int = 1) -> tuple[str, float]:
    """The recomputed layers keep their input, the others their working set, plus one working set while a
    recomputed layer runs again; `tokens` is the rank's share of the row (context parallelism over `n`)."""
    layer_working_set = tokens * s.hidden * 17 * c + tokens * s.top_k * s.moe_intermediate * 3 * c
    layer_working_set += repeated_kv_bytes(s, tokens, c, n)
    k = recompute.checkpointed
    held = k * tokens * s.hidden * c + (s.layers - k) * layer_working_set + (layer_working_set if k else 0)
    label = {"none": "AC off", "full": "AC on"}.get(recompute.mode, f"AC on {k} of {s.layers} layers")
    return f"activations ({label}{f', 1/{n} of the row' if n > 1 else ''})", held


def _context_buffers(s: Structure, tokens: int, c: int, n: int) -> list[tuple[str, float]]:
    """Context parallelism's exchange in flight: the chunks of the largest tensor sent (q or the repeated k) and
    those received; nothing without it."""
    if n == 1:
        return []
    q, k, _, _ = exchanged(s, tokens, c, n)
    return [("context-parallel all-to-all buffers (send + receive)", 2 * max(q, k))]


def _recomputed_moe_layers(s: Structure, recompute: Recompute) -> int:
    """MoE layers among the recomputed ones, taken as spread like the MoE layers themselves."""
    return math.ceil(recompute.checkpointed * s.moe_layers / s.layers) if s.layers else 0


def _all_to_all(s: Structure, tokens: int, c: int, recompute: Recompute) -> list[tuple[str, float]]:
    """Expert parallelism's token rows: one exchange in flight, and the outputs every recomputed MoE layer's
    dispatch and combine keep for the backward. Each exchange moves a row per (token, expert) pair: the dispatch
    receives s · top_k rows under uniform routing, the combine exactly its own s · top_k back."""
    exchange = tokens * s.top_k * s.hidden * c
    rows: list[tuple[str, float]] = [("token all-to-all buffers (send + receive)", 2 * exchange)]
    moe = _recomputed_moe_layers(s, recompute)
    if moe:
        rows.append((f"all-to-all outputs kept for backward ({moe} MoE layers x 2)", moe * 2 * exchange))
    return rows


def _expert_lora_merged(s: Structure, c: int, recompute: Recompute, k: int) -> tuple[str, float]:
    """PEFT's expert LoRA on a base not quantised: W + BA of every local expert, kept by each MoE layer that is not
    recomputed (one layer's while a recomputed one runs)."""
    kept = max(s.moe_layers - _recomputed_moe_layers(s, recompute), 1)
    return f"expert LoRA W + BA kept for backward ({kept} MoE layers)", kept * s.experts_layer / k * c


def _expert_parallel_weights(
    cfg: Config, s: Structure, dense_shards: int, c: int, p: int, held: Held, stored: float, layer: float, k: int
) -> list[tuple[str, float]]:
    """Weight rows of expert parallelism: E/k experts whole, the rest sharded over `dense_shards` workers."""
    if held == "fp8":
        experts = s.experts + 4 * s.expert_rows
        experts_layer = s.experts_layer + 4 * s.expert_rows // max(s.moe_layers, 1)
    else:
        experts, experts_layer = s.experts * p, s.experts_layer * c
    expert_lora = s.expert_lora
    rows = [
        (f"non-expert weights (/{dense_shards})", (stored - experts) / dense_shards),
        (f"routed experts ({s.num_experts // k} of {s.num_experts} whole)", experts / k),
    ]
    if dense_shards > 1:
        gathered = 1 + cfg.fsdp.forward_prefetch
        rows += [
            (f"gathered layers, non-expert part ({gathered} x)", gathered * (layer - experts_layer)),
            ("gathered root (embeddings, head)", s.root * c),
        ]
    rows.append(("LoRA params+grads+AdamW", ((s.lora - expert_lora) / dense_shards + expert_lora / k) * 16))
    return rows


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def format_plans(
    plans: list[MemoryPlan],
    s: Structure,
    tokens: int,
    other: list[MemoryPlan] | None = None,
    batch: tuple[int, int] | None = None,
    context: int = 1,
) -> str:
    """The table of `plans`; with `other` (the same runs with the frozen base stored the other way: FP8 / bf16),
    a line of its totals next to them; `context`: the GPUs each row is split over."""
    head = f"{s.architecture}: {s.total / 1e9:.2f}B params, LoRA {s.lora / 1e6:.1f}M trainable, {tokens} tokens/GPU"
    if batch is not None:
        split = f", split over {context} GPUs: parallel.context_parallel" if context > 1 else ""
        head += f" ({batch[0]} x {batch[1]}: per_device_train_batch_size x max_length{split})"
    head += f", frozen base stored in {plans[0].frozen}"
    names = [name for name, _ in plans[0].rows]
    width = max(len(name) for name in names) + 2
    lines = [head, "component".ljust(width) + "".join(f"{'W=' + str(p.world_size):>10}" for p in plans)]
    for i, name in enumerate(names):
        label = name.split(" (/")[0] if "(/" in name else name
        lines.append(label.ljust(width) + "".join(f"{p.rows[i][1]:>10.2f}" for p in plans))
    lines.append("total GiB/GPU".ljust(width) + "".join(f"{p.total_gib:>10.1f}" for p in plans))
    lines.append("  layers recomputed (AC)".ljust(width) + "".join(f"{p.recompute:>10}" for p in plans))
    if other:
        label = f"  with {other[0].frozen} base"
        lines.append(label.ljust(width) + "".join(f"{p.total_gib:>10.1f}" for p in other))
    if plans[0].capacity_gib:
        # every plan is for plans[0]'s GPU, so each has its capacity
        verdicts = "".join(f"{'fits' if p.total_gib <= cast(float, p.capacity_gib) else 'OOM':>10}" for p in plans)
        lines.append(f"on {plans[0].gpu} ({plans[0].capacity_gib} GiB)".ljust(width) + verdicts)
    return "\n".join(lines)


def dequantised_at_once(s: Structure, expert_parallel: int = 1) -> int:
    """Elements of the largest quantised weight (FP8 or NF4) dequantised at once: a whole linear, or one chunk of a
    layer's routed experts (`rayft.model.fp8.expert_chunks`, shared by both storages: only experts with tokens, at
    most EXPERT_DEQUANT_BUDGET elements, at least one expert; counted as if every local expert had tokens, as at
    thousands of tokens per micro-batch). Taken over every matrix FP8 would hold, a bound for NF4's subset."""
    experts = 0
    if s.fp8_expert_numel:
        local = max(1, s.num_experts // expert_parallel)
        experts = min(local, max(1, EXPERT_DEQUANT_BUDGET // s.fp8_expert_numel)) * s.fp8_expert_numel
    return max(s.fp8_linear_largest, experts)


def choose_recompute(
    cfg: Config,
    s: Structure,
    world_size: int,
    on_gpu: bool,
    gpu: str | None,
    held: Held = "dtype",
    expert_parallel: int = 1,
    fp8_compute: bool = False,
) -> Recompute:
    """`fsdp.activation_checkpointing: auto`: the least recompute whose memory plan fits `gpu`
    (`rayft.plan.recompute.choose`); no capacity known (CPU workers, no GPU named): the config's fallback."""
    capacity = GPU_GIB.get(gpu) if on_gpu and gpu else None

    def fits(recompute: Recompute) -> bool:
        plan = plan_memory(cfg, s, world_size, on_gpu, gpu, held, expert_parallel, recompute, fp8_compute)
        return plan.total_gib <= cast(float, capacity)

    return choose(cfg, s.layers, fits if capacity is not None else None)
