"""`dpo.reference: precomputed` on a shared filesystem whose ranks see different files (NFS attribute caching, a
PVC mounted per node): whether to read the stored table or score anew is decided once, by rank 0, and every rank
trains on the same table. Two gloo ranks, each with its own view of the run directory."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port
from fixtures.ranks import spawn_ranks

from rayft import demo

WORLD = 2
KEYS = np.array([3, 7, 11], dtype=np.int64)
RANK0_LOGPS = np.array([[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]])


def _config(tmp: Path) -> dict:
    cfg = demo.demo_config(tmp)
    cfg["train"]["objective"] = "dpo"
    cfg["dpo"] = {"reference": "precomputed"}
    cfg["data"]["packing"] = False
    return cfg


def _rank(rank: int, port: int, raw: dict, views: list[str], rank1_file: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from rayft.config import Config
    from rayft.train import reference
    from rayft.train.rundir import RunDir

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        cfg = Config.from_dict(raw)
        run = RunDir(views[rank])
        identity = reference.table_identity(cfg)
        if rank == 0:
            run.write_file(reference.TABLE_FILE, reference.ReferenceTable(KEYS, RANK0_LOGPS, identity).to_bytes())
        elif rank1_file == "stale":  # the same settings, older values: what a cached view of an earlier write shows
            stale = reference.ReferenceTable(KEYS, RANK0_LOGPS + 1.0, identity)
            run.write_file(reference.TABLE_FILE, stale.to_bytes())
        elif rank1_file == "other_settings":
            other = reference.ReferenceTable(KEYS, RANK0_LOGPS, {**identity, "max_length": 1})
            run.write_file(reference.TABLE_FILE, other.to_bytes())
        # No model, no shard: a rank that decided to score would fail on them, and must not.
        table = reference.precompute(None, None, cfg, None, torch.device("cpu"), None, run, rank, WORLD)
        np.save(Path(out) / f"rank{rank}_keys.npy", table.keys)
        np.save(Path(out) / f"rank{rank}_logps.npy", table.logps)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank1_file", ["missing", "stale", "other_settings"])
def test_the_stored_reference_table_is_rank_zeros_on_every_rank(tmp_path, rank1_file):
    """Rank 0's view holds a table made under the run's settings; rank 1's view lacks it, shows stale values, or
    shows one made under other settings. Every rank must read rank 0's table and none may start scoring (a rank
    in the scoring pass's FSDP collectives while another trains hangs an NCCL job)."""
    views = [str(tmp_path / f"view{r}") for r in range(WORLD)]
    out = tmp_path / "out"
    out.mkdir()
    spawn_ranks(_rank, args=(free_port(), _config(tmp_path), views, rank1_file, str(out)), nprocs=WORLD)
    for rank in range(WORLD):
        np.testing.assert_array_equal(np.load(out / f"rank{rank}_keys.npy"), KEYS)
        np.testing.assert_array_equal(np.load(out / f"rank{rank}_logps.npy"), RANK0_LOGPS)


def test_a_torn_stored_table_is_scored_again_not_an_error(tmp_path):
    """Rank 0 reads the table alone while the others wait for its verdict: a file it cannot read (a write cut short
    on a filesystem without atomic renames) means scoring anew, not a rank 0 crash."""
    from rayft.config import Config
    from rayft.train import reference
    from rayft.train.rundir import RunDir

    identity = reference.table_identity(Config.from_dict(_config(tmp_path)))
    run = RunDir(str(tmp_path / "run"))
    whole = reference.ReferenceTable(KEYS, RANK0_LOGPS, identity).to_bytes()
    run.write_file(reference.TABLE_FILE, whole)
    assert reference.stored_table(run, identity) is not None
    run.write_file(reference.TABLE_FILE, whole[: len(whole) // 2])
    assert reference.stored_table(run, identity) is None
