"""`rayft config from-accelerate` on the seed recipe's files: the config it writes validates and trains the seed's
settings, key by key."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml
from conftest import SEED_CONFIG, Fixtures, run_cli

from rayft.config import Config, ConfigError, load_config
from rayft.config_import import convert

SEEDS = SEED_CONFIG.parent
ACCELERATE = SEEDS / "accelerate_fsdp2_3xh200.yaml"
FLATTENED = SEEDS / "accelerate_fsdp_2node_flattened.txt"


def _fixture_paths(fixtures: Fixtures, out) -> list[str]:
    return [
        f"model.model_name_or_path={fixtures.model}",
        f"data.dataset_name_or_path={fixtures.dataset}",
        f"train.output_dir={out}",
    ]


def test_seed_files_convert_to_a_config_that_validates(fixtures: Fixtures, tmp_path, capsys):
    out = tmp_path / "rayft.yaml"
    overrides = [a for o in _fixture_paths(fixtures, tmp_path / "run") for a in ("--override", o)]
    result = run_cli(
        capsys, "config", "from-accelerate", str(ACCELERATE), "--trl", str(SEED_CONFIG), *overrides, "--out", str(out)
    )
    assert result.rc == 0, result.err
    assert out.read_text().startswith(f"# Written by: rayft config from-accelerate {ACCELERATE} --trl {SEED_CONFIG}")
    result = run_cli(capsys, "validate", "--config", str(out))
    assert result.rc == 0, result.err
    assert "config ok" in result.out


def test_the_converted_config_trains_the_seed_settings_key_by_key():
    acc = yaml.safe_load(ACCELERATE.read_text())
    fsdp = acc["fsdp_config"]
    raw, notes = convert(str(ACCELERATE), str(SEED_CONFIG))
    cfg = load_config(
        None,
        [
            f"{s}.{k}={yaml.safe_dump(v, default_flow_style=True).strip()}"
            for s, values in raw.items()
            for k, v in values.items()
        ],
    )
    seed = yaml.safe_load(SEED_CONFIG.read_text())
    as_loaded = load_config(SEED_CONFIG)  # the seed's values as rayft reads them (report_to: none → [none])
    for section, values in seed.items():
        for key in values:
            assert getattr(getattr(cfg, section), key) == getattr(getattr(as_loaded, section), key), (section, key)
    assert cfg.ray.num_workers == acc["num_processes"] == 3
    assert cfg.ray.placement_strategy == "STRICT_SPREAD"  # one process per machine
    assert cfg.train.bf16 is (acc["mixed_precision"] == "bf16")
    assert cfg.fsdp.reshard_after_forward is fsdp["fsdp_reshard_after_forward"]
    assert cfg.fsdp.cpu_offload is fsdp["fsdp_offload_params"]
    assert cfg.fsdp.checkpointing() == ("full" if fsdp["fsdp_activation_checkpointing"] else "none")
    assert cfg.fsdp.forward_prefetch == int(fsdp["fsdp_forward_prefetch"])
    assert cfg.fsdp.backward_prefetch == 1  # BACKWARD_PRE: the next layer's gather during backward
    assert cfg.model.load_mode == "sharded"  # fsdp_cpu_ram_efficient_loading: no rank holds the whole model
    assert any("fsdp_transformer_layer_cls_to_wrap" in n for n in notes)  # left out with a note, not silently


def test_a_flattened_fsdp1_file_and_its_sharding_strategy():
    raw, _ = convert(str(FLATTENED))
    assert raw["ray"] == {"num_workers": 2, "placement_strategy": "STRICT_SPREAD"}
    assert raw["fsdp"]["reshard_after_forward"] is True  # FULL_SHARD
    assert raw["fsdp"]["cpu_offload"] is False and raw["fsdp"]["forward_prefetch"] == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "num_processes: 4\nnum_machines: 2\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n",
            {
                "ray": {"num_workers": 4, "workers_per_node": 2, "placement_strategy": "STRICT_SPREAD"},
                "fsdp": {"reshard_after_forward": True, "shard_size": 2},
            },
        ),
        (
            "distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: 'no'\n",
            {
                "ray": {"num_workers": 2, "placement_strategy": "PACK"},
                "fsdp": {"shard_size": 1},
                "train": {"bf16": False},
            },
        ),
    ],
    ids=["hybrid shard", "DDP"],
)
def test_other_layouts(tmp_path, text, expected):
    path = tmp_path / "acc.yaml"
    path.write_text(text)
    raw, _ = convert(str(path))
    for section, values in expected.items():
        assert {k: raw[section][k] for k in values} == values


def test_flat_trl_keys_map_to_sections(tmp_path):
    acc, trl = tmp_path / "acc.yaml", tmp_path / "sft.yaml"
    acc.write_text("distributed_type: FSDP\nnum_processes: 2\nmixed_precision: bf16\n")
    trl.write_text(
        "lora_r: 8\nlora_target_modules: [q_proj]\nmax_seq_length: 512\nlearning_rate: 2.0e-4\n"
        "dataset_name: org/data\npush_to_hub: false\n"
    )
    raw, notes = convert(str(acc), str(trl), accept_differences=True)  # use_peft and the chat loss left to TRL
    assert {k: raw["lora"][k] for k in ("r", "target_modules")} == {"r": 8, "target_modules": ["q_proj"]}
    assert raw["data"]["max_length"] == 512
    assert raw["train"]["learning_rate"] == 2e-4 and raw["data"]["dataset_name_or_path"] == "org/data"
    assert any("push_to_hub" in n for n in notes)


def test_trl_names_carried_over_that_the_converter_dropped(tmp_path):
    """TRL's lora_modules_to_save and transformers' evaluation_strategy have rayft keys: they were dropped as "no
    rayft key" (the table a rayft config's suggestions read is the converter's too)."""
    acc, trl = tmp_path / "acc.yaml", tmp_path / "sft.yaml"
    acc.write_text("distributed_type: FSDP\nnum_processes: 2\nmixed_precision: bf16\n")
    trl.write_text("lora_modules_to_save: [lm_head]\nevaluation_strategy: steps\nlora_target_modules: [q_proj]\n")
    raw, notes = convert(str(acc), str(trl), accept_differences=True)
    assert raw["lora"]["modules_to_save"] == ["lm_head"] and raw["train"]["eval_strategy"] == "steps"
    assert "val_ratio" not in raw.get("data", {})  # it evaluates: a hold-out as rayft's default, not TRL's none
    assert not any("lora_modules_to_save" in n or "evaluation_strategy" in n for n in notes), notes


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("distributed_type: DEEPSPEED\n", "rayft trains with FSDP2"),
        ("mixed_precision: fp16\n", "mixed_precision fp16"),
        ("num_processes: 3\nnum_machines: 2\n", "multiple of num_machines"),
    ],
)
def test_what_cannot_be_carried_over_is_refused(tmp_path, text, needle, capsys):
    path = tmp_path / "acc.yaml"
    path.write_text(text)
    result = run_cli(capsys, "config", "from-accelerate", str(path))
    assert result.rc == 2 and needle in result.err, result.err
    with pytest.raises(ConfigError, match=needle):
        convert(str(path))


