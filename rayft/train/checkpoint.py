"""Training-state checkpoints (sharded DCP, written by every rank) and the gathered PEFT adapter.

A checkpoint directory holds:
  state/                 torch.distributed.checkpoint shards, written by every rank in parallel: LoRA params,
                         optimizer, scheduler, progress (step, epoch, batches of the epoch consumed) and each
                         rank's RNG states, so a resumed run continues exactly where this one stood
  adapter/               PEFT adapter (adapter_config.json + adapter_model.safetensors), gathered on rank 0
  trainer_state.json     step, epoch and the metrics reported with it
The frozen base model is never written.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import peft
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

STATE_DIR = "state"
ADAPTER_DIR = "adapter"
TRAINER_STATE = "trainer_state.json"

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
) -> None:
    """Collective: every rank writes its own shards; rank 0 adds the adapter and trainer_state.json."""
    dcp.save(_training_state(model, optimizer, scheduler, progress), checkpoint_id=str(directory / STATE_DIR))
    save_adapter(model, directory / ADAPTER_DIR)
    if dist.get_rank() == 0:
        (directory / TRAINER_STATE).write_text(json.dumps({**asdict(progress), "metrics": metrics}, indent=2))


def load_checkpoint(
    directory: Path, model: peft.PeftModel, optimizer: torch.optim.Optimizer, scheduler: Any
) -> Progress:
    """Collective: each rank reads the shards it owns back into the sharded model and optimizer.

    DCP reshards on load, so a checkpoint written by N ranks resumes on M. Each rank gets back its own RNG
    states when the writer had that rank; otherwise it keeps its seeded ones (the run is then no longer
    bit-for-bit the same, which a different world size never is anyway).
    """
    checkpoint_id = str(directory / STATE_DIR)
    saved = {"progress": asdict(Progress())}
    dcp.load(saved, checkpoint_id=checkpoint_id)
    progress = Progress(**saved["progress"])

    state = _training_state(model, optimizer, scheduler, progress)
    rank = dist.get_rank()
    if rank >= progress.world_size:
        del state["rng"]
    dcp.load(state, checkpoint_id=checkpoint_id)
    set_model_state_dict(model, state["model"], options=StateDictOptions(ignore_frozen_params=True, strict=False))
    set_optimizer_state_dict(model, optimizer, state["optim"], options=_TRAINABLE)
    scheduler.load_state_dict(state["scheduler"])
    if "rng" in state:
        _set_rng_state(state["rng"][f"rank{rank}"])
    return progress


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
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_adapter(model: peft.PeftModel, directory: Path, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
    """Collective: gather every shard of every LoRA tensor (never the frozen base) and write PEFT format."""
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    )
    if dist.get_rank() == 0:
        model.save_pretrained(str(directory), state_dict=full, safe_serialization=True, save_embedding_layers=False)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
    dist.barrier()


ADAPTER_WEIGHTS = "adapter_model.safetensors"


def load_adapter_weights(model: peft.PeftModel, directory: Path) -> None:
    """A saved PEFT adapter into the (sharded) LoRA model built from its config: every rank reads the small file
    whole and keeps its own shards of it."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(directory) / ADAPTER_WEIGHTS))
    name = model.active_adapter
    ours = model.state_dict()
    state = {}
    for key, tensor in saved.items():
        # PEFT files leave out the adapter's name: ...q_proj.lora_A.weight is ...q_proj.lora_A.default.weight here
        target = key.replace(".lora_A.", f".lora_A.{name}.").replace(".lora_B.", f".lora_B.{name}.")
        if target not in ours:
            raise ValueError(f"{directory}: {key} has no place in this model (an adapter for another base?)")
        state[target] = tensor.to(ours[target].dtype)
    missing = [k for k in ours if ".lora_" in k and k not in state]
    if missing:
        raise ValueError(f"{directory}: the adapter has no {missing[0]} (and {len(missing) - 1} more)")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def missing_state_files(directory: Path) -> list[str]:
    """What a checkpoint's DCP state lacks: each file its `.metadata` references, missing or shorter than the
    byte ranges recorded for it ("name (missing)" / "name (N of M bytes)"). Empty when complete. Raises ValueError
    when `.metadata` itself cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    state = Path(directory) / STATE_DIR
    metadata = FileSystemReader(str(state)).read_metadata()
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
