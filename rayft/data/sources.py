"""Find where each dataset split comes from, on the driver, before any Ray work starts.

Understands the layouts users actually have: a Hugging Face datasets directory
(`<root>/<config_name>/<split>-*.parquet`, as wikitext ships, or `<root>/data/<split>-*`), a `save_to_disk`
directory, a directory of `<split>.jsonl`-style files, a directory of plain data files, a single file, a glob,
or a hub dataset name (loaded with `datasets`, needs network access). Every failure names the path or split and
what to change.
"""

from __future__ import annotations

import glob
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayft.config import ConfigError, DataConfig

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}
GLOB_CHARS = re.compile(r"[*?[]")
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class SplitSource:
    """One split: its files and the reader they need, or an already loaded `datasets.Dataset` (format `hf`)."""

    what: str  # for messages: "split 'train' in /data/wikitext/wikitext-2-raw-v1"
    format: str  # parquet | json | text | hf
    paths: tuple[str, ...] = ()
    dataset: Any = field(default=None, compare=False, repr=False)

    def nbytes(self) -> int:
        if self.format == "hf":
            return int(self.dataset.data.nbytes)
        return sum(Path(p).stat().st_size for p in self.paths)

    def describe(self) -> str:
        if self.format == "hf":
            return f"{self.what} ({len(self.dataset):,} records)"
        return f"{self.what}: {len(self.paths)} {self.format} file(s)"

    def columns(self) -> list[str]:
        """The record fields, read from the first file (parquet schema, first JSON records) or the dataset."""
        if self.format == "hf":
            return list(self.dataset.column_names)
        if self.format == "text":
            return ["text"]
        if self.format == "parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(self.paths[0]).names)
        return sorted({key for record in _first_json_records(Path(self.paths[0])) for key in record})


def resolve_splits(data: DataConfig) -> tuple[SplitSource, SplitSource | None]:
    """Return (train, validation); validation is None when the dataset has no such split."""
    spec = data.dataset_name_or_path
    if GLOB_CHARS.search(spec):
        matches = sorted(Path(p) for p in glob.glob(str(Path(spec).expanduser()), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise ConfigError(f"data.dataset_name_or_path: the pattern {spec} matches no file")
        return _as_split(f"files matching {spec}", files), None
    root = Path(spec).expanduser()
    if not root.exists():
        if HUB_NAME.match(spec) and not spec.startswith((".", "/", "~")):
            return _hub_splits(data)
        raise ConfigError(
            f"data.dataset_name_or_path: {root} does not exist (a local file, directory or glob is expected; "
            "download hub datasets to the shared volume first)"
        )
    if root.is_file():
        return _as_split(str(root), [root]), None
    if (root / "dataset_dict.json").is_file() or (root / "state.json").is_file():
        return _saved_splits(root, data)

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


def _as_split(what: str, paths: list[Path]) -> SplitSource:
    formats = {FORMATS.get(p.suffix) for p in paths}
    if None in formats:
        odd = sorted({p.suffix or p.name for p in paths if p.suffix not in FORMATS})
        raise ConfigError(f"{what}: unsupported file type(s) {', '.join(odd)}; use {', '.join(FORMATS)}")
    if len(formats) > 1:
        raise ConfigError(f"{what}: mixes file types ({', '.join(sorted(formats))}); keep one format per split")
    empty = [str(p) for p in paths if p.stat().st_size == 0]
    if empty:
        raise ConfigError(f"{what}: empty file(s): {', '.join(empty)}")
    return SplitSource(what=what, format=formats.pop(), paths=tuple(str(p.resolve()) for p in paths))


def _saved_splits(root: Path, data: DataConfig) -> tuple[SplitSource, SplitSource | None]:
    """A directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    import datasets

    loaded = datasets.load_from_disk(str(root))
    if isinstance(loaded, datasets.Dataset):
        return SplitSource(what=f"dataset saved in {root}", format="hf", dataset=loaded), None
    return _pick_splits(loaded, data, str(root))


def _hub_splits(data: DataConfig) -> tuple[SplitSource, SplitSource | None]:
    import datasets

    name = data.dataset_name_or_path
    try:
        loaded = datasets.load_dataset(name, data.dataset_config_name)
    except Exception as e:  # offline, unknown name, gated: all end the same way for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"data.dataset_name_or_path: '{name}' is not a local path and loading it from the Hugging Face hub "
            f"failed ({first}). On a machine without hub access, download it to the shared volume first "
            "(its parquet files, or `save_to_disk`) and point at that directory"
        ) from None
    return _pick_splits(loaded, data, f"hub dataset {name}")


def _pick_splits(loaded: Any, data: DataConfig, where: str) -> tuple[SplitSource, SplitSource | None]:
    if data.train_split not in loaded:
        raise ConfigError(f"data.train_split: no split '{data.train_split}' in {where} (it has {', '.join(loaded)})")
    train = SplitSource(f"split '{data.train_split}' of {where}", "hf", dataset=loaded[data.train_split])
    if data.val_split and data.val_split in loaded:
        return train, SplitSource(f"split '{data.val_split}' of {where}", "hf", dataset=loaded[data.val_split])
    return train, None


def _first_json_records(path: Path, limit: int = 100) -> list[dict[str, Any]]:
    """Up to `limit` records from the start of a JSON Lines file (or a JSON array), skipping broken lines."""
    with path.open("rb") as f:
        head = f.read(1 << 20)
    if head.lstrip().startswith(b"["):
        try:
            records = json.loads(path.read_bytes())
        except ValueError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return [r for r in records[:limit] if isinstance(r, dict)]
    records = []
    for line in head.splitlines()[:limit]:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