# rayft's setting ← TRL's effective one, as TRL's own SFTConfig / ModelConfig hold it for the same file.
EFFECTIVE = {
    "train.learning_rate": "learning_rate",
    "train.gradient_accumulation_steps": "gradient_accumulation_steps",
    "train.per_device_train_batch_size": "per_device_train_batch_size",
    "train.lr_scheduler_type": "lr_scheduler_type",
    "train.warmup_steps": "warmup_steps",
    "train.weight_decay": "weight_decay",
    "train.num_train_epochs": "num_train_epochs",
    "train.max_steps": "max_steps",
    "train.eval_strategy": "eval_strategy",
    "train.save_steps": "save_steps",
    "train.save_total_limit": "save_total_limit",
    "train.logging_steps": "logging_steps",
    "train.seed": "seed",
    "train.max_grad_norm": "max_grad_norm",
    "train.optim": "optim",
    "train.gradient_checkpointing": "gradient_checkpointing",
    "data.max_length": "max_length",
    "data.packing": "packing",
    "data.text_field": "dataset_text_field",
    "lora.r": "lora_r",
    "lora.lora_alpha": "lora_alpha",
    "lora.lora_dropout": "lora_dropout",
    "lora.use_rslora": "use_rslora",
    "model.torch_dtype": "dtype",
}
MINIMAL = {
    "model_name_or_path": "/models/m",
    "dataset_name": "org/chats",
    "use_peft": True,
    "lora_target_modules": ["q_proj", "v_proj"],
    "assistant_only_loss": True,
}
FULL = {
    **MINIMAL,
    "learning_rate": 1e-4,
    "gradient_accumulation_steps": 4,
    "per_device_train_batch_size": 2,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 10,
    "weight_decay": 0.01,
    "num_train_epochs": 2,
    "max_steps": 300,
    "eval_strategy": "steps",
    "eval_steps": 50,
    "save_steps": 100,
    "save_total_limit": 3,
    "logging_steps": 5,
    "seed": 7,
    "max_grad_norm": 0.5,
    "optim": "adamw_torch",
    "gradient_checkpointing": False,
    "max_length": 512,
    "packing": True,
    "packing_strategy": "wrapped",
    "dataset_text_field": "content",
    "lora_r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.1,
    "use_rslora": True,
    "dtype": "bfloat16",
}


