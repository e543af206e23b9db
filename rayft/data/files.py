"""What a data file really holds, judged by its content rather than its name: run on the driver before Ray starts.

Parquet: the footer and every row group's metadata are read, and the needed columns of the row groups decoded up to
a byte budget (garbled pages only show when decoded). Text and JSON Lines: the encoding is sniffed (UTF-16/32 is
refused, never read as UTF-8, where its NUL bytes would pass as valid text), and the record fields are found by
scanning the whole file, so records lacking a field at the start, or one huge first record, do not hide the
fields of the rest.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

from rayft.config import ConfigError

if TYPE_CHECKING:
    from pyarrow.parquet import ParquetFile

# Compressed column bytes decoded per preflight; beyond it row groups are checked by their metadata only.
PARQUET_DECODE_BUDGET = 512 * 2**20
SNIFF_BYTES = 64 * 2**10
SAMPLE_RECORDS = 20  # records whose keys are listed when a field is missing
COMPRESSED = (  # magic number, format, the command that writes its content to stdout (the file name follows)
    (b"\x1f\x8b", "gzip", "gzip -dc <"),
    (b"(\xb5/\xfd", "zstd", "zstd -dc <"),
    (b"BZh", "bzip2", "bzip2 -dc <"),
    (b"\xfd7zXZ\x00", "xz", "xz -dc <"),
    (b"PK\x03\x04", "zip", "unzip -p"),
)
BOMS = (  # UTF-32 first: the UTF-32-LE mark begins with the UTF-16-LE one
    (codecs.BOM_UTF32_LE, "UTF-32LE"),
    (codecs.BOM_UTF32_BE, "UTF-32BE"),
    (codecs.BOM_UTF16_LE, "UTF-16LE"),
    (codecs.BOM_UTF16_BE, "UTF-16BE"),
)


class DecodeBudget:
    """Bytes of parquet column chunks still to decode in this preflight."""

    def __init__(self, nbytes: int = PARQUET_DECODE_BUDGET):
        self.left = nbytes

    def take(self, nbytes: int) -> bool:
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True


def check_parquet(path: Path, columns: Iterable[str], budget: DecodeBudget) -> int:
    """The file's row count, after checking its footer, its row groups' byte ranges and (within the budget) that
    the wanted columns decode."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(
            f"{path}: not a readable parquet file ({_first_line(e)}): cut short, or not parquet; write or copy it again"
        ) from None
    try:
        _check_row_groups(parquet, path, [c for c in columns if c in parquet.schema_arrow.names], budget)
        return cast(int, parquet.metadata.num_rows)  # pyarrow has no type hints
    finally:
        parquet.close()


def _check_row_groups(parquet: ParquetFile, path: Path, wanted: list[str], budget: DecodeBudget) -> None:
    import pyarrow as pa

    meta, size = parquet.metadata, path.stat().st_size
    for group in range(meta.num_row_groups):
        row_group = meta.row_group(group)
        chunks = [row_group.column(i) for i in range(row_group.num_columns)]
        for chunk in chunks:
            start = chunk.dictionary_page_offset or chunk.data_page_offset
            if start + chunk.total_compressed_size > size:
                raise ConfigError(
                    f"{path}: row group {group} (column {chunk.path_in_schema}) lies past the end of the file "
                    f"({size:,} bytes): a corrupt file; write or copy it again"
                )
        # path_in_schema is dotted for nested columns (messages.list.element.role): count them by their top level
        nbytes = sum(c.total_compressed_size for c in chunks if c.path_in_schema.split(".")[0] in wanted)
        if wanted and budget.take(nbytes):
            try:
                parquet.read_row_group(group, columns=wanted)
            except (pa.ArrowException, OSError) as e:
                raise ConfigError(
                    f"{path}: row group {group} does not decode ({_first_line(e)}): a corrupt file; write or copy "
                    "it again"
                ) from None


