"""TRL's and transformers' names for rayft's keys, where they are spelt otherwise (`lora_r` is `lora.r`).

One table for both readers of those names: the converter of a TRL file (`rayft config from-accelerate --trl`) carries
each over by it, and a rayft config that uses one of them is answered with the rayft key it means.
"""

from __future__ import annotations

# SFTConfig / TRL ModelConfig / ScriptArguments / TrainingArguments name → rayft's dotted key.
TRL_NAMES = {
    "model_revision": "model.revision", "dtype": "model.torch_dtype", "lora_r": "lora.r",
    "lora_target_modules": "lora.target_modules", "lora_task_type": "lora.task_type",
    "lora_modules_to_save": "lora.modules_to_save",
    "dataset_name": "data.dataset_name_or_path", "dataset_config": "data.dataset_config_name",
    "dataset_train_split": "data.train_split", "dataset_test_split": "data.val_split",
    "dataset_text_field": "data.text_field", "max_seq_length": "data.max_length",
    "evaluation_strategy": "train.eval_strategy",
}  # fmt: skip


def trl_hint(name: str) -> str:
    """` (TRL's lora_r is rayft's lora.r)` for a TRL name rayft spells otherwise; empty for any other name."""
    return f" (TRL's {name} is rayft's {TRL_NAMES[name]})" if name in TRL_NAMES else ""
