"""The settings that make a run what it is, recorded in its run directory and compared before it is continued.

A config pointed at a run directory that already holds checkpoints continues that run (Ray resumes from its latest
checkpoint). That is right for a rerun of the same config after a crash, and wrong when the config changed: the
run would go on with its own weights and schedule position but the new data or learning rate, or (another model,
another LoRA shape) fail after the cluster started with a size mismatch. So each run records the settings below
when it starts, and both `rayft validate` and the job compare them with the config before anything starts:
- `SHAPE`: the checkpoint cannot be loaded otherwise: refused, always.
- `MEANING`: the run would mean something else: refused unless `train.resume: continue` says to go on anyway
  (extending a finished run by raising `train.max_steps`, say), and then listed in the job log.
Other settings (cadence of logging, evaluation and checkpoints, the cluster's size and layout, trackers) may change
between the runs of one training.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rayft.config import Config, ConfigError

log = logging.getLogger("rayft")

SHAPE = (
    "model.model_name_or_path",
    "lora.r",
    "lora.target_modules",
    "lora.target_experts",
    "lora.use_dora",
    "lora.modules_to_save",
    "lora.bias",
    "train.objective",
)
MEANING = (
    "lora.lora_alpha",
    "lora.use_rslora",
    "data.dataset_name_or_path",
    "data.dataset_config_name",
    "data.max_length",
    "data.packing",
    "train.num_train_epochs",
    "train.max_steps",
    "train.per_device_train_batch_size",
    "train.gradient_accumulation_steps",
    "train.learning_rate",
    "train.lr_scheduler_type",
    "train.warmup_ratio",
    "train.warmup_steps",
    "train.weight_decay",
    "train.seed",
)


def run_settings(cfg: Config) -> dict[str, Any]:
    """`section.key` → value of every compared setting; local paths made absolute (a rerun from another directory
    names the same files)."""
    settings = {}
    for key in (*SHAPE, *MEANING):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if key.endswith("_name_or_path") and value and Path(value).expanduser().exists():
            value = str(Path(value).expanduser().resolve())
        settings[key] = list(value) if isinstance(value, tuple) else value
    return settings


def check_continuation(cfg: Config, recorded: dict[str, Any] | None, run_uri: str) -> None:
    """Refuse (or with `train.resume: continue`, log) the differences between the run `run_uri` holds, whose
    settings are `recorded` (None: recorded by an older rayft, nothing to compare), and the config."""
    if recorded is None:
        return
    now = run_settings(cfg)
    changed = [key for key in (*SHAPE, *MEANING) if key in recorded and recorded[key] != now[key]]
    if not changed:
        return
    said = "; ".join(f"{key} {recorded[key]!r} → {now[key]!r}" for key in changed)
    shape = [key for key in changed if key in SHAPE]
    if shape:
        raise ConfigError(
            f"{run_uri} holds checkpoints of another model or adapter ({said}): its checkpoints cannot be loaded "
            f"into this one; set ray.name (or train.output_dir) for a new run, or restore {', '.join(shape)}"
        )
    if cfg.train.resume != "continue":
        raise ConfigError(
            f"{run_uri} holds a run of other settings ({said}), which this config would continue from its latest "
            "checkpoint: set train.resume: continue to go on with the new settings, or ray.name (or "
            "train.output_dir) for a new run"
        )
    log.warning("train.resume: continue: %s goes on with changed settings: %s", run_uri, said)