def parquet_columns(path: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return list(pq.read_schema(path).names)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(
            f"{path}: not a readable parquet file ({_first_line(e)}): cut short, or not parquet; write or copy it again"
        ) from None


def check_encoding(path: Path) -> None:
    """UTF-8 (with or without its BOM) passes; compressed data is refused by its magic number, UTF-16/32 by its BOM
    or, without one, by its NUL bytes."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    for magic, name, tool in COMPRESSED:
        if head.startswith(magic):
            raise ConfigError(
                f"{path} is {name}-compressed data, not text: rayft reads {path.suffix or 'text'} files uncompressed; "
                f"decompress it first: {tool} {path.name} > {path.stem}.plain{path.suffix}"
            )
    for bom, name in BOMS:
        if head.startswith(bom):
            raise ConfigError(
                f"{path} is {name} text (its byte-order mark says so); rayft reads UTF-8: convert it, e.g. "
                f"iconv -f {name} -t UTF-8 {path.name} > {path.stem}.utf8{path.suffix}"
            )
    nuls = head.count(b"\0")
    if nuls * 8 > len(head):
        raise ConfigError(
            f"{path}: {nuls:,} of its first {len(head):,} bytes are NUL: UTF-16/32 text without a byte-order mark, "
            "or not text at all; convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)"
        )


def line_count(path: Path) -> int:
    """Records of a text / JSON Lines file as the reader splits them: lines, the final newline ending the last."""
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n")


def split_lines(content: bytes, json_array_ok: bool) -> list[bytes]:
    """A text or JSON file's records as the readers split them: its lines (no BOM, no line ends, the final newline
    ending the last line), or for a JSON file holding one top-level array, its elements, one JSON line each."""
    content = content.removeprefix(codecs.BOM_UTF8)  # Windows editors write one; it is not part of the text
    if json_array_ok and content.lstrip().startswith(b"["):
        return json_array_records(content)
    lines = [line.rstrip(b"\r") for line in content.split(b"\n")]
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def first_lines(path: Path, json_array_ok: bool, n: int) -> list[bytes]:
    """`split_lines` of the file's first `n` records, reading only as far as they go (a JSON array is read whole:
    its elements are not lines)."""
    with open(path, "rb") as f:
        if json_array_ok and starts_json_array(f.read(SNIFF_BYTES)):
            return split_lines(path.read_bytes(), json_array_ok)[:n]
        f.seek(0)
        lines: list[bytes] = []
        for line in f:
            if len(lines) >= n:
                break
            lines.append(line.removesuffix(b"\n").rstrip(b"\r").removeprefix(codecs.BOM_UTF8 if not lines else b""))
        return lines


def json_array_records(content: bytes) -> list[bytes]:
    """The elements of a top-level JSON array, one JSON line each; content that does not parse is one record (the
    tokenizer counts it as bad_json)."""
    try:
        records = json.loads(content)
    except ValueError:
        return [content]
    return [json.dumps(r).encode() for r in records] if isinstance(records, list) else [content]


def starts_json_array(head: bytes) -> bool:
    """Whether a JSON file's first bytes open a top-level array (else it is JSON Lines)."""
    return head.lstrip().removeprefix(codecs.BOM_UTF8).lstrip().startswith(b"[")


def json_fields(paths: Iterable[Path], wanted: Iterable[str]) -> list[str]:
    """The fields of a JSON (Lines) split: the keys of its first records, plus every wanted field that any record
    anywhere has. After the first records, a line is parsed only while a wanted field is still unseen and its
    quoted name occurs in the line, so the scan runs at the speed of a byte search."""
    scan = _FieldScan(set(wanted))
    for path in paths:
        for keys in _keys_of_records(Path(path), scan):
            scan.add(keys)
            if scan.done:
                return scan.fields()
    return scan.fields()


class _FieldScan:
    def __init__(self, wanted: set[str]):
        self.remaining = wanted
        self.found: set[str] = set()
        self.sampled = 0

    @property
    def sampling(self) -> bool:
        return self.sampled < SAMPLE_RECORDS

    @property
    def done(self) -> bool:
        return not self.remaining and not self.sampling

    def add(self, keys: set[str]) -> None:
        if self.sampling:
            self.found |= keys
            self.sampled += 1
        self.found |= keys & self.remaining
        self.remaining -= keys

    def worth_parsing(self, line: bytes) -> bool:
        return self.sampling or any(f'"{name}"'.encode() in line for name in self.remaining)

    def fields(self) -> list[str]:
        return sorted(self.found)


def _keys_of_records(path: Path, scan: _FieldScan) -> Iterator[set[str]]:
    with open(path, "rb") as f:
        first = f.read(SNIFF_BYTES).lstrip().removeprefix(codecs.BOM_UTF8).lstrip()[:1]
        f.seek(0)
        if first == b"[":
            try:
                records = json.loads(f.read().removeprefix(codecs.BOM_UTF8))
            except ValueError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from None
            for record in records if isinstance(records, list) else []:
                if isinstance(record, dict):
                    yield set(record)
            return
        for line in f:
            if scan.done:
                return
            if not scan.worth_parsing(line):
                continue
            try:
                record = json.loads(line.removeprefix(codecs.BOM_UTF8))
            except ValueError:
                continue
            if isinstance(record, dict):
                yield set(record)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
