"""Each worker process's local staging directory for checkpoint shards.

Stdlib only: it is all a process needs to stage or clean up shards, and importing the checkpoint module (torch,
Ray Train, PEFT) costs seconds.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

SPOOL_ROOT = "rayft-checkpoints"


def checkpoint_spool(run_name: str, run_id: str | None) -> Path:
    """This worker process's local staging dir for checkpoint shards: `<tmp>/rayft-checkpoints/<name>-<run id>/
    pid<N>`, so two jobs (even with the same ray.name) and two attempts of one run never share one. A killed
    worker leaves its half-written shards behind: they are removed here once their process is gone."""
    run_folder = Path(tempfile.gettempdir()) / SPOOL_ROOT / f"{run_name}-{run_id or uuid.uuid4().hex}"
    run_folder.mkdir(parents=True, exist_ok=True)
    for stale in run_folder.glob("pid*"):
        if stale.name[3:].isdigit() and not _alive(int(stale.name[3:])):
            shutil.rmtree(stale, ignore_errors=True)
    spool = run_folder / f"pid{os.getpid()}"
    shutil.rmtree(spool, ignore_errors=True)  # a dead process's, whose pid this one got
    spool.mkdir()
    return spool


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
