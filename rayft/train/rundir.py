"""The run directory on Ray's storage (`storage_path/name`): a shared-PVC path or a pyarrow URI (s3://, gs://).

Ray Train owns the checkpoint registry in it (`checkpoint_manager_snapshot.json`); rayft adds step-named
checkpoint directories, `metrics.jsonl` and `loss.png`. A checkpoint directory that exists but is not registered
was left by a worker that died while saving: nothing will ever resume from it, so it is removed when the run
resumes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
# Ray Train V2's record of the checkpoints it registered (and so will resume from and retain).
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
METRICS = "metrics.jsonl"
LOSS_PLOT = "loss.png"
EVAL_RESULT = "eval.json"  # of a `rayft eval` run


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
        return self.fs.get_file_info(join(self.path, name)).type != pafs.FileType.NotFound

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

    def remove_checkpoints_after(self, step: int, keep: frozenset[str] = frozenset()) -> list[str]:
        """Delete checkpoint dirs newer than the one being resumed from: written but never registered."""
        removed = []
        for later, name in sorted(self.checkpoints().items()):
            if later > step and name not in keep:
                self.fs.delete_dir(join(self.path, name))
                removed.append(name)
        return removed

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.exists(METRICS):
            return []
        return [json.loads(line) for line in self.read_file(METRICS).decode().splitlines() if line.strip()]

    def write_metrics(self, rows: list[dict[str, Any]]) -> None:
        """Rewritten whole each time: object stores cannot append, and the file stays small."""
        self.fs.create_dir(self.path, recursive=True)
        with self.fs.open_output_stream(join(self.path, METRICS)) as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows).encode())

    def write_file(self, name: str, data: bytes) -> None:
        self.fs.create_dir(self.path, recursive=True)
        with self.fs.open_output_stream(join(self.path, name)) as f:
            f.write(data)

    def read_file(self, name: str) -> bytes:
        with self.fs.open_input_stream(join(self.path, name)) as f:
            return f.read()
