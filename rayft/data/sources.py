"""Find where each dataset split comes from, on the driver, before any Ray work starts.

Understands the layouts users actually have: a Hugging Face datasets directory
(`<root>/<config_name>/<split>-*.parquet`, as wikitext ships, or `<root>/data/<split>-*`), a `save_to_disk`
directory, a directory of `<split>.jsonl`-style files, a directory of plain data files, a single file, a glob,
or a hub dataset name (loaded with `datasets`, needs network access). Every failure names the path or split and
what to change.
"""

from __future__ import annotations

import codecs
import glob
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from rayft.config import DEFAULT_VAL_SPLIT, SEED_DATASET_CONFIG, ConfigError, DataConfig
from rayft.data.files import (
    SNIFF_BYTES,
    DecodeBudget,
    check_encoding,
    check_parquet,
    first_lines,
    json_fields,
    line_count,
    parquet_columns,
    starts_json_array,
)
from rayft.data.records import decode_line
from rayft.file_checks import check_link

if TYPE_CHECKING:
    import pyarrow as pa

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}
# Names that make a file a split's: a folder holding any is never read whole as the training split.
TRL_EVAL_SPLIT = "test"
SPLIT_WORDS = ("train", "training", "validation", "valid", "val", "dev", "eval", "test")
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

    def columns(self, wanted: Iterable[str] = ()) -> list[str]:
        """The record fields: the parquet schema, the dataset's columns, or for JSON the keys of the first records
        plus each `wanted` field that any record of any file has (records lacking it are skipped, not fatal)."""
        if self.format == "hf":
            return list(self.dataset.column_names)
        if self.format == "text":
            return ["text"]
        if self.format == "parquet":
            return parquet_columns(Path(self.paths[0]))
        return json_fields([Path(p) for p in self.paths], wanted)

    def check_content(self, columns: Iterable[str], budget: DecodeBudget) -> None:
        """Every file is what its name says: parquet that decodes, text in UTF-8."""
        for path in map(Path, self.paths):
            if self.format == "parquet":
                check_parquet(path, columns, budget)
            elif self.format in ("text", "json"):
                check_encoding(path)

    def head(self, n: int) -> tuple[pa.Table, list[tuple[str, int]]]:
        """The first `n` records as the job's readers hand them to its tokenizer (columns, or `_raw` lines for JSON
        and text: rayft.data.pipeline.read_records), each with its file and index in that file."""
        import pyarrow as pa

        if self.format == "hf":
            count = min(n, len(self.dataset))
            return self.dataset.with_format("arrow")[0:count], [(self.what, i) for i in range(count)]
        tables: list[pa.Table] = []
        where: list[tuple[str, int]] = []
        for path in self.paths:
            table = _head_of_file(Path(path), self.format, n - len(where))
            tables.append(table)
            where += [(path, i) for i in range(table.num_rows)]
            if len(where) >= n:
                break
        return pa.concat_tables(tables, promote_options="default"), where

    def sample(self, n: int) -> list[tuple[str, int, Any]]:
        """The first `n` records as (file, index in that file, record or None where the line is not a JSON
        object): what `rayft validate` checks against the tokenizer's chat format (plain text has none)."""
        if self.format == "text":
            return []
        table, where = self.head(n)
        if "_raw" in table.column_names:
            records = [decode_line(raw, self.format)[0] for raw in table.column("_raw").to_pylist()]
        else:
            records = table.to_pylist()
        return [(file, index, record) for (file, index), record in zip(where, records, strict=True)]

    def rows(self) -> int:
        """Records before tokenization, as the reader yields them (what a hold-out split divides)."""
        if self.format == "hf":
            return len(self.dataset)
        if self.format == "parquet":
            import pyarrow.parquet as pq

            return sum(pq.read_metadata(p).num_rows for p in self.paths)
        return sum(_json_array_length(Path(p)) if self.format == "json" else line_count(Path(p)) for p in self.paths)


