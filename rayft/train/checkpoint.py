"""Training-state checkpoints (sharded DCP, written by every rank), the gathered PEFT adapter, and the manager
that stages, reports, resumes and tidies them.

A checkpoint directory holds:
  state/                 torch.distributed.checkpoint shards, written by every rank in parallel: LoRA params and
                         optimizer tensors, plus each rank's JSON document (a uint8 tensor: rayft/train/safe_dcp.py)
                         with progress (step, epoch, batches of the epoch consumed), scheduler, optimizer
                         hyperparameters and its RNG states, so a resumed run continues exactly where this one stood
  adapter/               PEFT adapter (adapter_config.json + adapter_model.safetensors), gathered on rank 0
  trainer_state.json     step, epoch, the metrics reported with it and the id of the run that wrote it
The frozen base model is never written.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

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

from rayft.model.lora import adapter_file_keys
from rayft.parallel.expert import ExpertParallel, is_expert_lora
from rayft.train import safe_dcp
from rayft.train.atomic import replace_dir, staging_dir, write_text_atomic
from rayft.train.rundir import RunDir, checkpoint_dir_name
from rayft.train.runtime import Runtime
from rayft.train.safe_dcp import CheckpointFormatError
from rayft.train.spool import checkpoint_spool

log = logging.getLogger("rayft")

STATE_DIR = "state"
ADAPTER_DIR = "adapter"
TRAINER_STATE = "trainer_state.json"
DOCUMENT = "rayft_doc"  # the per-rank JSON document's key in DCP; checkpoints without it are of an older format

_TRAINABLE = StateDictOptions(ignore_frozen_params=True)


@dataclass
class Progress:
    """Where training stands; the data position is in micro-batches of the current epoch, per rank."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    # Ranks that wrote the checkpoint: a resume on another world size maps the data position and RNGs.
    world_size: int = 1


def save_checkpoint(
    directory: Path,
    model: peft.PeftModel,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    progress: Progress,
    metrics: dict[str, Any],
    run_id: str | None = None,
) -> None:
    """Collective: every rank writes its own shards and document; rank 0 adds the adapter and trainer_state.json
    (with the id of the run that wrote it: only that run's housekeeping may ever delete the directory)."""
    state = _training_state(model, optimizer, scheduler, progress)
    if (ep := expert_layout(model)) is not None:
        ep.to_checkpoint(state)
    tensors, document = safe_dcp.split(state)
    tensors[DOCUMENT] = {f"rank{dist.get_rank()}": safe_dcp.to_tensor(document)}
    dcp.save(tensors, checkpoint_id=str(directory / STATE_DIR))
    save_adapter(model, directory / ADAPTER_DIR)
    if dist.get_rank() == 0:
        trainer_state = {**asdict(progress), "metrics": metrics, "run_id": run_id}
        write_text_atomic(directory / TRAINER_STATE, json.dumps(trainer_state, indent=2))


