"""From raw records to examples: which text a record holds and which of its tokens carry the loss.

An example is a list of segments `(text, trained)`: plain text is one trained segment; a prompt/completion record
is an untrained prompt then a trained completion; a chat alternates between the two, as token ids from the
tokenizer's own chat encoding (rayft/data/chat.py). A record that cannot be an
example gets a skip reason instead, so the driver can count and report it: one bad line must never stop a run.
Pure Python, run inside Ray Data tasks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeGuard

from rayft.config import Config, ConfigError, DataConfig, template_fields
from rayft.data.chat import ChatRefused, as_messages, chat_tokens

# Why a record was skipped, in the order the driver reports them.
SKIPS = ("empty", "missing_field", "not_text", "not_utf8", "bad_json", "chat_template", "too_long", "no_completion")
# A segment is text to encode, or ids the tokenizer's own chat encoding already gave.
Segments = list[tuple[str | list[int], bool]]
# Fields every preference record has (the prompt may be implicit: the common start of both).
PREFERENCE_FIELDS = ("chosen", "rejected")
SHAREGPT_FIELD = "conversations"  # ShareGPT's turns ({from, value}), read as the messages where records have none
# A top-level wikitext heading (" = Title = "), which starts an article; " = = Section = = " does not.
WIKITEXT_TITLE = re.compile(r"^ ?= [^=].*[^=] = ?$")


@dataclass(frozen=True)
class RecordFormat:
    """How records of one dataset become examples (decided once on the driver from its fields)."""

    kind: str  # text | prompt_completion | messages | preference
    text_field: str = "text"
    prompt_template: str | None = None
    completion_field: str = "completion"
    messages_field: str = "messages"
    completion_only: bool = False
    join_wikitext_articles: bool = False


def record_fields(data: DataConfig) -> list[str]:
    """Every field the record format may read: what the scan of a JSON split looks for beyond its first records."""
    fields = [data.text_field, data.messages_field, SHAREGPT_FIELD, "prompt", data.completion_field, *PREFERENCE_FIELDS]
    if data.prompt_template is not None:
        fields += template_fields(data.prompt_template)
    return list(dict.fromkeys(fields))


def messages_field(data: DataConfig, fields: Collection[str]) -> str:
    """`data.messages_field`, or ShareGPT's `conversations` where records lack the former and hold the latter."""
    return SHAREGPT_FIELD if data.messages_field not in fields and SHAREGPT_FIELD in fields else data.messages_field


def auto_kind(fields: Collection[str], data: DataConfig) -> str:
    """`data.format: auto`: the record kind the fields make (a dataset's columns, or one record's keys)."""
    if all(name in fields for name in PREFERENCE_FIELDS):
        return "preference"
    if data.prompt_template is not None:
        return "prompt_completion"
    if messages_field(data, fields) in fields:
        return "messages"
    if "prompt" in fields and data.completion_field in fields:
        return "prompt_completion"
    return "text"


def kind_of_record(record: Any, data: DataConfig) -> str | None:
    """The kind one record would be read as on its own (its non-null fields), or None where it has none of the
    fields any kind reads: how the sample check finds a split mixing kinds."""
    if not isinstance(record, dict):
        return None
    fields = {name for name, value in record.items() if value is not None}
    kind = auto_kind(fields, data)
    if kind == "prompt_completion" and data.prompt_template is not None:
        return kind if set(template_fields(data.prompt_template)) <= fields else None
    return kind if kind != "text" or data.text_field in fields else None


def record_format(data: DataConfig, columns: list[str], where: str) -> RecordFormat:
    """Pick the record kind (`data.format: auto` looks at the fields) and check the fields it needs exist."""
    kind = data.format if data.format != "auto" else auto_kind(columns, data)
    if kind == "text":
        needed = {data.text_field: "data.text_field"}
    elif kind == "preference":
        needed = {name: "data.format" for name in PREFERENCE_FIELDS}
    elif kind == "messages":
        needed = {messages_field(data, columns): "data.messages_field"}
    else:
        prompt_fields = template_fields(data.prompt_template) if data.prompt_template else ["prompt"]
        needed = {name: "data.prompt_template" for name in prompt_fields}
        needed[data.completion_field] = "data.completion_field"
    missing = [f"'{name}' ({key})" for name, key in needed.items() if name not in columns]
    if missing:
        raise ConfigError(
            f"{where}: records have no field {', '.join(missing)}; their fields are {', '.join(columns) or 'none'}. "
            "Point the named key at one of them"
        )
    if data.completion_only_loss and kind == "text":
        raise ConfigError(
            "data.completion_only_loss: true needs instruction records (data.prompt_template, prompt/completion "
            "fields) or chat messages; these are plain text"
        )
    if data.join_wikitext_articles and kind != "text":
        raise ConfigError("data.join_wikitext_articles: true applies to plain text records only")
    return RecordFormat(
        kind=kind,
        text_field=data.text_field,
        prompt_template=data.prompt_template,
        completion_field=data.completion_field,
        messages_field=messages_field(data, columns),
        completion_only=kind != "text" if data.completion_only_loss is None else data.completion_only_loss,
        join_wikitext_articles=data.join_wikitext_articles,
    )


