"""How many GPUs a sequence length needs, and over how many of them to split each row (`rayft plan
--context-parallel auto`).

For every context-parallel degree N the model allows (a divisor of its query heads: `rayft.parallel.context`), the
fewest GPUs on which the run fits: GPUs within one node first (1 up to a node's), then whole nodes, N dividing the
count; FSDP over all of them, the only layout context parallelism is combined with, each with the activation
checkpointing `auto` chooses there. The answer is the fewest GPUs any N fits on, and among the degrees that fit
there the most tokens a second (not the shortest step: a step on W GPUs trains W/N rows, so a larger N shortens it
by training fewer; ties: the smaller N, which exchanges less).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from rayft.config import Config
from rayft.model.frozen import Held
from rayft.plan.comm import Cluster, Layout
from rayft.plan.memory import GPU_GIB
from rayft.plan.steptime import Hardware, LayoutPlan, layout_plan
from rayft.plan.structure import Structure

MAX_NODES = 64  # how far the search goes before it says no size fits


@dataclass(frozen=True)
class ContextFit:
    """The fewest GPUs one context-parallel degree fits on, with that run's plan."""

    context: int
    cluster: Cluster
    plan: LayoutPlan


def with_context(cfg: Config, context: int, max_length: int | None = None) -> Config:
    """`cfg` with `parallel.context_parallel` (and `data.max_length`) set: a run the planner tries, not the user's
    config, so the config's rules between sections are not asked."""
    tried = copy.copy(cfg)
    tried.parallel = dataclasses.replace(cfg.parallel, context_parallel=context)
    if max_length is not None:
        tried.data = dataclasses.replace(cfg.data, max_length=max_length)
    return tried


def degrees(s: Structure) -> list[int]:
    """The context-parallel degrees the model takes: the divisors of its query heads."""
    return [n for n in range(1, s.heads + 1) if s.heads % n == 0]


def clusters(gpus_per_node: int, max_nodes: int = MAX_NODES) -> list[Cluster]:
    """Cluster sizes in the order the search tries them: 1 to a node's GPUs within one node, then whole nodes."""
    within = [Cluster(1, g) for g in range(1, gpus_per_node + 1)]
    return within + [Cluster(nodes, gpus_per_node) for nodes in range(2, max_nodes + 1)]


def fewest_gpus(
    cfg: Config, s: Structure, hw: Hardware, held: Held, gpus_per_node: int, max_nodes: int = MAX_NODES
) -> list[ContextFit]:
    """For each degree the model takes, the smallest cluster (`clusters`) whose plan fits `hw`; degrees that fit
    on none are left out."""
    found = []
    for n in degrees(s):
        tried = with_context(cfg, n)
        for cluster in clusters(gpus_per_node, max_nodes):
            if cluster.world % n:
                continue
            plan = layout_plan(tried, s, Layout(shard=cluster.world), cluster, hw, held)
            if plan.fits:
                found.append(ContextFit(n, cluster, plan))
                break
    return found


def choose(fits: list[ContextFit]) -> ContextFit | None:
    """The fewest GPUs, then the most tokens a second there, then the smaller degree."""
    return min(fits, key=lambda f: (f.cluster.world, -round(f.plan.tokens_per_s, 6), f.context), default=None)


def format_fits(cfg: Config, s: Structure, hw: Hardware, fits: list[ContextFit], gpus_per_node: int) -> str:
    """A row per degree (its fewest GPUs, memory, all-to-all bytes and step), then the answer with its memory."""
    row = cfg.train.per_device_train_batch_size * cfg.data.max_length
    lines = [
        f"{s.architecture}, {row:,} tokens a row ({cfg.train.per_device_train_batch_size} x {cfg.data.max_length}: "
        f"per_device_train_batch_size x max_length), {hw.gpu} ({GPU_GIB[hw.gpu]} GiB), {gpus_per_node} GPUs a "
        f"node: the fewest GPUs each parallel.context_parallel fits on (FSDP over them, {hw.mfu:.0%} MFU); a2a: GB "
        "a GPU receives per step in context parallelism's all-to-alls",
        f"{'CP':>4} {'GPUs':>5} {'nodes':>9} {'GiB/GPU':>8} {'AC':>6} {'a2a GB':>8} {'compute':>8} {'step s':>8}"
        f" {'tok/s':>8}",
    ]
    best = choose(fits)
    for f in fits:
        p = f.plan
        lines.append(
            f"{('*' if f is best else ' ') + str(f.context):>4} {f.cluster.world:>5} "
            f"{f'{f.cluster.nodes} x {f.cluster.gpus_per_node}':>9} {p.memory.total_gib:>8.1f} "
            f"{p.recompute.short():>6} {p.comm.per_step('all_to_all') / 1e9:>8.1f} {p.time.busy_s:>8.1f} "
            f"{p.time.predicted_s:>8.1f} {p.tokens_per_s:>8,.0f}"
        )
    if best is None:
        lines.append(f"* no degree fits on up to {MAX_NODES} nodes of {gpus_per_node} {hw.gpu}")
        return "\n".join(lines)
    memory = " · ".join(f"{name.split(' (')[0]} {gib:.2f}" for name, gib in best.plan.memory.rows)
    lines += [
        f"* {row:,} tokens a row: parallel.context_parallel {best.context} on {best.cluster.world} {hw.gpu} "
        f"({best.cluster.nodes} node(s) x {best.cluster.gpus_per_node}), {best.plan.memory.total_gib:.1f} GiB/GPU, "
        f"{best.plan.memory.frozen} base, activation checkpointing {best.plan.recompute.describe()}, step "
        f"{best.plan.time.predicted_s:.1f} s",
        f"  GiB/GPU: {memory}",
    ]
    return "\n".join(lines)
