"""`rayft config from-accelerate`: the rayft config that does what an accelerate launch config and a TRL/SFT
training YAML did, so users of that recipe start from their own files rather than re-typing them.

accelerate's processes become Ray workers and its `fsdp_*` keys the `fsdp` section; the SFT YAML's keys (the seed
recipe's sections, or SFTConfig's flat keys as `trl sft --config` reads them) map to model/lora/data/train. What
Ray or rayft does by itself (launching, wrapping, state dicts) is left out with a note, never silently.

A flat TRL file means TRL's defaults for what it leaves out: each such setting gets the installed TRL's default
(read from its `SFTConfig` and `ModelConfig`), not rayft's. What rayft cannot do the same way (full fine-tuning, a
4-bit base, NEFTune, ...) is refused, naming each difference, unless `accept_differences` writes the config anyway
with every difference listed in it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from rayft.config import SECTIONS, Config, ConfigError, key_owners, parse_override, read_yaml, set_nested
from rayft.trl_names import TRL_NAMES

# Launch facts Ray takes care of (processes, rendezvous, the machine's rank): nothing to carry over.
LAUNCH_KEYS = frozenset(
    {
        "compute_environment",
        "debug",
        "downcast_bf16",
        "enable_cpu_affinity",
        "rdzv_backend",
        "same_network",
        "machine_rank",
        "main_training_function",
        "main_process_ip",
        "main_process_port",
        "gpu_ids",
        "dynamo_config",
        "tpu_env",
        "tpu_use_cluster",
        "tpu_use_sudo",
        "use_cpu",
        "num_processes",
        "num_machines",
        "distributed_type",
        "mixed_precision",
        "fsdp_config",
        "parallelism_config",
    }
)
# FSDP settings rayft's FSDP2 wrapping fixes itself: per decoder layer, LoRA-only trainable, PEFT adapter files.
FSDP_BUILT_IN = frozenset(
    {
        "fsdp_version",
        "fsdp_use_orig_params",
        "fsdp_auto_wrap_policy",
        "fsdp_transformer_layer_cls_to_wrap",
        "fsdp_limit_all_gathers",
        "fsdp_sync_module_states",
        "fsdp_state_dict_type",
        "state_dict_cpu_offload",
        "fsdp_min_num_params",
    }
)
# FSDP1 sharding strategies (by name or number) → (fsdp.reshard_after_forward, sharded within a node only)
STRATEGIES = {
    "FULL_SHARD": (True, False), "SHARD_GRAD_OP": (False, False), "NO_SHARD": (False, None),
    "HYBRID_SHARD": (True, True), "HYBRID_SHARD_ZERO2": (False, True), "_HYBRID_SHARD_ZERO2": (False, True),
}  # fmt: skip
STRATEGY_NUMBERS = dict(
    enumerate(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"], 1)
)
PREFETCH = {"BACKWARD_PRE": 1, "BACKWARD_POST": 1, "NO_PREFETCH": 0}
TRL_SECTIONS = ("model", "lora", "data", "train")
# rayft key ← the SFTConfig / ModelConfig field whose default a flat TRL file means when it leaves the key out.
TRL_DEFAULTED = {
    "train.learning_rate": "learning_rate", "train.gradient_accumulation_steps": "gradient_accumulation_steps",
    "train.per_device_train_batch_size": "per_device_train_batch_size",
    "train.per_device_eval_batch_size": "per_device_eval_batch_size", "train.lr_scheduler_type": "lr_scheduler_type",
    "train.warmup_steps": "warmup_steps", "train.weight_decay": "weight_decay",
    "train.num_train_epochs": "num_train_epochs", "train.max_steps": "max_steps",
    "train.eval_strategy": "eval_strategy",
    "train.save_strategy": "save_strategy", "train.save_steps": "save_steps",
    "train.save_total_limit": "save_total_limit", "train.logging_steps": "logging_steps", "train.seed": "seed",
    "train.max_grad_norm": "max_grad_norm", "train.optim": "optim",
    "train.gradient_checkpointing": "gradient_checkpointing", "train.report_to": "report_to",
    "train.load_best_model_at_end": "load_best_model_at_end", "data.max_length": "max_length",
    "data.packing": "packing", "data.text_field": "dataset_text_field", "model.torch_dtype": "dtype",
    "lora.r": "lora_r", "lora.lora_alpha": "lora_alpha", "lora.lora_dropout": "lora_dropout",
    "lora.use_rslora": "use_rslora", "lora.use_dora": "use_dora",
}  # fmt: skip
# What rayft cannot do as TRL does: (TRL field, whether its effective value differs, the difference and the fix).
TRL_DIFFERENCES = (
    ("use_peft", lambda v: not v, "use_peft false (TRL's default): full fine-tuning, where rayft trains LoRA "
     "adapters (the lora section); set use_peft: true"),
    ("load_in_8bit", bool, "load_in_8bit: an 8-bit base, where rayft holds the frozen base in model.frozen_dtype "
     "(FP8 E4M3 or bf16)"),
    ("neftune_noise_alpha", lambda v: v is not None, "neftune_noise_alpha: NEFTune embedding noise, which rayft "
     "does not add"),
    ("chat_template_path", lambda v: v is not None, "chat_template_path: rayft renders chats with the tokenizer's "
     "own template (model.tokenizer_name_or_path names the tokenizer)"),
    ("lora_target_modules", lambda v: v is None, "lora_target_modules unset: PEFT's per-architecture default "
     "(q_proj and v_proj for most models), where rayft's lora.target_modules auto takes every projection; name "
     "the modules"),
    ("use_liger_kernel", bool, "use_liger_kernel: rayft computes the loss with its own fused, chunked head "
     "(train.fused_loss)"),
    ("eos_token", lambda v: v is not None, "eos_token: TRL ends each example with this token, where rayft ends it "
     "with the tokenizer's own EOS; name a tokenizer whose EOS it is (model.tokenizer_name_or_path)"),
)  # fmt: skip
LOSS_KEYS = ("completion_only_loss", "assistant_only_loss")
# Flat TRL fields read above rather than carried over by name.
TRL_HANDLED = frozenset(
    {f for f, _, _ in TRL_DIFFERENCES}
    | {"assistant_only_loss", "load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant", "packing_strategy"}
)


def convert(
    accelerate: str,
    trl: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    accept_differences: bool = False,
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The rayft config (checked) and notes on what was left out; ConfigError for what cannot be carried over (and,
    unless `accept_differences`, for what rayft would do otherwise than TRL)."""
    acc = _mapping(accelerate)
    raw: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    per_node = _launch(acc, raw, accelerate)
    _fsdp(_fsdp_keys(acc), raw, notes, per_node)
    _mesh(acc.get("parallelism_config") or {}, raw, accelerate)
    skipped = sorted(k for k in acc if k not in LAUNCH_KEYS and not k.startswith("fsdp_"))
    if skipped:
        notes.append(f"{accelerate}: not carried over (unknown to rayft): {', '.join(skipped)}")
    if trl is not None:
        _trl(_mapping(trl), raw, notes, trl, accept_differences)
    for item in overrides:
        keys, value = parse_override(item)
        set_nested(raw, keys, value, "--override")
    Config.from_dict(raw, source=trl or accelerate)
    return raw, notes


