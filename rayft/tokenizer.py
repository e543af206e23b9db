"""Tokenizer loading with the special tokens Mistral checkpoints often leave unset."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rayft.config import ModelConfig

# Any of these makes a directory a tokenizer directory; special_tokens_map.json travels with them when copied.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tekken.json", "tokenizer.model")


def copy_tokenizer_files(source: Path, destination: Path) -> None:
    for name in (*TOKENIZER_FILES, "special_tokens_map.json"):
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, Path(destination) / name)


def has_tokenizer(directory: Path) -> bool:
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


# Mistral's tekken vocabulary reserves these ids; tokenizer files converted from it do not declare them.
MISTRAL_SPECIALS = {"bos": "<s>", "eos": "</s>", "pad": "<pad>"}


def tokenizer_path(model: ModelConfig) -> str:
    return model.tokenizer_name_or_path or model.model_name_or_path


def load_tokenizer(model: ModelConfig) -> PreTrainedTokenizerBase:
    """Load the tokenizer and make sure bos, eos and pad are set (pad falls back to `<pad>`, then eos)."""
    tok = AutoTokenizer.from_pretrained(tokenizer_path(model))
    ids = _special_ids(Path(model.model_name_or_path) / "config.json")
    vocab = tok.get_vocab()
    for role in ("bos", "eos", "pad"):
        if getattr(tok, f"{role}_token") is not None:
            continue
        token = None
        if ids.get(role) is not None:
            token = tok.convert_ids_to_tokens(ids[role])
        elif MISTRAL_SPECIALS[role] in vocab:
            token = MISTRAL_SPECIALS[role]
        if token is not None:
            setattr(tok, f"{role}_token", token)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _special_ids(config_json: Path) -> dict[str, int | None]:
    """bos/eos/pad ids declared by the model config (the text config inside a VLM wrapper)."""
    try:
        cfg = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return {}
    cfg = cfg.get("text_config") or cfg
    out = {}
    for role in ("bos", "eos", "pad"):
        value = cfg.get(f"{role}_token_id")
        out[role] = value[0] if isinstance(value, list) else value
    return out
