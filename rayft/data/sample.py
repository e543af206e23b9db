"""What the job's own record pipeline makes of the first records of each split, found before any cluster resource
(by `rayft validate` and by the job's preflight alike): records kept and skipped by reason with the first offending
record's file and index, a split mixing record kinds, and records that would train on nothing.

The records go through the same encoder class the tokenizer actors run (`rayft.data.pipeline.record_encoder`), one
record at a time so that every verdict has its record. A split of at most `SAMPLE_RECORDS` records is checked
whole; a larger one by its first `SAMPLE_RECORDS`, and the report says which.

Before them, `check_data` is the data's part of preflight: the files by content, the record fields, the objective
the records fit, and the first records' chat encoding (or that a hold-out split can be cut).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

from rayft.config import Config, ConfigError
from rayft.data.chat import ChatRefused, TokenSegments, chat_tokens, runs_of
from rayft.data.files import DecodeBudget
from rayft.data.records import (
    SKIPS,
    RecordFormat,
    chat_conversation,
    check_objective,
    decode_line,
    kind_of_record,
    record_fields,
    record_format,
)
from rayft.data.sources import SplitSource, check_hold_out
from rayft.data.tokenizer import TokenizerFacts, load_tokenizer

SAMPLE_RECORDS = 1000
CHAT_SAMPLE = 64  # records of each split encoded by `rayft validate` (about a second with a chat template)
NO_SIGNAL = "no_signal"  # kept, but nothing in it trains (not a skip: the job would train on it)

# What each skip reason means for a record, and what to change.
REASONS = {
    "empty": ("is empty (no text, or an empty completion)", "drop such records or fill them"),
    "missing_field": (
        "lacks a field the record format reads",
        "point data.text_field / data.messages_field / data.completion_field at a field the records have, or set "
        "data.format",
    ),
    "not_text": (
        "holds the field in another type than the format reads (a chat needs a list of {role, content} messages, "
        "text fields need strings)",
        "store the field in that type, or set data.format to the kind the records are",
    ),
    "not_utf8": ("is not UTF-8 text", "decompress the file, or convert it to UTF-8 (a gzip file needs gunzip first)"),
    "bad_json": ("is not one JSON object on one line", "fix or drop the line"),
    "chat_template": (
        "is refused by the tokenizer's chat template",
        "fix the record, or point model.tokenizer_name_or_path at a tokenizer whose chat format fits",
    ),
    "too_long": ("is longer than data.max_length", "raise data.max_length, or set data.overlong: truncate"),
    "no_completion": ("has a prompt that fills data.max_length", "raise data.max_length or shorten the prompts"),
    NO_SIGNAL: (
        "trains on nothing (assistant replies that are all empty, or a preference pair whose chosen and rejected "
        "tokenize alike)",
        "fix or drop such records",
    ),
}


@dataclass(frozen=True)
class Example:
    """The first record of a split that trains, as the job's pipeline encodes it: what `rayft validate` shows."""

    where: tuple[str, int]  # (file, index)
    runs: TokenSegments  # its token ids, in runs that are trained or not


@dataclass
class SampleReport:
    """One split's checked records: counts by verdict, the first record of each, and the record kinds seen."""

    what: str
    checked: int = 0
    whole: bool = True  # every record of the split was checked
    kept: int = 0
    counts: Counter[str] = field(default_factory=Counter)  # skip reason or NO_SIGNAL → records
    first: dict[str, tuple[str, int]] = field(default_factory=dict)  # same keys → (file, index)
    kinds: Counter[str] = field(default_factory=Counter)  # record kind → records
    first_of_kind: dict[str, tuple[str, int]] = field(default_factory=dict)
    example: Example | None = None

    @property
    def skipped(self) -> int:
        return sum(n for reason, n in self.counts.items() if reason != NO_SIGNAL)

    def scope(self) -> str:
        return f"all {self.checked:,} records" if self.whole else f"the first {self.checked:,} records"

    def describe(self) -> str:
        text = f"{self.what}: {self.scope()} checked, {self.kept:,} kept"
        return text + f"; {self.tally()}" if self.counts else text

    def tally(self) -> str:
        """The counts by verdict, skip reasons in the order the job reports them, then records without a signal."""
        return ", ".join(f"{v} {self.counts[v]:,}" for v in (*SKIPS, NO_SIGNAL) if self.counts[v])

    def note(self, verdict: str, where: tuple[str, int]) -> None:
        self.counts[verdict] += 1
        self.first.setdefault(verdict, where)

    def first_record(self, verdict: str) -> str:
        file, index = self.first[verdict]
        meaning, fix = REASONS[verdict]
        return f"{file}: record {index} {meaning}; {fix}"


