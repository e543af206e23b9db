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
from rayft.train.rundir import RunDir

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


def last_step(run: RunDir) -> int:
    """The last step the run's history records (0 for none)."""
    return max((int(r.get("step", 0)) for r in run.read_metrics()), default=0)


def finished_run(run_uri: str, done: int, total: int | None) -> str:
    """What rerunning a finished run does, and the two ways to train more: said by `rayft validate` (where the
    schedule's length in steps is not known yet: `total` None) and by the job (which knows it)."""
    where = f"step {done} of {total}" if total is not None else f"step {done}, its final adapter written"
    return (
        f"{run_uri} holds a run that finished at {where}: this config trains nothing more (the job ends at once, "
        "keeping its final adapter); to train further raise train.max_steps (or num_train_epochs) with "
        "train.resume: continue, or set ray.name (or train.output_dir) for a new run"
    )


def check_checkpoint_shape(cfg: Config, recorded: dict[str, Any] | None, checkpoint: str) -> None:
    """`train.resume_from_checkpoint` naming another run's checkpoint (whose run recorded `recorded`): a new run
    may change what the run means (new data, a new schedule), never what the checkpoint holds. The model is the
    same where both paths name it or their config.json files say the same (a copy elsewhere)."""
    if recorded is None:
        return
    now = run_settings(cfg)
    changed = [
        key
        for key in SHAPE
        if key in recorded
        and recorded[key] != now[key]
        and not (key == "model.model_name_or_path" and _same_model(recorded[key], now[key]))
    ]
    if changed:
        said = "; ".join(f"{key} {recorded[key]!r} → {now[key]!r}" for key in changed)
        raise ConfigError(
            f"train.resume_from_checkpoint: {checkpoint} holds the state of another model or adapter ({said}): it "
            f"cannot be loaded into this one; restore {', '.join(changed)}, or start without resume_from_checkpoint"
        )


def _same_model(a: str, b: str) -> bool:
    try:
        return (Path(a) / "config.json").read_bytes() == (Path(b) / "config.json").read_bytes()
    except OSError:
        return False
