"""Tokenizer loading with the special tokens Mistral checkpoints often leave unset, and the preflight check that the
tokenizer is there, its JSON files parse and it loads (before any cluster resource is held)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from rayft.config import Config, ConfigError, ModelConfig
from rayft.file_checks import check_json_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# transformers is imported inside load_tokenizer: tokenizer actors that only encode text never need it (a
# third of their start-up).

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
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path(model))
    ids = _special_ids(Path(model.model_name_or_path) / "config.json")
    vocab = tok.get_vocab()
    for role in ("bos", "eos", "pad"):
        if getattr(tok, f"{role}_token") is not None:
            continue
        token = None
        if ids.get(role) is not None:
            token = tok.convert_ids_to_tokens(cast(int, ids[role]))  # not None: checked above
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


# Strings on which the Rust tokenizer file must give transformers' exact ids before the actors may use it alone.
PROBE = [
    "The quick brown fox, 1234567 times.",
    "  leading spaces\tand tabs\n\nnew lines ",
    " = Valkyria Chronicles III = ",
    "héllo wörld — naïve café ½",
    "日本語のテキストと中文",
    "emoji 🤗 and symbols <>{}[]#@",
    "<s>literal</s> [INST] markers [/INST]",
    "x",
]


@dataclass(frozen=True)
class TokenizerFacts:
    """What the tokenizer actors need, settled once on the driver."""

    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    # tokenizer.json when the `tokenizers` library alone encodes exactly as the loaded tokenizer does: the actors
    # then skip transformers (start in a third of the time) and encode about twice as fast.
    rust_file: str | None
    # Tokens it can produce (added ones included): the embedding must have at least as many rows.
    vocab_size: int | None = None


def tokenizer_facts(model: ModelConfig) -> TokenizerFacts:
    """Settled by loading the tokenizer with transformers (seconds, every run), or read back from the local cache
    when the same files gave them before (rayft/cache.py: keyed by their bytes and the library versions)."""
    from rayft.cache import content_key, read_cached, write_cached

    directory = Path(tokenizer_path(model)).expanduser()
    files = [directory / n for n in (*TOKENIZER_FILES, "special_tokens_map.json")]
    key = content_key(
        "tokenizer-facts",
        [*files, Path(model.model_name_or_path) / "config.json"],
        packages=("transformers", "tokenizers"),
    )
    cached = read_cached("tokenizer-facts", key)
    if cached is not None and (cached.get("rust_file") is None or Path(cached["rust_file"]).is_file()):
        return TokenizerFacts(**cached)
    tok = load_tokenizer(model)
    facts = TokenizerFacts(tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, _rust_file(tok, model), len(tok))
    write_cached("tokenizer-facts", key, dataclasses.asdict(facts))
    return facts


def _rust_file(tok: PreTrainedTokenizerBase, model: ModelConfig) -> str | None:
    path = Path(tokenizer_path(model)).expanduser() / "tokenizer.json"
    if not path.is_file():
        return None
    encode = rust_encoder(str(path))
    return str(path) if encode(PROBE) == tok(PROBE, add_special_tokens=False)["input_ids"] else None


def rust_encoder(path: str) -> Callable[[list[str]], list[list[int]]]:
    """Texts → ids without special tokens, straight from a tokenizer.json; one per file version and process (the
    driver encodes both of a small source's splits, and a 131k-entry file takes ~0.4 s to load)."""
    stat = os.stat(path)
    return _rust_encoder(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _rust_encoder(path: str, mtime_ns: int, size: int) -> Callable[[list[str]], list[list[int]]]:
    from tokenizers import Tokenizer

    rust = Tokenizer.from_file(path)
    return lambda texts: [e.ids for e in rust.encode_batch_fast(texts, add_special_tokens=False)]


def check_tokenizer(cfg: Config) -> TokenizerFacts:
    """The tokenizer the run would load, before any cluster: its files present, parseable and loading; its facts."""
    path = Path(tokenizer_path(cfg.model)).expanduser()
    if not path.is_dir() or not has_tokenizer(path):
        raise ConfigError(
            f"model.tokenizer_name_or_path: no tokenizer in {path} (looked for {', '.join(TOKENIZER_FILES)}); "
            "set model.tokenizer_name_or_path to the directory that has one"
        )
    for name in (*TOKENIZER_FILES, "special_tokens_map.json"):
        check_json_file(path / name)
    try:
        return tokenizer_facts(cfg.model)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"model.tokenizer_name_or_path: the tokenizer in {path} does not load ({type(e).__name__}: {first}); "
            "copy its tokenizer files again from the model's source"
        ) from None