def _fsdp_keys(acc: dict[str, Any]) -> dict[str, Any]:
    """The fsdp_config mapping, plus fsdp_* keys at the top level (a file whose indentation was lost)."""
    flat = {k: v for k, v in acc.items() if k.startswith("fsdp_") and k != "fsdp_config"}
    return {**flat, **(acc.get("fsdp_config") or {})}


def _mapping(path: str) -> dict[str, Any]:
    data, _ = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys, got {type(data).__name__}")
    return data


def _launch(acc: dict[str, Any], raw: dict[str, dict[str, Any]], source: str) -> int:
    """Processes → Ray workers, machines → nodes of `ray.workers_per_node` workers each (so a machine's GPUs stay in
    one pod, where they share NVLink), mixed precision → train.bf16; the processes per machine."""
    kind = acc.get("distributed_type", "FSDP")
    if kind not in ("FSDP", "MULTI_GPU", "NO", "MULTI_CPU"):
        raise ConfigError(f"{source}: distributed_type {kind}: rayft trains with FSDP2 (FSDP or MULTI_GPU configs)")
    processes, machines = int(acc.get("num_processes", 1)), int(acc.get("num_machines", 1))
    if machines < 1 or processes < machines or processes % machines:
        raise ConfigError(f"{source}: num_processes {processes} must be a multiple of num_machines {machines}")
    per_node = processes // machines
    ray = raw.setdefault("ray", {})
    ray["num_workers"] = processes
    if per_node > 1:
        ray["workers_per_node"] = per_node
    ray["placement_strategy"] = "PACK" if machines == 1 else "STRICT_SPREAD"
    if acc.get("use_cpu") or kind == "MULTI_CPU":
        ray["use_gpu"] = False
    if kind == "MULTI_GPU":  # DDP: every worker holds the whole model
        raw.setdefault("fsdp", {})["shard_size"] = 1
    precision = str(acc.get("mixed_precision", "no")).lower()
    if precision not in ("bf16", "no"):
        raise ConfigError(
            f"{source}: mixed_precision {precision}: rayft trains LoRA in bf16 (or fp32); set mixed_precision: bf16"
        )
    raw.setdefault("train", {})["bf16"] = precision == "bf16"
    return per_node


