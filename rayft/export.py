"""`rayft export`: hand a trained adapter over as is, or merged into a standalone text-only checkpoint.

The merged checkpoint is what plain `transformers` loads without rayft: the causal LM alone (for Mistral-Small-4,
`Mistral4ForCausalLM` without the vision tower), dequantised from FP8, LoRA folded in (routed experts included),
saved as safetensors with its config and tokenizer. Merging holds the whole model in host memory once
(≈ 2 bytes × parameters in bf16), on one machine, outside the training cluster.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from rayft.config import DTYPES, ConfigError, ModelConfig
from rayft.data.tokenizer import copy_tokenizer_files, has_tokenizer

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def export(adapter: Path, base: Path, out: Path, merge: bool, dtype: str = "bfloat16") -> Path:
    adapter, base, out = Path(adapter), Path(base), Path(out)
    _check_inputs(adapter, base, dtype)
    out.mkdir(parents=True, exist_ok=True)
    if merge:
        _merge(adapter, base, out, getattr(torch, dtype))
    else:
        for name in ADAPTER_FILES:
            shutil.copy2(adapter / name, out / name)
        config = json.loads((out / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str(base.resolve())
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer_files(adapter if has_tokenizer(adapter) else base, out)
    return out


def _merge(adapter: Path, base: Path, out: Path, dtype: torch.dtype) -> None:
    import peft

    from rayft.model.build import empty_model
    from rayft.model.weights import buffers_kept, load_sharded_

    model = empty_model(ModelConfig(model_name_or_path=str(base), torch_dtype=str(dtype).removeprefix("torch.")))
    with buffers_kept(model):
        model.to_empty(device=torch.device("cpu"))
    load_sharded_(model, base)  # one process: whole tensors, dequantised
    merged = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.config.use_cache = True
    merged.save_pretrained(str(out))


def _check_inputs(adapter: Path, base: Path, dtype: str) -> None:
    missing = [name for name in ADAPTER_FILES if not (adapter / name).is_file()]
    if missing:
        raise ConfigError(f"--adapter {adapter}: not a PEFT adapter directory (missing {', '.join(missing)})")
    if not (base / "config.json").is_file():
        raise ConfigError(f"--base {base}: not a model directory (no config.json)")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
