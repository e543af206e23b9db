"""A conversation → token ids and which of them carry the loss, from the tokenizer's own chat encoding.

Two kinds of tokenizer: Mistral's (`MistralCommonBackend`, tekken.json or a sentencepiece `.model`), encoded by
mistral-common, and a `tokenizer.json` with a Jinja chat template, encoded by transformers. Neither is rendered to
text and encoded again: Mistral's control tokens only round-trip through its own encoder, and transformers warns
that doing so with this backend is unsafe.

Chats come as people write them: content as a string or as a list of parts (the OpenAI / Hugging Face multimodal
form), assistant turns calling tools (`tool_calls`) and `tool` turns answering them, and ShareGPT's `from`/`value`
turns. Each is handed to the tokenizer in a form its chat format renders, or refused: a template that prints a list
of parts as a Python list, or never reads `tool_calls`, would otherwise train on a repr or on an empty reply.

The mask: a template with `{% generation %}` blocks gives it directly (transformers'
`return_assistant_tokens_mask`). Otherwise, and always for Mistral (mistral-common encodes but marks nothing), the
ids of growing prefixes are compared: assistant turn i's prompt is the conversation before it (with the generation
prompt), its trained tokens are what encoding turn i adds beyond that. Templates whose earlier output changes when
turns are added (Mistral's v3 moves the system prompt into the last user turn) train the last assistant turn only.
"""

from __future__ import annotations

import re
from typing import Any

# Roles any chat template renders; templates name others they accept by comparing against them.
STANDARD_ROLES = ("system", "user", "assistant", "tool")
MISTRAL_ROLES = STANDARD_ROLES  # what mistral-common's ChatCompletionRequest accepts
# `message['role'] == 'x'`, `message.role != "x"`, `role in ['x', 'y']`
_ROLE_TEST = re.compile(r"""role['"]?\]?\s*(?:==|!=)\s*['"](\w+)['"]""")
_ROLE_LIST = re.compile(r"""role['"]?\]?\s+(?:not\s+)?in\s*[\[(]([^\])]*)[\])]""")
_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")
# A template that reads the parts of a content list itself: `content['type']`, `item.text`, `part["text"]`.
_READS_PARTS = re.compile(r"""\[['"](?:type|text)['"]\]|\.(?:type|text)\b""")
TokenSegments = list[tuple[list[int], bool]]
TEXT_PART_SEPARATOR = "\n\n"  # between a turn's text parts, where mistral-common puts it
IMAGE_PARTS = ("image", "image_url", "input_image")
# ShareGPT's `from` names → the roles chat templates know.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "function_call": "assistant", "observation": "tool"}  # fmt: skip


class ChatRefused(ValueError):
    """Why a conversation cannot be a training example: one line, for `rayft validate` and the skip count."""


def is_mistral_common(tokenizer: Any) -> bool:
    return type(tokenizer).__name__ == "MistralCommonBackend"


def as_messages(turns: Any) -> list[dict[str, Any]] | None:
    """A record's conversation as `{role, content}` messages: as written, or ShareGPT's `{from, value}` turns with
    their roles mapped (an unknown `from` is kept as the role, for the role check to name); None for anything
    else."""
    if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) for t in turns):
        return None
    if all("role" in t for t in turns):
        return turns
    if all("from" in t and "value" in t for t in turns):
        return [{"role": SHAREGPT_ROLES.get(str(t["from"]), str(t["from"])), "content": t["value"]} for t in turns]
    return None


