"""`rayft export`: hand a trained adapter over as is, or merged into a standalone text-only checkpoint.

The merged checkpoint is what plain `transformers` loads without rayft: the causal LM alone (for Mistral-Small-4,
`Mistral4ForCausalLM` without the vision tower), dequantised from FP8, LoRA folded in (routed experts included),
saved as safetensors with its config and tokenizer. Merging holds the whole model in host memory once
(≈ 2 bytes × parameters in bf16), on one machine, outside the training cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from rayft.config import DTYPES, Config, ConfigError, ModelConfig
from rayft.data.tokenizer import copy_tokenizer_files, has_tokenizer
from rayft.model.files import (
    ADAPTER_CONFIG,
    ADAPTER_FILES,
    INDEX_FILE,
    check_adapter,
    check_adapter_files,
    check_safetensors_dir,
    check_weights_match,
)
from rayft.schema import checked


def export(adapter: Path, base: Path, out: Path, merge: bool, dtype: str | None = None) -> Path:
    """Checks everything first (no work on a bad adapter or base), writes into a temporary directory next to
    `out` and renames it into place: `out` is either the complete export or untouched, never half-written.
    `dtype`: of the merged weights; None keeps the base's own (bf16 for a quantised base)."""
    adapter, base, out = Path(adapter), Path(base), Path(out)
    _check_inputs(adapter, base, dtype)
    dtype = dtype or base_dtype(base)
    model = check_adapter(adapter, Config(model=ModelConfig(model_name_or_path=str(base))))
    if merge:
        check_safetensors_dir(base, f"--base {base}")
        check_weights_match(model, base)
    _check_out(out)
    created = _missing_parents(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 would otherwise become the export's permissions
    try:
        _write(adapter, base, staging, merge, dtype)
        _replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in created:  # innermost first
            try:
                parent.rmdir()
            except OSError:
                break
        raise
    return out


def _write(adapter: Path, base: Path, out: Path, merge: bool, dtype: str) -> None:
    if merge:
        _merge(adapter, base, out, getattr(torch, dtype))
    else:
        for name in ADAPTER_FILES:
            shutil.copy2(adapter / name, out / name)
        config = json.loads((out / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str(base.resolve())
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer_files(adapter if has_tokenizer(adapter) else base, out)


def _replace(staging: Path, out: Path) -> None:
    """Rename the finished export into place; a previous export there is swapped out, then deleted."""
    if not out.exists():
        staging.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _check_out(out: Path) -> None:
    """`--out` is a new path, an empty directory or a previous export (replaced); never a file or someone's
    unrelated directory."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory path (created if missing)")
    if out.is_dir() and any(out.iterdir()) and not _is_export(out):
        raise ConfigError(
            f"--out {out} is a directory with other content (not a previous export); choose a new or empty directory"
        )
    existing = out.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--out {out}: {existing} is a file, not a directory")


def _is_export(directory: Path) -> bool:
    return any((directory / name).is_file() for name in (ADAPTER_CONFIG, "config.json", INDEX_FILE))


def _missing_parents(out: Path) -> list[Path]:
    missing = []
    parent = out.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    return missing


def _merge(adapter: Path, base: Path, out: Path, dtype: torch.dtype) -> None:
    import peft

    from rayft.model.build import empty_model
    from rayft.model.weights import buffers_kept, load_sharded_

    section = {"model_name_or_path": str(base), "torch_dtype": str(dtype).removeprefix("torch.")}
    model = empty_model(checked("model", ModelConfig, section))
    with buffers_kept(model):
        model.to_empty(device=torch.device("cpu"))
    load_sharded_(model, base)  # one process: whole tensors, dequantised
    merged = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.config.use_cache = True
    merged.save_pretrained(str(out))


def base_dtype(base: Path) -> str:
    """The dtype a base checkpoint declares (its config.json, or its text model's), where it is one a merge can
    write; bfloat16 for a quantised (FP8) base or one that declares none."""
    config = json.loads((base / "config.json").read_text())
    for part in (config, config.get("text_config") or {}):
        if "quantization_config" in part:
            return "bfloat16"
    declared = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    return declared if declared in DTYPES else "bfloat16"


def _check_inputs(adapter: Path, base: Path, dtype: str | None) -> None:
    check_adapter_files(adapter, f"--adapter {adapter}")
    if not (base / "config.json").is_file():
        raise ConfigError(f"--base {base}: not a model directory (no config.json)")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