def sample_report(
    cfg: Config, source: SplitSource, fmt: RecordFormat, tokenizer: TokenizerFacts, limit: int = SAMPLE_RECORDS
) -> SampleReport:
    """The first `limit` records of `source` through the job's encoder, one verdict per record."""
    from rayft.data.pipeline import record_encoder

    actor, kwargs = record_encoder(source.format, fmt, cfg.model, cfg.data, tokenizer, cfg.dpo.max_prompt_length)
    encode = actor(**kwargs)
    table, where = source.head(limit + 1)  # one more tells whether the split goes on
    report = SampleReport(what=source.what, whole=len(where) <= limit)
    table, where = table.slice(0, limit), where[:limit]
    raw = table.column("_raw").to_pylist() if "_raw" in table.column_names else None
    for i, place in enumerate(where):
        record = decode_line(raw[i], source.format)[0] if raw is not None else table.slice(i, 1).to_pylist()[0]
        kind = kind_of_record(record, cfg.data)
        if kind is not None:
            report.kinds[kind] += 1
            report.first_of_kind.setdefault(kind, place)
        row = encode(table.slice(i, 1)).to_pylist()[0]
        report.checked += 1
        if row["skip"]:
            report.note(row["skip"], place)
            continue
        report.kept += 1
        if not _trains(row, record, fmt):
            report.note(NO_SIGNAL, place)
        elif report.example is None:
            report.example = Example(place, token_runs(row, fmt))
    return report


def token_runs(row: dict[str, Any], fmt: RecordFormat) -> TokenSegments:
    """An encoded row's ids in runs by whether the loss covers them (a preference pair: its chosen side)."""
    if fmt.kind == "preference":
        ids, start = row["chosen_ids"], row["prompt_length"]
        mask = [0] * start + [1] * (len(ids) - start)
    else:
        ids = row["input_ids"]
        mask = row.get("loss_mask") or [1] * len(ids)
    return runs_of(ids, mask)


def rendered(example: Example, tokenizer: Any, limit: int = 600) -> str:
    """The example as one line of text, special tokens shown, the trained text inside ⟦ ⟧, line breaks as \\n;
    cut at `limit` characters."""
    text = "".join(
        f"⟦{piece}⟧" if trained else piece
        for ids, trained in example.runs
        for piece in [tokenizer.decode(ids, skip_special_tokens=False)]
    ).replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def check_sample(cfg: Config, report: SampleReport, fmt: RecordFormat) -> list[str]:
    """Refuse what the job would train wrongly or not at all (ConfigError); the warnings for what it would train
    with records left out or empty."""
    d = cfg.data
    if d.format == "auto" and len(report.kinds) > 1:
        kinds = ", ".join(
            f"{kind} {n:,} (first: {report.first_of_kind[kind][0]}: record {report.first_of_kind[kind][1]})"
            for kind, n in report.kinds.most_common()
        )
        raise ConfigError(
            f"data: {report.what} mixes record kinds in {report.scope()}: {kinds}; the job would read them all as "
            f"{fmt.kind} and skip the others. Set data.format to the kind to train on (the rest are skipped and "
            "counted), or split the file by kind"
        )
    if report.checked == 0:
        return []
    if report.kept == 0:
        reason = max((r for r in report.counts if r != NO_SIGNAL), key=report.counts.__getitem__)
        raise ConfigError(
            f"data: {report.what}: none of {report.scope()} would train ({report.tally()}); first: "
            f"{report.first_record(reason)}"
        )
    if report.skipped and d.bad_records == "error":
        reason = next(r for r in report.first if r != NO_SIGNAL)  # in record order
        raise ConfigError(
            f"data: {report.what}: {report.skipped:,} of {report.scope()} would be skipped ({report.tally()}) and "
            f"data.bad_records is error; first: {report.first_record(reason)}; or set data.bad_records: skip"
        )
    # Blank lines of plain text (a third of wikitext's) hold nothing that is lost: counted, never warned about.
    blank = report.counts["empty"] if fmt.kind == "text" else 0
    skips = [r for r in report.counts if r != NO_SIGNAL and not (blank and r == "empty")]
    warnings = []
    if skips:
        n = sum(report.counts[r] for r in skips)
        warnings.append(_within_share(report, n, blank, d.max_skipped_share, "data.max_skipped_share", skips))
    if report.counts[NO_SIGNAL]:
        n = report.counts[NO_SIGNAL]
        warnings.append(_within_share(report, n, 0, d.max_no_signal_share, "data.max_no_signal_share", [NO_SIGNAL]))
    return warnings


