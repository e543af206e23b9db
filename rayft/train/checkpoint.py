"""Training-state checkpoints (sharded DCP, written by every rank), the gathered PEFT adapter, and the manager
that stages, reports, resumes and tidies them. What a checkpoint directory holds, and what can be read from it
without a model, is `rayft.train.checkpoint_dir`.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import peft
import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import PreTrainedTokenizerBase

from rayft.model.files import ADAPTER_WEIGHTS
from rayft.model.lora import adapter_file_keys
from rayft.parallel.expert import is_expert_lora
from rayft.parallel.layout import ParallelDims
from rayft.train import safe_dcp
from rayft.train.atomic import replace_dir, staging_dir, write_text_atomic
from rayft.train.checkpoint_dir import (
    ADAPTER_DIR,
    DOCUMENT,
    STATE_DIR,
    TRAINER_STATE,
    Progress,
    read_document,
    remove_unregistered,
    reported_metrics,
)
from rayft.train.rundir import RunDir, checkpoint_dir_name
from rayft.train.runtime import Runtime
from rayft.train.spool import checkpoint_spool
from rayft.train.steps import StepPlan

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType
    from torch.optim.lr_scheduler import LRScheduler

log = logging.getLogger("rayft")

_TRAINABLE = StateDictOptions(ignore_frozen_params=True)


def save_checkpoint(
    directory: Path,
    model: peft.PeftModel,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    progress: Progress,
    metrics: dict[str, Any],
    layout: ParallelDims,
    run_id: str | None = None,
) -> None:
    """Collective: every rank writes its own shards and document; rank 0 adds the adapter and trainer_state.json
    (with the id of the run that wrote it: only that run's housekeeping may ever delete the directory). `layout`:
    the one the model was built on."""
    state = _training_state(model, optimizer, scheduler, progress)
    if (ep := layout.expert_parallel) is not None:
        ep.to_checkpoint(state)
    tensors, document = safe_dcp.split(state)
    tensors[DOCUMENT] = {f"rank{dist.get_rank()}": safe_dcp.to_tensor(document)}
    # dcp.save is public: torch re-exports it without an __all__, which strict mypy does not count as an export
    dcp.save(tensors, checkpoint_id=str(directory / STATE_DIR))  # type: ignore[attr-defined]
    save_adapter(model, directory / ADAPTER_DIR, layout)
    if dist.get_rank() == 0:
        trainer_state = {**asdict(progress), "metrics": metrics, "run_id": run_id}
        write_text_atomic(directory / TRAINER_STATE, json.dumps(trainer_state, indent=2))


def load_checkpoint(
    directory: Path,
    model: peft.PeftModel,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    layout: ParallelDims,
) -> Progress:
    """Collective: each rank reads the shards it owns back into the sharded model (built on `layout`) and optimizer.

    DCP reshards on load, so a checkpoint written by N ranks resumes on M. Each rank gets back its own RNG
    states when the writer had that rank; otherwise it keeps its seeded ones (the run is then no longer
    bit-for-bit the same, which a different world size never is anyway). Nothing is unpickled.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    document, progress = read_document(directory, rank)
    ep = layout.expert_parallel
    target = _training_state(model, optimizer, scheduler, progress)
    if ep is not None:
        ep.to_checkpoint(target)
    tensors, _ = safe_dcp.split(target)
    if rank >= progress.world_size:  # no RNG of this rank in the checkpoint: keep the seeded one
        del tensors["rng"]
        document.pop("rng", None)
    safe_dcp.load_tensors(tensors, directory / STATE_DIR)
    state = safe_dcp.join(document, tensors)
    if ep is not None:
        ep.from_checkpoint(state)
    set_model_state_dict(model, state["model"], options=StateDictOptions(ignore_frozen_params=True, strict=False))
    set_optimizer_state_dict(model, optimizer, state["optim"], options=_TRAINABLE)
    scheduler.load_state_dict(state["scheduler"])
    if "rng" in state:
        _set_rng_state(state["rng"][f"rank{rank}"])
    return progress


def _training_state(
    model: peft.PeftModel, optimizer: torch.optim.Optimizer, scheduler: LRScheduler, progress: Progress
) -> dict[str, Any]:
    """What DCP writes and reads back. RNG states differ per rank, so each rank has its own key."""
    return {
        "model": get_model_state_dict(model, options=_TRAINABLE),
        "optim": get_optimizer_state_dict(model, optimizer, options=_TRAINABLE),
        "scheduler": scheduler.state_dict(),
        "progress": asdict(progress),
        "rng": {f"rank{dist.get_rank()}": _rng_state()},
    }


def _rng_state() -> dict[str, Any]:
    """Every generator a step can draw from: LoRA dropout (torch, per device) and anything in Python/NumPy."""
    # the legacy tuple (numpy's hint for the default `legacy=True` also allows the dict of `legacy=False`)
    name, keys, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (name, keys.tolist(), pos, has_gauss, cached),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_adapter(
    model: peft.PeftModel, directory: Path, layout: ParallelDims, tokenizer: PreTrainedTokenizerBase | None = None
) -> None:
    """Collective: gather every shard of every LoRA tensor (never the frozen base) of the model built on `layout`
    and write PEFT format."""
    full = cast(  # the trainable parameters: tensors
        dict[str, torch.Tensor],
        get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        ),
    )
    if (ep := layout.expert_parallel) is not None:  # each worker's experts' LoRA, made whole in PEFT's layout
        full = ep.gather_adapter(model, full)
    if dist.get_rank() == 0:
        model.save_pretrained(str(directory), state_dict=full, safe_serialization=True, save_embedding_layers=False)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
    dist.barrier()