def decode_line(raw: bytes, file_format: str) -> tuple[dict[str, Any] | None, str]:
    """One line of a text or JSON Lines file → (record, "") or (None, skip reason)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not_utf8"
    if file_format == "text":
        return {"text": line}, ""
    if not line.strip():
        return None, "empty"
    try:
        record = json.loads(line)
    except ValueError:
        return None, "bad_json"
    return (record, "") if isinstance(record, dict) else (None, "bad_json")


def segments(
    record: dict[str, Any], fmt: RecordFormat, chat_tokenizer: Callable[[], Any]
) -> tuple[Segments | None, bool, str]:
    """(segments, needs bos/eos added, skip reason). A chat's ids carry their own special tokens.
    `chat_tokenizer()` gives the transformers tokenizer, asked for only when a record needs its chat format."""
    if fmt.kind == "text":
        text, reason = _text(record, fmt.text_field)
        return ([(text, True)] if text is not None else None), True, reason
    conversation = chat_conversation(record, fmt)
    if conversation is not None:
        try:
            messages, first_trained = conversation
            return list(chat_tokens(messages, chat_tokenizer(), first_trained)), False, ""
        except ChatRefused:
            return None, False, "chat_template"
    if fmt.kind == "messages":
        return None, False, "missing_field" if record.get(fmt.messages_field) is None else "not_text"
    return _prompt_completion(record, fmt)


def chat_conversation(record: Any, fmt: RecordFormat) -> tuple[list[dict[str, Any]], int] | None:
    """(conversation, index of its first trained message) of a chat record: a messages list, or a prompt and a
    completion that are both message lists (only the completion's assistant turns train); None otherwise."""
    if not isinstance(record, dict):
        return None
    if fmt.kind == "messages":
        messages = as_messages(record.get(fmt.messages_field))
        return (messages, 0) if messages is not None else None
    if fmt.kind == "prompt_completion" and fmt.prompt_template is None:
        prompt, completion = as_messages(record.get("prompt")), as_messages(record.get(fmt.completion_field))
        if prompt is not None and completion is not None:
            return [*prompt, *completion], len(prompt)
    return None


def _text(record: dict[str, Any], name: str) -> tuple[str | None, str]:
    value = record.get(name)
    if value is None:
        return None, "missing_field"
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None, "not_utf8"
    if not isinstance(value, str):
        return None, "not_text"
    if not value.strip():
        return None, "empty"
    return value, ""


def _prompt_completion(record: dict[str, Any], fmt: RecordFormat) -> tuple[Segments | None, bool, str]:
    completion = record.get(fmt.completion_field)
    if fmt.prompt_template is not None:
        try:
            prompt: object = fmt.prompt_template.format(**record)
        except (KeyError, IndexError):
            return None, True, "missing_field"
    else:
        prompt = record.get("prompt")
    if prompt is None or completion is None:
        return None, True, "missing_field"
    if not isinstance(prompt, str) or not isinstance(completion, str):
        return None, True, "not_text"
    if not completion.strip():
        return None, True, "empty"
    return [(prompt, False), (completion, True)], True, ""


def _is_chat(value: Any) -> TypeGuard[list[dict[str, Any]]]:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def join_wikitext_articles(texts: list[str]) -> list[tuple[str, int]]:
    """Join paragraph lines into articles, each starting at a top-level heading. Returns (article, lines joined).
    Lines before the first heading of the batch form an article of their own (the tail of one cut by a batch)."""
    articles: list[tuple[str, int]] = []
    lines: list[str] = []
    for text in texts:
        if WIKITEXT_TITLE.match(text.rstrip("\n")) and lines:
            articles.append(("\n".join(lines), len(lines)))
            lines = []
        lines.append(text.strip("\n"))
    if lines:
        articles.append(("\n".join(lines), len(lines)))
    return articles


def check_objective(cfg: Config, records: RecordFormat, what: str) -> None:
    """DPO trains on preference pairs and only on them; SFT cannot use pairs."""
    preference = records.kind == "preference"
    if cfg.train.objective == "dpo" and not preference:
        raise ConfigError(
            f"train.objective: dpo needs preference records (fields chosen and rejected, prompt optional); {what} "
            f"holds {records.kind} records"
        )
    if cfg.train.objective != "dpo" and preference:
        raise ConfigError(f"{what} holds preference records (chosen/rejected): set train.objective: dpo for them")
