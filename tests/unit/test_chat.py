"""Chat records → token ids + assistant-only loss mask, from the tokenizer's own chat encoding: Mistral's tekken
(transformers' `MistralCommonBackend`, encoded by mistral-common in its fine-tuning mode) and a `tokenizer.json` with
a chat template (SmolLM2's). Expected ids come from an independent path: the raw vocabularies (mistral-common's
Tekkenizer, the `tokenizers` library) encoding each piece of the conversation, joined by the format's control
tokens as written here."""

from __future__ import annotations

import dataclasses
import json
import re
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
    return tekken_model(tmp_path_factory.mktemp("tekken") / "model")


def tokenize(model: Path, fmt, max_length: int = 256) -> Tokenize:
    model_cfg = ModelConfig(model_name_or_path=str(model))
    facts = dataclasses.asdict(tokenizer_facts(model_cfg))
    return Tokenize(
        dataclasses.asdict(model_cfg), facts, dataclasses.asdict(fmt), "json", max_length, False, "truncate"
    )


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
    record = {
        "prompt": CONVERSATION[:4],
        "chosen": CONVERSATION[4:],
        "rejected": [{"role": "assistant", "content": "It is 5."}],
    }
    row = actor(pa.table({"_raw": pa.array([json.dumps(record).encode()], type=pa.binary())})).to_pylist()[0]
    ids, mask = tekken_expected(tekken)
    prompt = ids[: mask.index(1)]
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    raw = Tekkenizer.from_file(str(tekken / "tekken.json"))
    assert row["skip"] == "" and row["chosen_ids"] == ids and row["prompt_length"] == len(prompt)
    assert row["rejected_ids"] == [*prompt, *raw.encode("It is 5.", bos=False, eos=False), raw.eos_id]


# Chats as people write them: content as a list of parts, tool calls, ShareGPT's turns.
PARTS = [
    dict(m, content=[{"type": "text", "text": m["content"]}, {"type": "text", "text": "Thanks."}])
    if m["role"] == "user"
    else m
    for m in CONVERSATION
]
JOINED = [dict(m, content=f"{m['content']}\n\nThanks.") if m["role"] == "user" else m for m in CONVERSATION]
CALL = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
TOOLS = [
    CONVERSATION[3],
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "4"},
    CONVERSATION[4],
]
# A ChatML template that renders tool calls (SmolLM2's own never reads them).
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "<tool_call>{{ c['function']['name'] }} {{ c['function']['arguments'] }}</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_text_parts_are_joined_where_the_template_expects_a_string(smollm2: Path, tekken: Path):
    """SmolLM2's template printed a list of parts as a Python list, and rayft trained on "[{'type': 'text', ...".
    Both tokenizers now encode the parts as the text joined as mistral-common joins a turn's text chunks."""
    for model in (smollm2, tekken):
        parts, joined = encode_rows(model, [{"messages": PARTS}, {"messages": JOINED}])
        assert parts["skip"] == "" and parts["input_ids"] == joined["input_ids"], model
        assert parts["loss_mask"] == joined["loss_mask"]


@pytest.mark.parametrize(
    ("turn", "refusal"),
    [
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}, "holds an image part"),
        ({"role": "user", "content": [{"type": "audio", "audio": "x.wav"}]}, "content part of type 'audio'"),
        ({"role": "user", "content": {"text": "Hi"}}, "content is a dict: a string or a list of text parts"),
        ({"role": "user", "content": None}, "has no content"),
    ],
    ids=["image", "audio", "dict", "null"],
)
def test_content_rayft_cannot_train_on_is_refused_by_name(smollm2: Path, turn, refusal):
    from rayft.data.chat import ChatRefused, chat_tokens

    tokenizer = load_tokenizer(ModelConfig(model_name_or_path=str(smollm2)))
    with pytest.raises(ChatRefused, match=re.escape(refusal)):
        chat_tokens([turn, CONVERSATION[2]], tokenizer)
    assert encode_rows(smollm2, [{"messages": [turn, CONVERSATION[2]]}])[0]["skip"] == "chat_template"


def test_tool_calls_under_a_template_without_tools_are_refused(smollm2: Path):
    """SmolLM2's template never reads tool_calls: the call vanished and rayft trained an immediate <|im_end|>."""
    from rayft.data.chat import ChatRefused, chat_tokens

    tokenizer = load_tokenizer(ModelConfig(model_name_or_path=str(smollm2)))
    with pytest.raises(ChatRefused, match=r"turn 1 \(assistant\) calls tools, but the chat template never renders"):
        chat_tokens(TOOLS, tokenizer)
    assert encode_rows(smollm2, [{"messages": TOOLS}])[0]["skip"] == "chat_template"


def test_tool_calls_under_a_template_with_tools_are_trained(smollm2: Path, tmp_path):
    """The call is the assistant's to learn: its rendered text is trained, the tool's answer is context."""
    from tokenizers import Tokenizer

    model = tmp_path / "tools"
    model.mkdir()
    for item in smollm2.iterdir():
        (model / item.name).symlink_to(item)
    (model / "tokenizer_config.json").unlink()
    config = json.loads((smollm2 / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    (model / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    raw = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    ids: list[int] = []
    mask: list[int] = []
    bodies = ["What is 2+2?", '<tool_call>add {"a": 2, "b": 2}</tool_call>', "4", "It is 4."]
    for message, body in zip(TOOLS, bodies, strict=True):
        head = raw.encode(f"<|im_start|>{message['role']}\n", add_special_tokens=False).ids
        text = raw.encode(f"{body}<|im_end|>\n", add_special_tokens=False).ids
        ids += head + text
        mask += [0] * len(head) + [int(message["role"] == "assistant")] * len(text)
    row = encode_rows(model, [{"messages": TOOLS}])[0]
    assert row["skip"] == "" and row["input_ids"] == ids and row["loss_mask"] == mask


def test_sharegpt_turns_are_read_as_messages(smollm2: Path):
    """ShareGPT's `conversations` of {from, value} turns (human, gpt, system): read as the same messages."""
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    turns = [{"from": names[m["role"]], "value": m["content"]} for m in CONVERSATION]
    fmt = record_format(DataConfig(), ["conversations"], "x")
    assert fmt.kind == "messages" and fmt.messages_field == "conversations"
    row = tokenize(smollm2, fmt)(pa.table({"_raw": pa.array([json.dumps({"conversations": turns}).encode()])}))
    ids, mask = chatml_expected(smollm2)
    assert row.to_pylist()[0]["input_ids"] == ids and row.to_pylist()[0]["loss_mask"] == mask


def test_validate_shows_what_a_record_trains_on(smollm2: Path):
    """`rayft validate` prints the first record that trains as the job encodes it, the trained text in ⟦ ⟧: here the
    assistant turns of a chat, each through its end-of-turn token and newline, and none of the rest."""
    from rayft.data.sample import Example, rendered, token_runs

    fmt = record_format(DataConfig(), ["messages"], "x")
    row = encode_rows(smollm2, [{"messages": CONVERSATION}])[0]
    text = rendered(
        Example(("x", 0), token_runs(row, fmt)), load_tokenizer(ModelConfig(model_name_or_path=str(smollm2)))
    )
    assert text.count("⟦") == 2 and "\n" not in text, text
    assert "<|im_start|>assistant\\n⟦Hello! How can I help?<|im_end|>\\n⟧" in text, text
    assert "⟦It is 4.<|im_end|>\\n⟧" in text and text.startswith("<|im_start|>system\\nBe brief.<|im_end|>"), text
