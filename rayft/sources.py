"""Find the files behind each dataset split on disk, before any Ray work starts.

Understands the layouts users actually have: a Hugging Face datasets directory
(`<root>/<config_name>/<split>-*.parquet`, as wikitext ships, or `<root>/data/<split>-*`), a directory of
`<split>.jsonl`-style files, a directory of plain data files, or a single file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rayft.config import ConfigError, DataConfig

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}


@dataclass(frozen=True)
class SplitFiles:
    """The files of one split and the reader they need."""

    format: str
    paths: tuple[str, ...]


def resolve_splits(data: DataConfig) -> tuple[SplitFiles, SplitFiles | None]:
    """Return (train, validation) files; validation is None when the dataset has no such split."""
    root = Path(data.dataset_name_or_path).expanduser()
    if not root.exists():
        raise ConfigError(
            f"data.dataset_name_or_path: {root} does not exist (a local file or directory is expected; "
            "download hub datasets to the shared volume first)"
        )
    if root.is_file():
        return _as_split(str(root), [root]), None

    for base in _search_roots(root, data.dataset_config_name):
        train = _split_files(base, data.train_split)
        if train:
            val = _split_files(base, data.val_split) if data.val_split else []
            return (
                _as_split(f"split '{data.train_split}' in {base}", train),
                _as_split(f"split '{data.val_split}' in {base}", val) if val else None,
            )

    loose = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in FORMATS)
    if loose:
        return _as_split(str(root), loose), None
    looked = ", ".join(str(b) for b in _search_roots(root, data.dataset_config_name))
    raise ConfigError(
        f"data.dataset_name_or_path: no '{data.train_split}' split found in {root} (looked for "
        f"{data.train_split}-*.parquet / {data.train_split}.jsonl / {data.train_split}/*.txt in {looked}); "
        "check data.dataset_config_name and data.train_split"
    )


def _search_roots(root: Path, config_name: str | None) -> list[Path]:
    candidates = [root / config_name] if config_name else []
    candidates += [root / "data", root]
    return [c for c in candidates if c.is_dir()]


def _split_files(base: Path, split: str) -> list[Path]:
    found: list[Path] = []
    for suffix in FORMATS:
        found += base.glob(f"{split}-*{suffix}")
        found += base.glob(f"{split}{suffix}")
        found += base.glob(f"{split}/*{suffix}")
    return sorted(set(found))


def _as_split(what: str, paths: list[Path]) -> SplitFiles:
    formats = {FORMATS.get(p.suffix) for p in paths}
    if None in formats:
        raise ConfigError(f"{what}: unsupported file type(s); use {', '.join(FORMATS)}")
    if len(formats) > 1:
        raise ConfigError(f"{what}: mixes file types ({', '.join(sorted(formats))}); keep one format per split")
    empty = [str(p) for p in paths if p.stat().st_size == 0]
    if empty:
        raise ConfigError(f"{what}: empty file(s): {', '.join(empty)}")
    return SplitFiles(format=formats.pop(), paths=tuple(str(p.resolve()) for p in paths))