def _plain(value):
    return getattr(value, "value", value)  # TRL's enums


@pytest.mark.parametrize("sft", [MINIMAL, FULL], ids=["minimal", "full"])
def test_a_flat_trl_file_trains_what_trl_would_key_by_key(sft, tmp_path):
    """Every setting a flat TRL file leaves out is TRL's default, not rayft's (1e-4 vs 2e-5, 16 vs 1 accumulation
    steps, cosine vs linear, ...); every one it gives is carried over. TRL's side: its own SFTConfig and ModelConfig
    built from the same file (on CPU, as this machine must say)."""
    from trl import ModelConfig, SFTConfig

    acc, trl = tmp_path / "acc.yaml", tmp_path / "sft.yaml"
    acc.write_text("distributed_type: FSDP\nnum_processes: 2\nmixed_precision: bf16\n")
    trl.write_text(yaml.safe_dump(sft))
    raw, notes = convert(str(acc), str(trl))
    assert not [n for n in notes if n.startswith("differs")], notes
    ours = Config.from_dict(raw)
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    theirs_model = ModelConfig(**{k: v for k, v in sft.items() if k in model_fields})
    theirs = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        bf16=False,
        **{k: v for k, v in sft.items() if k not in model_fields and k != "dataset_name"},
    )
    for dotted, field in EFFECTIVE.items():
        section, key = dotted.split(".")
        want = _plain(getattr(theirs_model if field in model_fields else theirs, field))
        assert getattr(getattr(ours, section), key) == want, (dotted, getattr(getattr(ours, section), key), want)
    assert ours.trackers == list(theirs.report_to)  # none
    assert ours.train.warmup_ratio == 0.0 and ours.data.completion_only_loss is True  # assistant_only_loss
    assert (ours.data.hold_out == 0.0) is (theirs.eval_strategy == "no")  # TRL holds nothing out without evaluation


def test_trls_qlora_is_the_nf4_base(tmp_path, capsys):
    """load_in_4bit with bitsandbytes' NF4 and nested (double) quantisation: QLoRA as rayft holds it, no difference."""
    acc, trl = tmp_path / "acc.yaml", tmp_path / "sft.yaml"
    acc.write_text("distributed_type: FSDP\nnum_processes: 2\nmixed_precision: bf16\n")
    qlora = {
        "model_name_or_path": "/models/m",
        "use_peft": True,
        "lora_target_modules": ["q_proj"],
        "assistant_only_loss": True,
        "load_in_4bit": True,
        "use_bnb_nested_quant": True,
    }
    trl.write_text(yaml.safe_dump(qlora))
    out = tmp_path / "rayft.yaml"
    result = run_cli(capsys, "config", "from-accelerate", str(acc), "--trl", str(trl), "--out", str(out))
    assert result.rc == 0, result.err
    assert yaml.safe_load(out.read_text())["model"]["frozen_dtype"] == "nf4"
    trl.write_text(yaml.safe_dump({**qlora, "bnb_4bit_quant_type": "fp4"}))
    result = run_cli(capsys, "config", "from-accelerate", str(acc), "--trl", str(trl), "--out", str(out))
    assert result.rc == 2 and "bnb_4bit_quant_type fp4: rayft's 4-bit base is NF4" in result.err, result.err


