"""Config loading: the seed YAML unchanged, overrides, and user errors that name the key."""

from __future__ import annotations

import pytest
from conftest import SEED_CONFIG, write_yaml

from rayft.config import Config, ConfigError, load_config


def test_seed_yaml_loads_unchanged_with_its_values():
    cfg = load_config(SEED_CONFIG)
    assert cfg.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert cfg.data.dataset_config_name == "wikitext-2-raw-v1" and cfg.data.max_length == 1024
    assert cfg.train.gradient_accumulation_steps == 16 and cfg.train.warmup_ratio == 0.05
    assert cfg.train.learning_rate == 1e-4 and cfg.train.save_total_limit == 3 and cfg.train.report_to == "none"
    assert cfg.model.model_name_or_path == "/data/input/Models/Mistral-Small-4-119B-2603"  # seed dataclass default
    assert cfg.ray.placement_strategy == "STRICT_SPREAD" and cfg.fsdp.reshard_after_forward is True


def test_overrides_are_parsed_as_yaml_like_the_seed_script():
    cfg = load_config(
        SEED_CONFIG,
        ["train.learning_rate=1e-4", "lora.r=32", "lora.target_modules=[q_a_proj, kv_b_proj]", "ray.use_gpu=false"],
    )
    assert cfg.train.learning_rate == 1e-4  # YAML reads "1e-4" as a string; a float field accepts it
    assert cfg.lora.r == 32 and cfg.lora.target_modules == ["q_a_proj", "kv_b_proj"]
    assert cfg.ray.use_gpu is False


def test_round_trips_through_a_plain_dict():
    cfg = load_config(SEED_CONFIG, ["ray.resources_per_worker={CPU: 2, GPU: 1}"])
    assert Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("raw", "needles"),
    [
        ({"trian": {}}, ["unknown section 'trian'", "did you mean 'train'"]),
        ({"train": {"learnig_rate": 1e-4}}, ["train.learnig_rate", "did you mean 'learning_rate'"]),
        ({"train": {"per_device_train_batch_size": "two"}}, ["train.per_device_train_batch_size", "integer"]),
        ({"train": {"learning_rate": -1e-4}}, ["train.learning_rate", "> 0"]),
        ({"ray": {"num_workers": 0}}, ["ray.num_workers", ">= 1"]),
        ({"train": {"lr_scheduler_type": "cosin"}}, ["train.lr_scheduler_type", "did you mean 'cosine'"]),
        ({"train": {"bf16": "yes please"}}, ["train.bf16", "true or false"]),
        ({"lora": {"target_modules": []}}, ["lora.target_modules"]),
        ({"train": {"fp16": True}}, ["train.fp16"]),
        ({"ray": {"placement_strategy": "SPREAD_STRICT"}}, ["ray.placement_strategy"]),
        ({"ray": {"use_gpu": False}, "fsdp": {"param_dtype": "bfloat16"}}, ["fsdp.param_dtype", "gloo"]),
        ({"data": {"val_ratio": 1.5}}, ["data.val_ratio"]),
        ({"lora": {"target_experts": True}, "fsdp": {"activation_checkpointing": True}}, ["lora.lora_dropout: 0"]),
        ({"lora": {"target_experts": True, "lora_dropout": 0}}, ["fsdp.activation_checkpointing: true"]),
        ({"model": {"load_mode": "rank0"}}, ["model.load_mode", "sharded"]),
    ],
)
def test_bad_values_name_the_key(raw, needles):
    with pytest.raises(ConfigError) as err:
        Config.from_dict(raw)
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.learning_rate", "expected section.key=value"),
        ("trainer.learning_rate=1", "did you mean 'train'"),
        ("train.max_steps=[1", "not valid YAML"),
    ],
)
def test_malformed_overrides(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config(None, [override])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(write_yaml(tmp_path / "list.yaml", [1, 2]))
