"""Preference records (`train.objective: dpo`): a prompt with a chosen and a rejected completion → one row per pair.

A row holds both full sequences (prompt + chosen, prompt + rejected) and the prompt's length, so a pair can never be
split: it is shuffled, sharded and batched as one unit, and the collate puts the chosen rows of a micro-batch first
and the rejected ones after them, for one forward over both. Formats are TRL's: `prompt`/`chosen`/`rejected` as
strings or message lists (explicit prompt), or `chosen`/`rejected` alone holding the whole text or conversation
(implicit prompt: their common prefix, as `trl.extract_prompt` finds it). Conversations are encoded by the
tokenizer's own chat encoding (rayft/data/chat.py). A record that cannot be a pair gets a skip reason (the SFT
reasons), counted by the driver like any bad record. Pure Python + pyarrow, run inside Ray Data actors.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from ray.data.collate_fn import NumpyBatchCollateFn

from rayft.data.chat import ChatRefused, chat_tokens
from rayft.data.encoder import RecordEncoder
from rayft.data.records import _is_chat

if TYPE_CHECKING:
    import torch

    from rayft.data.reference_table import ReferenceTable

IGNORE_INDEX = -100
PAIR_COLUMNS = ("chosen_ids", "rejected_ids", "prompt_length")


# (prompt, chosen, rejected) as text, or for conversations the ids of prompt, prompt + chosen, prompt + rejected
PairParts = tuple[str, str, str] | tuple[list[int], list[int], list[int]]


@dataclass(frozen=True)
class Pair:
    """One preference example as token ids: the prompt's and each completion's."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


@dataclass(frozen=True)
class PairLimits:
    """How long a pair may be: `max_prompt_length` keeps the prompt's end, `max_length` bounds prompt + completion
    (overlong: truncate the completion's end, or skip the pair)."""

    max_length: int
    max_prompt_length: int | None = None
    overlong: str = "truncate"


def pair_texts(record: dict[str, Any], chat_tokenizer: Callable[[], Any]) -> tuple[PairParts | None, str]:
    """(prompt, chosen, rejected) as text; for conversations the ids of prompt, prompt + chosen and prompt + rejected
    from the tokenizer's own chat encoding (rayft/data/chat.py); or None and why."""
    from trl.data_utils import extract_prompt

    chosen, rejected, prompt = record.get("chosen"), record.get("rejected"), record.get("prompt")
    if chosen is None or rejected is None:
        return None, "missing_field"
    example = {"chosen": chosen, "rejected": rejected}
    if prompt is None:  # implicit prompt: the common prefix of both
        both_text = isinstance(chosen, str) and isinstance(rejected, str)
        if not both_text and not (_is_chat(chosen) and _is_chat(rejected)):
            return None, "not_text"
        example = extract_prompt(example)
    else:
        example["prompt"] = prompt
    parts = (example["prompt"], example["chosen"], example["rejected"])
    if all(isinstance(p, str) for p in parts):
        if not parts[1].strip() or not parts[2].strip():
            return None, "empty"
        return parts, ""
    if not all(isinstance(p, list) for p in parts) or not all(_is_chat(p) for p in parts if p):
        return None, "not_text"
    if not all(_has_content(p) for p in parts[1:]):
        return None, "empty"
    try:
        tokenizer = chat_tokenizer()
        chosen_ids, rejected_ids = (
            chat_tokens([*example["prompt"], *side], tokenizer, first_trained=len(example["prompt"]))
            for side in (example["chosen"], example["rejected"])
        )
    except ChatRefused:
        return None, "chat_template"
    prompt_ids = [t for ids, _ in itertools.takewhile(lambda run: not run[1], chosen_ids) for t in ids]
    return (prompt_ids, _joined(chosen_ids), _joined(rejected_ids)), ""


def _joined(runs: list[tuple[list[int], bool]]) -> list[int]:
    return [t for ids, _ in runs for t in ids]


def _has_content(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), str) and m["content"].strip() for m in messages)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(ids: tuple[list[int], list[int], list[int]], bos: list[int], eos: list[int]) -> Pair | None:
    """From the ids of prompt, prompt + chosen and prompt + rejected (each encoded whole, as TRL does, so tokens
    that merge across the boundary stay merged): the completion starts where both diverge from the prompt. `bos`
    and `eos` are added for plain text (empty lists for chat ids, which carry their own). None when a
    completion has no tokens."""
    prompt, with_chosen, with_rejected = ids
    n = min(common_prefix(prompt, with_chosen), common_prefix(prompt, with_rejected))
    chosen, rejected = with_chosen[n:], with_rejected[n:]
    if not chosen or not rejected:
        return None
    return Pair(bos + prompt[:n], _ended(chosen, eos), _ended(rejected, eos))


def _ended(ids: list[int], eos: list[int]) -> list[int]:
    return ids if not eos or ids[-1:] == eos else ids + eos


def fit(pair: Pair, limits: PairLimits) -> tuple[Pair | None, str, bool]:
    """Apply the length limits: (pair, skip reason, truncated). A prompt that leaves no room for a completion token
    is `no_completion`: it could only be trained on nothing."""
    prompt = pair.prompt
    truncated = False
    if limits.max_prompt_length is not None and len(prompt) > limits.max_prompt_length:
        prompt, truncated = prompt[-limits.max_prompt_length :], True
    room = limits.max_length - len(prompt)
    if room <= 0:
        return None, "no_completion", truncated
    longest = max(len(pair.chosen), len(pair.rejected))
    if longest > room:
        if limits.overlong == "skip":
            return None, "too_long", truncated
        truncated = True
    return Pair(prompt, pair.chosen[:room], pair.rejected[:room]), "", truncated