def _mesh(mesh: dict[str, Any], raw: dict[str, dict[str, Any]], source: str) -> None:
    """accelerate's `parallelism_config`: HSDP (dp_replicate × dp_shard) is `fsdp.shard_size` dp_shard; tensor and
    context parallelism rayft does not have, so a file asking for them is refused rather than trained otherwise."""
    sizes = {str(k).removeprefix("parallelism_config_"): v for k, v in mesh.items()}
    other = {k: int(v) for k, v in sizes.items() if k in ("tp_size", "cp_size", "sp_size") and int(v) > 1}
    if other:
        raise ConfigError(
            f"{source}: parallelism_config {', '.join(f'{k} {v}' for k, v in other.items())}: rayft shards with "
            "FSDP2 (and expert parallelism) only; set them to 1"
        )
    if int(sizes.get("dp_replicate_size", 1)) > 1 and int(sizes.get("dp_shard_size", 1)) > 1:
        raw.setdefault("fsdp", {})["shard_size"] = int(sizes["dp_shard_size"])


def _fsdp(keys: dict[str, Any], raw: dict[str, dict[str, Any]], notes: list[str], per_node: int) -> None:
    """accelerate's fsdp_* keys → the fsdp section (and model.load_mode)."""
    fsdp = raw.setdefault("fsdp", {})
    strategy = keys.get("fsdp_sharding_strategy", keys.get("fsdp_reshard_after_forward"))
    if isinstance(strategy, bool):
        fsdp["reshard_after_forward"] = strategy
    elif strategy is not None:
        name = STRATEGY_NUMBERS.get(strategy, strategy) if isinstance(strategy, int) else str(strategy).upper()
        if name not in STRATEGIES:
            raise ConfigError(f"fsdp_sharding_strategy {strategy}: unknown; valid: {', '.join(STRATEGIES)}")
        reshard, hybrid = STRATEGIES[name]
        fsdp["reshard_after_forward"] = reshard
        if hybrid is None or hybrid:
            fsdp["shard_size"] = 1 if hybrid is None else per_node
    for theirs, ours in (
        ("fsdp_offload_params", "cpu_offload"),
        ("fsdp_activation_checkpointing", "activation_checkpointing"),
    ):
        if theirs in keys:
            fsdp[ours] = bool(keys[theirs])
    if "fsdp_forward_prefetch" in keys:
        fsdp["forward_prefetch"] = int(bool(keys["fsdp_forward_prefetch"]))
    if "fsdp_backward_prefetch" in keys:
        fsdp["backward_prefetch"] = PREFETCH.get(str(keys["fsdp_backward_prefetch"]).upper(), 1)
    if "fsdp_cpu_ram_efficient_loading" in keys:
        raw.setdefault("model", {})["load_mode"] = "sharded" if keys["fsdp_cpu_ram_efficient_loading"] else "full"
    handled = {
        "fsdp_sharding_strategy",
        "fsdp_reshard_after_forward",
        "fsdp_offload_params",
        "fsdp_forward_prefetch",
        "fsdp_activation_checkpointing",
        "fsdp_backward_prefetch",
        "fsdp_cpu_ram_efficient_loading",
    }
    built_in = sorted(k for k in keys if k in FSDP_BUILT_IN)
    if built_in:
        notes.append(
            f"rayft's FSDP2 wrapping does this itself (per decoder layer, PEFT adapter files): {', '.join(built_in)}"
        )
    unknown = sorted(k for k in keys if k not in FSDP_BUILT_IN and k not in handled)
    if unknown:
        notes.append(f"not carried over (unknown to rayft): {', '.join(unknown)}")


