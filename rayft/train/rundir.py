"""The run directory on Ray's storage (`storage_path/name`): a shared-PVC path or a pyarrow URI (s3://, gs://).

Ray Train owns the checkpoint registry in it (`checkpoint_manager_snapshot.json`); rayft adds step-named
checkpoint directories, `metrics.jsonl`, `records.jsonl` (with `train.record_ledger`), `loss.png` and
`rayft_run.json`, the run's identity: every checkpoint rayft writes records it, and only directories carrying it
are ever deleted by the run's housekeeping.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

import pyarrow.fs as pafs

log = logging.getLogger("rayft")

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
# Ray Train V2's record of the checkpoints it registered (and so will resume from and retain).
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
METRICS = "metrics.jsonl"
RECORDS = "records.jsonl"  # rayft.train.ledger
LOSS_PLOT = "loss.png"
EVAL_RESULT = "eval.json"  # of a `rayft eval` run
IDENTITY = "rayft_run.json"


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint-{step:06d}"


def join(base: str, *parts: str) -> str:
    """`base/part/...` for local paths and URIs alike."""
    return "/".join([base.rstrip("/"), *parts])


@dataclass
class RunDir:
    uri: str
    fs: pafs.FileSystem = field(init=False, repr=False)
    path: str = field(init=False)

    def __post_init__(self) -> None:
        self.fs, self.path = pafs.FileSystem.from_uri(self.uri)

    def exists(self, name: str) -> bool:
        return cast(bool, self.fs.get_file_info(join(self.path, name)).type != pafs.FileType.NotFound)

    def has_registered_checkpoints(self) -> bool:
        """True when Ray has a checkpoint of this run to resume from (a new fit() picks it up by itself)."""
        return self.exists(RAY_SNAPSHOT)

    def checkpoints(self) -> dict[int, str]:
        """Step → name of every checkpoint directory present, registered or not."""
        selector = pafs.FileSelector(self.path, allow_not_found=True)
        found = {}
        for info in self.fs.get_file_info(selector):
            match = CHECKPOINT_PATTERN.match(info.base_name)
            if match and info.type == pafs.FileType.Directory:
                found[int(match[1])] = info.base_name
        return found

    def delete_dir(self, name: str) -> None:
        self.fs.delete_dir(join(self.path, name))

    def set_aside(self, name: str, suffix: str) -> str:
        """Rename `name` to `name + suffix` (`-2`, `-3`, … added where that is taken), out of `checkpoints()`'s
        listing and so out of any housekeeping, without deleting a byte of it; the new name."""
        new, n = f"{name}{suffix}", 1
        while self.exists(new):
            n += 1
            new = f"{name}{suffix}-{n}"
        self.fs.move(join(self.path, name), join(self.path, new))
        return new

    def run_id(self) -> str | None:
        """The identity recorded by the run that owns this directory; None for a directory without one."""
        try:
            return cast("str | None", json.loads(self.read_file(IDENTITY))["run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def new_run_id(self, settings: dict[str, Any] | None = None) -> str:
        """Record a fresh identity for a run starting in this directory, with the settings it is compared by when
        continued (`rayft.train.run_settings`)."""
        run_id = uuid.uuid4().hex
        self.write_file(IDENTITY, json.dumps({"run_id": run_id, "settings": settings}).encode())
        return run_id

    def settings(self) -> dict[str, Any] | None:
        """The settings the run recorded as it started; None where it recorded none (an older rayft)."""
        try:
            settings = json.loads(self.read_file(IDENTITY)).get("settings")
        except (OSError, ValueError, AttributeError):
            return None
        return settings if isinstance(settings, dict) else None

    def read_metrics(self) -> list[dict[str, Any]]:
        return self.read_rows(METRICS)

    def write_metrics(self, rows: list[dict[str, Any]]) -> None:
        self.write_rows(METRICS, rows)

    def read_rows(self, name: str) -> list[dict[str, Any]]:
        """The rows of a JSON-lines file (none where it does not exist); a line that does not parse (a write cut
        short by a crash, on a filesystem without atomic renames) is skipped with a warning: a run's history must
        never stop a resume."""
        if not self.exists(name):
            return []
        rows = []
        for number, line in enumerate(self.read_file(name).decode(errors="replace").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if isinstance(row, dict):
                rows.append(row)
            else:
                log.warning("%s line %d is not a JSON record (a torn write?): skipped", join(self.uri, name), number)
        return rows

    def write_rows(self, name: str, rows: list[dict[str, Any]]) -> None:
        """Rewritten whole each time (object stores cannot append), into a temporary file moved over the old one:
        a kill mid-write leaves the previous version."""
        self.write_file(name, "".join(json.dumps(row) + "\n" for row in rows).encode())

    def write_file(self, name: str, data: bytes) -> None:
        """Written under a temporary name, then moved into place (a rename on local and shared filesystems;
        object stores publish an object whole anyway)."""
        self.fs.create_dir(self.path, recursive=True)
        tmp = join(self.path, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, join(self.path, name))

    def read_file(self, name: str) -> bytes:
        with self.fs.open_input_stream(join(self.path, name)) as f:
            return cast(bytes, f.read())
