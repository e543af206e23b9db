"""Ray Data pipeline: read a split → records to token ids in tokenizer actors → pack or keep → batches per worker.

Tokenization runs on the cluster's CPUs in parallel with training; Ray Train's `DataConfig` hands each worker an
equal `streaming_split`, so no rank runs out of batches while the others wait in a collective. The driver runs
the same stages once in counting mode before the workers start: that gives the row count the step plan needs and
the skipped-record counts, and turns an empty or unreadable split into an error that names it. Small sources stay
tokenized in the object store, so that pass is not repeated by every epoch.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data
from ray.data.collate_fn import NumpyBatchCollateFn

from rayft import environment
from rayft.config import Config, ConfigError, DataConfig, ModelConfig
from rayft.data.encoder import RecordEncoder
from rayft.data.files import split_lines
from rayft.data.preference import PAIR_COLUMNS, PairLimits, PreferenceCollate, PreferenceTokenize
from rayft.data.records import (
    SKIPS,
    RecordFormat,
    Segments,
    join_wikitext_articles,
    record_fields,
    record_format,
    segments,
)
from rayft.data.sources import SplitSource, resolve_splits
from rayft.data.tokenizer import TokenizerFacts, tokenizer_facts
from rayft.logs import quiet_ray_data_here

if TYPE_CHECKING:
    import torch

    from rayft.data.reference_table import ReferenceTable

# torch and transformers are imported where they are used: Ray Data task workers unpickle this module's functions
# and would otherwise each spend seconds importing both just to split lines.

log = logging.getLogger("rayft")
IGNORE_INDEX = -100
TOKENIZE_BATCH = 256
PACK_BATCH = 1024  # examples per packing batch: one short tail block per batch
CACHE_AUTO_BYTES = 2 << 30
RAW_BLOCK_ROWS = 2048  # records per block before tokenization
# Sources up to this size are tokenized and packed in the driver process, in well under a second: a Ray Data
# execution costs a fixed 7-25 s (its tokenizer actors start, import, load the tokenizer), which is most of a small
# job's start-up. Bigger ones go through the tokenizer actors (parallel, streaming). RAYFT_DRIVER_TOKENIZE_BYTES
# (rayft/environment.py, where its default is) overrides it (0: always the actors).


@dataclass
class SplitStats:
    """What the counting pass saw in one split."""

    records: int = 0  # read from the source (lines, rows)
    examples: int = 0  # usable examples (articles when wikitext lines are joined)
    rows: int = 0  # what the workers iterate: examples, or packed blocks
    tokens: int = 0
    truncated: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        text = f"{self.records:,} records, {self.examples:,} examples, {self.tokens:,} tokens"
        if self.skipped:
            text += (
                f"; skipped {sum(self.skipped.values()):,} ("
                + ", ".join(f"{reason} {n:,}" for reason, n in self.skipped.items())
                + ")"
            )
        if self.truncated:
            text += f"; {self.truncated:,} truncated to max_length"
        return text


@dataclass
class Datasets:
    """The tokenized splits plus their row counts (needed up front to plan the LR schedule)."""

    train: ray.data.Dataset
    train_stats: SplitStats
    validation: ray.data.Dataset | None
    validation_rows: int

    @property
    def train_rows(self) -> int:
        return self.train_stats.rows


def build_datasets(
    cfg: Config,
    splits: tuple[SplitSource, SplitSource | None] | None = None,
    fmt: RecordFormat | None = None,
    tokenizer: TokenizerFacts | None = None,
    rows: Rows | None = None,
) -> Datasets:
    """Runs on the driver: counts the training rows, tokenizes the validation split. `splits`, `fmt` and
    `tokenizer` as preflight settled them (settled here when not given); `rows`, the small splits' rows
    `small_rows` made before Ray started, which are not read again."""
    configure_ray_data()
    if rows is not None:
        return driver_datasets(rows)
    d = cfg.data
    train_src, val_src = splits or resolve_splits(d)
    fmt = fmt or record_format(d, train_src.columns(record_fields(d)), train_src.what)
    tokenizer = tokenizer or tokenizer_facts(cfg.model)
    if in_driver(train_src, val_src):
        return driver_datasets(driver_rows(cfg, train_src, val_src, fmt, tokenizer))
    train, validation = _read_splits(cfg, train_src, val_src)
    tokenize = partial(
        tokenized, fmt=fmt, model=cfg.model, data=d, tokenizer=tokenizer, max_prompt_length=cfg.dpo.max_prompt_length
    )
    train_tokens = tokenize(train, train_src.format, actors_at_start=actors_at_start(cfg))
    cache = _cache(d, train_src)

    def count_train() -> tuple[ray.data.Dataset, SplitStats]:
        # Cached: tokenized once, here; the count and every epoch then only re-pack from the object store.
        tokens = train_tokens.materialize() if cache else train_tokens
        return tokens, count(finished(tokens, d, counting=True), train_src.what)

    def tokenize_validation() -> ray.data.Dataset | None:
        # Evaluation reruns many times over a small split: tokenize it once and keep it in the object store.
        if validation is None:
            return None
        validation_rows = first_rows(finished(tokenize(validation, (val_src or train_src).format), d), d)
        return cast(ray.data.Dataset, validation_rows.materialize())  # Ray's decorator hides its type

    # Both executions mostly wait on their tokenizer actors starting: overlap them.
    with ThreadPoolExecutor(2, thread_name_prefix="rayft-data") as pool:
        train_job, validation_job = pool.submit(count_train), pool.submit(tokenize_validation)
        train_tokens, stats = train_job.result()
        tokenized_validation = validation_job.result()
    _report_train(train_src, stats, d)
    validation_rows = tokenized_validation.count() if tokenized_validation is not None else 0
    if validation_rows == 0 and val_src is not None:
        raise ConfigError(f"data: {val_src.what} has no usable records; fix it or set data.val_split: null")
    return Datasets(
        train=finished(train_tokens, d),
        train_stats=stats,
        validation=tokenized_validation if validation_rows else None,
        validation_rows=validation_rows,
    )


def _read_splits(
    cfg: Config, train_src: SplitSource, val_src: SplitSource | None
) -> tuple[ray.data.Dataset, ray.data.Dataset | None]:
    """Both splits as Ray datasets; without a validation split, a held-out share of the training records when the
    run evaluates."""
    d = cfg.data
    train = read_split(train_src)
    validation = read_split(val_src) if val_src else None
    if validation is None and d.hold_out > 0 and cfg.train.eval_strategy != "no":
        _log_hold_out(d, train_src)
        # Deterministic hold-out so a rerun (or a resumed run) evaluates on the same records.
        train, validation = train.train_test_split(test_size=d.hold_out, shuffle=True, seed=cfg.train.seed)
    return train, validation


def _report_train(train_src: SplitSource, stats: SplitStats, d: DataConfig) -> None:
    """The training split's count in the job log, and a refusal where nothing of it is usable."""
    shape = f"blocks of {d.max_length} tokens" if d.packing else "examples"
    log.info("data: %s: %s → %d %s", train_src.what, stats.describe(), stats.rows, shape)
    _check_usable(stats, train_src.what, d)