def _within_share(report: SampleReport, n: int, blank: int, limit: float, key: str, verdicts: list[str]) -> str:
    """The warning for `n` records of these verdicts, or ConfigError where their share of the records that are not
    `blank` is over `key`'s limit."""
    reason = max(verdicts, key=report.counts.__getitem__)
    share = n / (report.checked - blank)
    what = REASONS[NO_SIGNAL][0] if verdicts == [NO_SIGNAL] else "would be skipped"
    of = report.scope() if not blank else f"the {report.checked - blank:,} non-blank of {report.scope()}"
    said = f"data: {report.what}: {n:,} of {of} ({share:.0%}) {what} ({report.tally()})"
    if share > limit:
        raise ConfigError(f"{said}, over {key} {limit:g}; first: {report.first_record(reason)}; or raise {key}")
    return f"{said}; first: {report.first_record(reason)}"


def _trains(row: dict[str, Any], record: Any, fmt: RecordFormat) -> bool:
    """Whether a kept record carries a training signal: a preference pair whose two sides differ; a chat with an
    assistant reply to learn (its end-of-turn token alone teaches the model to say nothing)."""
    if fmt.kind == "preference":
        return cast(bool, row["chosen_ids"] != row["rejected_ids"])  # two lists of ids
    conversation = chat_conversation(record, fmt)
    if conversation is None:
        return True
    messages, first_trained = conversation
    replies = [m for m in messages[first_trained:] if m.get("role") == "assistant"]
    return any(_text_of(m.get("content")).strip() for m in replies) or not replies


def _text_of(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def check_data(cfg: Config, train: SplitSource, validation: SplitSource | None) -> RecordFormat:
    """Files by content first (a UTF-16 file must not be scanned as UTF-8 JSON), then the record fields across
    every record, then that a hold-out split can be cut."""
    d = cfg.data
    wanted = record_fields(d)
    budget = DecodeBudget()
    for source in (train, validation):
        if source is not None:
            source.check_content(wanted, budget)
    records = record_format(d, train.columns(wanted), train.what)
    check_objective(cfg, records, train.what)
    if validation is not None:
        record_format(d, validation.columns(wanted), validation.what)
    if records.kind in ("messages", "prompt_completion"):
        _check_chat_sample(cfg, records, [s for s in (train, validation) if s is not None])
    elif cfg.train.eval_strategy != "no":
        check_hold_out(d, train)
    return records


def check_samples(
    cfg: Config, records: RecordFormat, tokenizer: TokenizerFacts, sources: list[SplitSource]
) -> tuple[list[SampleReport], list[str]]:
    """Each split's first records through the job's own pipeline (`sample_report`): the reports, and the
    warnings for records it would leave out or train on without a signal."""
    reports = [sample_report(cfg, source, records, tokenizer) for source in sources]
    return reports, [w for report in reports for w in check_sample(cfg, report, records)]


def _check_chat_sample(cfg: Config, records: RecordFormat, sources: list[SplitSource]) -> None:
    """The first records of each split through the tokenizer's own chat encoding, as the job would encode them: a
    role the template does not know, a last turn that is not the assistant's or an empty loss mask is answered
    here, with the record, rather than counted as skipped after the cluster started."""
    tokenizer = None
    for source in sources:
        for where, index, record in source.sample(CHAT_SAMPLE):
            conversation = chat_conversation(record, records)
            if conversation is None:
                continue
            tokenizer = tokenizer or load_tokenizer(cfg.model)
            try:
                chat_tokens(conversation[0], tokenizer, conversation[1])
            except ChatRefused as e:
                raise ConfigError(
                    f"{where}: record {index} ({records.kind} in {source.what}): {e}; fix or drop the record, or "
                    f"point model.tokenizer_name_or_path at a tokenizer whose chat format fits"
                ) from None