def load_checkpoint(
    directory: Path, model: peft.PeftModel, optimizer: torch.optim.Optimizer, scheduler: Any
) -> Progress:
    """Collective: each rank reads the shards it owns back into the sharded model and optimizer.

    DCP reshards on load, so a checkpoint written by N ranks resumes on M. Each rank gets back its own RNG
    states when the writer had that rank; otherwise it keeps its seeded ones (the run is then no longer
    bit-for-bit the same, which a different world size never is anyway). Nothing is unpickled.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    document, progress = read_document(directory, rank)
    ep = expert_layout(model)
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


def read_document(directory: Path, rank: int = 0) -> tuple[dict[str, Any], Progress]:
    """This rank's JSON document (rank 0's where the writer had fewer ranks) and the progress in it; a clear
    CheckpointFormatError for a checkpoint of an older rayft."""
    metadata = check_format(directory)
    key = f"rank{rank}"
    if safe_dcp.stored_tensor_size(metadata, f"{DOCUMENT}.{key}") is None:
        key = "rank0"
    buffer = torch.empty(safe_dcp.stored_tensor_size(metadata, f"{DOCUMENT}.{key}"), dtype=torch.uint8)
    safe_dcp.load_tensors({DOCUMENT: {key: buffer}}, directory / STATE_DIR)
    document = safe_dcp.from_tensor(buffer)
    saved = document.get("progress", {})
    if set(saved) != {f.name for f in fields(Progress)}:
        raise CheckpointFormatError(f"{directory}: progress {sorted(saved)} is not rayft's; {_OLDER_FIX}")
    return document, Progress(**saved)


_OLDER_FIX = (
    "this rayft resumes only checkpoints whose state it can read without unpickling: continue that run with the "
    "rayft version that wrote it, or start without train.resume_from_checkpoint"
)


def check_format(directory: Path):
    """The checkpoint's DCP metadata (read without executing anything); CheckpointFormatError, one line naming
    the directory and the fix, for what is not a rayft checkpoint of this format."""
    state = Path(directory) / STATE_DIR
    if not (state / ".metadata").is_file():
        raise CheckpointFormatError(f"{directory}: no {STATE_DIR}/.metadata, not a complete rayft checkpoint")
    metadata = safe_dcp.read_metadata(state)
    if safe_dcp.stored_tensor_size(metadata, f"{DOCUMENT}.rank0") is None:
        raise CheckpointFormatError(f"{directory}: a checkpoint of an older rayft format; {_OLDER_FIX}")
    return metadata


def expert_layout(model) -> ExpertParallel | None:
    """The expert-parallel layout the model was built with (`rayft.parallel.expert`), None for FSDP only."""
    return getattr(model, "expert_parallel", None)


def _training_state(model, optimizer, scheduler, progress: Progress) -> dict[str, Any]:
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
    name, keys, pos, has_gauss, cached = np.random.get_state()
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


def save_adapter(model: peft.PeftModel, directory: Path, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
    """Collective: gather every shard of every LoRA tensor (never the frozen base) and write PEFT format."""
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    )
    if (ep := expert_layout(model)) is not None:  # each worker's experts' LoRA, made whole in PEFT's layout
        full = ep.gather_adapter(model, full)
    if dist.get_rank() == 0:
        model.save_pretrained(str(directory), state_dict=full, safe_serialization=True, save_embedding_layers=False)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
    dist.barrier()


def publish_adapter(model: peft.PeftModel, directory: Path, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
    """Collective: `save_adapter` into a staging dir beside `directory`, swapped in whole by rank 0, so a crash
    mid-write never leaves a half-new adapter under the final name."""
    staged = staging_dir(directory) if dist.get_rank() == 0 else directory
    try:
        save_adapter(model, staged, tokenizer)
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(staged, ignore_errors=True)
        raise
    if dist.get_rank() == 0:
        replace_dir(staged, directory)
    dist.barrier()


ADAPTER_WEIGHTS = "adapter_model.safetensors"


def load_adapter_weights(model: peft.PeftModel, directory: Path) -> None:
    """A saved PEFT adapter into the (sharded) LoRA model built from its config: every rank reads the small file
    whole and keeps its own shards of it."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(directory) / ADAPTER_WEIGHTS))
    ours = model.state_dict()
    places = adapter_file_keys(model)
    state = {}
    for key, tensor in saved.items():
        target = places.get(key)
        if target is None:
            raise ValueError(f"{directory}: {key} has no place in this model (an adapter for another base?)")
        if (ep := expert_layout(model)) is not None and is_expert_lora(target):
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
    scheduler: Any
    progress: Progress