def _log_hold_out(d: DataConfig, train_src: SplitSource) -> None:
    log.info(
        "data: no '%s' split; holding out %.0f%% of %s for evaluation", d.val_split, 100 * d.hold_out, train_src.what
    )


def first_rows(dataset: ray.data.Dataset, d: DataConfig) -> ray.data.Dataset:
    """The validation rows evaluation scores: the first `data.max_eval_samples` in order, or all of them."""
    return dataset if d.max_eval_samples is None else dataset.limit(d.max_eval_samples)


def in_driver(*sources: SplitSource | None) -> bool:
    """Whether the splits are small enough to tokenize in the driver process (RAYFT_DRIVER_TOKENIZE_BYTES)."""
    limit: int = environment.value(environment.DRIVER_TOKENIZE_BYTES)
    return sum(s.nbytes() for s in sources if s is not None) <= limit


def driver_datasets(rows: Rows) -> Datasets:
    """The small-source path: the rows `driver_rows` made go to the object store, so the row count is exact,
    nothing is counted twice and epochs only reshuffle."""
    return Datasets(
        train=_to_object_store(rows.train),
        train_stats=rows.train_stats,
        validation=_to_object_store(rows.validation) if rows.validation_rows else None,
        validation_rows=rows.validation_rows,
    )


