"""Bytes each GPU receives from the others, per micro-batch and per optimizer step, for each way of spreading the
model over the cluster: the numbers `rayft.parallel.tally` measures (same convention: bytes received from other
ranks, as ring / pairwise algorithms move them).

Notation: W = workers (nodes × GPUs per node), S = shard group of the (non-expert) weights, R = W / S replicas,
k = expert-parallel degree, m = micro-batches per step (gradient accumulation), s = tokens per GPU per micro-batch,
h = hidden size, c = bytes of the compute dtype, r = bytes of the gradient-reduction dtype (fsdp.reduce_dtype).
A collective over g ranks of a tensor of T bytes (the gathered output, the reduce-scatter input, the all-reduced
buffer) delivers to each rank: all-gather and reduce-scatter T·(g−1)/g, all-reduce 2·T·(g−1)/g; an all-to-all in
which each rank sends D bytes spread evenly delivers D·(g−1)/g.

Layouts:
  FSDP        S = W. Each decoder layer is gathered in forward and again in backward (reshard_after_forward, the
              default; the last layer stays gathered from its forward to its backward, and the
              recompute of activation checkpointing reuses the backward gather): per micro-batch
              (2 − 1/L)·G_layers·(S−1)/S, L = decoder layers, G_layers = frozen layer weights as gathered (c bytes
              each; FP8 storage: 1 byte + a 4-byte row scale per row; NF4: half a byte, an int8 scaler per 64
              weights, a 4-byte factor per 16,384 and a 4-byte mean per matrix) + layer LoRA·c. Without
              reshard_after_forward: once per step.
              The root (embeddings, norm, head) is gathered once and kept when it holds no LoRA, else once per
              micro-batch. Per step: LoRA gradients reduce-scattered, LoRA·r·(S−1)/S (on the last micro-batch).
  HSDP        S = GPUs per node (gathers stay on NVLink), R = nodes: as FSDP within the node, then the
              reduce-scattered LoRA gradients (LoRA·r/S) all-reduced across the R replicas.
  EP k        rayft.parallel.expert's (dp, ep) mesh of W/k × k workers: every MoE layer's E routed experts split
              over each ep-group of k consecutive workers (within a node when k divides the GPUs of a node, whole
              nodes when those divide k), E/k whole experts each, never gathered; the W/k workers of a dp-group
              (ranks k apart) hold the same experts and all-reduce their LoRA gradients (expert_LoRA·r/k). Tokens
              travel instead: per MoE layer per micro-batch each rank sends s·top_k·h·c bytes to dispatch and as
              much to combine, forward and backward: 4·s·top_k·h·c·(k−1)/k received, activation checkpointing
              included (its recompute reuses the saved exchanges); uniform routing. The rest (attention, shared
              expert, norms, router, embeddings, head) is HSDP within a node: S = GPUs per node, R = nodes (held
              whole with one GPU a node).
  CP N        context parallelism (rayft.parallel.context, with FSDP over all W): N consecutive workers split each
              packed row, s = a rank's 1/N of it. Per attention layer per micro-batch a rank sends q, k and v to
              heads and the output back, forward and backward, and the forward's again in every recomputed layer
              (2·L + K sets of four, K = layers recomputed): X = s·(H·d_qk + H_kv·repeat·(d_qk + d_v) + H·d_v)·c
              bytes a set, X·(N−1)/N received (`rayft.plan.ulysses`).
Plus one 8-byte all-reduce per step (the step's target-token count). Scalar reductions inside gradient clipping
are neither counted here nor tallied.

Inter-node share, for the time model: a group of g ranks over n nodes (g/n per node, each GPU with its own NIC)
receives T·(n−1)/g per rank over the network in an all-gather or reduce-scatter (twice that in an all-reduce), and
D·(n−1)/n in an all-to-all; the rest moves over NVLink.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayft.config import Config, expert_groups_follow_nodes
from rayft.model.frozen import Held
from rayft.model.nf4_format import storage_bytes as nf4_storage_bytes
from rayft.plan.memory import compute_bytes, tokens_per_micro_batch
from rayft.plan.recompute import Recompute
from rayft.plan.structure import Structure
from rayft.plan.ulysses import degree, exchanged, exchanges_per_micro_batch

MICRO_BATCH, STEP = "micro-batch", "step"
TARGET_COUNT_BYTES = 8  # the float64 all-reduce of the step's target tokens (rayft.train.step.step_targets)


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def nodes_spanned(self, size: int, stride: int = 1) -> int:
        """Nodes a group of `size` ranks spaced `stride` apart covers (ranks fill a node before the next)."""
        return len({j * stride // self.gpus_per_node for j in range(size)})


@dataclass(frozen=True)
class Layout:
    """How the model is spread: the (non-expert) weights sharded over groups of `shard` consecutive workers and
    replicated across the groups; routed experts split over `expert_parallel` consecutive workers (then the rest
    is sharded within a node: `expert`)."""

    shard: int
    expert_parallel: int = 1

    @classmethod
    def expert(cls, k: int, cluster: Cluster) -> Layout:
        """Expert parallelism over k workers as rayft.parallel.expert lays it out: the rest HSDP within a node."""
        return cls(shard=cluster.gpus_per_node, expert_parallel=k)

    def name(self, cluster: Cluster) -> str:
        if self.expert_parallel > 1:
            return f"EP {self.expert_parallel}" + ("" if self.shard == 1 else f", rest HSDP {self.shard}")
        if self.shard == cluster.world:
            return "FSDP"
        return "replicated" if self.shard == 1 else f"HSDP {self.shard}x{cluster.world // self.shard}"


@dataclass(frozen=True)
class Transfer:
    """One recurring collective: what it moves, how often, and the bytes each GPU receives each time."""

    kind: str  # all_gather, reduce_scatter, all_reduce, all_to_all (the tally's kinds)
    what: str
    per: str  # MICRO_BATCH or STEP
    received: float
    inter_node: float  # of `received`, what crosses the inter-node network


@dataclass
class CommPlan:
    layout: Layout
    micro_batches: int
    transfers: list[Transfer] = field(default_factory=list)

    def per_step(self, kind: str | None = None, inter_node: bool = False) -> float:
        """Bytes received per GPU in one optimizer step (of one collective kind, or all; or their inter-node part)."""
        return sum(
            (t.inter_node if inter_node else t.received) * (self.micro_batches if t.per == MICRO_BATCH else 1)
            for t in self.transfers
            if kind is None or t.kind == kind
        )


def layouts(cluster: Cluster, s: Structure) -> list[Layout]:
    """FSDP over all workers; HSDP (shard within a node, replicate across) on several multi-GPU nodes, or full
    replication on single-GPU nodes; EP k for every k > 1 dividing W and the experts whose groups keep to node
    boundaries (what the config accepts)."""
    w, g = cluster.world, cluster.gpus_per_node
    out = [Layout(shard=w)]
    if cluster.nodes > 1:
        out.append(Layout(shard=g))
    if s.num_experts:
        for k in range(2, w + 1):
            if w % k == 0 and s.num_experts % k == 0 and expert_groups_follow_nodes(k, g):
                out.append(Layout.expert(k, cluster))
    return out


def plan_comm(
    cfg: Config,
    s: Structure,
    layout: Layout,
    cluster: Cluster,
    on_gpu: bool,
    held: Held,
    recompute: Recompute | None = None,
) -> CommPlan:
    """The collectives of one optimizer step of `layout` on `cluster`, with their bytes per GPU, the frozen base
    `held` as the job holds it (NF4 never with expert parallelism: the config refuses it); `recompute` (default:
    the config's as it stands) says how often context parallelism exchanges again."""
    plan = CommPlan(layout, cfg.train.gradient_accumulation_steps)
    c, r = compute_bytes(cfg, on_gpu), _reduce_bytes(cfg)
    k, w = layout.expert_parallel, cluster.world
    if held == "nf4" and k > 1:
        raise ValueError("NF4 storage takes no expert parallelism")
    experts_as_gathered = (s.experts + s.expert_rows * 4 if held == "fp8" else s.experts * c) if k > 1 else 0
    expert_lora = s.expert_lora if k > 1 else 0
    layers = _gathered_layers(s, c, held) - experts_as_gathered - expert_lora * c
    plan.transfers += _sharded(cfg, s, layout, cluster, layers, s.lora - expert_lora, c, r)
    if k > 1:  # ep-groups: k consecutive ranks; dp-groups: W/k ranks k apart holding the same experts
        dp = w // k
        plan.transfers += _all_reduce(
            "LoRA gradients, routed experts", expert_lora * r / k, dp, cluster.nodes_spanned(dp, stride=k)
        )
        plan.transfers.append(_all_to_all(cfg, s, k, cluster.nodes_spanned(k), c))
    if degree(cfg) > 1:
        recomputed = (recompute or Recompute.of(cfg, s.layers)).checkpointed
        plan.transfers.append(_context_all_to_all(cfg, s, cluster, c, recomputed))
    plan.transfers += _all_reduce("step's target-token count", TARGET_COUNT_BYTES, w, cluster.nodes_spanned(w))
    plan.transfers = [t for t in plan.transfers if t.received > 0]
    return plan


def _reduce_bytes(cfg: Config) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(cfg.fsdp.reduce_dtype, 4)


def _gathered_layers(s: Structure, c: int, held: Held) -> float:
    """G_layers: every decoder layer's parameters as FSDP gathers them (frozen + LoRA), all layers: the quantised
    matrices as stored, the rest in c."""
    if held == "nf4":
        frozen = (s.layers_frozen - s.nf4) * c + nf4_storage_bytes(s.nf4, s.nf4_matrices)
    elif held == "fp8":
        frozen = (s.layers_frozen - s.fp8) * c + s.fp8 + s.fp8_rows * 4
    else:
        frozen = s.layers_frozen * c
    return frozen + s.layers_lora * c


def _sharded(
    cfg: Config, s: Structure, layout: Layout, cluster: Cluster, layers: float, lora: int, c: int, r: int
) -> list[Transfer]:
    """FSDP / HSDP collectives of the (non-expert) weights sharded over groups of `layout.shard` workers."""
    shard, replicas = layout.shard, cluster.world // layout.shard
    nodes = cluster.nodes_spanned(shard)
    out = []
    if cfg.fsdp.reshards():  # the last layer stays gathered from its forward to its backward
        out.append(
            _collective(
                "all_gather",
                "decoder layers, forward + backward but the last's",
                MICRO_BATCH,
                (2 - 1 / s.layers) * layers,
                shard,
                nodes,
            )
        )
    else:
        out.append(_collective("all_gather", "decoder layers, kept over the step", STEP, layers, shard, nodes))
    if s.root_lora:
        out.append(
            _collective("all_gather", "root (embeddings, head) with its LoRA", MICRO_BATCH, s.root * c, shard, nodes)
        )
    out.append(_collective("reduce_scatter", "LoRA gradients", STEP, lora * r, shard, nodes))
    if replicas > 1:
        out += _all_reduce(
            "LoRA gradient shards across replicas",
            lora * r / shard,
            replicas,
            cluster.nodes_spanned(replicas, stride=shard),
        )
    return out


def _collective(kind: str, what: str, per: str, total: float, ranks: int, nodes: int) -> Transfer:
    """An all-gather or reduce-scatter of `total` bytes over `ranks` ranks on `nodes` nodes."""
    return Transfer(kind, what, per, total * (ranks - 1) / ranks, total * (nodes - 1) / ranks)


def _all_reduce(what: str, total: float, ranks: int, nodes: int) -> list[Transfer]:
    """A ring all-reduce once per step: a reduce-scatter then an all-gather, each (g−1)/g of the buffer."""
    if ranks <= 1:
        return []
    return [Transfer("all_reduce", what, STEP, 2 * total * (ranks - 1) / ranks, 2 * total * (nodes - 1) / ranks)]


def _all_to_all(cfg: Config, s: Structure, k: int, nodes: int, c: int) -> Transfer:
    """Token dispatch + combine of every MoE layer, forward + backward (activation checkpointing's recompute
    reuses the forward's saved exchanges: `rayft.parallel.alltoall.checkpoint_context`)."""
    passes = 4
    sent = s.moe_layers * passes * tokens_per_micro_batch(cfg) * s.top_k * s.hidden * c
    what = f"tokens to experts and back, {passes} passes x {s.moe_layers} MoE layers"
    return Transfer("all_to_all", what, MICRO_BATCH, sent * (k - 1) / k, sent * (nodes - 1) / nodes)


def _context_all_to_all(cfg: Config, s: Structure, cluster: Cluster, c: int, recomputed: int) -> Transfer:
    """Context parallelism's q, k, v to heads and output back in every attention layer: forward, backward and the
    recompute's forward (`rayft.plan.ulysses`), in groups of N consecutive workers."""
    n = degree(cfg)
    sets = exchanges_per_micro_batch(s.layers, recomputed)
    sent = sets * sum(exchanged(s, tokens_per_micro_batch(cfg), c, n))
    what = f"q, k, v to heads and output back, {sets} x 4 (CP {n}, {s.layers} layers, {recomputed} recomputed)"
    nodes = cluster.nodes_spanned(n)
    return Transfer("all_to_all", what, MICRO_BATCH, sent * (n - 1) / n, sent * (nodes - 1) / nodes)
