"""`dpo.reference: precomputed`: the reference log-probs of every training pair, computed once before the first step.

A first pass runs the base (adapter switched off, no gradients) over each worker's training shard; the workers
exchange what they scored, so every rank holds the whole table: pair key → log π_ref(chosen), log π_ref(rejected).
The training collate then carries each pair's two values with its rows (`reference_logps`), and a step needs one
forward per micro-batch instead of two. Keys are a hash of the pair's tokens, so they survive the per-epoch
reshuffle and the equal split handing a pair to another worker. The table is written to the run directory: a
restarted worker group (failure, resume) reads it instead of scoring again. Whether to read it is rank 0's call,
sent to every rank with the table's bytes: on a shared filesystem with attribute caching (NFS, a PVC) ranks can
see different files, and a rank scoring (FSDP collectives) while another trains would hang the group. A pair the
table lacks (the equal split may drop other rows in a later epoch) makes its whole step score the reference live,
on every rank alike.
"""

from __future__ import annotations

import logging
import time
import zipfile
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from rayft.data.reference_table import ReferenceTable
from rayft.parallel.parallelize import reshard_all
from rayft.train.dpo import SequenceLogprobs, reference_logprobs
from rayft.train.rundir import RunDir
from rayft.train.transfer import to_device

if TYPE_CHECKING:
    from rayft.config import Config
    from rayft.train.runtime import Collate, Shard
    from rayft.train.step import Autocast

log = logging.getLogger("rayft")

TABLE_FILE = "reference_logps.npz"


def table_identity(cfg: Config) -> dict[str, Any]:
    """What a stored table's values depend on; a table made under other settings is scored anew."""
    m = cfg.model
    return {
        "model": m.model_name_or_path,
        "dtype": m.torch_dtype,
        "frozen_dtype": m.frozen_dtype,
        "bf16": cfg.train.bf16,
        "max_length": cfg.data.max_length,
        "max_prompt_length": cfg.dpo.max_prompt_length,
    }


def stored_table(run: RunDir, identity: dict[str, Any]) -> ReferenceTable | None:
    """The table an earlier attempt of this run wrote, if it was made under the same settings and reads whole (rank 0
    must not fail here: the other ranks wait for its verdict)."""
    if not run.exists(TABLE_FILE):
        return None
    try:
        table = ReferenceTable.from_bytes(run.read_file(TABLE_FILE))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        log.warning("%s does not read (%s); scoring the reference again", TABLE_FILE, e)
        return None
    if table.identity != identity:
        log.warning("%s was scored under other settings (%s); scoring the reference again", TABLE_FILE, table.identity)
        return None
    return table


@torch.no_grad()
def score_batches(
    model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]], device: torch.device, autocast: Autocast
) -> tuple[np.ndarray, np.ndarray]:
    """The pairs of these (collated) batches: their keys and reference (chosen, rejected) log-probs."""
    model.eval()
    logprobs = SequenceLogprobs(model)
    keys, logps = [], []
    for batch in batches:
        keys.append(batch.pop("pair_key").numpy())
        batch = to_device(batch, device)
        with autocast():
            scored = reference_logprobs(model, logprobs, batch).double().cpu()
        logps.append(torch.stack(scored.chunk(2), dim=1).numpy())
    model.train()
    if not keys:
        return np.zeros(0, np.int64), np.zeros((0, 2))
    return np.concatenate(keys), np.concatenate(logps)


def agreed_table(run: RunDir, identity: dict[str, Any], rank: int) -> ReferenceTable | None:
    """The stored table as rank 0 sees it, on every rank (None everywhere where rank 0 finds none usable), so all
    ranks take the same branch and train on the same values whatever their own view of the run directory holds."""
    shared: list[bytes | None] = [None]
    if rank == 0:
        table = stored_table(run, identity)
        shared[0] = None if table is None else table.to_bytes()
    dist.broadcast_object_list(shared, src=0)
    return None if shared[0] is None else ReferenceTable.from_bytes(shared[0])


def precompute(
    model: torch.nn.Module,
    shard: Shard,
    cfg: Config,
    collate: Collate,
    device: torch.device,
    autocast: Autocast,
    run: RunDir,
    rank: int,
    world: int,
) -> ReferenceTable:
    """The run's table: read from the run directory (rank 0's view, shared), or scored now on every one of the
    `world` ranks and exchanged (then written)."""
    identity = table_identity(cfg)
    table = agreed_table(run, identity, rank)
    if table is not None:
        if rank == 0:
            log.info("reference log-probs of %d pairs read from %s", len(table), TABLE_FILE)
        return table
    started = time.perf_counter()
    batches = shard.iter_torch_batches(batch_size=cfg.train.per_device_eval_batch_size, collate_fn=collate)
    mine = score_batches(model, batches, device, autocast)
    reshard_all(model)  # no backward follows: free what forward kept gathered for it
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    table = ReferenceTable.merge(gathered, identity)
    if rank == 0:
        run.write_file(TABLE_FILE, table.to_bytes())
        log.info(
            "reference log-probs of %d pairs scored in %.1f s (one pass, adapter off); kept in %s",
            len(table),
            time.perf_counter() - started,
            TABLE_FILE,
        )
    return table
