"""Checks any file a user points rayft at gets, whatever it holds (a model's, a tokenizer's, a dataset's): a damaged
file or a broken link named as what it is, with the fix, rather than as the loader's error about something else."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from rayft.config import ConfigError


def check_link(path: Path, what: str) -> None:
    """A symbolic link that leads nowhere, named as what it is (not "does not exist")."""
    if not path.is_symlink() or path.exists():
        return
    try:
        path.resolve(strict=True)
    except RuntimeError:  # Python < 3.13 reports a loop so
        problem = "a symbolic link loop"
    except OSError as e:
        problem = (
            "a symbolic link loop"
            if e.errno == errno.ELOOP
            else f"a symbolic link to {os.readlink(path)}, which does not exist"
        )
    else:
        return
    raise ConfigError(f"{what}: {path} is {problem}; copy the file again or fix the link")


def check_json_file(path: Path) -> None:
    """A JSON file (a tokenizer's, a model's config) that does not parse, cut short by a copy most often: named,
    with the fix; the loaders' own message is the parser's, without the file."""
    if path.suffix != ".json" or not path.is_file():
        return
    try:
        json.loads(path.read_bytes())
    except ValueError as e:
        raise ConfigError(
            f"{path}: not valid JSON ({e}; {path.stat().st_size:,} bytes): cut short or damaged; copy it again from "
            "the model's source"
        ) from None
