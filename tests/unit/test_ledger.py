"""The record ledger's fingerprints (one per sequence, padding left out, packed rows cut per example) and its rows
cut back to the checkpoint a run continues from."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from rayft.data.pipeline import PackedCollate, PadCollate
from rayft.train.ledger import RecordLedger, fingerprint, sequences
from rayft.train.rundir import RunDir

SEQS = [[5, 9, 14], [7, 7, 7, 7, 2], [300]]


def digest(ids: list[int]) -> str:
    return hashlib.blake2b(np.array(ids, dtype="<i8").tobytes(), digest_size=8).hexdigest()


def as_read(seqs: list[list[int]], **columns) -> dict[str, np.ndarray]:
    """Rows as the data pipeline hands them to a collate: object arrays of per-row arrays."""
    batch = {"input_ids": seqs, **columns}
    out = {}
    for name, rows in batch.items():
        column = np.empty(len(rows), dtype=object)
        column[:] = [np.asarray(r) for r in rows]
        out[name] = column
    return out


@pytest.mark.parametrize("pad_id", [0, 7])  # 7 also occurs inside a sequence: only the mask may drop a token
def test_a_padded_batch_gives_each_sequence_without_its_padding(pad_id: int):
    batch = PadCollate(pad_id, multiple=8)(as_read(SEQS))
    assert batch["input_ids"].shape == (3, 8)
    assert [fingerprint(s) for s in sequences(batch)] == [digest(s) for s in SEQS]


def test_a_packed_row_gives_each_example_apart():
    positions = [list(range(len(s))) for s in SEQS]
    batch = PackedCollate()(as_read(SEQS, position_ids=positions))
    assert batch["input_ids"].shape == (1, 9)
    assert [fingerprint(s) for s in sequences(batch)] == [digest(s) for s in SEQS]


def test_other_sequences_give_other_fingerprints():
    assert len({digest(s) for s in ([1, 2], [2, 1], [1, 2, 0], [258])}) == 4
    assert fingerprint(torch.tensor([1, 2])) != fingerprint(torch.tensor([2, 1]))


def batch_of(*seqs: list[int]) -> dict[str, torch.Tensor]:
    return PadCollate(0)(as_read(list(seqs)))


def test_a_continued_run_keeps_the_rows_up_to_its_checkpoint(process_group, tmp_path):
    """Steps 1-5 written; a run continuing from step 3's checkpoint trains 4 again (on other records here) and
    writes: rows 1-3 of the first run, its own 4. A fresh start drops the old rows."""
    run = RunDir(str(tmp_path))
    first = RecordLedger(run, 0, 1, continues_from=None)
    for step in range(1, 6):
        first.add(step, 0, [batch_of([step, step]), batch_of([step, 100])])
    first.write()
    continued = RecordLedger(run, 0, 1, continues_from=3)
    continued.add(4, 0, [batch_of([40])])
    continued.write()
    rows = run.read_rows("records.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["records"] == [digest([3, 3]), digest([3, 100])]
    assert rows[3]["records"] == [digest([40])]
    fresh = RecordLedger(run, 0, 1, continues_from=None)
    fresh.write()
    assert run.read_rows("records.jsonl") == []


def test_the_file_is_written_again_only_after_new_steps(process_group, tmp_path):
    """The final checkpoint's write serves the end of the run: a second write without new steps leaves the file
    alone. A continued run writes its cut-back rows even before its first step."""
    run = RunDir(str(tmp_path))
    ledger = RecordLedger(run, 0, 1, continues_from=None)
    for step in (1, 2):
        ledger.add(step, 0, [batch_of([step])])
    ledger.write()
    written = (tmp_path / "records.jsonl").stat().st_ino  # each write is a new file moved into place
    ledger.write()
    assert (tmp_path / "records.jsonl").stat().st_ino == written
    ledger.add(3, 0, [batch_of([3])])
    ledger.write()
    assert [r["step"] for r in run.read_rows("records.jsonl")] == [1, 2, 3]
    RecordLedger(run, 0, 1, continues_from=1).write()
    assert [r["step"] for r in run.read_rows("records.jsonl")] == [1]