def _trl(trl: dict[str, Any], raw: dict[str, dict[str, Any]], notes: list[str], source: str, accept: bool) -> None:
    """The SFT YAML: rayft's own sections as they are (the seed recipe's layout), SFTConfig's flat keys by name;
    for a flat file, TRL's defaults for what it leaves out and the differences rayft cannot avoid."""
    owners = key_owners(TRL_SECTIONS)
    skipped, flat = [], {k: v for k, v in trl.items() if not (k in SECTIONS and isinstance(v, dict))}
    for key, value in trl.items():
        if key in SECTIONS and isinstance(value, dict):
            for name, item in value.items():
                _put(raw, f"{key}.{name}", item, notes, source)
        elif key in TRL_NAMES or key in owners:
            _put(raw, TRL_NAMES.get(key) or owners[key], value, notes, source)
        elif key not in TRL_HANDLED:
            skipped.append(key)
    if skipped:
        notes.append(f"{source}: not carried over (no rayft key): {', '.join(skipped)}")
    if not flat:
        return  # the seed recipe's own layout: its defaults are rayft's
    effective = {**trl_defaults(), **flat}
    _fill_trl_defaults(raw, flat, effective)
    differences = _trl_differences(raw, flat, effective) + _four_bit(raw, effective, notes, source)
    if differences and not accept:
        raise ConfigError(
            f"{source}: rayft would train otherwise than TRL here: "
            + "; ".join(differences)
            + ". Change these in the TRL file, or pass --accept-differences to write the config anyway (each "
            "difference is listed in it)"
        )
    notes += [f"differs from TRL: {d}" for d in differences]


def _four_bit(raw: dict[str, dict[str, Any]], effective: dict[str, Any], notes: list[str], source: str) -> list[str]:
    """TRL's QLoRA (`load_in_4bit`, bitsandbytes' NF4) as `model.frozen_dtype: nf4`; what rayft's NF4 does otherwise
    (another 4-bit type, block scales not double-quantised) as differences."""
    if not effective.get("load_in_4bit"):
        return []
    _put(raw, "model.frozen_dtype", "nf4", notes, source)
    differences = []
    if effective.get("bnb_4bit_quant_type", "nf4") != "nf4":
        differences.append(
            f"bnb_4bit_quant_type {effective['bnb_4bit_quant_type']}: rayft's 4-bit base is NF4; set "
            "bnb_4bit_quant_type: nf4"
        )
    if not effective.get("use_bnb_nested_quant"):
        differences.append(
            "use_bnb_nested_quant false (TRL's default): bitsandbytes keeps each block's scale whole, where rayft's "
            "NF4 quantises the scales again (QLoRA's double quantisation, 0.37 bits a weight less); set "
            "use_bnb_nested_quant: true"
        )
    return differences


