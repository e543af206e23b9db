"""The built-in demo: a tiny random-init Mistral with the real Mistral tokenizer, and wikitext-shaped text.

Used when the job runs without `--config`, and by the tests, so both exercise the same fixtures.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

TINY_MISTRAL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 11,
}
# lm_head too: on a random-init model only the output layer can make the loss drop visibly in a few steps.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
CONFIG_NAME = "wikitext-2-raw-v1"


def tekken_file() -> Path:
    """The real Mistral tekken tokenizer (131k vocab) that the mistral-common package ships."""
    try:
        import mistral_common
    except ImportError:
        raise RuntimeError("the demo needs mistral-common: pip install 'rayft[demo]'") from None
    return Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"


def make_tokenizer(directory: Path) -> None:
    from transformers import AutoTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    staging = directory / "_tekken"
    staging.mkdir(exist_ok=True)
    shutil.copy(tekken_file(), staging / "tekken.json")
    tok = AutoTokenizer.from_pretrained(str(staging))
    tok.bos_token, tok.eos_token, tok.pad_token = "<s>", "</s>", "<pad>"
    tok.save_pretrained(str(directory))
    shutil.rmtree(staging)


def make_tiny_mistral(directory: Path, seed: int = 0, **overrides: int) -> Path:
    """Random-init dense Mistral (~17M params, almost all in the 131k-row embeddings) + tokenizer: tekken, unless
    the directory holds a tokenizer already; the embeddings have a row for each of its ids."""
    import torch
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM
    from transformers.utils import logging as hf_logging

    if (directory / "config.json").exists():
        return directory
    if not (directory / "tokenizer.json").exists():
        make_tokenizer(directory)
    vocab_size = len(AutoTokenizer.from_pretrained(str(directory)))
    torch.manual_seed(seed)
    model = MistralForCausalLM(MistralConfig(vocab_size=vocab_size, **{**TINY_MISTRAL, **overrides}))
    shown = hf_logging.is_progress_bar_enabled()
    # a one-shard progress bar is the demo log's first line otherwise (transformers leaves these two unannotated)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        model.save_pretrained(str(directory))
    finally:
        if shown:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    return directory


_WORDS = {
    "subject": [
        "the river",
        "the old castle",
        "the army",
        "a small village",
        "the railway",
        "the museum",
        "the king",
        "the ship",
        "the festival",
        "the university",
    ],
    "verb": ["was built", "was destroyed", "was founded", "was restored", "was visited", "was described"],
    "when": [
        "in 1854",
        "in the winter of 1912",
        "during the war",
        "after the flood",
        "in the early years",
        "before the election",
    ],
    "by": [
        "by local farmers",
        "by the government",
        "by French engineers",
        "by a wealthy merchant",
        "by the church",
        "by several artists",
    ],
}


def _paragraph(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(2, 5)):
        parts = [rng.choice(_WORDS[k]) for k in ("subject", "verb", "when", "by")]
        sentences.append(" ".join(parts).capitalize() + " .")
    return " " + " ".join(sentences) + " "


def make_wikitext(directory: Path, train_articles: int = 60, val_articles: int = 8, seed: int = 0) -> Path:
    """Parquet files in the Hugging Face wikitext layout: `<dir>/wikitext-2-raw-v1/<split>-00000-of-00001.parquet`.

    Like the real corpus: one line per record, headings ` = Title = `, and many empty lines.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = directory / CONFIG_NAME
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, articles in (("train", train_articles), ("validation", val_articles), ("test", val_articles)):
        lines: list[str] = []
        for a in range(articles):
            lines += ["", f" = {rng.choice(_WORDS['subject']).title()} {a} = ", ""]
            for _ in range(rng.randint(3, 6)):
                lines += [_paragraph(rng), ""]
        pq.write_table(pa.table({"text": lines}), out / f"{split}-00000-of-00001.parquet")
    return directory


def demo_config(root: Path) -> dict[str, Any]:
    """Two CPU workers on one machine, a few dozen steps, frequent eval/save so every feature shows."""
    return {
        "model": {"model_name_or_path": str(root / "tiny-mistral"), "torch_dtype": "float32"},
        "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": LORA_TARGETS},
        "data": {
            "dataset_name_or_path": str(root / "wikitext"),
            "dataset_config_name": CONFIG_NAME,
            "max_length": 64,
            "packing": True,
        },
        "train": {
            "output_dir": str(root / "output"),
            "num_train_epochs": 3,
            "per_device_train_batch_size": 4,
            "per_device_eval_batch_size": 8,
            "gradient_accumulation_steps": 2,
            "learning_rate": 3e-3,
            "warmup_ratio": 0.1,
            "bf16": False,
            "logging_steps": 5,
            "eval_steps": 10,
            "save_steps": 10,
            "save_total_limit": 2,
        },
        "ray": {"num_workers": 2, "use_gpu": False, "placement_strategy": "PACK", "max_failures": 0},
    }


def prepare(root: Path) -> dict[str, Any]:
    root = root.resolve()
    make_tiny_mistral(root / "tiny-mistral")
    make_wikitext(root / "wikitext")
    return demo_config(root)


def held_out_losses(root: Path, adapter: Path, rows: int = 8, length: int = 64) -> tuple[float, float]:
    """The demo's proof of its result, taken as a user would take it: the base model alone, and the base with the
    final adapter loaded through PEFT, each scored on the first rows of the validation split (the next-token loss of
    transformers' own forward, not rayft's). Returns (base loss, adapter loss)."""
    import pyarrow.parquet as pq
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = root / "tiny-mistral"
    lines = pq.read_table(root / "wikitext" / CONFIG_NAME / "validation-00000-of-00001.parquet")["text"].to_pylist()
    ids = AutoTokenizer.from_pretrained(str(model_dir))("".join(lines))["input_ids"]
    if len(ids) < rows * length:
        raise RuntimeError(f"the demo's validation split has {len(ids)} tokens, fewer than {rows * length}")
    batch = torch.tensor(ids[: rows * length]).view(rows, length)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        base = float(model(input_ids=batch, labels=batch).loss)
        tuned = float(PeftModel.from_pretrained(model, str(adapter)).eval()(input_ids=batch, labels=batch).loss)
    return base, tuned