class CheckpointManager:
    """One worker's side of the run's checkpoints: resume (Ray's own checkpoint first, else an explicit one),
    stage shards on local disk and report them to Ray, and tidy up what provably nobody can resume from.

    Housekeeping never guesses. It deletes a checkpoint directory only when Ray handed this run a checkpoint to
    resume from (so Ray's registry was read), the directory is newer than that checkpoint (Ray registers in
    step order, so it was never registered), and its trainer_state.json carries this run's id. A fresh start
    deletes nothing.
    """

    def __init__(self, run: RunDir, run_id: str | None, run_name: str, upload: str, runtime: Runtime):
        self.run, self.run_id, self.upload, self.runtime = run, run_id, upload, runtime
        self.rank = runtime.rank
        self.spool = checkpoint_spool(run_name, run_id)
        self.stall_s = 0.0  # what saving cost this attempt: seconds training stood still
        self.last_saved = -1
        self.resumed_metrics: dict[str, Any] | None = None  # what this run reported with the checkpoint it resumes

    def restore(self, explicit: str | None, state: TrainState, plan, accum: int) -> bool:
        """Continue from this run's latest registered checkpoint (a restart after a failure, or the same job run
        again), else from `train.resume_from_checkpoint`, else start fresh. True when something was loaded."""
        own = self.runtime.own_checkpoint()
        checkpoint = own or (ray.train.Checkpoint(explicit) if explicit else None)
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                progress = load_checkpoint(Path(d), state.model, state.optimizer, state.scheduler)
                if own is not None and self.rank == 0:
                    self.resumed_metrics = reported_metrics(Path(d))
            log.info(
                "resumed from %s: step %d, epoch %d, %d batches into the epoch (written by %d workers)",
                checkpoint.path, progress.step, progress.epoch, progress.batches_in_epoch, progress.world_size,
            )  # fmt: skip
            state.progress = remap_position(progress, plan, accum)
        # A resumed run's starting point is a checkpoint already: never write (and register) it a second time.
        self.last_saved = state.progress.step
        if own is not None and self.rank == 0:
            for name in remove_unregistered(self.run, self.run_id, state.progress.step):
                log.warning("removed %s/%s: written by this run, never registered by Ray (a save that failed)",
                            self.run.uri, name)  # fmt: skip
        return checkpoint is not None

    def save(self, state: TrainState, metrics: dict[str, Any]) -> None:
        """Every rank writes its shards to local disk, then the runtime (Ray) copies them into one step-named dir
        on storage and registers it (`Runtime.report`)."""
        started = time.perf_counter()
        name = checkpoint_dir_name(state.progress.step)
        local = self.spool / name
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        save_checkpoint(local, state.model, state.optimizer, state.scheduler, state.progress, metrics, self.run_id)
        written = time.perf_counter() - started
        self.runtime.report(metrics, local, name, self.upload)
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


def reported_metrics(directory: Path) -> dict[str, Any] | None:
    """The metrics a checkpoint was reported with (its trainer_state.json); None when it has none."""
    try:
        metrics = json.loads((directory / TRAINER_STATE).read_text()).get("metrics")
    except (OSError, ValueError, AttributeError):
        return None
    return metrics if isinstance(metrics, dict) else None


def remap_position(progress: Progress, plan, accum: int) -> Progress:
    """Express the data position for this run's world size and epoch length."""
    if progress.world_size != plan.world_size:
        consumed = progress.batches_in_epoch * progress.world_size // plan.world_size
        log.warning(
            "checkpoint written by %d workers, resuming on %d: continuing after ~%d of %d batches of epoch %d "
            "(same data share; not bit-identical to an uninterrupted run)",
            progress.world_size, plan.world_size, consumed, plan.micro_batches_per_epoch, progress.epoch,
        )  # fmt: skip
        progress.batches_in_epoch = consumed - consumed % accum
        progress.world_size = plan.world_size
    if progress.batches_in_epoch >= plan.micro_batches_per_epoch:
        progress.epoch += 1
        progress.batches_in_epoch = 0
    return progress


def remove_unregistered(run: RunDir, run_id: str | None, resumed_step: int) -> list[str]:
    """Delete the checkpoint dirs newer than the registered one being resumed from that this run wrote; keep
    (and name) those that cannot be proven to be this run's."""
    if run_id is None:
        return []
    removed = []
    for step, name in sorted(run.checkpoints().items()):
        if step <= resumed_step:
            continue
        if checkpoint_run_id(run, name) == run_id:
            run.delete_dir(name)
            removed.append(name)
        else:
            log.warning("kept %s/%s: not registered, but not provably written by this run (delete it by hand if it "
                        "is not needed)", run.uri, name)  # fmt: skip
    return removed


def checkpoint_run_id(run: RunDir, name: str) -> str | None:
    """The run id a checkpoint dir's trainer_state.json records; None when absent or unreadable."""
    try:
        return json.loads(run.read_file(f"{name}/{TRAINER_STATE}")).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def missing_state_files(directory: Path) -> list[str]:
    """What a checkpoint's DCP state lacks: each file its `.metadata` references, missing or shorter than the
    byte ranges recorded for it ("name (missing)" / "name (N of M bytes)"). Empty when complete. Raises ValueError
    when `.metadata` itself cannot be read."""
    state = Path(directory) / STATE_DIR
    metadata = safe_dcp.read_metadata(state)  # never unpickles anything but DCP's own metadata classes
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        path = state / name
        if not path.is_file():
            problems.append(f"{name} (missing)")
        elif path.stat().st_size < size:
            problems.append(f"{name} ({path.stat().st_size:,} of {size:,} bytes)")
    return problems
