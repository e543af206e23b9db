"""The per-machine cache of test models (tests/fixtures/cache.py): built once however many sessions ask at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from fixtures import cache


def test_concurrent_askers_share_one_build(tmp_path, monkeypatch):
    """Two askers at once (as the two xdist workers of a fresh machine): one builds, the other waits for that copy;
    a later asker finds it without building."""
    monkeypatch.setenv(cache.ROOT_ENV, str(tmp_path))
    builds: list[int] = []

    def build(directory: Path) -> None:
        builds.append(threading.get_ident())
        time.sleep(0.5)  # long enough that the second asker arrives while the first builds
        directory.mkdir()
        (directory / "weights.bin").write_bytes(b"model")

    got: list[Path] = []
    askers = [threading.Thread(target=lambda: got.append(cache.cached_dir("model", "k1", build))) for _ in range(2)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert len(builds) == 1 and got == [tmp_path / "model-k1"] * 2
    assert (tmp_path / "model-k1" / "weights.bin").read_bytes() == b"model"
    assert cache.cached_dir("model", "k1", build) == tmp_path / "model-k1" and len(builds) == 1
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["model-k1"], "a staging dir was left"
