"""What a preemption costs a run, for `rayft plan`: the checkpoint a drain notice saves at once, the steps trained
after the notice that the restart trains again, and the restart's reading of the frozen base.

Storage is the bound on both transfers: every rank writes its own shards of the LoRA state and reads its own rows of
the base, in parallel, so what the shared volume (or object store) moves in aggregate sets the time."""

from __future__ import annotations

from dataclasses import dataclass

from rayft.config import Config
from rayft.model.frozen import Held
from rayft.plan.comm import Cluster, Layout
from rayft.plan.memory import base_bytes, plan_memory, stored_bytes
from rayft.plan.structure import Structure

GB = 1e9
# LoRA in fp32 with AdamW: the weights and the two moments in the DCP state, and the adapter gathered beside it.
CHECKPOINT_BYTES_PER_LORA = 4 * 3 + 4
STORAGE_GBYTES_S = 2.0  # assumed aggregate bandwidth of the shared volume, GB/s: `rayft plan --storage-gbps`


@dataclass(frozen=True)
class PreemptionCost:
    checkpoint_bytes: float
    base_bytes: float  # what the restarted ranks read of the frozen base, all together
    storage_bytes_per_s: float
    steps_after_notice: int  # at most: the notice is looked at every `ray.preemption_check_steps`

    @property
    def save_s(self) -> float:
        return self.checkpoint_bytes / self.storage_bytes_per_s

    @property
    def reload_s(self) -> float:
        return self.base_bytes / self.storage_bytes_per_s


def preemption_cost(
    cfg: Config, s: Structure, filed: Held, layout: Layout, cluster: Cluster, storage_gbytes_s: float = STORAGE_GBYTES_S
) -> PreemptionCost:
    """`filed`: how the checkpoint's files hold the base (`rayft.model.build.checkpoint_held`), what a restart
    reads whatever the job then holds in memory."""
    return PreemptionCost(
        checkpoint_bytes=s.lora * CHECKPOINT_BYTES_PER_LORA,
        base_bytes=restart_reads(cfg, s, filed, layout, cluster),
        storage_bytes_per_s=storage_gbytes_s * GB,
        steps_after_notice=cfg.ray.preemption_check_steps,
    )


def restart_reads(cfg: Config, s: Structure, filed: Held, layout: Layout, cluster: Cluster) -> float:
    """The base's bytes the restarted ranks read from files holding it as `filed`: each copy the layout keeps is
    read once, its shards by their ranks (one copy for FSDP, one per group of `shard` workers, the routed experts
    one per group of k)."""
    base = base_bytes(cfg, s, filed)
    if layout.expert_parallel == 1:
        return base * cluster.world / layout.shard
    experts = s.experts + 4 * s.expert_rows if filed == "fp8" else s.experts * stored_bytes(cfg)
    return (base - experts) * cluster.world / layout.shard + experts * cluster.world / layout.expert_parallel


def smallest_group(cfg: Config, s: Structure, gpu: str, held: Held) -> int | None:
    """The fewest workers of an elastic run's range (`ray.num_workers: [min, max]`) whose memory plan fits `gpu`:
    how far the run can shrink and go on; None where no size of the range fits."""
    for workers in cfg.ray.sizes():
        plan = plan_memory(cfg, s, workers, True, gpu, held=held, expert_parallel=cfg.parallel.expert_groups())
        if plan.capacity_gib is None or plan.total_gib <= plan.capacity_gib:
            return workers
    return None


def format_preemption(
    cfg: Config, cost: PreemptionCost, workers: int, step_s: float | None, smallest: int | None = None, gpu: str = ""
) -> str:
    """The lines `rayft plan` prints under the layouts; `smallest`: `smallest_group` of an elastic run."""
    storage = f"{cost.storage_bytes_per_s / GB:g} GB/s of storage"
    if cfg.ray.preemption != "checkpoint" or cfg.train.save_strategy == "no":
        first = "a drain notice saves nothing (ray.preemption: ignore, or no checkpoints): the steps since the last"
        first += " periodic checkpoint are trained again"
    else:
        redo = f" (~{cost.steps_after_notice * step_s:.1f} s)" if step_s is not None else ""
        first = (
            f"a drain notice saves a checkpoint of {cost.checkpoint_bytes / GB:.2f} GB (LoRA, AdamW state, adapter) "
            f"in ~{cost.save_s:.1f} s at {storage}; at most {cost.steps_after_notice} step(s) after the notice"
            f"{redo} are trained again"
        )
    return "\n".join(
        [
            f"preemption: {first}",
            f"  the restart reads {cost.base_bytes / GB:.1f} GB of the frozen base again (every copy the layout "
            f"keeps): ~{cost.reload_s:.0f} s at {storage}, besides the worker group's start",
            f"  {_restart(cfg, workers, smallest, gpu)}",
        ]
    )


def _restart(cfg: Config, workers: int, smallest: int | None, gpu: str) -> str:
    r = cfg.ray
    if not r.elastic:
        return f"the run restarts at its {workers} workers: a cluster without a spare node waits for one"
    said = f"an elastic run (ray.num_workers [{r.fewest_workers}, {r.num_workers}]) goes on with the workers left"
    if smallest is None:
        return f"{said}, but at no size of its range does the memory plan fit a {gpu}"
    accumulation = cfg.train.gradient_accumulation_steps * r.num_workers // smallest
    return (
        f"{said}: the fewest whose memory plan fits a {gpu} are {smallest}, each accumulating {accumulation} "
        "micro-batches a step (the global batch is kept)"
    )
