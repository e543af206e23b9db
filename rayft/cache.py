"""Facts about input files that cost seconds to settle and never change while the files do not: kept on the local
disk under ~/.cache/rayft (or $RAYFT_CACHE_DIR) as small JSON documents, keyed by a hash of the files' bytes, their
paths and the versions of the libraries that settled them. A change of any of them is a new key; a cache that
cannot be read or written is simply not used (never an error of the run).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, cast

from rayft import environment

CHUNK = 1 << 20


def cache_dir() -> Path:
    return Path(environment.value(environment.CACHE_DIR) or Path.home() / ".cache" / "rayft")


def content_key(kind: str, files: Iterable[Path], packages: Iterable[str] = (), extra: str = "") -> str:
    """sha256 over the kind, `extra`, the package versions and each file's path and bytes (absent files count as
    absent: adding one changes the key)."""
    digest = hashlib.sha256(f"{kind}\0{extra}\0".encode())
    for name in packages:
        try:
            digest.update(f"{name}={version(name)}\0".encode())
        except PackageNotFoundError:
            digest.update(f"{name}=-\0".encode())
    for path in files:
        path = Path(path).expanduser().resolve()
        digest.update(f"{path}\0".encode())
        if not path.is_file():
            digest.update(b"absent\0")
            continue
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def read_cached(kind: str, key: str) -> dict[str, Any] | None:
    try:
        return cast("dict[str, Any]", json.loads((cache_dir() / kind / f"{key}.json").read_text()))
    except (OSError, ValueError):
        return None


def write_cached(kind: str, key: str, value: dict[str, Any]) -> None:
    """Written to a temporary file and renamed: a reader never sees half a document."""
    try:
        folder = cache_dir() / kind
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, folder / f"{key}.json")
    except OSError:
        return
