"""What a worker's run takes from whatever launched it: its rank and device, its data shards, the checkpoint it
continues from, and where finished checkpoints are reported.

In production Ray Train provides all of it (`RayRuntime`); the Trainer itself makes no Ray call. So the same run
can be driven by plain gloo ranks from already tokenized rows (`LocalRuntime`): the numeric properties of training
(exact resume, expert parallelism equal to FSDP, DPO) are then checked without a Ray cluster, while what Ray itself
does (placement, restarts, retention, data sharding, job submission) keeps its tests on a real one.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa
    import ray.train
    import torch

    from rayft.train.sinks import Gauges

# A batch as Ray Data reads it (a dict of numpy arrays) → what the loop trains on.
Collate = Callable[[dict[str, np.ndarray]], Any]


class Shard(Protocol):
    """A rank's share of one split, iterated as Ray Data's `DataIterator` is."""

    def iter_torch_batches(
        self,
        *,
        batch_size: int,
        collate_fn: Callable[[dict[str, np.ndarray]], Any],
        local_shuffle_buffer_size: int | None = None,
        local_shuffle_seed: int | None = None,
    ) -> Iterator[Any]: ...


@dataclass(frozen=True)
class PreemptionNotice:
    """Nodes of the run being drained (a spot reclaim, a scale-down, maintenance): which, the ranks on them, and
    the deadline (UNIX seconds; None when the drain gave none)."""

    nodes: tuple[str, ...]
    ranks: tuple[int, ...]
    deadline: float | None = None

    def describe(self, now: float) -> str:
        left = f"deadline in {self.deadline - now:.0f} s" if self.deadline is not None else "no deadline given"
        return f"node(s) {', '.join(n[:12] for n in self.nodes)} (ranks {list(self.ranks)}) draining, {left}"


class Runtime(Protocol):
    """The launcher's side of a worker's run."""

    rank: int
    device: torch.device

    def shard(self, split: str) -> Shard:
        """This rank's shard of `split` ("train", "validation")."""
        ...

    def own_checkpoint(self) -> ray.train.Checkpoint | None:
        """The run's latest registered checkpoint, when the launcher restarted (or reran) this run."""
        ...

    def report(self, metrics: dict[str, Any], local: Path, name: str, upload: str) -> None:
        """Hand a checkpoint staged in `local` (every rank its own shards) over to storage as `name`."""
        ...

    def gauges(self, run: str, extra: dict[str, str] | None) -> Gauges | None:
        """Where rank 0's metrics are exported as live gauges; None where nothing scrapes them."""
        ...

    def preemption(self) -> PreemptionNotice | None:
        """A drain notice for a node of the run, else None. Collective: every rank asks, equally often."""
        ...


class RayRuntime:
    """A Ray Train worker's runtime: everything from `ray.train`'s context."""

    def __init__(self) -> None:
        import ray.train
        import ray.train.torch

        self.rank = ray.train.get_context().get_world_rank()
        self.device = ray.train.torch.get_device()

    def shard(self, split: str) -> Shard:
        import ray.train

        return cast(Shard, ray.train.get_dataset_shard(split))  # a DataIterator

    def own_checkpoint(self) -> ray.train.Checkpoint | None:
        import ray.train

        return cast("ray.train.Checkpoint | None", ray.train.get_checkpoint())

    def report(self, metrics: dict[str, Any], local: Path, name: str, upload: str) -> None:
        """Ray registers the checkpoint (for retention and resume) only once every rank's copy finished, so a crash
        mid-save leaves the previous checkpoint in charge; with async upload training goes on during the copy."""
        import ray.train
        from ray.train import CheckpointUploadMode

        ray.train.report(
            dict(metrics),
            checkpoint=ray.train.Checkpoint.from_directory(str(local)),
            checkpoint_dir_name=name,
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC if upload == "async" else CheckpointUploadMode.SYNC,
            delete_local_checkpoint_after_upload=True,
        )

    def gauges(self, run: str, extra: dict[str, str] | None) -> Gauges | None:
        from rayft.train.sinks import Gauges

        return Gauges(run, extra)

    def preemption(self) -> PreemptionNotice | None:
        """Ray Train's notice (`ray.train.get_preemption_info`): a barrier across the workers, which agree on it."""
        import ray.train

        info = ray.train.get_preemption_info()
        if info is None:
            return None
        deadline = info.deadline_ms / 1000 if info.deadline_ms else None
        return PreemptionNotice(tuple(info.preempted_node_ids), tuple(info.preempted_ranks), deadline)


@dataclass
class RowShard:
    """A rank's rows held in memory, batched as Ray Data batches them for a collate function (a dict of numpy
    arrays, list columns as object arrays) and shuffled by a seeded permutation when a shuffle buffer is set."""

    rows: pa.Table

    def iter_torch_batches(
        self,
        *,
        batch_size: int,
        collate_fn: Callable[[dict[str, np.ndarray]], Any],
        local_shuffle_buffer_size: int | None = None,
        local_shuffle_seed: int | None = None,
    ) -> Iterator[Any]:
        order = np.arange(self.rows.num_rows)
        if local_shuffle_buffer_size:
            order = np.random.default_rng(local_shuffle_seed).permutation(order)
        columns = {name: self.rows.column(name).to_pylist() for name in self.rows.column_names}
        for start in range(0, len(order), batch_size):
            picked = order[start : start + batch_size]
            batch = {}
            for name, values in columns.items():
                column = np.empty(len(picked), dtype=object)
                column[:] = [np.asarray(values[i]) for i in picked]
                batch[name] = column
            yield collate_fn(batch)


@dataclass
class LocalRuntime:
    """A gloo rank's runtime: shards given as rows, checkpoints copied into the run directory and counted as
    registered at once (what Ray registers is this run's own to resume from: `resume` names one)."""

    rank: int
    device: torch.device
    run_dir: Path
    shards: dict[str, RowShard] = field(default_factory=dict)
    resume: Path | None = None
    reported: list[dict[str, Any]] = field(default_factory=list)
    notices: list[PreemptionNotice | None] = field(default_factory=list)  # what each look finds; then None

    def shard(self, split: str) -> Shard:
        return self.shards[split]

    def own_checkpoint(self) -> ray.train.Checkpoint | None:
        import ray.train

        return ray.train.Checkpoint(str(self.resume)) if self.resume is not None else None

    def report(self, metrics: dict[str, Any], local: Path, name: str, upload: str) -> None:
        import torch.distributed as dist

        target = self.run_dir / name
        target.mkdir(parents=True, exist_ok=True)
        shutil.copytree(local, target, dirs_exist_ok=True)
        shutil.rmtree(local)
        dist.barrier()  # registered once every rank's shards are in place, as Ray registers it
        self.reported.append({**metrics, "checkpoint": name})

    def gauges(self, run: str, extra: dict[str, str] | None) -> Gauges | None:
        return None

    def preemption(self) -> PreemptionNotice | None:
        return self.notices.pop(0) if self.notices else None
