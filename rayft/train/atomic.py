"""Local files and directories that are either the old version or the new one, never half of each.

A file is written next to its target and renamed over it (rename is atomic within a filesystem). A directory is
built under a temporary name beside its target, then swapped in with two renames: at every moment the complete
old or the complete new directory exists (under the target's name, or for an instant under a `.old-` name).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def staging_dir(target: Path) -> Path:
    """A fresh empty directory beside `target` (same filesystem, so the final rename is atomic)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))


def replace_dir(staged: Path, target: Path) -> None:
    """`staged` becomes `target`; a previous `target` is removed only once the new one is in place."""
    staged, target = Path(staged), Path(target)
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    if target.exists():
        os.replace(target, old)
    os.replace(staged, target)
    shutil.rmtree(old, ignore_errors=True)
