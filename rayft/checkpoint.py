"""Training-state checkpoints (sharded DCP, written by every rank) and the gathered PEFT adapter.

A checkpoint directory holds:
  state/                 torch.distributed.checkpoint shards: LoRA params, optimizer, scheduler, progress
  adapter/               PEFT adapter (adapter_config.json + adapter_model.safetensors), gathered on rank 0
  trainer_state.json     step, epoch and the metrics reported with it
The frozen base model is never written.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
    step: int = 0
    epoch: int = 0


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
    """Collective: each rank reads the shards it owns back into the sharded model and optimizer."""
    state = _training_state(model, optimizer, scheduler, Progress())
    dcp.load(state, checkpoint_id=str(directory / STATE_DIR))
    set_model_state_dict(model, state["model"], options=StateDictOptions(ignore_frozen_params=True, strict=False))
    set_optimizer_state_dict(model, optimizer, state["optim"], options=_TRAINABLE)
    scheduler.load_state_dict(state["scheduler"])
    return Progress(**state["progress"])


def _training_state(model, optimizer, scheduler, progress: Progress) -> dict[str, Any]:
    """What DCP writes and reads back: trainable params (sharded), optimizer, scheduler, progress."""
    return {
        "model": get_model_state_dict(model, options=_TRAINABLE),
        "optim": get_optimizer_state_dict(model, optimizer, options=_TRAINABLE),
        "scheduler": scheduler.state_dict(),
        "progress": asdict(progress),
    }


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