def small_rows(
    cfg: Config, splits: tuple[SplitSource, SplitSource | None], fmt: RecordFormat, tokenizer: TokenizerFacts
) -> Rows | None:
    """The splits' rows where they are small enough to tokenize on the driver (`in_driver`), made before Ray is
    started or joined, so that their count can refuse a job that holds no cluster yet; None for bigger splits,
    which the tokenizer actors count on the cluster (reading them here too would read them twice)."""
    if not in_driver(*splits):
        return None
    return driver_rows(cfg, *splits, fmt, tokenizer)


@dataclass
class Rows:
    """Both splits tokenized and finished in this process: the rows the workers iterate."""

    train: pa.Table
    train_stats: SplitStats
    validation: pa.Table | None

    @property
    def validation_rows(self) -> int:
        return self.validation.num_rows if self.validation is not None else 0


def driver_rows(
    cfg: Config, train_src: SplitSource, val_src: SplitSource | None, fmt: RecordFormat, tokenizer: TokenizerFacts
) -> Rows:
    """The same Tokenize and finish stages as the tokenizer actors run, over the same 256-record batches, in this
    process: the hold-out, the training rows with their counts, and the validation rows evaluation scores."""
    d, mpl = cfg.data, cfg.dpo.max_prompt_length
    train_records = read_records(train_src)
    val_records = read_records(val_src) if val_src else None
    val_format = (val_src or train_src).format
    if val_records is None and d.hold_out > 0 and cfg.train.eval_strategy != "no":
        _log_hold_out(d, train_src)
        train_records, val_records = hold_out(train_records, d.hold_out, cfg.train.seed)
    train_rows, stats = tokenize_in_process(train_records, train_src.format, fmt, cfg.model, d, tokenizer, mpl)
    _report_train(train_src, stats, d)
    validation = None
    if val_records is not None:
        val_rows, _ = tokenize_in_process(val_records, val_format, fmt, cfg.model, d, tokenizer, mpl)
        validation = val_rows.slice(0, d.max_eval_samples)
    if (validation is None or validation.num_rows == 0) and val_src is not None:
        raise ConfigError(f"data: {val_src.what} has no usable records; fix it or set data.val_split: null")
    return Rows(train=train_rows, train_stats=stats, validation=validation)


def read_records(source: SplitSource) -> pa.Table:
    """A split's records as read_split's readers give them (columns, or `_raw` lines), in file order."""
    if source.format == "hf":
        return source.dataset.with_format("arrow")[0 : len(source.dataset)]
    if source.format == "parquet":
        import pyarrow.parquet as pq

        try:
            return pa.concat_tables([pq.read_table(p) for p in source.paths], promote_options="default")
        except Exception as e:
            raise ConfigError(f"data: reading {source.what} failed: {type(e).__name__}: {e}") from e
    contents = pa.table({"bytes": pa.array([Path(p).read_bytes() for p in source.paths], type=pa.binary())})
    return _split_lines(contents, json_array_ok=source.format == "json")


def hold_out(records: pa.Table, fraction: float, seed: int) -> tuple[pa.Table, pa.Table]:
    """A seeded shuffle, then the last `fraction` is the validation split (as Ray's train_test_split cuts it)."""
    order = np.random.default_rng(seed).permutation(records.num_rows)
    cut = int(records.num_rows * (1 - fraction))
    return records.take(pa.array(order[:cut])), records.take(pa.array(order[cut:]))