def trl_defaults() -> dict[str, Any]:
    """The installed TRL's defaults of `SFTConfig` and `ModelConfig` fields (enums as their values)."""
    # trl re-exports these lazily; its TYPE_CHECKING import lacks `as`, so mypy sees no explicit export
    from trl import ModelConfig, SFTConfig  # type: ignore[attr-defined]

    found: dict[str, Any] = {}
    for cls in (SFTConfig, ModelConfig):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                found.setdefault(f.name, getattr(f.default, "value", f.default))
    return found


def _fill_trl_defaults(raw: dict[str, dict[str, Any]], flat: dict[str, Any], effective: dict[str, Any]) -> None:
    """Every mapped setting neither file gave: TRL's default. Evaluation follows TRL: no hold-out without it."""
    for dotted, field in TRL_DEFAULTED.items():
        section, key = dotted.split(".", 1)
        if key in raw.get(section, {}) or field in flat or field not in effective:
            continue
        raw.setdefault(section, {})[key] = _as_rayft(dotted, effective[field])
    if "warmup_ratio" not in flat and "warmup_ratio" not in raw.get("train", {}):
        # transformers 5's TrainingArguments has warmup_steps only: no warm-up unless the file asks for one
        raw.setdefault("train", {})["warmup_ratio"] = effective.get("warmup_ratio", 0.0)
    evaluates = raw.get("train", {}).get("eval_strategy", effective.get("eval_strategy", "no")) != "no"
    if not evaluates and "val_ratio" not in raw.get("data", {}):
        raw.setdefault("data", {})["val_ratio"] = 0.0  # TRL evaluates nothing, so it holds nothing out
    if effective.get("assistant_only_loss") and "completion_only_loss" not in flat:
        raw.setdefault("data", {})["completion_only_loss"] = True


def _as_rayft(dotted: str, value: Any) -> Any:
    """TRL's value in rayft's type: whole epochs and steps, report_to as a list."""
    if dotted in ("train.num_train_epochs", "train.logging_steps", "train.save_steps") and float(value).is_integer():
        return int(value)
    if dotted == "train.report_to":
        return [value] if isinstance(value, str) else value
    return value


def _trl_differences(raw: dict[str, dict[str, Any]], flat: dict[str, Any], effective: dict[str, Any]) -> list[str]:
    found = [text for field, differs, text in TRL_DIFFERENCES if field in effective and differs(effective[field])]
    strategy = effective.get("packing_strategy", "bfd")
    if effective.get("packing") and strategy != "wrapped":
        found.append(
            f"packing_strategy {strategy}: TRL places whole examples in rows (best-fit decreasing), where rayft's "
            "packing concatenates them and cuts the stream into rows of data.max_length (an example may span two "
            "rows); set packing_strategy: wrapped, which packs as rayft does"
        )
    if not any(k in flat for k in LOSS_KEYS) and "completion_only_loss" not in raw.get("data", {}):
        found.append(
            "assistant_only_loss false (TRL's default): TRL trains every token of a conversation, where rayft "
            "trains the assistant turns of chat data (data.completion_only_loss); set assistant_only_loss or "
            "completion_only_loss"
        )
    return found


def _put(raw: dict[str, dict[str, Any]], dotted: str, value: Any, notes: list[str], source: str) -> None:
    section, key = dotted.split(".", 1)
    values = raw.setdefault(section, {})
    if key in values and values[key] != value:
        notes.append(
            f"{dotted}: {source} says {value!r} where the accelerate config says {values[key]!r}; kept {value!r}"
        )
    values[key] = value


def to_yaml(raw: dict[str, Any], notes: list[str], accelerate: str, trl: str | None) -> str:
    """The config file's text: where it came from and what was left out, as comments above the sections."""
    command = f"rayft config from-accelerate {accelerate}" + (f" --trl {trl}" if trl else "")
    header = [f"# Written by: {command}", *(f"# note: {n}" for n in notes)]
    return "\n".join(header) + "\n" + yaml.safe_dump(raw, sort_keys=False)