def test_what_rayft_would_train_otherwise_than_trl_is_refused_or_listed(tmp_path, capsys):
    """Full fine-tuning (TRL's default without use_peft), a 4-bit base, NEFTune, a chat template file, PEFT's own
    target modules and TRL's whole-conversation loss: refused, each named, unless --accept-differences."""
    acc, trl = tmp_path / "acc.yaml", tmp_path / "sft.yaml"
    acc.write_text("distributed_type: FSDP\nnum_processes: 2\nmixed_precision: bf16\n")
    trl.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": "/models/m",
                "load_in_4bit": True,
                "neftune_noise_alpha": 5,
                "chat_template_path": "t.jinja",
            }
        )
    )
    result = run_cli(capsys, "config", "from-accelerate", str(acc), "--trl", str(trl))
    assert result.rc == 2, result.err
    for says in (
        "use_peft false (TRL's default): full fine-tuning",
        "use_bnb_nested_quant false (TRL's default)",
        "neftune_noise_alpha: NEFTune",
        "chat_template_path:",
        "lora_target_modules unset",
        "assistant_only_loss false (TRL's default)",
        "--accept-differences",
    ):
        assert says in result.err, result.err
    out = tmp_path / "rayft.yaml"
    result = run_cli(
        capsys, "config", "from-accelerate", str(acc), "--trl", str(trl), "--accept-differences", "--out", str(out)
    )
    assert result.rc == 0, result.err
    listed = [line for line in out.read_text().splitlines() if line.startswith("# note: differs from TRL:")]
    assert len(listed) == 6, out.read_text()


def test_machines_become_nodes_of_workers_and_hsdp_becomes_shard_size(tmp_path):
    """2 machines × 8 processes: two nodes of 8 workers (one pod each, its GPUs on one NVLink), not 16 one-GPU
    pods; accelerate's HSDP mesh (dp_replicate 2 × dp_shard 8) is fsdp.shard_size 8."""
    path = tmp_path / "acc.yaml"
    path.write_text(
        "num_processes: 16\nnum_machines: 2\nparallelism_config:\n"
        "  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 8\n"
    )
    raw, _ = convert(str(path))
    assert raw["ray"] == {"num_workers": 16, "workers_per_node": 8, "placement_strategy": "STRICT_SPREAD"}
    assert raw["fsdp"]["shard_size"] == 8
    cfg = Config.from_dict(raw)
    assert cfg.ray.nodes == 2 and cfg.ray.ray_placement_strategy() == "PACK"


def test_a_mesh_rayft_does_not_have_is_refused(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text("num_processes: 8\nparallelism_config:\n  parallelism_config_tp_size: 2\n")
    with pytest.raises(ConfigError, match="parallelism_config tp_size 2: rayft shards with FSDP2"):
        convert(str(path))


@pytest.mark.parametrize(
    ("trl_text", "needle"),
    [
        ("packing: true\n", "packing_strategy bfd: TRL places whole examples in rows"),
        ("packing: true\npacking_strategy: bfd_split\n", "packing_strategy bfd_split"),
        ("eos_token: <|im_end|>\n", "eos_token: TRL ends each example with this token"),
    ],
    ids=["bfd", "bfd_split", "eos_token"],
)
def test_trl_packing_and_eos_that_rayft_does_otherwise_are_differences(tmp_path, trl_text, needle):
    acc, trl = tmp_path / "acc.yaml", tmp_path / "sft.yaml"
    acc.write_text("num_processes: 2\nmixed_precision: bf16\n")
    trl.write_text("use_peft: true\nlora_target_modules: [q_proj]\nassistant_only_loss: true\n" + trl_text)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        convert(str(acc), str(trl))
    notes = convert(str(acc), str(trl), accept_differences=True)[1]
    assert any(needle in n for n in notes), notes
    wrapped = "use_peft: true\nlora_target_modules: [q_proj]\nassistant_only_loss: true\npacking: true\n"
    trl.write_text(wrapped + "packing_strategy: wrapped\n")
    assert not any("packing" in n for n in convert(str(acc), str(trl))[1])
