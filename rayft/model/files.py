"""Checks of a model directory and its weight files that cost only their headers: run on the driver before any
cluster resource is held (a directory with a config.json of a model_type transformers knows, and weights).

A safetensors file is an 8-byte header length, a JSON header (dtype, shape and byte range of every tensor), then
the data; a file cut short still has a readable header, so the header's byte ranges are compared with the size
on disk. Shapes are compared with the model `config.json` builds on the meta device: the sharded loader reads
the rows the model asks for, so a config that does not describe the weights would otherwise load garbage (or the
neighbouring tensor's bytes) without an error.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from rayft.config import Config, ConfigError
from rayft.file_checks import check_json_file, check_link
from rayft.model.safetensors_format import SAFETENSORS_DTYPES

if TYPE_CHECKING:
    from transformers import PreTrainedModel

INDEX_FILE = "model.safetensors.index.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
REDOWNLOAD = "download or copy it again"


def safetensors_header(path: Path, what: str) -> dict[str, Any]:
    """The parsed header of one safetensors file, after checking that the file holds every byte it declares."""
    try:
        return _read_header(path, what)
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path} ({e.strerror or e}); {REDOWNLOAD}") from None


def _read_header(path: Path, what: str) -> dict[str, Any]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ConfigError(f"{what}: {path} is {size} bytes, too short for a safetensors file; {REDOWNLOAD}")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise ConfigError(
                f"{what}: {path} declares a {header_len}-byte header but has {size} bytes: not a safetensors file, "
                f"or cut short; {REDOWNLOAD}"
            )
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"{what}: {path} has a corrupt safetensors header ({e}); {REDOWNLOAD}") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{what}: {path} has a corrupt safetensors header (not a JSON object); {REDOWNLOAD}")
    end = max((_tensor_span(path, what, key, info) for key, info in header.items() if key != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise ConfigError(
            f"{what}: {path} is truncated: its header declares {8 + header_len + end:,} bytes, the file has "
            f"{size:,} (an interrupted download or copy); {REDOWNLOAD}"
        )
    return header


def _tensor_span(path: Path, what: str, key: str, info: Any) -> int:
    """The end of a tensor's byte range, after checking that range fits its dtype and shape."""
    try:
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        shape = [int(n) for n in info["shape"]]
        begin, end = (int(n) for n in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(
            f"{what}: {path}: tensor '{key}' has an unreadable header entry {info!r} (dtype {_dtype_names()}); "
            f"{REDOWNLOAD}"
        ) from None
    if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
        raise ConfigError(
            f"{what}: {path}: tensor '{key}' spans bytes {begin}..{end}, but {info['dtype']} {shape} needs "
            f"{math.prod(shape) * dtype.itemsize}: a corrupt header; {REDOWNLOAD}"
        )
    return end


def _dtype_names() -> str:
    return "/".join(SAFETENSORS_DTYPES)


def check_safetensors_dir(directory: Path, what: str = "model.model_name_or_path") -> None:
    """Every `*.safetensors` file complete, and the index (when there is one) consistent with the files."""
    headers = {p.name: safetensors_header(p, what) for p in sorted(directory.glob("*.safetensors"))}
    index = directory / INDEX_FILE
    if index.is_file():
        _check_index(index, headers, what)


def _check_index(index: Path, headers: dict[str, dict[str, Any]], what: str) -> None:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{what}: {index} is not a safetensors index ({e}); {REDOWNLOAD}") from None
    for file in sorted(set(weight_map.values())):
        if file not in headers:
            tensor = next(k for k, v in weight_map.items() if v == file)
            raise ConfigError(
                f"{what}: {index} names shard {file} (tensor '{tensor}' and others), which is not in "
                f"{index.parent}; download the missing shard"
            )
    for key, file in weight_map.items():
        if key not in headers[file]:
            raise ConfigError(
                f"{what}: {index} puts tensor '{key}' in {file}, which does not have it (the index and the shards "
                f"come from different downloads?); {REDOWNLOAD}"
            )
    indexed = set(weight_map.values())
    for file in sorted(indexed):
        extra = sorted(k for k in headers[file] if k != "__metadata__" and k not in weight_map)
        if extra:
            raise ConfigError(
                f"{what}: {index.parent / file} holds tensor '{extra[0]}'"
                + (f" and {len(extra) - 1} more" if len(extra) > 1 else "")
                + f" that {index.name} does not list (the index and the shards come from different downloads?); "
                + REDOWNLOAD
            )


def check_weights_match(model: nn.Module, directory: Path) -> None:
    """The sharded loader's own read plan, made here on the meta model `config.json` builds: every base tensor is
    in the checkpoint (a tied head is its embedding) with the model's shape, a usable dtype and FP8 scale — what
    would fail on the workers after the cluster started fails now."""
    from rayft.model.weights import CheckpointKeyError, CheckpointShapeError, SafetensorsCheckpoint, plan_reads

    checkpoint = SafetensorsCheckpoint(directory)
    try:
        plan_reads(model, checkpoint)
    except CheckpointShapeError as e:
        raise ConfigError(f"model.model_name_or_path: {e}") from None
    except CheckpointKeyError as e:
        raise ConfigError(
            f"model.model_name_or_path: {e}; a tensor is never left at random init: use the weights that belong "
            "to this config.json"
        ) from None
    finally:
        checkpoint.close()


def check_vocab(tokenizer_size: int | None, model: nn.Module, tokenizer_dir: str) -> None:
    """Token ids the tokenizer can produce must index the embedding: a larger tokenizer fails (on GPU: a device
    assert) at the first rare token, hours in."""
    embeddings = cast("PreTrainedModel", model).get_input_embeddings()  # a PeftModel hands the call on
    rows = cast(torch.Tensor, embeddings.weight).shape[0]
    if tokenizer_size is not None and tokenizer_size > rows:
        raise ConfigError(
            f"model.tokenizer_name_or_path: the tokenizer in {tokenizer_dir} has {tokenizer_size:,} tokens, the "
            f"model's embedding {rows:,} rows: ids from {rows:,} on would index past it; use the tokenizer that "
            "belongs to the model"
        )


def with_adapter_shape(cfg: Config, adapter: Path) -> Config:
    """cfg with LoRA shaped like a saved adapter's adapter_config.json, so that its weights fit."""
    path = Path(adapter) / ADAPTER_CONFIG
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--adapter: cannot read {path} ({e}); give a PEFT adapter directory") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"--adapter: {path} is not a JSON object; give a PEFT adapter directory")
    raw = cfg.to_dict()
    targets = saved.get("target_modules") or ["auto"]
    raw["lora"].update(
        r=saved.get("r", cfg.lora.r),
        lora_alpha=saved.get("lora_alpha", cfg.lora.lora_alpha),
        target_modules=sorted(targets) if isinstance(targets, list | set) else [targets],
        target_experts=bool(saved.get("target_parameters")),
        use_dora=bool(saved.get("use_dora")),
        use_rslora=bool(saved.get("use_rslora")),
        modules_to_save=saved.get("modules_to_save") or None,
    )
    if raw["lora"]["target_experts"]:  # what expert LoRA requires for training; it does not matter for eval or export
        raw["lora"]["lora_dropout"] = 0.0
    return Config.from_dict(raw)


def check_adapter_files(adapter: Path, what: str) -> dict[str, Any]:
    """A PEFT adapter directory holds its config and a complete safetensors file (every byte its header declares);
    returns that header. `what` names the directory's role in messages (`--adapter DIR`)."""
    missing = [name for name in ADAPTER_FILES if not (Path(adapter) / name).is_file()]
    if missing:
        raise ConfigError(f"{what}: not a PEFT adapter directory (missing {', '.join(missing)})")
    return safetensors_header(Path(adapter) / ADAPTER_WEIGHTS, what)


def check_adapter(adapter: Path, base_cfg: Config) -> nn.Module:
    """A saved adapter is complete and fits the base: its safetensors file holds every byte, and each LoRA tensor
    has the place and shape the base model, wrapped with the adapter's own config, gives it. Returns that wrapped
    model (on the meta device)."""
    from rayft.model.build import weightless_lora_model
    from rayft.model.lora import adapter_file_keys

    adapter = Path(adapter)
    header = check_adapter_files(adapter, f"--adapter {adapter}")
    cfg = with_adapter_shape(base_cfg, adapter)
    model, _ = weightless_lora_model(cfg)
    places = adapter_file_keys(model)
    shapes = dict(model.state_dict())
    ours = {target: list(shapes[target].shape) for target in places.values()}
    base = cfg.model.model_name_or_path
    for key, info in header.items():
        if key == "__metadata__":
            continue
        target = places.get(key)
        if target not in ours:
            raise ConfigError(
                f"--adapter {adapter}: tensor '{key}' has no place in the model at {base} (an adapter for another "
                "base model?); export or evaluate it with the base it was trained on"
            )
        if list(info["shape"]) != ours[target]:
            raise ConfigError(
                f"--adapter {adapter}: tensor '{key}' has shape {list(info['shape'])}, the model at {base} with "
                f"this adapter's config needs {ours[target]} (an adapter for another base model?); use the base it "
                "was trained on"
            )
    lacking = sorted(set(ours) - {places[k] for k in header if k in places})
    if lacking:
        raise ConfigError(
            f"--adapter {adapter}: {ADAPTER_WEIGHTS} has no tensor for '{lacking[0]}'"
            + (f" and {len(lacking) - 1} more" if len(lacking) > 1 else "")
            + f" that its {ADAPTER_CONFIG} targets; the adapter is incomplete: copy it again"
        )
    return model


def check_model_dir(path: Path) -> None:
    """A local Hugging Face model directory: no dangling link, a config.json of a known model_type, weights."""
    key = "model.model_name_or_path"
    check_link(path, key)
    if not path.exists():
        raise ConfigError(
            f"{key}: {path} does not exist (a local model directory is expected; download hub models to the "
            "shared volume first)"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key}: {path} has no config.json; point it at a Hugging Face model directory")
    _check_model_type(path / "config.json")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ConfigError(f"{key}: {path} has no *.safetensors weights")


def _check_model_type(config_json: Path) -> None:
    """The model_type transformers builds the model from: one it knows (rayft runs no code shipped with a model)."""
    import difflib

    import transformers

    # the module's table (with its own additions), left out of its __all__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # type: ignore[attr-defined]

    check_json_file(config_json)
    model_type = json.loads(config_json.read_bytes()).get("model_type")
    if model_type in CONFIG_MAPPING_NAMES:
        return
    if model_type is None:
        raise ConfigError(f"{config_json}: no model_type; the model's own config.json names its architecture")
    near = difflib.get_close_matches(str(model_type), CONFIG_MAPPING_NAMES, n=3)
    hint = f" (close: {', '.join(near)})" if near else ""
    raise ConfigError(
        f"{config_json}: model_type '{model_type}' is not one transformers {transformers.__version__} knows{hint}; "
        "fix it, or upgrade transformers if the architecture is newer"
    )