def tokenize_in_process(
    records: pa.Table,
    source_format: str,
    fmt: RecordFormat,
    model: ModelConfig,
    data: DataConfig,
    tokenizer: TokenizerFacts,
    max_prompt_length: int | None = None,
) -> tuple[pa.Table, SplitStats]:
    """Tokenize in TOKENIZE_BATCH-record batches and finish (pack or keep) PACK_BATCH examples at a time, as the
    actor pipeline batches them; returns the rows the workers iterate and what was counted."""
    encoder, kwargs = record_encoder(source_format, fmt, model, data, tokenizer, max_prompt_length)
    encode = encoder(**kwargs)
    encoded = [encode(records.slice(i, TOKENIZE_BATCH)) for i in range(0, records.num_rows, TOKENIZE_BATCH)]
    tokens = pa.concat_tables([t for t in encoded if t.num_rows]) if any(t.num_rows for t in encoded) else None
    if tokens is None:
        return pa.table({"input_ids": pa.array([], type=pa.list_(pa.int32()))}), SplitStats(records=0)
    batches = [tokens.slice(i, PACK_BATCH) for i in range(0, tokens.num_rows, PACK_BATCH)]
    rows = pa.concat_tables([finish(b, data.max_length, data.packing, counting=False) for b in batches])
    stats = _sum_stats(pa.concat_tables([finish(b, data.max_length, data.packing, counting=True) for b in batches]))
    return rows, stats


def _to_object_store(table: pa.Table) -> ray.data.Dataset:
    """Rows into the object store in blocks of RAW_BLOCK_ROWS: the equal split hands rows out block-wise.
    `from_blocks`, not `from_arrow`: it reads each block's metadata here rather than in a remote task, whose worker
    process was a second of the driver's start-up."""
    blocks = [table.slice(i, RAW_BLOCK_ROWS) for i in range(0, table.num_rows, RAW_BLOCK_ROWS)] or [table]
    return cast(ray.data.Dataset, ray.data.from_blocks(blocks))  # from_blocks has no return type hint


def small_eval_rows(cfg: Config, split: str, tokenizer: TokenizerFacts) -> pa.Table | None:
    """The split's rows where it is small enough to tokenize on the driver (`in_driver`), finished and cut to
    `data.max_eval_samples`, made before the cluster is joined so that their count can refuse an evaluation that
    holds no cluster yet (`check_eval_rows`); None for a bigger split, which the tokenizer actors count."""
    d = cfg.data
    source = eval_source(d, split)
    if not in_driver(source):
        return None
    fmt = record_format(d, source.columns(record_fields(d)), source.what)
    table, _ = tokenize_in_process(
        read_records(source), source.format, fmt, cfg.model, d, tokenizer, cfg.dpo.max_prompt_length
    )
    table = table.slice(0, d.max_eval_samples)
    check_eval_rows(cfg, source.what, table.num_rows)
    return table


def check_eval_rows(cfg: Config, what: str, rows: int) -> None:
    """An evaluation split that cannot give every worker a row is refused."""
    if rows < cfg.ray.num_workers:
        raise ConfigError(f"data: {what} has {rows} usable rows, fewer than ray.num_workers={cfg.ray.num_workers}")


def build_eval_dataset(
    cfg: Config, split: str, small: pa.Table | None, tokenizer: TokenizerFacts | None = None
) -> tuple[ray.data.Dataset, int]:
    """One split, tokenized and finished (and cut to `data.max_eval_samples`) as training's validation split is,
    kept in the object store. `small`: what `small_eval_rows` answered before the cluster was joined, its rows (not
    read again), or None for a split the tokenizer actors read and count here."""
    configure_ray_data()
    if small is not None:
        return _to_object_store(small), small.num_rows
    d = cfg.data
    source = eval_source(d, split)
    fmt = record_format(d, source.columns(record_fields(d)), source.what)
    tokenizer = tokenizer or tokenizer_facts(cfg.model)
    tokens = tokenized(
        read_split(source), source.format, fmt, cfg.model, d, tokenizer, actors_at_start(cfg), cfg.dpo.max_prompt_length
    )
    dataset = first_rows(finished(tokens, d), d).materialize()
    rows = dataset.count()
    check_eval_rows(cfg, source.what, rows)
    return dataset, rows


