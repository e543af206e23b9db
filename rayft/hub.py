"""Models and datasets named by their Hugging Face hub id (`org/name`), resolved through the hub cache.

A platform pre-seeds `HF_HOME` on the shared volume in huggingface_hub's own layout (`hub/models--org--name/...`);
rayft resolves each name once, on the driver before training, to that cache's snapshot directory, so workers are
handed a plain path and never talk to the hub. Where the hub is reachable (no `HF_HUB_OFFLINE`), a name missing from
the cache is downloaded into it once: a file lock in the cache makes every other process (another driver, another
node sharing the volume) wait for that download and then find it cached. A name the cache already holds is used
as cached, without asking the hub (pin `revision` to a commit for an exact snapshot). The cache layout, its
look-ups and the downloads are huggingface_hub's; rayft only turns their failures into errors that name the key,
repo and revision.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from rayft.config import Config, ConfigError

if TYPE_CHECKING:
    from typing import TypeGuard

    from huggingface_hub import CachedRepoInfo

# `org/name`, as the hub spells repo ids today; anything existing on disk is a path first. (A bare legacy `name` is
# left to the readers: a relative path that does not exist keeps its "does not exist" error.)
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
TRUE = {"1", "ON", "YES", "TRUE"}
LOCK_TIMEOUT_S = 6 * 3600  # a 100+ GB checkpoint over a slow link; a dead holder's lock is released by the OS


def is_hub_name(spec: str | None) -> TypeGuard[str]:
    """A hub repo id rather than a local path: not on disk, not path-like, `org/name`-shaped."""
    if not spec or _path_like(spec) or Path(spec).expanduser().exists():
        return False
    return bool(REPO_ID.match(spec))


def _path_like(spec: str) -> bool:
    """Written as a path or a URI, never a repo id."""
    return spec.startswith((".", "/", "~")) or "://" in spec


def hub_cache() -> Path:
    """The cache huggingface_hub uses, read from the environment now (its constants are fixed at import time)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return any(os.environ.get(k, "").upper() in TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve(key: str, repo_id: str, repo_type: str = "model", revision: str | None = None) -> Path:
    """The local snapshot directory of `repo_id` at `revision` (None = main), downloaded first where allowed."""
    from filelock import FileLock
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache()
    try:
        found = snapshot_download(
            repo_id, repo_type=repo_type, revision=revision, cache_dir=cache, local_files_only=True
        )
    except LocalEntryNotFoundError:
        if offline():
            raise ConfigError(_not_cached(key, repo_id, repo_type, revision, cache)) from None
        cache.mkdir(parents=True, exist_ok=True)
        lock = cache / ".locks" / f"rayft--{repo_type}s--{repo_id.replace('/', '--')}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(lock, timeout=LOCK_TIMEOUT_S):  # whoever waited here finds the holder's download cached
            try:
                found = snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=cache)
            except Exception as e:  # unknown repo or revision, gated, no network: the same advice for the user
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                command = download_command(repo_id, repo_type, revision, cache)
                raise ConfigError(
                    f"{key}: '{repo_id}'{_at(revision)} could not be downloaded into {cache} ({first}); check the "
                    f"name and revision, or pre-seed the cache (`{command}`) and set HF_HUB_OFFLINE=1"
                ) from None
    _check_complete(key, repo_id, Path(found))
    return Path(found)


def check_repo_id(key: str, spec: str | None) -> None:
    """A value shaped like `org/name` that is neither on disk nor a valid hub id (a space, a stray character) is
    refused with the hub's own rule, rather than reported as a path that does not exist."""
    from huggingface_hub.errors import HFValidationError

    # re-exported lazily; the package's TYPE_CHECKING import lacks `as`, so mypy sees no explicit export
    from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]

    if not spec or spec.count("/") != 1 or _path_like(spec):
        return
    if is_hub_name(spec) or Path(spec).expanduser().exists():
        return
    try:
        validate_repo_id(spec)
    except HFValidationError as e:
        raise ConfigError(
            f"{key}: '{spec}' is no local path, and not a hub repo id either ({e}); fix the name, or give an "
            "existing directory"
        ) from None