def pair_key(chosen: np.ndarray, rejected: np.ndarray, prompt_length: int) -> int:
    """A pair's identity from its tokens (signed 64-bit, as torch and numpy hold it): the key of its precomputed
    reference log-probs (`rayft.train.reference`), the same whichever worker and epoch the pair lands in."""
    digest = hashlib.blake2b(digest_size=8)
    for part in (np.asarray(chosen, dtype=np.int64), np.asarray(rejected, dtype=np.int64)):
        digest.update(part.tobytes())
        digest.update(b"|")
    digest.update(int(prompt_length).to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little", signed=True)


class PreferenceTokenize(RecordEncoder):
    """Ray Data actor: preference records → one row per pair (`PAIR_COLUMNS`), skipped records flagged as the SFT
    actor flags them (`skip`, `truncated`, `records` columns), so counting and `finish` treat both alike."""

    def __init__(self, model: dict[str, Any], tokenizer: dict[str, Any], source_format: str, limits: dict[str, Any]):
        super().__init__(model, tokenizer, source_format)
        self.limits = PairLimits(**limits)

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts: list[PairParts | None] = []
        reasons: list[str] = []
        chat: list[bool] = []
        for record, why in self._records(batch):
            found, reason = pair_texts(record, self.chat_tokenizer) if record else (None, why)
            texts.append(found)
            reasons.append(reason)
            chat.append(bool(record) and not isinstance(record.get("chosen"), str))
        flat = [t for f in texts if f and isinstance(f[0], str) for t in (f[0], f[0] + f[1], f[0] + f[2])]
        encoded = iter(self.encode(flat)) if flat else iter(())
        rows: list[tuple[Pair | None, str, bool]] = []
        for found, reason, is_chat in zip(texts, reasons, chat, strict=True):
            if found is None:
                rows.append((None, reason, False))
                continue
            ids = (next(encoded), next(encoded), next(encoded)) if isinstance(found[0], str) else found
            specials = ([], []) if is_chat else (self.bos, self.eos)
            pair = tokenize_pair(ids, *specials)
            rows.append(fit(pair, self.limits) if pair is not None else (None, "empty", False))
        return pair_table(rows)


def pair_table(rows: list[tuple[Pair | None, str, bool]]) -> pa.Table:
    """(pair or None, skip reason, truncated) per record → the actor's output table."""
    ids = pa.list_(pa.int32())
    return pa.table(
        {
            "chosen_ids": pa.array([p.prompt + p.chosen if p else [] for p, _, _ in rows], type=ids),
            "rejected_ids": pa.array([p.prompt + p.rejected if p else [] for p, _, _ in rows], type=ids),
            "prompt_length": pa.array([len(p.prompt) if p else 0 for p, _, _ in rows], type=pa.int32()),
            "skip": pa.array([reason if p is None else "" for p, reason, _ in rows], type=pa.string()),
            "truncated": pa.array([t for _, _, t in rows], type=pa.bool_()),
            "records": pa.array([1] * len(rows), type=pa.int32()),
        }
    )


class PreferenceCollate(NumpyBatchCollateFn):
    """A micro-batch of B pairs → 2B rows, the chosen sequences first, then the rejected ones in the same order,
    right-padded to the longest rounded up to `multiple` (capped at `max_length`); labels are the completion tokens
    only (prompt and padding are -100). With `keys`, each pair's key (`pair_key`, B) comes along; with a `reference`
    table, the key and the pair's reference log-probs too (`reference_logps`, 2B in row order, NaN where the table
    lacks the pair) and how many pairs it lacks (`reference_missing`)."""

    def __init__(
        self,
        pad_id: int,
        multiple: int = 1,
        max_length: int | None = None,
        reference: ReferenceTable | None = None,
        keys: bool = False,
    ):
        self.pad_id, self.multiple, self.max_length = pad_id, multiple, max_length
        self.reference = reference  # rayft.data.reference_table.ReferenceTable
        self.keys = keys or reference is not None

    # Ray 2.60 hints the return as an unbound TypeVar (CollatedData), which no override can match; Ray's docs
    # return dicts of tensors
    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:  # type: ignore[override]
        import torch

        seqs = [np.asarray(s) for s in (*batch["chosen_ids"], *batch["rejected_ids"])]
        prompts = [int(n) for n in batch["prompt_length"]] * 2
        longest = max(len(s) for s in seqs)
        rounded = -(-longest // self.multiple) * self.multiple
        longest = max(longest, min(rounded, self.max_length or rounded))
        input_ids = torch.full((len(seqs), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(seqs), longest), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for i, (s, prompt) in enumerate(zip(seqs, prompts, strict=True)):
            row = torch.from_numpy(s.astype(np.int64))
            input_ids[i, : len(s)] = row
            labels[i, prompt : len(s)] = row[prompt:]
            attention_mask[i, : len(s)] = 1
        out = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if not self.keys:  # hashing every pair only where a precomputed reference needs it
            return out
        keys = np.array(
            [
                pair_key(c, r, n)
                for c, r, n in zip(batch["chosen_ids"], batch["rejected_ids"], batch["prompt_length"], strict=True)
            ]
        )
        out["pair_key"] = torch.from_numpy(keys)
        if self.reference is not None:
            values, missing = self.reference.lookup(keys)
            out["reference_logps"] = torch.from_numpy(np.concatenate([values[:, 0], values[:, 1]]))
            out["reference_missing"] = torch.tensor(missing)
        return out
