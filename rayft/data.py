"""Ray Data pipeline: read split files → keep non-empty text → tokenize in actors → batches on each worker.

Tokenization runs on the cluster's CPUs in parallel with training; Ray Train's `DataConfig` then hands each
worker an equal `streaming_split` so no rank runs out of batches while the others wait in a collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import ray.data
from ray.data.collate_fn import NumpyBatchCollateFn

from rayft.config import Config, ConfigError, DataConfig, ModelConfig
from rayft.sources import SplitFiles, resolve_splits

if TYPE_CHECKING:
    import torch

# torch and transformers are imported where they are used: Ray Data task workers unpickle this module's functions
# and would otherwise each spend seconds importing both just to filter text.

IGNORE_INDEX = -100


@dataclass
class Datasets:
    """The tokenized splits plus their row counts (needed up front to plan the LR schedule)."""

    train: ray.data.Dataset
    train_rows: int
    validation: ray.data.Dataset | None
    validation_rows: int


def build_datasets(cfg: Config) -> Datasets:
    """Runs on the driver: builds the lazy training pipeline and counts its rows; tokenizes validation."""
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # tqdm bars turn `ray job logs` into noise; the dashboard shows progress
    # The same records in the same order to the same rank every run (also turns off locality-based dispatch):
    # a resumed run skips exactly the batches it already trained on.
    context.execution_options.preserve_order = True
    train_files, val_files = resolve_splits(cfg.data)
    train = _text_records(train_files, cfg.data)
    validation = _text_records(val_files, cfg.data) if val_files else None
    if validation is None and cfg.data.val_ratio > 0 and cfg.train.eval_strategy != "no":
        # Deterministic hold-out so a rerun (or a resumed run) evaluates on the same records.
        train, validation = train.train_test_split(test_size=cfg.data.val_ratio, shuffle=True, seed=cfg.train.seed)

    train_rows = train.count()
    if train_rows == 0:
        raise ConfigError(
            f"data: split '{cfg.data.train_split}' of {cfg.data.dataset_name_or_path} has no non-empty "
            f"'{cfg.data.text_field}' values"
        )
    tokenized_validation, validation_rows = None, 0
    if validation is not None:
        # Evaluation reruns many times over a small split: tokenize it once and keep it in the object store.
        tokenized_validation = _tokenized(validation, cfg).materialize()
        validation_rows = tokenized_validation.count()
    return Datasets(
        train=_tokenized(train, cfg),
        train_rows=train_rows,
        validation=tokenized_validation if validation_rows else None,
        validation_rows=validation_rows,
    )


def _text_records(files: SplitFiles, data: DataConfig) -> ray.data.Dataset:
    if files.format == "parquet":
        ds = ray.data.read_parquet(list(files.paths))
    elif files.format == "json":
        ds = ray.data.read_json(list(files.paths))
    else:
        ds = ray.data.read_text(list(files.paths))
    field = "text" if files.format == "text" else data.text_field
    return ds.map_batches(partial(_non_empty_text, field=field), batch_format="numpy", batch_size=4096)


def _non_empty_text(batch: dict[str, np.ndarray], field: str) -> dict[str, np.ndarray]:
    """Keep only records whose text field is a non-blank string (wikitext is ~1/3 empty lines)."""
    if field not in batch:
        return {"text": np.array([], dtype=object)}
    texts = [t for t in batch[field] if isinstance(t, str) and t.strip()]
    return {"text": np.array(texts, dtype=object)}


def _tokenized(ds: ray.data.Dataset, cfg: Config) -> ray.data.Dataset:
    return ds.map_batches(
        Tokenize,
        fn_constructor_kwargs={"model": dataclasses.asdict(cfg.model), "max_length": cfg.data.max_length},
        batch_format="numpy",
        batch_size=256,
        concurrency=(1, cfg.data.tokenize_workers),
        num_cpus=1,
    )


class Tokenize:
    """Ray Data actor: loads the tokenizer once, turns text into `[bos] ids [eos]` cut to max_length."""

    def __init__(self, model: dict[str, Any], max_length: int):
        from rayft.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(ModelConfig(**model))
        self.max_length = max_length
        self.bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        self.eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[np.ndarray]]:
        encoded = self.tokenizer(list(batch["text"]), add_special_tokens=False)["input_ids"]
        ids = [np.asarray((self.bos + e + self.eos)[: self.max_length], dtype=np.int32) for e in encoded]
        return {"input_ids": ids}


class PadCollate(NumpyBatchCollateFn):
    """Right-pad to the longest sequence in the batch; padding is masked out of attention and loss."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        import torch

        seqs = batch["input_ids"]
        longest = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), longest), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for i, s in enumerate(seqs):
            input_ids[i, : len(s)] = torch.from_numpy(np.asarray(s, dtype=np.int64))
            attention_mask[i, : len(s)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