def resolve_splits(data: DataConfig) -> tuple[SplitSource, SplitSource | None]:
    """Return (train, validation); validation is None when the dataset has no such split."""
    _check_config_name(data)
    spec = data.dataset_name_or_path
    if GLOB_CHARS.search(spec):
        matches = sorted(Path(p) for p in glob.glob(str(Path(spec).expanduser()), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise ConfigError(f"data.dataset_name_or_path: the pattern {spec} matches no file")
        return _as_split(f"files matching {spec}", files), None
    root = Path(spec).expanduser()
    check_link(root, "data.dataset_name_or_path")
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
            train_source = _as_split(f"split '{data.train_split}' in {base}", train)
            val_split = eval_split(data, _split_names(base))
            val = _split_files(base, val_split) if val_split else []
            if val_split and not val:
                _no_val_split(data, str(base), _split_names(base))
            return train_source, _as_split(f"split '{val_split}' in {base}", val) if val else None

    named = sorted(
        {n for b in _search_roots(root, data.dataset_config_name) for n in _split_names(b)}
        & {*SPLIT_WORDS, data.train_split, data.val_split}
    )
    if named:
        raise ConfigError(
            f"data.train_split: no split '{data.train_split}' in {root} (it has {', '.join(named)}); name one of "
            "those (files of other splits are never read as training data)"
        )
    loose = sorted(p for p in root.iterdir() if p.suffix in FORMATS)
    for path in loose:
        check_link(path, str(root))
    if loose:
        return _as_split(str(root), loose), None
    looked = ", ".join(str(b) for b in _search_roots(root, data.dataset_config_name))
    raise ConfigError(
        f"data.dataset_name_or_path: no '{data.train_split}' split found in {root} (looked for "
        f"{data.train_split}-*.parquet / {data.train_split}.jsonl / {data.train_split}/*.txt in {looked}); "
        "check data.dataset_config_name and data.train_split"
    )


def _check_config_name(data: DataConfig) -> None:
    """`data.dataset_config_name` picks a folder of a local dataset directory (or a hub dataset's configuration):
    named for a single file, a glob, or a folder the directory lacks, it would be ignored without a word."""
    name, spec = data.dataset_config_name, data.dataset_name_or_path
    root = Path(spec).expanduser()
    if name in (None, SEED_DATASET_CONFIG):  # the default applies where the folder is, and is silent elsewhere
        return
    if GLOB_CHARS.search(spec) or root.is_file():
        what = "a file pattern" if GLOB_CHARS.search(spec) else "a single file"
        raise ConfigError(
            f"data.dataset_config_name {name!r}: data.dataset_name_or_path {spec} is {what}, which has no "
            "configurations; leave data.dataset_config_name out"
        )
    saved = (root / "dataset_dict.json").is_file() or (root / "state.json").is_file()
    if root.is_dir() and not saved and not (root / name).is_dir():
        folders = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise ConfigError(
            f"data.dataset_config_name {name!r}: {root} has no folder {name} (its folders: "
            f"{', '.join(folders) or 'none'}); name one of them, or leave data.dataset_config_name out to read the "
            "files at its top"
        )


def _search_roots(root: Path, config_name: str | None) -> list[Path]:
    candidates = [root / config_name] if config_name else []
    candidates += [root / "data", root]
    return [c for c in candidates if c.is_dir()]


def _split_files(base: Path, split: str) -> list[Path]:
    """`<split>.jsonl`, `<split>-*.parquet`, `<split>/*.txt`, ...: dangling links included, and refused, so that
    an unreadable train file is an error rather than a split that seems absent."""
    found: list[Path] = []
    for entry in base.iterdir():
        if entry.name == split and entry.is_dir():
            found += [p for p in entry.iterdir() if p.suffix in FORMATS]
        elif entry.suffix in FORMATS and (entry.stem == split or entry.name.startswith(f"{split}-")):
            found.append(entry)
    for path in found:
        check_link(path, f"split '{split}'")
    return sorted(found)


def _as_split(what: str, paths: list[Path]) -> SplitSource:
    formats = {FORMATS.get(p.suffix) for p in paths}
    if None in formats:
        odd = sorted({p.suffix or p.name for p in paths if p.suffix not in FORMATS})
        raise ConfigError(f"{what}: unsupported file type(s) {', '.join(odd)}; use {', '.join(FORMATS)}")
    known = cast("set[str]", formats)  # None is ruled out above
    if len(known) > 1:
        raise ConfigError(f"{what}: mixes file types ({', '.join(sorted(known))}); keep one format per split")
    empty = [str(p) for p in paths if p.stat().st_size == 0]
    if empty:
        raise ConfigError(f"{what}: empty file(s): {', '.join(empty)}")
    return SplitSource(what=what, format=known.pop(), paths=tuple(str(p.resolve()) for p in paths))


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
    val_split = eval_split(data, list(loaded))
    if val_split and val_split in loaded:
        return train, SplitSource(f"split '{val_split}' of {where}", "hf", dataset=loaded[val_split])
    if val_split:
        _no_val_split(data, where, list(loaded))
    return train, None


def eval_split(data: DataConfig, splits: list[str]) -> str | None:
    """The split evaluated: `data.val_split`; where that is the default `validation` and the dataset has none but has
    `test`, that one, as TRL's SFTTrainer evaluates on `test` by default and datasets made for it have no other."""
    if data.val_split == DEFAULT_VAL_SPLIT and data.val_split not in splits and TRL_EVAL_SPLIT in splits:
        return TRL_EVAL_SPLIT
    return data.val_split


def _no_val_split(data: DataConfig, where: str, splits: list[str]) -> None:
    """A named validation split the dataset lacks: a typo must not quietly turn into holding out training data,
    so holding out needs data.val_ratio set."""
    if data.val_ratio is not None:
        return
    raise ConfigError(
        f"data.val_split: no split '{data.val_split}' in {where} (it has {', '.join(sorted(splits)) or 'none'}); "
        "name one of those, or set data.val_ratio (e.g. 0.05) to hold out training records instead"
    )


def _split_names(base: Path) -> list[str]:
    """The split names of a directory of `<split>-*.parquet` / `<split>.jsonl` / `<split>/*.txt` files."""
    names = set()
    for path in base.iterdir():
        if path.is_dir() and any(p.suffix in FORMATS for p in path.iterdir()):
            names.add(path.name)
        elif path.suffix in FORMATS:
            names.add(path.stem.split("-")[0])
    return sorted(names)


def _head_of_file(path: Path, file_format: str, n: int) -> pa.Table:
    import pyarrow as pa

    if file_format == "parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        batch = next(parquet.iter_batches(batch_size=n), None)
        return pa.Table.from_batches([batch]) if batch is not None else parquet.schema_arrow.empty_table()
    lines = first_lines(path, json_array_ok=file_format == "json", n=n)
    return pa.table({"_raw": pa.array(lines, type=pa.binary())})


def _json_array_length(path: Path) -> int:
    """Records of a JSON file: the elements of a top-level array, else its lines (JSON Lines)."""
    with path.open("rb") as f:
        starts_array = starts_json_array(f.read(SNIFF_BYTES))
    if not starts_array:
        return line_count(path)
    try:
        records = json.loads(path.read_bytes().removeprefix(codecs.BOM_UTF8))
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return len(records) if isinstance(records, list) else 1


def check_hold_out(d: DataConfig, train: SplitSource) -> None:
    """Ray's train_test_split needs at least one training record left after holding out (as Ray computes it)."""
    if d.hold_out <= 0:
        return
    rows = train.rows()
    if int(rows * (1 - d.hold_out)) < 1:
        raise ConfigError(
            f"data: {train.what} has {rows} record(s) and there is no validation split: too few to hold out "
            f"{d.hold_out:.0%} for evaluation; add records or a validation split (data.val_split), or set "
            "data.val_ratio: 0 (no evaluation)"
        )
