"""The record ledger (`train.record_ledger`): which sequences each optimizer step trained on, as a fingerprint per
sequence, in the run directory's `records.jsonl` (a row per step: `step`, `epoch`, `records`).

It answers what data made an adapter, and whether a run that was resumed, shrunk or grown trained on each record
once. Like the metrics history, the rows are cut back to the checkpoint a run continues from, so the file always
describes the steps the adapter holds. Rank 0 gathers each step's fingerprints (one small collective and one host
copy of the token ids a step, paid only while the ledger is on) and rewrites the file with every checkpoint and at
the end of the run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rayft.train.rundir import RECORDS, RunDir

if TYPE_CHECKING:
    from rayft.model.loss import Batch


def fingerprint(token_ids: torch.Tensor) -> str:
    """Sixteen hex digits of a BLAKE2b digest of the sequence's token ids (as int64)."""
    return hashlib.blake2b(token_ids.to(torch.int64).numpy().tobytes(), digest_size=8).hexdigest()


def sequences(batch: Batch) -> Iterator[torch.Tensor]:
    """The token ids of each sequence of a collated batch on the host, padding left out: a padded row up to its
    attention mask, a packed row cut where its position ids restart (each packed example on its own). A preference
    batch's rows are its chosen and its rejected sequences: two per pair."""
    ids = batch["input_ids"].cpu()
    mask = batch.get("attention_mask")
    if mask is not None:
        for row, keep in zip(ids, mask.cpu().bool(), strict=True):
            yield row[keep]
        return
    for row, positions in zip(ids, batch["position_ids"].cpu(), strict=True):
        starts = [*torch.nonzero(positions == 0).flatten().tolist(), len(row)]
        for start, end in pairwise(starts):
            yield row[start:end]


class RecordLedger:
    """Rank 0's rows of `records.jsonl`; every rank adds its part of each step (a collective: all ranks call
    `add`)."""

    def __init__(self, run: RunDir, rank: int, world_size: int, continues_from: int | None):
        """`continues_from`: the step of the checkpoint this run resumes from (rows after it are dropped: those steps
        are trained again), None for a fresh start."""
        self.run, self.rank, self.world_size = run, rank, world_size
        kept = [] if continues_from is None or rank != 0 else run.read_rows(RECORDS)
        self.rows: list[dict[str, Any]] = [r for r in kept if r.get("step", 0) <= (continues_from or 0)]
        self.written: int | None = None  # rows in the file as this run last wrote it (None: not written yet)

    def add(self, step: int, epoch: int, batches: list[Batch]) -> None:
        """The step's sequences over all ranks, in rank order (an elastic run's: the global batch's order)."""
        mine = [fingerprint(s) for batch in batches for s in sequences(batch)]
        parts: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if parts is not None:
            self.rows.append({"step": step, "epoch": epoch, "records": [f for part in parts for f in part]})

    def write(self) -> None:
        """Rank 0 rewrites the file whole (object stores cannot append), and only when steps were added since it
        last wrote: the final checkpoint's write serves the end of the run too."""
        if self.rank == 0 and self.written != len(self.rows):
            self.run.write_rows(RECORDS, self.rows)
            self.written = len(self.rows)