def publish_adapter(
    model: peft.PeftModel, directory: Path, layout: ParallelDims, tokenizer: PreTrainedTokenizerBase | None = None
) -> None:
    """Collective: `save_adapter` into a staging dir beside `directory`, swapped in whole by rank 0, so a crash
    mid-write never leaves a half-new adapter under the final name."""
    staged = staging_dir(directory) if dist.get_rank() == 0 else directory
    try:
        save_adapter(model, staged, layout, tokenizer)
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(staged, ignore_errors=True)
        raise
    if dist.get_rank() == 0:
        replace_dir(staged, directory)
    dist.barrier()


def load_adapter_weights(model: peft.PeftModel, directory: Path, layout: ParallelDims) -> None:
    """A saved PEFT adapter into the (sharded) LoRA model built from its config on `layout`: every rank reads the
    small file whole and keeps its own shards of it."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(directory) / ADAPTER_WEIGHTS))
    ours = model.state_dict()
    places = adapter_file_keys(model)
    ep = layout.expert_parallel
    state: dict[str, ValueType] = {}
    for key, tensor in saved.items():
        target = places.get(key)
        if target is None:
            raise ValueError(f"{directory}: {key} has no place in this model (an adapter for another base?)")
        if ep is not None and is_expert_lora(target):
            tensor = ep.local_part(target, tensor)
        state[target] = tensor.to(ours[target].dtype)
    missing = [k for k in places.values() if k not in state]
    if missing:
        raise ValueError(f"{directory}: the adapter has no {missing[0]} (and {len(missing) - 1} more)")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


@dataclass
class TrainState:
    """The stateful parts a checkpoint holds (the frozen base is rebuilt from the hub, never saved)."""

    model: peft.PeftModel
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    progress: Progress


class CheckpointManager:
    """One worker's side of the run's checkpoints: resume (Ray's own checkpoint first, else an explicit one),
    stage shards on local disk and report them to Ray, and tidy up what provably nobody can resume from.

    Housekeeping never guesses. It deletes a checkpoint directory only when Ray handed this run a checkpoint to
    resume from (so Ray's registry was read), the directory is newer than that checkpoint (Ray registers in
    step order, so it was never registered), and its trainer_state.json carries this run's id. A fresh start
    deletes nothing.
    """

    def __init__(
        self, run: RunDir, run_id: str | None, run_name: str, upload: str, runtime: Runtime, layout: ParallelDims
    ):
        self.run, self.run_id, self.upload, self.runtime = run, run_id, upload, runtime
        self.layout = layout  # the run's, which the model is built on
        self.rank = runtime.rank
        self.spool = checkpoint_spool(run_name, run_id)
        self.stall_s = 0.0  # what saving cost this attempt: seconds training stood still
        self.last_saved = -1
        self.resumed_metrics: dict[str, Any] | None = None  # what this run reported with the checkpoint it resumes

    def restore(self, explicit: str | None, state: TrainState, plan: StepPlan, world_size: int, accum: int) -> bool:
        """Continue from this run's latest registered checkpoint (a restart after a failure, or the same job run
        again), else from `train.resume_from_checkpoint`, else start fresh. True when something was loaded."""
        own = self.runtime.own_checkpoint()
        checkpoint = own or (ray.train.Checkpoint(explicit) if explicit else None)
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                progress = load_checkpoint(Path(d), state.model, state.optimizer, state.scheduler, self.layout)
                if own is not None and self.rank == 0:
                    self.resumed_metrics = reported_metrics(Path(d))
            log.info(
                "resumed from %s: step %d, epoch %d, %d batches into the epoch (written by %d workers)",
                checkpoint.path,
                progress.step,
                progress.epoch,
                progress.batches_in_epoch,
                progress.world_size,
            )
            state.progress = remap_position(progress, plan, world_size, accum)
        # A resumed run's starting point is a checkpoint already: never write (and register) it a second time.
        self.last_saved = state.progress.step
        if own is not None and self.rank == 0:
            for name in remove_unregistered(self.run, self.run_id, state.progress.step):
                log.warning(
                    "removed %s/%s: written by this run, never registered by Ray (a save that failed)",
                    self.run.uri,
                    name,
                )
        return checkpoint is not None

    def save(self, state: TrainState, metrics: dict[str, Any]) -> None:
        """Every rank writes its shards to local disk, then the runtime (Ray) copies them into one step-named dir
        on storage and registers it (`Runtime.report`)."""
        started = time.perf_counter()
        name = checkpoint_dir_name(state.progress.step)
        local = self.spool / name
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        try:
            s = state
            save_checkpoint(local, s.model, s.optimizer, s.scheduler, s.progress, metrics, self.layout, self.run_id)
            written = time.perf_counter() - started
            self.runtime.report(metrics, local, name, self.upload)
        except BaseException:  # never handed over: nothing will upload or delete these shards
            shutil.rmtree(local, ignore_errors=True)
            raise
        stalled = time.perf_counter() - started
        log.info("%s: training paused %.2f s (state written in %.2f s, %s upload)", name, stalled, written, self.upload)
        self.stall_s += stalled
        self.last_saved = state.progress.step

    def close(self) -> None:
        """Drop the spool once Ray has uploaded (and so deleted) every staged checkpoint; never mid-upload."""
        for empty in (self.spool, self.spool.parent):
            try:
                empty.rmdir()
            except OSError:
                return


def remap_position(progress: Progress, plan: StepPlan, world_size: int, accum: int) -> Progress:
    """Express the data position for this group's size, this run's way of reading (split or global order) and the
    epoch's length. A global-order position means the same at every size; any other change is mapped by share of
    the epoch. Either way the run continues at a step boundary of its own: at or before the position, never past
    a record not trained on."""
    written = (progress.world_size, progress.global_order)
    other_size = progress.world_size != world_size and not plan.global_order
    remapped = progress.global_order != plan.global_order or other_size
    if remapped:
        consumed = progress.batches_in_epoch * (1 if progress.global_order else progress.world_size)  # all ranks'
        progress.batches_in_epoch = consumed if plan.global_order else consumed // world_size
    progress.world_size, progress.global_order = world_size, plan.global_order
    if progress.batches_in_epoch >= plan.micro_batches_per_epoch:
        progress.epoch += 1
        progress.batches_in_epoch = 0
    per_step = plan.global_micro_per_step or accum
    uneven = progress.batches_in_epoch % per_step  # written with steps of another size (another maximum, accumulation)
    progress.batches_in_epoch -= uneven
    if remapped:
        log.warning(
            "checkpoint written by %d workers%s, resuming on %d%s: continuing after ~%d of %d batches of epoch %d "
            "(same data share; not bit-identical to an uninterrupted run)",
            written[0],
            " reading in global order" if written[1] else "",
            world_size,
            " in global order" if plan.global_order else "",
            progress.batches_in_epoch,
            plan.micro_batches_per_epoch,
            progress.epoch,
        )
    elif uneven:
        log.warning(
            "checkpoint's data position %d is not a whole number of this run's steps of %d micro-batches: "
            "continuing from the step before it",
            progress.batches_in_epoch + uneven,
            per_step,
        )
    return progress
