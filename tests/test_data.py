"""Dataset file resolution, tokenization and batching (the Ray Data pipeline itself runs in the e2e tests)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import Fixtures

from rayft.config import Config, ConfigError, DataConfig, ModelConfig
from rayft.data import IGNORE_INDEX, PadCollate, Tokenize
from rayft.schedule import make_plan
from rayft.sources import resolve_splits


def test_wikitext_layout_resolves_both_splits(fixtures: Fixtures):
    train, val = resolve_splits(DataConfig(dataset_name_or_path=str(fixtures.dataset)))
    assert train.format == "parquet" and train.paths[0].endswith("wikitext-2-raw-v1/train-00000-of-00001.parquet")
    assert val is not None and val.paths[0].endswith("validation-00000-of-00001.parquet")


def test_single_jsonl_file_has_no_validation_split(tmp_path):
    f = tmp_path / "records.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"line {i}"}) for i in range(5)))
    train, val = resolve_splits(DataConfig(dataset_name_or_path=str(f)))
    assert train.format == "json" and val is None


def test_missing_split_names_the_split(fixtures: Fixtures):
    with pytest.raises(ConfigError, match="no 'training' split"):
        resolve_splits(DataConfig(dataset_name_or_path=str(fixtures.dataset), train_split="training"))


def test_tokenize_adds_bos_eos_and_truncates(fixtures: Fixtures):
    tokenize = Tokenize(model={**ModelConfig(model_name_or_path=str(fixtures.model)).__dict__}, max_length=6)
    out = tokenize({"text": np.array(["Hello", "The old castle was built in 1854 by the church ."], dtype=object)})
    short, long = out["input_ids"]
    assert short[0] == 1 and short[-1] == 2 and len(short) >= 3
    assert len(long) == 6 and long[0] == 1 and long[-1] != 2  # truncated: no eos


def test_collate_pads_right_and_masks_padding_out_of_the_loss():
    batch = PadCollate(pad_id=11)({"input_ids": np.array([np.array([1, 5, 2]), np.array([1, 2])], dtype=object)})
    assert batch["input_ids"].tolist() == [[1, 5, 2], [1, 2, 11]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[1, 5, 2], [1, 2, IGNORE_INDEX]]


def test_plan_counts_equal_shards_and_partial_accumulation():
    cfg = Config.from_dict({"train": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                      "num_train_epochs": 2, "warmup_ratio": 0.1}})  # fmt: skip
    plan = make_plan(cfg, train_rows=331, validation_rows=42, world_size=2)
    # 165 rows per worker → 42 micro-batches → 21 optimizer steps per epoch
    assert (plan.micro_batches_per_epoch, plan.steps_per_epoch, plan.total_steps) == (42, 21, 42)
    assert plan.warmup_steps == 5 and plan.has_validation
    with pytest.raises(ConfigError, match=r"cannot feed ray\.num_workers=4"):
        make_plan(cfg, train_rows=3, validation_rows=0, world_size=4)
