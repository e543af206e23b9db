"""What the two tokenizer actors share (SFT's `Tokenize`, DPO's `PreferenceTokenize`): one tokenizer per actor and
the records of a batch, read the same way for every source format."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import pyarrow as pa

from rayft.config import ModelConfig
from rayft.data.records import decode_line

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class RecordEncoder:
    """Base of the Ray Data tokenizer actors: the encoder (the tokenizers library's Rust encoder where there is a
    tokenizer.json, else transformers), the transformers tokenizer on first need (chat templates), BOS/EOS ids."""

    def __init__(self, model: dict[str, Any], tokenizer: dict[str, Any], source_format: str):
        from rayft.data.tokenizer import TokenizerFacts, rust_encoder

        facts = TokenizerFacts(**tokenizer)
        self.model = ModelConfig(**model)
        self._chat_tokenizer: PreTrainedTokenizerBase | None = None
        self.encode = rust_encoder(facts.rust_file) if facts.rust_file else self._encode_with_transformers
        self.source_format = source_format
        self.bos = [facts.bos_id] if facts.bos_id is not None else []
        self.eos = [facts.eos_id] if facts.eos_id is not None else []

    def chat_tokenizer(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer, loaded on first need (chat templates, or no tokenizer.json to encode with)."""
        if self._chat_tokenizer is None:
            from rayft.data.tokenizer import load_tokenizer

            self._chat_tokenizer = load_tokenizer(self.model)
        return self._chat_tokenizer

    def _encode_with_transformers(self, texts: list[str]) -> list[list[int]]:
        return cast("list[list[int]]", self.chat_tokenizer()(texts, add_special_tokens=False)["input_ids"])

    def _records(self, batch: pa.Table) -> Iterator[tuple[Any, str]]:
        """(record, why it is unusable or "") per row: JSON/text sources arrive as `_raw` lines, the rest as rows."""
        if "_raw" in batch.column_names:
            for raw in batch.column("_raw").to_pylist():
                yield decode_line(raw, self.source_format)
        else:
            for record in batch.to_pylist():
                yield record, ""
