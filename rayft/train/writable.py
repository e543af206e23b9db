"""Whether the places a run writes to take writes: its output directory and Ray's storage path, checked by
creating something there before any cluster resource is held (permission bits and a listing prove nothing)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from rayft.config import Config, ConfigError, is_uri

STORAGE_PROBE_S = 30.0  # a remote storage_path's write probe; longer than the S3 client's own retries


def check_run_writable(cfg: Config) -> None:
    """`train.output_dir` and `ray.storage_path` (a local path or a remote URI) take writes."""
    check_writable("train.output_dir", Path(cfg.train.output_dir).expanduser())
    storage = cfg.ray.storage_path
    if storage and is_uri(storage):
        check_remote_writable("ray.storage_path", storage)
    elif storage:
        check_writable("ray.storage_path", Path(storage).expanduser())


def check_writable(key: str, path: Path) -> None:
    """Create something where the path would go: permission bits say nothing for root, nor for read-only mounts,
    quotas or network volumes that refuse writes."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}: cannot create {path}: {existing} is a file, not a directory")
    try:
        probe = tempfile.mkdtemp(prefix=".rayft-write-probe-", dir=existing)
    except OSError as e:
        raise ConfigError(
            f"{key}: cannot create {path}: creating anything in {existing} fails ({e.strerror}); choose a writable "
            "directory"
        ) from None
    shutil.rmtree(probe, ignore_errors=True)


def check_remote_writable(key: str, uri: str, timeout_s: float = STORAGE_PROBE_S) -> None:
    """Write and delete a marker object where the run's checkpoints will go: a bucket that does not exist, refused
    credentials or no route from here fail now, with the key, instead of at the first checkpoint as a traceback."""
    import uuid
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as Timeout

    import pyarrow.fs as pafs

    def probe() -> None:
        fs, path = pafs.FileSystem.from_uri(uri)
        marker = f"{path.rstrip('/')}/.rayft-write-probe-{uuid.uuid4().hex}"
        with fs.open_output_stream(marker) as out:
            out.write(b"rayft")
        fs.delete_file(marker)

    pool = ThreadPoolExecutor(max_workers=1)
    try:
        pool.submit(probe).result(timeout=timeout_s)
    except Timeout:
        raise ConfigError(
            f"{key}: {uri} did not answer within {timeout_s:.0f} s (writing a probe object); check the endpoint and "
            "the network from here and from the workers"
        ) from None
    except Exception as e:  # the filesystems raise OSError, ArrowInvalid, ArrowNotImplementedError...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"{key}: writing a probe object under {uri} failed ({first}); check the bucket's name, the credentials "
            "(AWS_* / GOOGLE_APPLICATION_CREDENTIALS) and the network, from here and from the workers"
        ) from None
    finally:
        pool.shutdown(wait=False)