def eval_source(d: DataConfig, split: str) -> SplitSource:
    """The split `rayft eval` scores; checked on the driver before the cluster is joined."""
    # val_ratio set: a missing split is answered here, naming --split, not with hold-out advice
    train_src, val_src = resolve_splits(dataclasses.replace(d, val_split=split, val_ratio=0.0))
    source = train_src if split == d.train_split else val_src
    if source is None:
        raise ConfigError(f"data: no split '{split}' in {d.dataset_name_or_path}; name one with --split")
    return source


def actors_at_start(cfg: Config) -> int:
    """Tokenizer actors to start at once: all of data.tokenize_workers when the cluster has CPUs to spare beyond
    the training workers and the read/pack tasks, else one. Actors started up front hold their CPUs: more than the
    cluster can spare would starve the tasks that feed them (a hang, on a small machine)."""
    cpus = ray.cluster_resources().get("CPU", 0)  # type: ignore[no-untyped-call]  # Ray 2.60 leaves it unannotated
    spare = cpus - cfg.ray.num_workers * (cfg.ray.resources_per_worker or {}).get("CPU", 1)
    return max(1, min(cfg.data.tokenize_workers, int(spare // 3)))


def _cache(d: DataConfig, source: SplitSource) -> bool:
    return d.cache_tokenized if d.cache_tokenized is not None else source.nbytes() <= CACHE_AUTO_BYTES


def configure_ray_data() -> None:
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # tqdm bars turn `ray job logs` into noise; the dashboard shows progress
    quiet_ray_data_here()  # no execution plan per execution (also in the actors the context travels to)
    # The same records in the same order to the same rank every run (also turns off locality-based dispatch):
    # a resumed run skips exactly the batches it already trained on.
    context.execution_options.preserve_order = True
    # Ray 2.60's new read path spends ~10 s in its file-listing task before the first block (measured here, every
    # execution); the established datasources start reading at once.
    context.use_datasource_v2 = False


def _check_usable(stats: SplitStats, what: str, d: DataConfig) -> None:
    if stats.rows == 0:
        why = f" (skipped: {', '.join(f'{r} {n}' for r, n in stats.skipped.items())})" if stats.skipped else ""
        raise ConfigError(f"data: {what} has no usable records{why}; check data.text_field / data.format")
    if stats.skipped and d.bad_records == "error":
        raise ConfigError(f"data: {what}: {stats.describe()}; set data.bad_records: skip to train on the rest")


def read_split(source: SplitSource) -> ray.data.Dataset:
    """Parquet and `datasets` splits read as Arrow; text and JSON as raw lines, so that a broken line becomes a
    counted skip in the tokenizer actors rather than a failed read task."""
    if source.format == "hf":
        records = ray.data.from_huggingface(source.dataset)
    elif source.format == "parquet":
        records = ray.data.read_parquet(list(source.paths))
    else:
        records = ray.data.read_binary_files(list(source.paths)).map_batches(
            partial(_split_lines, json_array_ok=source.format == "json"), batch_format="pyarrow", batch_size=1
        )
    # A file (or row group) arrives as one block and a block goes to one tokenizer actor: cut big ones up
    # (streaming, no barrier) so that every actor gets work.
    return records.repartition(target_num_rows_per_block=RAW_BLOCK_ROWS)


def _split_lines(batch: pa.Table, json_array_ok: bool) -> pa.Table:
    lines = [line for content in batch.column("bytes").to_pylist() for line in split_lines(content, json_array_ok)]
    return pa.table({"_raw": pa.array(lines, type=pa.binary())})


def record_encoder(
    source_format: str,
    fmt: RecordFormat,
    model: ModelConfig,
    data: DataConfig,
    tokenizer: TokenizerFacts,
    max_prompt_length: int | None,
) -> tuple[type, dict[str, Any]]:
    """The callable class that turns a batch of records into token rows, with its constructor's arguments: one
    choice for the actor pool and the in-driver path alike. Preference records become one row per pair."""
    common = {
        "model": dataclasses.asdict(model),
        "tokenizer": dataclasses.asdict(tokenizer),
        "source_format": source_format,
    }
    if fmt.kind == "preference":
        limits = PairLimits(data.max_length, max_prompt_length, data.overlong)
        return PreferenceTokenize, {**common, "limits": dataclasses.asdict(limits)}
    return Tokenize, {
        **common,
        "fmt": dataclasses.asdict(fmt),
        "max_length": data.max_length,
        "packing": data.packing,
        "overlong": data.overlong,
    }


def tokenized(
    raw: ray.data.Dataset,
    source_format: str,
    fmt: RecordFormat,
    model: ModelConfig,
    data: DataConfig,
    tokenizer: TokenizerFacts,
    actors_at_start: int = 1,
    max_prompt_length: int | None = None,
) -> ray.data.Dataset:
    """Records → token rows in actors that each load the tokenizer once (skipped records stay, flagged). The pool
    starts with `actors_at_start` (their start is most of a small split's time) and grows to
    data.tokenize_workers as CPUs allow; min 1, so that a split of one block does not warn. Preference records
    become one row per pair (`rayft.data.preference`); `max_prompt_length` applies to those."""
    actor, kwargs = record_encoder(source_format, fmt, model, data, tokenizer, max_prompt_length)
    return raw.map_batches(
        actor,
        fn_constructor_kwargs=kwargs,
        batch_format="pyarrow",
        batch_size=TOKENIZE_BATCH,
        compute=ray.data.ActorPoolStrategy(
            min_size=1, max_size=data.tokenize_workers, initial_size=min(actors_at_start, data.tokenize_workers)
        ),
        num_cpus=1,
    )


def finished(tokens: ray.data.Dataset, data: DataConfig, counting: bool = False) -> ray.data.Dataset:
    """Drop flagged records and pack (or keep) the examples. `counting` ends in one statistics row per batch
    instead of the data: the same stages over the same blocks, so the counts are those of the real stream."""
    return tokens.map_batches(
        partial(finish, max_length=data.max_length, packing=data.packing, counting=counting),
        batch_format="pyarrow",
        batch_size=PACK_BATCH,
    )


def count(stats_rows: ray.data.Dataset, what: str) -> SplitStats:
    try:
        rows = stats_rows.take_all()
    except Exception as e:
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(f"data: reading {what} failed: {first}") from e
    return _sum_stats(rows)


def _sum_stats(rows: list[dict[str, Any]] | pa.Table) -> SplitStats:
    """One SplitStats from finish()'s statistics rows."""
    if isinstance(rows, pa.Table):
        rows = rows.to_pylist()
    total = SplitStats()
    for row in rows:
        total.records += row["records"]
        total.examples += row["examples"]
        total.rows += row["rows"]
        total.tokens += row["tokens"]
        total.truncated += row["truncated"]
        for reason in SKIPS:
            if row[f"skip_{reason}"]:
                total.skipped[reason] = total.skipped.get(reason, 0) + row[f"skip_{reason}"]
    return total


class Tokenize(RecordEncoder):
    """Ray Data actor: records → token ids (+ a loss mask for instruction data), one output row per example.

    Records that cannot be used stay as rows with a skip reason and no tokens, for the counting pass.
    """

    def __init__(
        self,
        model: dict[str, Any],
        tokenizer: dict[str, Any],
        fmt: dict[str, Any],
        source_format: str,
        max_length: int,
        packing: bool,
        overlong: str,
    ):
        super().__init__(model, tokenizer, source_format)
        self.fmt = RecordFormat(**fmt)
        self.max_length = None if packing else max_length
        self.overlong = overlong

    def __call__(self, batch: pa.Table) -> pa.Table:
        examples: list[tuple[Segments, bool, int]] = []  # (segments, add specials, records)
        skipped: list[str] = []
        for record, why in self._records(batch):
            found, specials, reason = segments(record, self.fmt, self.chat_tokenizer) if record else (None, False, why)
            if found is None:
                skipped.append(reason)
            else:
                examples.append((found, specials, 1))
        if self.fmt.join_wikitext_articles and examples:
            # plain text records only (rayft.data.records.record_format): one text segment each
            articles = join_wikitext_articles([cast(str, seg[0][0]) for seg, _, _ in examples])
            examples = [([(text, True)], True, lines) for text, lines in articles]
        return self._encode(examples, skipped)

    def _encode(self, examples: list[tuple[Segments, bool, int]], skipped: list[str]) -> pa.Table:
        texts = [text for found, _, _ in examples for text, _ in found if isinstance(text, str)]
        encoded = iter(self.encode(texts)) if texts else iter(())
        ids_out, masks_out, skip_out, truncated_out, records_out = [], [], [], [], []
        for found, specials, records in examples:
            ids = list(self.bos) if specials else []
            mask = [0 if self.fmt.completion_only else 1] * len(ids)
            for text, trained in found:
                piece = next(encoded) if isinstance(text, str) else text
                ids += piece
                mask += [1 if trained or not self.fmt.completion_only else 0] * len(piece)
            if specials:
                ids += self.eos
                mask += [1] * len(self.eos)
            reason, truncated = "", False
            if self.max_length is not None and len(ids) > self.max_length:
                if self.overlong == "skip":
                    reason = "too_long"
                else:
                    ids, mask, truncated = ids[: self.max_length], mask[: self.max_length], True
            if not reason and not any(mask):
                reason = "no_completion"  # the prompt alone fills max_length
            if reason:
                ids, mask = [], []
            ids_out.append(ids)
            masks_out.append(mask)
            skip_out.append(reason)
            truncated_out.append(truncated)
            records_out.append(records)
        for reason in skipped:
            ids_out.append([])
            masks_out.append([])
            skip_out.append(reason)
            truncated_out.append(False)
            records_out.append(1)
        columns = {
            "input_ids": pa.array(ids_out, type=pa.list_(pa.int32())),
            "skip": pa.array(skip_out, type=pa.string()),
            "truncated": pa.array(truncated_out, type=pa.bool_()),
            "records": pa.array(records_out, type=pa.int32()),
        }
        if self.fmt.completion_only:
            columns["loss_mask"] = pa.array(masks_out, type=pa.list_(pa.int8()))
        return pa.table(columns)


def finish(batch: pa.Table, max_length: int, packing: bool, counting: bool) -> pa.Table:
    """Drop skipped records, pack if asked; in counting mode return one row of statistics instead."""
    kept = batch.filter(pc.equal(batch.column("skip"), ""))
    data_columns = [c for c in ("input_ids", "loss_mask", *PAIR_COLUMNS) if c in kept.column_names]
    out = pack(kept.select(data_columns), max_length) if packing else kept.select(data_columns)
    if not counting:
        return out
    reasons = batch.column("skip").to_pylist()
    row: dict[str, list[int]] = {
        "records": [pc.sum(batch.column("records")).as_py() or 0],
        "examples": [kept.num_rows],
        "rows": [out.num_rows],
        "tokens": [_tokens(kept)],
        "truncated": [sum(batch.column("truncated").to_pylist())],
    }
    for reason in SKIPS:
        row[f"skip_{reason}"] = [reasons.count(reason)]
    return pa.table(row)


def _tokens(kept: pa.Table) -> int:
    """Tokens of the kept examples (both sequences of a preference pair)."""
    if not kept.num_rows:
        return 0
    columns = ["chosen_ids", "rejected_ids"] if "chosen_ids" in kept.column_names else ["input_ids"]
    return sum(len(kept.column(c).combine_chunks().flatten()) for c in columns)


def pack(table: pa.Table, max_length: int) -> pa.Table:
    """Concatenate the examples and cut `max_length` blocks (the last one shorter). Position ids restart at every
    example and at every block start, so attention never crosses an example inside a block (see PackedCollate)."""
    columns = {name: table.column(name).combine_chunks() for name in table.column_names}
    ids = columns["input_ids"]
    # flatten(), not .values: respects the array's own offset (non-zero for a sliced batch)
    flat = {name: col.flatten().to_numpy(zero_copy_only=False) for name, col in columns.items()}
    total = len(flat["input_ids"])
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    index = np.arange(total, dtype=np.int64)
    positions = index - np.maximum(starts, index - index % max_length)
    offsets = pa.array(np.append(np.arange(0, total, max_length), total).astype(np.int32))
    blocks = {name: pa.ListArray.from_arrays(offsets, pa.array(values)) for name, values in flat.items()}
    blocks["position_ids"] = pa.ListArray.from_arrays(offsets, pa.array(positions.astype(np.int32)))
    return pa.table(blocks)


def _labels(input_ids: np.ndarray, loss_mask: np.ndarray | None) -> np.ndarray:
    labels = input_ids.astype(np.int64)
    if loss_mask is not None:
        labels[np.asarray(loss_mask) == 0] = IGNORE_INDEX
    return labels


class PadCollate(NumpyBatchCollateFn):
    """Right-pad to the longest example in the batch, rounded up to `multiple` (capped at `max_length`); padding is
    masked out of attention and loss, and so are prompt tokens when the examples carry a loss mask."""

    def __init__(self, pad_id: int, multiple: int = 1, max_length: int | None = None):
        self.pad_id, self.multiple, self.max_length = pad_id, multiple, max_length

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:  # type: ignore[override]  # as PreferenceCollate's
        import torch

        seqs = batch["input_ids"]
        masks = batch.get("loss_mask")
        longest = max(len(s) for s in seqs)
        rounded = -(-longest // self.multiple) * self.multiple
        longest = max(longest, min(rounded, self.max_length or rounded))
        input_ids = torch.full((len(seqs), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(seqs), longest), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for i, s in enumerate(seqs):
            s = np.asarray(s)
            input_ids[i, : len(s)] = torch.from_numpy(s.astype(np.int64))
            labels[i, : len(s)] = torch.from_numpy(_labels(s, None if masks is None else masks[i]))
            attention_mask[i, : len(s)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class PackedCollate(NumpyBatchCollateFn):
    """Padding-free: the batch's blocks become one row with position ids restarting per example. Without an
    attention mask, transformers derives a per-example causal mask from the position ids (sdpa, eager, flex;
    flash-attention uses them as variable-length boundaries), and the first token of each example is never a
    target of the previous example's last one."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:  # type: ignore[override]  # as PreferenceCollate's
        import torch

        input_ids = np.concatenate([np.asarray(b) for b in batch["input_ids"]])
        positions = np.concatenate([np.asarray(b) for b in batch["position_ids"]])
        masks = batch.get("loss_mask")
        labels = _labels(input_ids, None if masks is None else np.concatenate([np.asarray(m) for m in masks]))
        labels[positions == 0] = IGNORE_INDEX
        return {
            "input_ids": torch.from_numpy(input_ids.astype(np.int64))[None],
            "position_ids": torch.from_numpy(positions.astype(np.int64))[None],
            "labels": torch.from_numpy(labels)[None],
        }


class AsRead(NumpyBatchCollateFn):
    """No collation: the batches as the pipeline reads them, for a reader that keeps only some and collates those
    itself."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:  # type: ignore[override]  # as PreferenceCollate's
        return batch


def collate_fn(
    data: DataConfig, pad_id: int, pairs: bool = False, reference: ReferenceTable | None = None, keys: bool = False
) -> NumpyBatchCollateFn:
    """The worker's batches: padding-free packed blocks, padded examples, or (`pairs`) padded preference pairs,
    with their keys (`keys`) or their precomputed reference log-probs (a `reference` table)."""
    if pairs:
        return PreferenceCollate(pad_id, data.pad_to_multiple_of, data.max_length, reference, keys)
    return PackedCollate() if data.packing else PadCollate(pad_id, data.pad_to_multiple_of, data.max_length)
