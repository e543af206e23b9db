"""The Ray Data pipeline on the real local cluster: every source kind, packing over a whole epoch, bad records
counted, and equal batches per rank from Ray Train's split of the data for 2 and 3 workers."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray
import ray.train
from conftest import TEST_RAY_ENV, Fixtures, RayCluster, tiny_config

from rayft.config import Config, ConfigError, DataConfig
from rayft.data.pipeline import (
    SplitStats,
    Tokenize,
    _check_usable,
    build_datasets,
    collate_fn,
    read_records,
    read_split,
)
from rayft.data.records import decode_line, record_format
from rayft.data.sources import resolve_splits
from rayft.data.tokenizer import tokenizer_facts
from rayft.train.step import epoch_batches
from rayft.train.steps import StepPlan, plan_steps

pytestmark = pytest.mark.ray
BLOCK = 32  # tokens per packed block: 853 blocks from the fixture, a count that neither 2 nor 3 divides


@pytest.fixture(scope="module")
def ray_driver(ray_cluster: RayCluster):
    """This process as a driver of the session's two-node cluster (train functions defined here travel by value)."""
    saved = dict(os.environ)
    os.environ.update(TEST_RAY_ENV)
    ray.init(address=ray_cluster.address, logging_level="ERROR", log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()
    os.environ.clear()
    os.environ.update(saved)


def _texts(source_ds: ray.data.Dataset | list[dict], file_format: str, field: str = "text") -> list[str]:
    out = []
    for row in source_ds if isinstance(source_ds, list) else source_ds.take_all():
        record = decode_line(row["_raw"], file_format)[0] if "_raw" in row else row
        if record and isinstance(record.get(field), str) and record[field].strip():
            out.append(record[field])
    return out


def test_every_reader_loads_its_records(ray_driver, fixtures: Fixtures, tmp_path):
    """Parquet (the wikitext layout), JSON Lines, a JSON array, plain text and a `save_to_disk` dataset through
    Ray Data (how each layout resolves to these: test_data.py)."""
    import datasets

    docs = [f"document number {i} about the river ." for i in range(7)]
    wikitext = [
        t
        for t in pq.read_table(next((fixtures.dataset / "wikitext-2-raw-v1").glob("train-*")))
        .column("text")
        .to_pylist()
        if t.strip()
    ]
    (tmp_path / "one.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)) + "\n")
    (tmp_path / "array.json").write_text(json.dumps([{"text": d} for d in docs]))
    (tmp_path / "plain.txt").write_text("\n".join(docs) + "\n")
    splits = {"train": docs[:6], "test": docs[6:]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(
        str(tmp_path / "saved")
    )
    cases = {
        "wikitext layout": (DataConfig(dataset_name_or_path=str(fixtures.dataset)), wikitext),
        "jsonl file": (DataConfig(dataset_name_or_path=str(tmp_path / "one.jsonl")), docs),
        "json array": (DataConfig(dataset_name_or_path=str(tmp_path / "array.json")), docs),
        "txt file": (DataConfig(dataset_name_or_path=str(tmp_path / "plain.txt")), docs),
        "save_to_disk": (DataConfig(dataset_name_or_path=str(tmp_path / "saved"), val_split="test"), docs[:6]),
    }
    for name, (data, want) in cases.items():
        train, _ = resolve_splits(data)
        assert _texts(read_split(train), train.format) == want, name
        assert _texts(read_records(train).to_pylist(), train.format) == want, name  # the driver's reader


@pytest.fixture(scope="module")
def packed(ray_driver, fixtures: Fixtures, tmp_path_factory):
    """The wikitext fixture tokenized and packed into BLOCK-token blocks by the real pipeline (counted, cached)."""
    raw = tiny_config(fixtures, tmp_path_factory.mktemp("packed"), per_device_train_batch_size=4)
    raw["data"].update(packing=True, max_length=BLOCK, shuffle_buffer_size=64)
    cfg = Config.from_dict(raw)
    return cfg, build_datasets(cfg)


def test_packing_keeps_every_token_once_and_restarts_positions_per_document(packed, fixtures: Fixtures):
    cfg, ds = packed
    fmt = record_format(cfg.data, ["text"], "x")
    facts = dataclasses.asdict(tokenizer_facts(cfg.model))
    tok = Tokenize(dataclasses.asdict(cfg.model), facts, fmt.__dict__, "parquet", BLOCK, True, "truncate")
    table = pq.read_table(next((fixtures.dataset / "wikitext-2-raw-v1").glob("train-*")))
    reference = [r["input_ids"] for r in tok(table).to_pylist() if not r["skip"]]
    want = np.concatenate(reference)

    blocks = ds.train.take_all()
    got = np.concatenate([b["input_ids"] for b in blocks])
    positions = np.concatenate([b["position_ids"] for b in blocks])
    assert len(blocks) == ds.train_rows == ds.train_stats.rows and ds.train_stats.tokens == len(want)
    assert (
        len(got) == len(want)
        and hashlib.sha256(got.astype(np.int32)).digest() == hashlib.sha256(want.astype(np.int32)).digest()
    )
    assert all(len(b["input_ids"]) <= BLOCK for b in blocks) and sum(len(b["input_ids"]) < BLOCK for b in blocks) <= 1

    doc_starts = set(np.cumsum([0] + [len(r) for r in reference[:-1]]).tolist())
    block_starts = set(np.cumsum([0] + [len(b["input_ids"]) for b in blocks[:-1]]).tolist())
    restarts = set(np.flatnonzero(positions == 0).tolist())
    assert restarts == doc_starts | block_starts  # a position never continues across a document
    steps = np.diff(positions)
    assert (steps[[i - 1 not in restarts and i not in restarts for i in range(1, len(positions))]] == 1).all()

    batch = next(iter(ds.train.iter_torch_batches(batch_size=4, collate_fn=collate_fn(cfg.data, pad_id=11))))
    assert set(batch) == {"input_ids", "position_ids", "labels"}  # padding-free: no mask, no pad token
    assert batch["input_ids"].shape == (1, 4 * BLOCK) and (batch["input_ids"] != 11).all()
    assert ds.train_stats.skipped == {"empty": ds.train_stats.records - ds.train_stats.examples}


def test_the_tokenizer_actors_give_what_the_driver_gives(packed, monkeypatch):
    """Small sources are tokenized in the driver, big ones by Ray Data's tokenizer actors: the same counts, the same
    blocks (one packing batch here), the same validation rows, whichever path a source takes."""
    cfg, in_driver = packed
    monkeypatch.setenv("RAYFT_DRIVER_TOKENIZE_BYTES", "0")  # every source through the actors
    by_actors = build_datasets(cfg)
    assert by_actors.train_stats == in_driver.train_stats
    assert by_actors.validation_rows == in_driver.validation_rows > 0

    def stream(ds) -> list[list[int]]:
        return [list(b["input_ids"]) for b in ds.take_all()]

    assert stream(by_actors.train) == stream(in_driver.train)
    assert stream(by_actors.validation) == stream(in_driver.validation)


@pytest.mark.parametrize("path", ["driver", "actors"])
def test_max_eval_samples_keeps_the_first_validation_rows(packed, path, monkeypatch):
    """`data.max_eval_samples: 3` evaluates on the whole split's first 3 rows, in order, on either path; a limit
    above the split's size keeps it whole."""
    cfg, whole = packed
    if path == "actors":
        monkeypatch.setenv("RAYFT_DRIVER_TOKENIZE_BYTES", "0")
    rows = [list(b["input_ids"]) for b in whole.validation.take_all()]
    assert len(rows) > 3
    for limit, want in ((3, rows[:3]), (len(rows) + 5, rows)):
        limited = build_datasets(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_eval_samples=limit)))
        assert limited.validation_rows == len(want)
        assert [list(b["input_ids"]) for b in limited.validation.take_all()] == want
        assert limited.train_stats == whole.train_stats


def _count_batches(shards: dict, cfg: Config, plan: StepPlan) -> dict:
    """One rank's two epochs, walked exactly as the training loop walks them (`epoch_batches`), then its validation
    shard: what it got of each."""
    collate = collate_fn(cfg.data, pad_id=11)
    epochs = []
    for epoch in range(2):
        firsts = [
            int(batch["input_ids"][0, :8].sum())
            for batch in epoch_batches(shards["train"], cfg, plan, epoch, 0, collate)
        ]
        epochs.append({"batches": len(firsts), "order": firsts})
    return {"epochs": epochs, "validation": sum(1 for _ in shards["validation"].iter_batches(batch_size=2))}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", [2, 3])
def test_uneven_data_gives_every_rank_the_planned_batches(packed, workers: int):
    """Ray Data's equal split of a row count that `workers` does not divide, made as Ray Train makes it for its
    workers (its `DataConfig.configure`: `streaming_split(n, equal=True)` on the cluster), read by `workers` ranks at
    once (threads here, each holding its shards as a Ray Train worker does): every rank gets the plan's batches in
    each of two epochs, reshuffled per epoch, and as many validation batches as the others. (A rank with fewer
    batches would leave the others waiting in a collective forever.) The worker group around the shards is Ray
    Train's, tested by every job on the test cluster."""
    cfg, ds = packed
    assert ds.train_rows % workers, "the fixture must not divide evenly"
    plan = plan_steps(cfg, ds.train_rows, ds.validation_rows, workers)
    configure = ray.train.DataConfig().configure
    split = configure(
        {"train": ds.train, "validation": ds.validation}, workers, worker_handles=None, worker_node_ids=None
    )
    with ThreadPoolExecutor(workers) as pool:
        ranks = list(pool.map(lambda shards: _count_batches(shards, cfg, plan), split))
    for r in ranks:
        assert [e["batches"] for e in r["epochs"]] == [plan.micro_batches_per_epoch] * 2
        first, second = (e["order"] for e in r["epochs"])
        assert first != second and sorted(first) != [], "no per-epoch reshuffle"
        assert r["validation"] == ranks[0]["validation"] > 0
    assert plan.micro_batches_per_epoch == -(-(ds.train_rows // workers) // 4)


def test_bad_records_are_counted_and_the_rest_trains(ray_driver, fixtures: Fixtures, tmp_path):
    """Instruction JSON Lines with garbage in it: every bad line is a counted skip, the good ones become
    examples whose loss covers only the completion."""
    good = [{"question": f"What is {i} plus {i}?", "answer": f" {2 * i}"} for i in range(12)]
    lines = [json.dumps(r).encode() for r in good]
    lines[3:3] = [b"\xff\xfe binary \x00\x01 garbage", b'{"question": "cut off', b'{"question": "no answer"}', b""]
    (tmp_path / "qa.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    raw = tiny_config(fixtures, tmp_path / "out")
    raw["data"].update(
        dataset_name_or_path=str(tmp_path / "qa.jsonl"),
        prompt_template="Q: {question}\nA:",
        completion_field="answer",
        val_ratio=0.0,
        packing=False,
    )
    ds = build_datasets(Config.from_dict(raw))
    assert ds.train_stats.skipped == {"not_utf8": 1, "bad_json": 1, "missing_field": 1, "empty": 1}
    assert (ds.train_stats.records, ds.train_stats.examples, ds.train_rows) == (16, 12, 12)
    row = ds.train.take(1)[0]
    assert len(row["loss_mask"]) == len(row["input_ids"]) and 0 < sum(row["loss_mask"]) < len(row["loss_mask"])

    with pytest.raises(ConfigError, match=r"skipped 4 .*set data.bad_records: skip"):
        _check_usable(ds.train_stats, "qa.jsonl", DataConfig(bad_records="error"))
    with pytest.raises(ConfigError, match=r"no usable records \(skipped: empty 5\)"):
        _check_usable(SplitStats(records=5, skipped={"empty": 5}), "x", DataConfig())
