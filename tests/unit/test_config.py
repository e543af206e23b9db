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
    assert (
        cfg.train.learning_rate == 1e-4
        and cfg.train.save_total_limit == 3
        and cfg.train.report_to == ["none"]
        and cfg.trackers == []
    )
    assert cfg.model.model_name_or_path == "/data/input/Models/Mistral-Small-4-119B-2603"  # seed dataclass default
    assert cfg.ray.placement_strategy == "STRICT_SPREAD" and cfg.fsdp.reshards() is True


def test_shard_size_groups_workers_and_decides_resharding():
    fsdp = Config.from_dict({"ray": {"num_workers": 4}, "fsdp": {"shard_size": 2}}).fsdp
    assert (fsdp.shard_group(4), fsdp.reshards()) == (2, True)  # HSDP: sharded in pairs, freed after forward
    fsdp = Config.from_dict({"ray": {"num_workers": 4}, "fsdp": {"shard_size": 1}}).fsdp
    # replicated: FSDP2's gathered copy is still a second copy of the weights; freed after forward all the same
    assert (fsdp.shard_group(4), fsdp.reshards()) == (1, True)
    assert Config.from_dict({"fsdp": {"shard_size": 1, "reshard_after_forward": False}}).fsdp.reshards() is False
    with pytest.raises(ConfigError, match=r"fsdp\.shard_size 3 must divide ray\.num_workers 4"):
        Config.from_dict({"ray": {"num_workers": 4}, "fsdp": {"shard_size": 3}})
    with pytest.raises(ConfigError, match=r"fsdp\.shard_size"):
        Config.from_dict({"fsdp": {"shard_size": 0}})


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
        ({"data": {"max_eval_samples": 0}}, ["data.max_eval_samples must be >= 1"]),
        ({"lora": {"target_experts": True}, "fsdp": {"activation_checkpointing": True}}, ["lora.lora_dropout: 0"]),
        (
            {"fsdp": {"activation_checkpointing": "partial"}},
            ["fsdp.activation_checkpointing: unknown value 'partial'", "auto, full, selective, none"],
        ),
        (
            {"fsdp": {"checkpoint_every_n_layers": 2}},
            ["fsdp.checkpoint_every_n_layers 2", "fsdp.activation_checkpointing is auto", "set it to selective"],
        ),
        ({"model": {"load_mode": "rank0"}}, ["model.load_mode", "sharded"]),
        (
            {"train": {"load_best_model_at_end": True, "eval_strategy": "no"}},
            ["load_best_model_at_end", "eval_strategy"],
        ),
        (
            {"train": {"load_best_model_at_end": True, "save_strategy": "no"}},
            ["load_best_model_at_end", "save_strategy"],
        ),
        ({"train": {"metric_for_best_model": "accuracy"}}, ["train.metric_for_best_model", "eval_loss"]),
        ({"ray": {"checkpoint_upload": "lazy"}}, ["ray.checkpoint_upload", "async"]),
        ({"train": {"report_to": "comet"}}, ["train.report_to: unknown value 'comet'"]),  # one, without its list
        ({"train": {"report_to": ["wandb", "comet"]}}, ["train.report_to[1]: unknown value 'comet'"]),
        ({"ray": {"preemption": "checkpoints"}}, ["ray.preemption: unknown value", "choose one of checkpoint, ignore"]),
        ({"ray": {"preemption_check_steps": 0}}, ["ray.preemption_check_steps must be >= 1"]),
        ({"ray": {"max_preemptions": -2}}, ["ray.max_preemptions must be >= -1"]),
        (
            {"model": {"frozen_dtype": "nf4", "load_mode": "full"}, "lora": {"use_dora": True}},
            ["lora.use_dora: true", "not model.frozen_dtype nf4"],
        ),
        ({"model": {"frozen_dtype": "nf5"}}, ["did you mean 'nf4'"]),
        ({"model": {"fp8_compute": "fp8"}}, ["model.fp8_compute: unknown value 'fp8'", "auto, true, false"]),
        (
            {"model": {"frozen_dtype": "nf4"}, "parallel": {"expert_parallel": 2}, "ray": {"num_workers": 2}},
            ["model.frozen_dtype nf4 cannot be combined with parallel.expert_parallel 2"],
        ),
        ({"ray": {"preemption_grace_s": -1}}, ["ray.preemption_grace_s must be >= 0"]),
        ({"ray": {"num_workers": 6, "workers_per_node": 4}}, ["ray.num_workers 6", "multiple of 4"]),
        ({"ray": {"num_workers": 4, "workers_per_node": 2, "placement_strategy": "SPREAD"}}, ["STRICT_SPREAD"]),
        (
            {"ray": {"num_workers": 12, "workers_per_node": 4}, "parallel": {"expert_parallel": 6}},
            ["parallel.expert_parallel 6", "ray.workers_per_node 4", "valid: [1, 2, 4, 12]"],
        ),
        (
            {"ray": {"num_workers": 6}, "parallel": {"context_parallel": 4}, "data": {"packing": True}},
            ["parallel.context_parallel 4 must divide ray.num_workers 6", "valid: [1, 2, 3, 6]"],
        ),
        ({"parallel": {"context_parallel": 0}}, ["parallel.context_parallel must be >= 1"]),
        ({"parallel": {"context_parallel": 2}}, ["parallel.context_parallel > 1 splits packed rows", "data.packing"]),
        (
            {
                "parallel": {"context_parallel": 2},
                "data": {"packing": True},
                "model": {"attn_implementation": "flex_attention"},
            },
            ["model.attn_implementation is flex_attention", "set sdpa, eager or null"],
        ),
        (
            {
                "ray": {"num_workers": 4},
                "parallel": {"context_parallel": 2, "expert_parallel": 2},
                "data": {"packing": True},
                "fsdp": {"shard_size": 2},
            },
            ["parallel.context_parallel > 1 is not yet combined with fsdp.shard_size; set"],
        ),
        (
            {"parallel": {"context_parallel": 2}, "train": {"objective": "dpo"}},
            ["parallel.context_parallel > 1 is not yet combined with train.objective: dpo"],
        ),
        (
            {
                "ray": {"num_workers": 4, "min_workers": 2},
                "parallel": {"context_parallel": 2},
                "data": {"packing": True},
            },
            ["not yet combined with ray.min_workers (elastic)"],
        ),
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


