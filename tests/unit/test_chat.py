"""Chat records → token ids + assistant-only loss mask, from the tokenizer's own chat encoding: Mistral's tekken
(transformers' `MistralCommonBackend`, encoded by mistral-common in its fine-tuning mode) and a `tokenizer.json` with
a chat template (SmolLM2's). Expected ids come from an independent path: the raw vocabularies (mistral-common's
Tekkenizer, the `tokenizers` library) encoding each piece of the conversation, joined by the format's control
tokens as written here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import Fixtures
from fixtures.chat import CONVERSATION, chatml_expected, tekken_expected, tekken_model

from rayft.config import DataConfig, ModelConfig
from rayft.data.pipeline import Tokenize
from rayft.data.records import record_format
from rayft.data.tokenizer import load_tokenizer, tokenizer_facts


@pytest.fixture(scope="module")
def tekken(fixtures: Fixtures, tmp_path_factory) -> Path:
    return tekken_model(fixtures, tmp_path_factory.mktemp("tekken") / "model")


def tokenize(model: Path, fmt, max_length: int = 256) -> Tokenize:
    model_cfg = ModelConfig(model_name_or_path=str(model))
    facts = dataclasses.asdict(tokenizer_facts(model_cfg))
    return Tokenize(dataclasses.asdict(model_cfg), facts, dataclasses.asdict(fmt), "json", max_length, False,
                    "truncate")  # fmt: skip


def encode_rows(model: Path, records: list[dict]) -> list[dict]:
    fmt = record_format(DataConfig(), sorted(records[0]), "x")
    raw = [json.dumps(r).encode() for r in records]
    return tokenize(model, fmt)(pa.table({"_raw": pa.array(raw, type=pa.binary())})).to_pylist()


def test_tekken_chat_trains_on_the_assistant_reply_in_fine_tuning_mode(tekken: Path):
    """On main every such record was skipped (`chat_template`): serving-mode validation wants a user turn last."""
    assert type(load_tokenizer(ModelConfig(model_name_or_path=str(tekken)))).__name__ == "MistralCommonBackend"
    row = encode_rows(tekken, [{"messages": CONVERSATION}])[0]
    ids, mask = tekken_expected(tekken)
    assert row["skip"] == "" and row["input_ids"] == ids and row["loss_mask"] == mask


def test_tekken_prompt_completion_chat_trains_on_the_completion(tekken: Path):
    record = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    row = encode_rows(tekken, [record])[0]
    ids, mask = tekken_expected(tekken)
    assert row["skip"] == "" and row["input_ids"] == ids and row["loss_mask"] == mask


def test_chat_template_tokenizer_trains_every_assistant_turn(smollm2: Path):
    row = encode_rows(smollm2, [{"messages": CONVERSATION}])[0]
    ids, mask = chatml_expected(smollm2)
    assert row["skip"] == "" and row["input_ids"] == ids and row["loss_mask"] == mask


def test_unknown_roles_and_conversations_ending_in_a_user_turn_are_skipped(smollm2: Path, tekken: Path):
    """SmolLM2's template renders any role: on main `narrator` was trained on without a word."""
    narrator = [CONVERSATION[1], {"role": "narrator", "content": "They wait."}, CONVERSATION[2]]
    rows = encode_rows(smollm2, [{"messages": narrator}, {"messages": CONVERSATION[:4]}])
    assert [r["skip"] for r in rows] == ["chat_template", "chat_template"]
    rows = encode_rows(tekken, [{"messages": narrator}, {"messages": CONVERSATION[:4]}])
    assert [r["skip"] for r in rows] == ["chat_template", "chat_template"]


def test_tekken_preference_pairs_use_the_fine_tuning_encoding(tekken: Path):
    """DPO's conversational pairs: on main skipped (`chat_template`) like SFT's."""
    from rayft.data.preference import PairLimits, PreferenceTokenize

    model_cfg = ModelConfig(model_name_or_path=str(tekken))
    facts = dataclasses.asdict(tokenizer_facts(model_cfg))
    limits = dataclasses.asdict(PairLimits(256, None, "truncate"))
    actor = PreferenceTokenize(dataclasses.asdict(model_cfg), facts, "json", limits)
    record = {"prompt": CONVERSATION[:4], "chosen": CONVERSATION[4:],
              "rejected": [{"role": "assistant", "content": "It is 5."}]}  # fmt: skip
    row = actor(pa.table({"_raw": pa.array([json.dumps(record).encode()], type=pa.binary())})).to_pylist()[0]
    ids, mask = tekken_expected(tekken)
    prompt = ids[: mask.index(1)]
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    raw = Tekkenizer.from_file(str(tekken / "tekken.json"))
    assert row["skip"] == "" and row["chosen_ids"] == ids and row["prompt_length"] == len(prompt)
    assert row["rejected_ids"] == [*prompt, *raw.encode("It is 5.", bos=False, eos=False), raw.eos_id]
