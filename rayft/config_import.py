"""`rayft config from-accelerate`: the rayft config that does what an accelerate launch config and a TRL/SFT
training YAML did, so users of that recipe start from their own files rather than re-typing them.

accelerate's processes become Ray workers and its `fsdp_*` keys the `fsdp` section; the SFT YAML's keys (the seed
recipe's sections, or SFTConfig's flat keys as `trl sft --config` reads them) map to model/lora/data/train. What
Ray or rayft does by itself (launching, wrapping, state dicts) is left out with a note, never silently.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from rayft.config import SECTIONS, Config, ConfigError, parse_override, read_yaml, set_nested

# Launch facts Ray takes care of (processes, rendezvous, the machine's rank): nothing to carry over.
LAUNCH_KEYS = frozenset({
    "compute_environment", "debug", "downcast_bf16", "enable_cpu_affinity", "rdzv_backend", "same_network",
    "machine_rank", "main_training_function", "main_process_ip", "main_process_port", "gpu_ids", "dynamo_config",
    "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu", "num_processes", "num_machines", "distributed_type",
    "mixed_precision", "fsdp_config",
})  # fmt: skip
# FSDP settings rayft's FSDP2 wrapping fixes itself: per decoder layer, LoRA-only trainable, PEFT adapter files.
FSDP_BUILT_IN = frozenset({
    "fsdp_version", "fsdp_use_orig_params", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_limit_all_gathers", "fsdp_sync_module_states", "fsdp_state_dict_type", "state_dict_cpu_offload",
    "fsdp_min_num_params",
})  # fmt: skip
# FSDP1 sharding strategies (by name or number) → (fsdp.reshard_after_forward, sharded within a node only)
STRATEGIES = {
    "FULL_SHARD": (True, False), "SHARD_GRAD_OP": (False, False), "NO_SHARD": (False, None),
    "HYBRID_SHARD": (True, True), "HYBRID_SHARD_ZERO2": (False, True), "_HYBRID_SHARD_ZERO2": (False, True),
}  # fmt: skip
STRATEGY_NUMBERS = dict(
    enumerate(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"], 1)
)
PREFETCH = {"BACKWARD_PRE": 1, "BACKWARD_POST": 1, "NO_PREFETCH": 0}
# SFTConfig / TRL ModelConfig / ScriptArguments names that are spelt differently here.
TRL_ALIASES = {
    "model_revision": "model.revision", "dtype": "model.torch_dtype", "lora_r": "lora.r",
    "lora_target_modules": "lora.target_modules", "lora_task_type": "lora.task_type",
    "dataset_name": "data.dataset_name_or_path", "dataset_config": "data.dataset_config_name",
    "dataset_train_split": "data.train_split", "dataset_test_split": "data.val_split",
    "dataset_text_field": "data.text_field", "max_seq_length": "data.max_length",
}  # fmt: skip
TRL_SECTIONS = ("model", "lora", "data", "train")


def convert(accelerate: str, trl: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> tuple[dict, list]:
    """The rayft config (checked) and notes on what was left out; ConfigError for what cannot be carried over."""
    acc = _mapping(accelerate)
    raw: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    per_node = _launch(acc, raw, accelerate)
    _fsdp(_fsdp_keys(acc), raw, notes, per_node)
    skipped = sorted(k for k in acc if k not in LAUNCH_KEYS and not k.startswith("fsdp_"))
    if skipped:
        notes.append(f"{accelerate}: not carried over (unknown to rayft): {', '.join(skipped)}")
    if trl is not None:
        _trl(_mapping(trl), raw, notes, trl)
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
    """Processes → Ray workers, machines → placement, mixed precision → train.bf16; the processes per machine."""
    kind = acc.get("distributed_type", "FSDP")
    if kind not in ("FSDP", "MULTI_GPU", "NO", "MULTI_CPU"):
        raise ConfigError(f"{source}: distributed_type {kind}: rayft trains with FSDP2 (FSDP or MULTI_GPU configs)")
    processes, machines = int(acc.get("num_processes", 1)), int(acc.get("num_machines", 1))
    if machines < 1 or processes < machines or processes % machines:
        raise ConfigError(f"{source}: num_processes {processes} must be a multiple of num_machines {machines}")
    per_node = processes // machines
    ray = raw.setdefault("ray", {})
    ray["num_workers"] = processes
    ray["placement_strategy"] = "PACK" if machines == 1 else "STRICT_SPREAD" if per_node == 1 else "SPREAD"
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
    for theirs, ours in (("fsdp_offload_params", "cpu_offload"),
                         ("fsdp_activation_checkpointing", "activation_checkpointing")):  # fmt: skip
        if theirs in keys:
            fsdp[ours] = bool(keys[theirs])
    if "fsdp_forward_prefetch" in keys:
        fsdp["forward_prefetch"] = int(bool(keys["fsdp_forward_prefetch"]))
    if "fsdp_backward_prefetch" in keys:
        fsdp["backward_prefetch"] = PREFETCH.get(str(keys["fsdp_backward_prefetch"]).upper(), 1)
    if "fsdp_cpu_ram_efficient_loading" in keys:
        raw.setdefault("model", {})["load_mode"] = "sharded" if keys["fsdp_cpu_ram_efficient_loading"] else "full"
    handled = {"fsdp_sharding_strategy", "fsdp_reshard_after_forward", "fsdp_offload_params", "fsdp_forward_prefetch",
               "fsdp_activation_checkpointing", "fsdp_backward_prefetch", "fsdp_cpu_ram_efficient_loading"}  # fmt: skip
    built_in = sorted(k for k in keys if k in FSDP_BUILT_IN)
    if built_in:
        notes.append(
            f"rayft's FSDP2 wrapping does this itself (per decoder layer, PEFT adapter files): {', '.join(built_in)}"
        )
    unknown = sorted(k for k in keys if k not in FSDP_BUILT_IN and k not in handled)
    if unknown:
        notes.append(f"not carried over (unknown to rayft): {', '.join(unknown)}")


def _trl(trl: dict[str, Any], raw: dict[str, dict[str, Any]], notes: list[str], source: str) -> None:
    """The SFT YAML: rayft's own sections as they are (the seed recipe's layout), SFTConfig's flat keys by name."""
    owners = _field_owners()
    skipped = []
    for key, value in trl.items():
        if key in SECTIONS and isinstance(value, dict):
            for name, item in value.items():
                _put(raw, f"{key}.{name}", item, notes, source)
        elif key in TRL_ALIASES or key in owners:
            _put(raw, TRL_ALIASES.get(key) or owners[key], value, notes, source)
        else:
            skipped.append(key)
    if skipped:
        notes.append(f"{source}: not carried over (no rayft key): {', '.join(skipped)}")


