"""What a rayft checkpoint directory holds, and what the driver reads from it without a model or a process group.

A checkpoint directory holds:
  state/                 torch.distributed.checkpoint shards, written by every rank in parallel: LoRA params and
                         optimizer tensors, plus each rank's JSON document (a uint8 tensor: rayft/train/safe_dcp.py)
                         with progress (step, epoch, batches of the epoch consumed), scheduler, optimizer
                         hyperparameters and its RNG states, so a resumed run continues exactly where this one stood
  adapter/               PEFT adapter (adapter_config.json + adapter_model.safetensors), gathered on rank 0
  trainer_state.json     step, epoch, the metrics reported with it and the id of the run that wrote it
The frozen base model is never written. Preflight checks a `train.resume_from_checkpoint` directory here: DCP state
that its `.metadata` describes completely, of this model and adapter shape.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from rayft import ray_private
from rayft.config import Config, ConfigError, is_uri
from rayft.train import safe_dcp
from rayft.train.run_settings import check_checkpoint_shape
from rayft.train.rundir import RAY_SNAPSHOT, RunDir
from rayft.train.safe_dcp import CheckpointFormatError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

log = logging.getLogger("rayft")

STATE_DIR = "state"
ADAPTER_DIR = "adapter"
TRAINER_STATE = "trainer_state.json"
DAMAGED_SUFFIX = ".damaged"  # a registered checkpoint set aside before a resume: out of `RunDir.checkpoints()`
DOCUMENT = "rayft_doc"  # the per-rank JSON document's key in DCP; checkpoints without it are of an older format


@dataclass
class Progress:
    """Where training stands; the data position is in micro-batches of the current epoch, per rank (or, in a run
    that reads its records in one global order, over all ranks)."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    # Ranks that wrote the checkpoint: a resume on another world size maps the data position and RNGs.
    world_size: int = 1
    # Whether batches_in_epoch counts the global stream's micro-batches (an elastic run's).
    global_order: bool = False


OPTIONAL_PROGRESS = {"global_order"}  # absent from checkpoints written before it existed: the default holds


def read_document(directory: Path, rank: int = 0) -> tuple[dict[str, Any], Progress]:
    """This rank's JSON document (rank 0's where the writer had fewer ranks) and the progress in it; a clear
    CheckpointFormatError for a checkpoint of an older rayft."""
    metadata = check_format(directory)
    key = f"rank{rank}"
    if safe_dcp.stored_tensor_size(metadata, f"{DOCUMENT}.{key}") is None:
        key = "rank0"
    # rank0's document is there (`check_format`), and this rank's where it is the key
    buffer = torch.empty(
        cast(torch.Size, safe_dcp.stored_tensor_size(metadata, f"{DOCUMENT}.{key}")), dtype=torch.uint8
    )
    safe_dcp.load_tensors({DOCUMENT: {key: buffer}}, directory / STATE_DIR)
    document = safe_dcp.from_tensor(buffer)
    saved = document.get("progress", {})
    if not {f.name for f in fields(Progress)} - OPTIONAL_PROGRESS <= set(saved) <= {f.name for f in fields(Progress)}:
        raise CheckpointFormatError(f"{directory}: progress {sorted(saved)} is not rayft's; {_OLDER_FIX}")
    return document, Progress(**saved)


_OLDER_FIX = (
    "this rayft resumes only checkpoints whose state it can read without unpickling: continue that run with the "
    "rayft version that wrote it, or start without train.resume_from_checkpoint"
)


def check_format(directory: Path) -> Metadata:
    """The checkpoint's DCP metadata (read without executing anything); CheckpointFormatError, one line naming
    the directory and the fix, for what is not a rayft checkpoint of this format."""
    state = Path(directory) / STATE_DIR
    if not (state / ".metadata").is_file():
        raise CheckpointFormatError(f"{directory}: no {STATE_DIR}/.metadata, not a complete rayft checkpoint")
    metadata = safe_dcp.read_metadata(state)
    if safe_dcp.stored_tensor_size(metadata, f"{DOCUMENT}.rank0") is None:
        raise CheckpointFormatError(f"{directory}: a checkpoint of an older rayft format; {_OLDER_FIX}")
    return metadata


def reported_metrics(directory: Path) -> dict[str, Any] | None:
    """The metrics a checkpoint was reported with (its trainer_state.json); None when it has none."""
    try:
        metrics = json.loads((directory / TRAINER_STATE).read_text()).get("metrics")
    except (OSError, ValueError, AttributeError):
        return None
    return metrics if isinstance(metrics, dict) else None


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
            log.warning(
                "kept %s/%s: not registered, but not provably written by this run (delete it by hand if it "
                "is not needed)",
                run.uri,
                name,
            )
    return removed


def checkpoint_run_id(run: RunDir, name: str) -> str | None:
    """The run id a checkpoint dir's trainer_state.json records; None when absent or unreadable."""
    try:
        return cast("str | None", json.loads(run.read_file(f"{name}/{TRAINER_STATE}")).get("run_id"))
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


