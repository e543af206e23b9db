"""Checks that need the filesystem but no cluster: run by `rayft validate` and before every training run."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rayft.config import Config, ConfigError, is_uri
from rayft.data.records import RecordFormat, record_format
from rayft.data.sources import SplitSource, resolve_splits
from rayft.data.tokenizer import TOKENIZER_FILES, TokenizerFacts, has_tokenizer, tokenizer_facts, tokenizer_path
from rayft.model.lora import LoraTargets
from rayft.plan import Structure, structure
from rayft.train.checkpoint import STATE_DIR


@dataclass
class Preflight:
    train: SplitSource
    validation: SplitSource | None
    records: RecordFormat
    tokenizer: TokenizerFacts
    lora: LoraTargets
    structure: Structure  # parameter counts, for the memory plan

    @property
    def trainable_params(self) -> int:
        return self.structure.lora

    @property
    def total_params(self) -> int:
        return self.structure.total + self.structure.lora


def preflight(cfg: Config) -> Preflight:
    _check_model_dir(Path(cfg.model.model_name_or_path).expanduser())
    tokenizer = _check_tokenizer(cfg)
    train, validation = resolve_splits(cfg.data)
    records = record_format(cfg.data, train.columns(), train.what)
    _check_writable("train.output_dir", Path(cfg.train.output_dir).expanduser())
    if cfg.ray.storage_path and not is_uri(cfg.ray.storage_path):
        _check_writable("ray.storage_path", Path(cfg.ray.storage_path).expanduser())
    _check_resume_source(cfg.train.resume_from_checkpoint)
    _check_trackers(cfg.trackers)

    targets, structure = inspect_lora(cfg)
    return Preflight(train, validation, records, tokenizer, targets, structure)


def inspect_lora(cfg: Config) -> tuple[LoraTargets, Structure]:
    """Resolve LoRA on a weightless copy of the model: the targets and the structure the memory plan needs."""
    from rayft.model.build import weightless_lora_model

    model, targets = weightless_lora_model(cfg)
    return targets, structure(model, model.config)


def _check_model_dir(path: Path) -> None:
    key = "model.model_name_or_path"
    if not path.exists():
        raise ConfigError(
            f"{key}: {path} does not exist (a local model directory is expected; download hub models to the "
            "shared volume first)"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key}: {path} has no config.json; point it at a Hugging Face model directory")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ConfigError(f"{key}: {path} has no *.safetensors weights")


def _check_tokenizer(cfg: Config) -> TokenizerFacts:
    path = Path(tokenizer_path(cfg.model)).expanduser()
    if not path.is_dir() or not has_tokenizer(path):
        raise ConfigError(
            f"model.tokenizer_name_or_path: no tokenizer in {path} (looked for {', '.join(TOKENIZER_FILES)}); "
            "set model.tokenizer_name_or_path to the directory that has one"
        )
    try:
        return tokenizer_facts(cfg.model)
    except Exception as e:
        raise ConfigError(f"model.tokenizer_name_or_path: the tokenizer in {path} does not load: {e}") from e


def _check_trackers(trackers: list[str]) -> None:
    from rayft.train.metrics import missing_tracker

    for name in trackers:
        package = missing_tracker(name)
        if package:
            raise ConfigError(
                f"train.report_to: {name} needs the {package} package, which is not installed; pip install "
                f"{package} (in the cluster's image too), or set train.report_to: none"
            )


def _check_resume_source(source: str | None) -> None:
    """A checkpoint dir is rayft's: DCP training state under state/ (the adapter alone cannot resume)."""
    if source in (None, "latest") or is_uri(source):
        return
    path = Path(source).expanduser()
    if not (path / STATE_DIR / ".metadata").is_file():
        found = "does not exist" if not path.exists() else f"has no {STATE_DIR}/.metadata (not a rayft checkpoint)"
        raise ConfigError(
            f"train.resume_from_checkpoint: {path} {found}; give a checkpoint-NNNNNN directory from a run's "
            "storage path, 'latest' to continue this run, or null"
        )


def _check_writable(key: str, path: Path) -> None:
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise ConfigError(f"{key}: cannot create {path} ({existing} is not a writable directory)")