def resolve_names(cfg: Config) -> None:
    """Replace hub names in the config by their snapshot directories, in place (before any path is read)."""
    m, d = cfg.model, cfg.data
    for key, spec in (
        ("model.model_name_or_path", m.model_name_or_path),
        ("model.tokenizer_name_or_path", m.tokenizer_name_or_path),
        ("data.dataset_name_or_path", d.dataset_name_or_path),
    ):
        check_repo_id(key, spec)
    if is_hub_name(m.model_name_or_path):
        m.model_name_or_path = str(resolve("model.model_name_or_path", m.model_name_or_path, "model", m.revision))
    elif m.revision is not None:
        raise ConfigError(f"model.revision: {m.model_name_or_path} is a local path; a revision needs a hub name")
    if is_hub_name(m.tokenizer_name_or_path):
        m.tokenizer_name_or_path = str(resolve("model.tokenizer_name_or_path", m.tokenizer_name_or_path))
    if is_hub_name(d.dataset_name_or_path):
        d.dataset_name_or_path = str(
            resolve("data.dataset_name_or_path", d.dataset_name_or_path, "dataset", d.revision)
        )
    elif d.revision is not None:
        raise ConfigError(f"data.revision: {d.dataset_name_or_path} is a local path; a revision needs a hub name")


def _not_cached(key: str, repo_id: str, repo_type: str, revision: str | None, cache: Path) -> str:
    """Which part is missing from the cache, the repo or the revision, with what the cache does hold."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    where = f"the Hugging Face cache {cache} (HF_HOME; HF_HUB_OFFLINE is set, nothing is downloaded)"
    try:
        repos: dict[tuple[str, str], CachedRepoInfo] = {
            (r.repo_type, r.repo_id): r for r in scan_cache_dir(cache).repos
        }
    except CacheNotFound:
        repos = {}
    repo = repos.get((repo_type, repo_id))
    if repo is None:
        return (
            f"{key}: '{repo_id}' is no local path, and {repo_type} repo '{repo_id}' is not in {where}; pre-seed it "
            f"(`{download_command(repo_id, repo_type, revision, cache)}`) or give a local directory"
        )
    refs = sorted(ref for rev in repo.revisions for ref in rev.refs)
    commits = sorted(rev.commit_hash[:12] for rev in repo.revisions)
    rev_key = "model.revision" if key.startswith("model.") else "data.revision"
    return (
        f"{key}: revision '{revision or 'main'}' of {repo_type} repo '{repo_id}' is not in {where} (it has refs: "
        f"{', '.join(refs) or 'none'}; commits: {', '.join(commits) or 'none'}); set {rev_key} to one of them or "
        f"pre-seed that revision (`{download_command(repo_id, repo_type, revision, cache)}`)"
    )


def download_command(repo_id: str, repo_type: str, revision: str | None, cache: Path) -> str:
    """The command that puts the repo into this cache: huggingface_hub's own CLI (`hf`)."""
    kind = " --repo-type dataset" if repo_type == "dataset" else ""
    at = f" --revision {revision}" if revision else ""
    return f"hf download {repo_id}{kind}{at} --cache-dir {cache}"


def _check_complete(key: str, repo_id: str, snapshot: Path) -> None:
    """A snapshot whose links point at blobs that are not there (a copy interrupted, a pruned cache) names them."""
    missing = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_symlink() and not p.exists())
    if missing:
        raise ConfigError(
            f"{key}: '{repo_id}' in {snapshot} lacks file(s) {', '.join(missing[:5])} (their blobs are missing); "
            "download the repo into the cache again"
        )


def _at(revision: str | None) -> str:
    return f" at revision '{revision}'" if revision else ""
