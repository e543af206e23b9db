"""What a preemption costs a run, for `rayft plan`: the checkpoint a drain notice saves at once, the steps trained
after the notice that the restart trains again, and the restart's reading of the frozen base.

Storage is the bound on both transfers: every rank writes its own shards of the LoRA state and reads its own rows of
the base, in parallel, so what the shared volume (or object store) moves in aggregate sets the time."""

from __future__ import annotations

from dataclasses import dataclass

from rayft.config import Config
from rayft.plan.comm import Cluster, Layout
from rayft.plan.memory import base_bytes, stored_bytes
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
    cfg: Config, s: Structure, fp8: bool, layout: Layout, cluster: Cluster, storage_gbytes_s: float = STORAGE_GBYTES_S
) -> PreemptionCost:
    return PreemptionCost(
        checkpoint_bytes=s.lora * CHECKPOINT_BYTES_PER_LORA,
        base_bytes=restart_reads(cfg, s, fp8, layout, cluster),
        storage_bytes_per_s=storage_gbytes_s * GB,
        steps_after_notice=cfg.ray.preemption_check_steps,
    )


def restart_reads(cfg: Config, s: Structure, fp8: bool, layout: Layout, cluster: Cluster) -> float:
    """The base's bytes the restarted ranks read: each copy the layout keeps is read once, its shards by their
    ranks (one copy for FSDP, one per group of `shard` workers, the routed experts one per group of k)."""
    base = base_bytes(cfg, s, fp8)
    if layout.expert_parallel == 1:
        return base * cluster.world / layout.shard
    experts = s.experts + 4 * s.expert_rows if fp8 else s.experts * stored_bytes(cfg)
    return (base - experts) * cluster.world / layout.shard + experts * cluster.world / layout.expert_parallel


def format_preemption(cfg: Config, cost: PreemptionCost, workers: int, step_s: float | None) -> str:
    """The lines `rayft plan` prints under the layouts."""
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
            f"  the run restarts at its {workers} workers: a cluster without a spare node waits for one",
        ]
    )