@pytest.mark.parametrize(
    ("train", "expected"),
    [
        ({}, ("eval_loss", "min")),
        ({"metric_for_best_model": "loss"}, ("eval_loss", "min")),  # transformers' spelling: eval_ is implied
        ({"greater_is_better": True}, ("eval_loss", "max")),
        ({"metric_for_best_model": None}, None),
        ({"eval_strategy": "no"}, None),  # nothing to rank by: newest-first retention
    ],
)
def test_checkpoint_ranking_follows_the_transformers_fields(train, expected):
    assert Config.from_dict({"train": train}).best_metric == expected


def test_unquoted_no_strategies_mean_no(tmp_path):
    """YAML 1.1 reads `save_strategy: no` as false; users mean the string."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  eval_strategy: no\n  save_strategy: no\n")
    cfg = load_config(path)
    assert cfg.train.eval_strategy == "no" and cfg.train.save_strategy == "no"


def test_uri_storage_paths_are_kept_as_uris():
    cfg = Config.from_dict({"ray": {"storage_path": "s3://bucket/runs", "name": "m4"}})
    assert cfg.storage_path == "s3://bucket/runs" and cfg.run_uri == "s3://bucket/runs/m4"


@pytest.mark.parametrize(
    ("raw", "mode", "every"),
    [
        ({}, "auto", None),  # auto unresolved (no job chose): no recompute, rayft's former default
        ({"fsdp": {"activation_checkpointing": True}}, "full", 1),  # accelerate's and older configs' true and false
        ({"fsdp": {"activation_checkpointing": False}}, "none", None),
        ({"fsdp": {"activation_checkpointing": "selective", "checkpoint_every_n_layers": 3}}, "selective", 3),
        ({"train": {"gradient_checkpointing": True}}, "full", 1),  # the HF trainer's flag asks for every layer
        (
            {"train": {"gradient_checkpointing": True}, "fsdp": {"activation_checkpointing": "selective"}},
            "selective",
            2,
        ),
    ],
)
def test_activation_checkpointing_reads_words_and_flags(raw, mode, every):
    cfg = Config.from_dict(raw)
    assert (cfg.checkpointing, cfg.checkpoint_every()) == (mode, every)


def test_expert_lora_no_longer_forces_recompute_and_keeps_it_where_nothing_chose():
    """The rule refusing expert LoRA without activation checkpointing was about memory (a bf16 base's experts keep
    W + BA for backward): the planner now counts that memory and chooses. An explicit none is the user's to make;
    `auto` left unresolved (no GPU capacity known) recomputes every layer, as the rule made every run do."""
    lora = {"target_experts": True, "lora_dropout": 0}
    assert Config.from_dict({"lora": lora, "fsdp": {"activation_checkpointing": "none"}}).checkpoint_every() is None
    assert Config.from_dict({"lora": lora}).checkpoint_every() == 1