def _put(raw: dict[str, dict[str, Any]], dotted: str, value: Any, notes: list[str], source: str) -> None:
    section, key = dotted.split(".", 1)
    values = raw.setdefault(section, {})
    if key in values and values[key] != value:
        notes.append(
            f"{dotted}: {source} says {value!r} where the accelerate config says {values[key]!r}; kept {value!r}"
        )
    values[key] = value


def _field_owners() -> dict[str, str]:
    """Flat SFTConfig name → `section.key`, for names only one of model/lora/data/train has."""
    owners: dict[str, list[str]] = {}
    for section in TRL_SECTIONS:
        for f in dataclasses.fields(SECTIONS[section]):
            owners.setdefault(f.name, []).append(f"{section}.{f.name}")
    return {name: places[0] for name, places in owners.items() if len(places) == 1}


def to_yaml(raw: dict[str, Any], notes: list[str], accelerate: str, trl: str | None) -> str:
    """The config file's text: where it came from and what was left out, as comments above the sections."""
    command = f"rayft config from-accelerate {accelerate}" + (f" --trl {trl}" if trl else "")
    header = [f"# Written by: {command}", *(f"# note: {n}" for n in notes)]
    return "\n".join(header) + "\n" + yaml.safe_dump(raw, sort_keys=False)