def _template(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else str(template)


def readable(messages: list[dict[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    """The conversation in a form the tokenizer's chat format renders: text parts joined into one string where the
    template expects a string (mistral-common and templates that read the parts take them as they are); raises
    ChatRefused for what it would render wrongly or not at all: image parts, parts of another kind, content of
    another type, tool calls or tool turns under a template that never reads `tool_calls`."""
    mistral = is_mistral_common(tokenizer)
    template = _template(tokenizer)
    takes_parts, takes_tools = mistral or bool(_READS_PARTS.search(template)), mistral or "tool_calls" in template
    out = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        turn = f"turn {i} ({role})"
        if (message.get("tool_calls") or role == "tool") and not takes_tools:
            raise ChatRefused(
                f"{turn} {'calls tools' if role != 'tool' else 'answers a tool call'}, but the chat template never "
                "renders tool calls (it would train on a reply without them); use a tokenizer whose template "
                "supports tools, or leave such records out"
            )
        if isinstance(content, list):
            content = _text_parts(content, turn)
            if not takes_parts:
                message = {**message, "content": TEXT_PART_SEPARATOR.join(p["text"] for p in content)}
        elif content is None and not message.get("tool_calls"):
            raise ChatRefused(f"{turn} has no content")
        elif content is not None and not isinstance(content, str):
            raise ChatRefused(
                f"{turn} content is a {type(content).__name__}: a string or a list of text parts is expected"
            )
        out.append(message)
    return out


def _text_parts(parts: list[Any], turn: str) -> list[dict[str, Any]]:
    """A content list's parts, each `{type: text, text: str}`; ChatRefused naming the first that is not."""
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in IMAGE_PARTS:
            raise ChatRefused(f"{turn} holds an image part: rayft trains on text; leave image records out")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ChatRefused(f"{turn} holds a content part of type {kind!r}: text parts ({{type: text, text}}) only")
    return parts


def allowed_roles(tokenizer: Any) -> list[str]:
    """The roles the tokenizer's chat format knows. A permissive template (`'<|im_start|>' + message['role']`)
    renders any role, so it cannot tell us: the standard roles and those the template itself names are allowed,
    and a typo or invented role (`narrator`) is refused rather than trained as whatever the template makes of it."""
    if is_mistral_common(tokenizer):
        return list(MISTRAL_ROLES)
    template = _template(tokenizer)
    named = _ROLE_TEST.findall(template)
    for listed in _ROLE_LIST.findall(template):
        named += re.findall(r"""['"](\w+)['"]""", listed)
    return list(dict.fromkeys([*STANDARD_ROLES, *named]))


def check_conversation(messages: list[dict[str, Any]], roles: list[str]) -> None:
    """Roles the template knows, and a last turn to learn from."""
    unknown = sorted({str(m.get("role")) for m in messages} - set(roles))
    if unknown:
        raise ChatRefused(f"role(s) {', '.join(unknown)} unknown to the chat template (it knows {', '.join(roles)})")
    last = messages[-1].get("role")
    if last != "assistant":
        raise ChatRefused(
            f"the last turn is '{last}', not 'assistant': nothing to learn from; end each conversation with the "
            "assistant's reply"
        )


def chat_tokens(messages: list[dict[str, Any]], tokenizer: Any, first_trained: int = 0) -> TokenSegments:
    """(ids, trained) runs covering the whole encoded conversation; raises ChatRefused. Assistant turns before
    message `first_trained` are context (a prompt/completion record's prompt), not trained."""
    check_conversation(messages, allowed_roles(tokenizer))
    messages = readable(messages, tokenizer)
    encoder = _MistralChat(tokenizer) if is_mistral_common(tokenizer) else _TemplateChat(tokenizer)
    whole = encoder.encode(messages, prompt=False)
    found = encoder.masked(messages, whole) if first_trained == 0 else None
    if found is None:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first_trained]
        found = _incremental(encoder, messages, turns, whole) or _incremental(encoder, messages, turns[-1:], whole)
    if found is None or not any(trained and ids for ids, trained in found):
        raise ChatRefused("the chat template gives the assistant turns no tokens of their own (empty loss mask)")
    return found


def runs_of(ids: list[int], mask: list[int]) -> TokenSegments:
    """Token ids in runs by whether their mask entry trains them."""
    runs: TokenSegments = []
    for token, flag in zip(ids, mask, strict=True):
        if runs and runs[-1][1] == bool(flag):
            runs[-1][0].append(token)
        else:
            runs.append(([token], bool(flag)))
    return runs


def _incremental(encoder: Any, messages: list[dict[str, Any]], turns: list[int], whole: list[int]) -> TokenSegments:
    out: TokenSegments = []
    done: list[int] = []
    for i in turns:
        prompt = encoder.encode(messages[:i], prompt=True) if i else []
        full = encoder.encode(messages[: i + 1], prompt=False)
        if not (prompt[: len(done)] == done and full[: len(prompt)] == prompt and whole[: len(full)] == full):
            return []
        out += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
        done = full
    out.append((whole[len(done) :], False))
    return [(ids, trained) for ids, trained in out if ids]


class _TemplateChat:
    """A transformers tokenizer with a Jinja chat template: its `apply_chat_template(tokenize=True)` ids."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode(self, messages: list[dict[str, Any]], prompt: bool) -> list[int]:
        try:
            out = self.tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=prompt, return_dict=True
            )
        except Exception as e:  # no template, or one that raises on these messages
            raise ChatRefused(f"the chat template cannot render it ({_first_line(e)})") from None
        return list(out["input_ids"])

    def masked(self, messages: list[dict[str, Any]], whole: list[int]) -> TokenSegments | None:
        """The template's own assistant mask, where it marks the assistant's text with `{% generation %}`."""
        template = self.tokenizer.chat_template
        if not isinstance(template, str) or not _GENERATION_BLOCK.search(template):
            return None
        out = self.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return runs_of(list(out["input_ids"]), list(out["assistant_masks"]))


class _MistralChat:
    """Mistral's tokenizer through mistral-common: the whole conversation and each prefix ending in an assistant
    turn are validated in its fine-tuning mode (which wants that last turn); the prompts before an assistant turn,
    which end in a user turn, in its test mode (what `MistralCommonBackend` loads)."""

    def __init__(self, tokenizer: Any):
        from mistral_common.protocol.instruct.normalize import get_normalizer
        from mistral_common.protocol.instruct.validator import ValidationMode, get_validator
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        loaded = tokenizer.tokenizer  # the backend's MistralTokenizer: its vocabulary is shared, not loaded again
        raw = loaded.instruct_tokenizer.tokenizer
        self.modes = {
            prompt: MistralTokenizer(
                loaded.instruct_tokenizer,
                validator=get_validator(raw.version, mode=mode),
                request_normalizer=get_normalizer(raw.version, raw.model_settings_builder),
            )
            for prompt, mode in ((False, ValidationMode.finetuning), (True, ValidationMode.test))
        }

    def encode(self, messages: list[dict[str, Any]], prompt: bool) -> list[int]:
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        try:
            request = ChatCompletionRequest.from_openai(messages=messages)
            return list(self.modes[prompt].encode_chat_completion(request).tokens)
        except Exception as e:  # mistral-common's validation: roles out of order, empty content, ...
            raise ChatRefused(f"mistral-common refuses it ({_first_line(e)})") from None

    def masked(self, messages: list[dict[str, Any]], whole: list[int]) -> TokenSegments | None:
        return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