def damage(directory: Path) -> str | None:
    """What keeps a checkpoint's DCP state from loading, as a clause after its path naming the files (None when
    complete). Read here, without a model: a shard missing at load time fails every worker only after the model
    load, and Ray's retries then fail the same way."""
    state = Path(directory) / STATE_DIR
    if not Path(directory).is_dir():
        return "is missing"
    if not (state / ".metadata").is_file():
        return f"is incomplete: no {state}/.metadata"
    try:
        problems = missing_state_files(directory)
    except Exception as e:  # a damaged .metadata: unpickling can fail in many ways
        said = (str(e).splitlines() or [""])[0]
        return f"is damaged: {state}/.metadata cannot be read ({type(e).__name__}: {said})"
    if not problems:
        return None
    more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
    return f"is incomplete: {state}/{problems[0]}{more}, which its .metadata references"


def damaged_newest(run: RunDir) -> tuple[dict[str, str], list[str]]:
    """(each registered checkpoint newer than the newest intact one, with what is wrong with it; every registered
    name, newest first). ConfigError (exit 2) when none is intact. Only local run directories are checked; Ray's
    registry is read through `rayft.ray_private` (a Ray that keeps it elsewhere: unchecked, as before, and said)."""
    if is_uri(run.uri):
        log.info("%s: checkpoints on remote storage are not checked before the run continues from them", run.uri)
        return {}, []
    names = ray_private.registered_checkpoints(run.read_file(RAY_SNAPSHOT))
    if names is None:
        log.warning("%s: this Ray does not read its %s: its checkpoints are not checked", run.uri, RAY_SNAPSHOT)
        return {}, []
    damaged: dict[str, str] = {}
    for name in names:
        found = damage(Path(run.path) / name)
        if found is None:
            break
        damaged[name] = found
    if damaged and len(damaged) == len(names):
        raise ConfigError(_none_intact(run, damaged))
    return damaged, names


def set_aside_damaged(run: RunDir) -> None:
    """Before a run continues from Ray's registry: each damaged registered checkpoint newer than the newest intact
    one (`damaged_newest`) is set aside (renamed `.damaged`, never deleted) and out of the registry, so Ray hands the
    workers the intact one rather than one they die loading."""
    damaged, names = damaged_newest(run)
    if not damaged:
        return
    rewritten = ray_private.unregister_checkpoints(run.read_file(RAY_SNAPSHOT), set(damaged))
    if rewritten is None:  # read a moment ago by the same class: not expected
        raise ConfigError(f"{run.uri}: {RAY_SNAPSHOT} cannot be rewritten by this Ray; {_none_intact(run, damaged)}")
    intact = names[len(damaged)]
    for name, found in damaged.items():  # renamed first: a crash before the rewrite leaves Ray a missing dir
        aside = run.set_aside(name, DAMAGED_SUFFIX) if run.exists(name) else None
        where = f"set aside as {aside} (nothing deleted)" if aside else "dropped from Ray's registry"
        log.warning("%s/%s %s: %s; the run continues from %s", run.uri, name, found, where, intact)
    run.write_file(RAY_SNAPSHOT, rewritten)


def damaged_note(run: RunDir) -> str | None:
    """`rayft validate`'s word on a run directory whose newest registered checkpoints are damaged: what the job will
    do with them (`set_aside_damaged`), said before it does it; ConfigError when none is intact."""
    damaged, names = damaged_newest(run)
    if not damaged:
        return None
    said = "; ".join(f"{run.uri}/{name} {found}" for name, found in damaged.items())
    return (
        f"{said}: the job will set {'it' if len(damaged) == 1 else 'them'} aside (renamed {DAMAGED_SUFFIX}, nothing "
        f"deleted) and continue from {names[len(damaged)]}"
    )


def _none_intact(run: RunDir, damaged: dict[str, str]) -> str:
    """The refusal of a run whose every registered checkpoint is damaged: each named, and the ways on."""
    said = "; ".join(f"{name} {found}" for name, found in damaged.items())
    return (
        f"{run.uri}: no checkpoint Ray registered is intact ({said}); nothing was renamed or deleted: start a new run "
        "(another train.output_dir or ray.name), fresh or with train.resume_from_checkpoint naming an intact "
        "checkpoint (one of these copied complete again)"
    )


def check_resume_source(cfg: Config) -> None:
    """A checkpoint dir is rayft's: DCP training state under state/ (the adapter alone cannot resume), complete,
    and of this model and adapter shape (as its run recorded them)."""
    source = cfg.train.resume_from_checkpoint
    if source in (None, "latest") or is_uri(source):
        return
    path = Path(source).expanduser()
    key = "train.resume_from_checkpoint"
    if not (path / STATE_DIR / ".metadata").is_file():
        found = "does not exist" if not path.exists() else f"has no {STATE_DIR}/.metadata (not a rayft checkpoint)"
        raise ConfigError(
            f"{key}: {path} {found}; give a checkpoint-NNNNNN directory from a run's "
            "storage path, 'latest' to continue this run, or null"
        )
    damaged = damage(path)
    if damaged is not None:
        raise ConfigError(f"{key}: {path} {damaged}; resume from an earlier checkpoint-NNNNNN (or copy this one again)")
    check_checkpoint_shape(cfg, RunDir(str(path.parent)).settings(), str(path))
