"""Records → examples → token ids → blocks → batches, without Ray (the pipeline itself: test_data_pipeline.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import Fixtures
from fixtures.chat import demo_model

from rayft.config import Config, ConfigError, DataConfig, ModelConfig
from rayft.data.pipeline import IGNORE_INDEX, PackedCollate, PadCollate, Tokenize, finish, pack
from rayft.data.records import RecordFormat, decode_line, join_wikitext_articles, record_format
from rayft.data.sources import resolve_splits
from rayft.data.tokenizer import tokenizer_facts
from rayft.train.steps import plan_steps

# A Mistral-style chat template (the tiny model's tekken tokenizer has [INST]/[/INST] but no template).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def tokenize(fx: Fixtures, fmt: RecordFormat, max_length: int = 64, packing=False, overlong="truncate", **model):
    return tokenize_with(fx.model, fmt, max_length, packing, overlong, **model)


def tokenize_with(model_dir: Path, fmt: RecordFormat, max_length=64, packing=False, overlong="truncate", **model):
    model_cfg = ModelConfig(model_name_or_path=str(model_dir), **model)
    facts = dataclasses.asdict(tokenizer_facts(model_cfg))
    return Tokenize(
        dataclasses.asdict(model_cfg), facts, dataclasses.asdict(fmt), "parquet", max_length, packing, overlong
    )


def test_wikitext_layout_resolves_both_splits(fixtures: Fixtures):
    train, val = resolve_splits(DataConfig(dataset_name_or_path=str(fixtures.dataset)))
    assert train.format == "parquet" and train.paths[0].endswith("wikitext-2-raw-v1/train-00000-of-00001.parquet")
    assert val is not None and val.paths[0].endswith("validation-00000-of-00001.parquet")
    assert train.columns() == ["text"]


def test_single_jsonl_file_has_no_validation_split(tmp_path):
    f = tmp_path / "records.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"line {i}"}) for i in range(5)))
    train, val = resolve_splits(DataConfig(dataset_name_or_path=str(f)))
    assert train.format == "json" and val is None and train.columns() == ["text"]


def test_split_directories_globs_and_saved_datasets_resolve(tmp_path):
    import datasets

    (tmp_path / "splits").mkdir()
    for split in ("train", "validation"):
        (tmp_path / "splits" / f"{split}.jsonl").write_text(json.dumps({"text": split}))
    train, val = resolve_splits(DataConfig(dataset_name_or_path=str(tmp_path / "splits")))
    assert train.paths[0].endswith("train.jsonl") and val is not None and val.paths[0].endswith("validation.jsonl")

    (tmp_path / "shards").mkdir()
    for i in range(3):
        (tmp_path / "shards" / f"part-{i}.txt").write_text(f"line {i}\n")
    train, val = resolve_splits(DataConfig(dataset_name_or_path=str(tmp_path / "shards" / "part-*.txt")))
    assert (train.format, len(train.paths), val) == ("text", 3, None)

    sizes = {"train": 3, "test": 1}
    saved = datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": [s] * n}) for s, n in sizes.items()})
    saved.save_to_disk(str(tmp_path / "saved"))
    train, val = resolve_splits(DataConfig(dataset_name_or_path=str(tmp_path / "saved"), val_split="test"))
    assert (train.format, len(train.dataset), len(val.dataset)) == ("hf", 3, 1)
    with pytest.raises(ConfigError, match=r"no split 'training' in .*saved \(it has train, test\)"):
        resolve_splits(DataConfig(dataset_name_or_path=str(tmp_path / "saved"), train_split="training"))


def test_a_dataset_made_for_trl_is_evaluated_on_its_test_split(tmp_path):
    """TRL evaluates on `test` by default: a folder or saved dataset with train and test only was refused until
    data.val_split: test was set."""
    import datasets

    (tmp_path / "files").mkdir()
    for split in ("train", "test"):
        (tmp_path / "files" / f"{split}.jsonl").write_text(json.dumps({"text": split}))
    _, val = resolve_splits(DataConfig(dataset_name_or_path=str(tmp_path / "files")))
    assert val is not None and val.paths[0].endswith("test.jsonl")
    sizes = {"train": 3, "test": 2}
    saved = datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": [s] * n}) for s, n in sizes.items()})
    saved.save_to_disk(str(tmp_path / "saved"))
    _, val = resolve_splits(DataConfig(dataset_name_or_path=str(tmp_path / "saved")))
    assert val is not None and val.dataset["text"] == ["test", "test"]
    # Another split named and absent is still a mistake to report, not a reason to evaluate on `test`.
    with pytest.raises(ConfigError, match=r"data\.val_split: no split 'dev' in .*files \(it has test, train\)"):
        resolve_splits(DataConfig(dataset_name_or_path=str(tmp_path / "files"), val_split="dev"))


def test_bad_sources_name_the_path_split_or_field(fixtures: Fixtures, tmp_path):
    with pytest.raises(ConfigError, match=r"data\.train_split: no split 'training' in .* \(it has test, train, valid"):
        resolve_splits(DataConfig(dataset_name_or_path=str(fixtures.dataset), train_split="training"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "train.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"empty file\(s\): .*train.jsonl"):
        resolve_splits(DataConfig(dataset_name_or_path=str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match="matches no file"):
        resolve_splits(DataConfig(dataset_name_or_path=str(tmp_path / "nothing-*.parquet")))
    with pytest.raises(ConfigError, match=r"no field 'body' \(data.text_field\); their fields are text"):
        record_format(DataConfig(text_field="body"), ["text"], "split 'train'")
    with pytest.raises(ConfigError, match=r"no field 'answer' \(data.completion_field\)"):
        record_format(DataConfig(prompt_template="Q: {question}\nA:", completion_field="answer"), ["question"], "x")


def test_a_dataset_config_name_that_would_be_ignored_is_refused(fixtures: Fixtures, tmp_path):
    """A configuration named for a single file, a file pattern, or a folder the dataset directory lacks was ignored
    without a word; the default (the seed's wikitext configuration) stays silent where it does not apply."""
    single = tmp_path / "train.jsonl"
    single.write_text('{"text": "a"}\n')
    for spec, needle in ((single, "is a single file"), (tmp_path / "*.jsonl", "is a file pattern")):
        with pytest.raises(ConfigError, match=f"data.dataset_config_name 'chats': .*{needle}"):
            resolve_splits(DataConfig(dataset_name_or_path=str(spec), dataset_config_name="chats"))
    with pytest.raises(ConfigError, match=r"has no folder chats \(its folders: wikitext-2-raw-v1\)"):
        resolve_splits(DataConfig(dataset_name_or_path=str(fixtures.dataset), dataset_config_name="chats"))
    assert list(resolve_splits(DataConfig(dataset_name_or_path=str(single)))[0].paths) == [str(single)]


def test_offline_hub_name_says_to_download_first(monkeypatch):
    import datasets
    import huggingface_hub

    # An offline cluster (the flags are read at import time, so set them where the libraries keep them)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"'rayft-nobody/no-such-dataset' is not a local path .* download it"):
        resolve_splits(DataConfig(dataset_name_or_path="rayft-nobody/no-such-dataset", dataset_config_name=None))


def test_record_kind_is_picked_from_the_fields():
    assert record_format(DataConfig(), ["text", "id"], "x").kind == "text"
    chat = record_format(DataConfig(), ["messages"], "x")
    assert chat.kind == "messages" and chat.completion_only
    pair = record_format(DataConfig(completion_only_loss=False), ["prompt", "completion"], "x")
    assert pair.kind == "prompt_completion" and not pair.completion_only
    with pytest.raises(ConfigError, match="completion_only_loss: true needs instruction records"):
        record_format(DataConfig(completion_only_loss=True), ["text"], "x")


def test_lines_that_are_not_utf8_or_json_are_skip_reasons():
    assert decode_line(b"caf\xc3\xa9", "text") == ({"text": "café"}, "")
    assert decode_line(b"\xff\xfe\x00garbage", "text") == (None, "not_utf8")
    assert decode_line(b'{"text": "ok"}', "json") == ({"text": "ok"}, "")
    assert decode_line(b'{"text": "cut', "json") == (None, "bad_json")
    assert decode_line(b"[1, 2]", "json") == (None, "bad_json")


def test_tokenize_adds_bos_eos_truncates_and_counts(fixtures: Fixtures):
    tok = tokenize(fixtures, RecordFormat("text"), max_length=6)
    out = tok(pa.table({"text": ["Hello", "The old castle was built in 1854 by the church .", "   ", None]}))
    rows = out.to_pylist() + tok(pa.table({"text": [7]})).to_pylist()
    short, long = rows[0]["input_ids"], rows[1]["input_ids"]
    assert short[0] == 1 and short[-1] == 2 and len(short) >= 3
    assert len(long) == 6 and long[0] == 1 and long[-1] != 2 and rows[1]["truncated"]  # cut: no eos
    assert sorted(r["skip"] for r in rows[2:]) == ["empty", "missing_field", "not_text"]
    assert "loss_mask" not in out.column_names  # plain text: every token is trained


def test_rust_fast_path_encodes_exactly_like_transformers(fixtures: Fixtures):
    """The actors encode with `tokenizers` alone when the probe agrees; same rows as through transformers."""
    model = ModelConfig(model_name_or_path=str(fixtures.model))
    facts = tokenizer_facts(model)
    assert facts.rust_file and facts.rust_file.endswith("tokenizer.json") and (facts.bos_id, facts.eos_id) == (1, 2)
    table = pq.read_table(next((fixtures.dataset / "wikitext-2-raw-v1").glob("train-*")))
    table = pa.concat_tables([table, pa.table({"text": ["héllo  wörld\t", "日本語 🤗", "<s> [INST] x [/INST] </s>"]})])
    fmt = dataclasses.asdict(record_format(DataConfig(), ["text"], "x"))
    fast = Tokenize(dataclasses.asdict(model), dataclasses.asdict(facts), fmt, "parquet", 64, False, "truncate")
    slow_facts = dataclasses.asdict(dataclasses.replace(facts, rust_file=None))
    slow = Tokenize(dataclasses.asdict(model), slow_facts, fmt, "parquet", 64, False, "truncate")
    assert fast.chat_tokenizer is not None and fast._chat_tokenizer is None  # transformers never loaded
    assert fast(table).equals(slow(table)) and fast._chat_tokenizer is None and slow._chat_tokenizer is not None


def test_completion_only_labels_on_a_hand_checked_tekken_example():
    """Real tekken ids, checked token by token: <s> Question : ĠWhat Ġis Ġthe Ġcapital Ġof ĠFrance ?Ċ Answer :
    | ĠParis </s> — loss on the last two only."""
    fmt = record_format(
        DataConfig(prompt_template="Question: {question}\nAnswer:", completion_field="answer"),
        ["question", "answer"],
        "x",
    )
    assert fmt.completion_only
    out = tokenize_with(demo_model(), fmt)(
        pa.table({"question": ["What is the capital of France?"], "answer": [" Paris"]})
    )
    row = out.to_pylist()[0]
    prompt = [1, 25229, 1058, 5675, 1395, 1278, 8961, 1307, 5498, 9551, 31106, 1058]
    assert row["input_ids"] == [*prompt, 6993, 2]
    batch = PadCollate(pad_id=11)({"input_ids": [np.array(row["input_ids"])], "loss_mask": [row["loss_mask"]]})
    assert batch["labels"][0].tolist() == [IGNORE_INDEX] * len(prompt) + [6993, 2]


def test_chat_template_trains_on_assistant_turns_only(fixtures: Fixtures, tmp_path):
    from transformers import AutoTokenizer

    tok_dir = tmp_path / "chat-tokenizer"
    hf_tok = AutoTokenizer.from_pretrained(str(fixtures.model))
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(tok_dir))
    fmt = record_format(DataConfig(), ["messages"], "x")
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Name?"},
        {"role": "assistant", "content": "Ray"},
    ]
    tok = tokenize(fixtures, fmt, tokenizer_name_or_path=str(tok_dir))
    row = tok(pa.table({"messages": [json.loads(json.dumps(messages))]})).to_pylist()[0]

    def ids(text: str) -> list[int]:
        return hf_tok(text, add_special_tokens=False)["input_ids"]

    user1, asst1, user2, asst2 = ids("Hi"), ids("Hello"), ids("Name?"), ids("Ray")
    want = [1, 3, *user1, 4, *asst1, 2, 3, *user2, 4, *asst2, 2]
    trained = [0, 0, *[0] * len(user1), 0, *[1] * len(asst1), 1, 0, *[0] * len(user2), 0, *[1] * len(asst2), 1]
    assert row["input_ids"] == want and row["loss_mask"] == trained
    no_template = tokenize(fixtures, fmt)(pa.table({"messages": [messages]})).to_pylist()[0]
    assert no_template["skip"] == "chat_template"


def test_prompt_longer_than_max_length_is_skipped_not_trained_on(fixtures: Fixtures):
    fmt = record_format(DataConfig(), ["prompt", "completion"], "x")
    out = tokenize(fixtures, fmt, max_length=4)(pa.table({"prompt": ["a very long prompt"], "completion": ["x"]}))
    assert out.to_pylist()[0]["skip"] == "no_completion"
    skipped = tokenize(fixtures, RecordFormat("text"), max_length=4, overlong="skip")(pa.table({"text": ["a b c d e"]}))
    assert skipped.to_pylist()[0]["skip"] == "too_long"


def test_pack_keeps_every_token_and_restarts_positions_per_example():
    docs = [[1, 5, 6, 2], [1, 7, 2], [1, 8, 9, 10, 11, 12, 2], [1, 2]]
    table = pa.table({"input_ids": pa.array(docs, type=pa.list_(pa.int32()))}).slice(0)
    blocks = pack(table, max_length=5).to_pylist()
    assert [b["input_ids"] for b in blocks] == [[1, 5, 6, 2, 1], [7, 2, 1, 8, 9], [10, 11, 12, 2, 1], [2]]
    # restart per example, and at each block start (a block never continues another one's positions)
    assert [b["position_ids"] for b in blocks] == [[0, 1, 2, 3, 0], [0, 1, 0, 1, 2], [0, 1, 2, 3, 0], [0]]
    stats = finish(
        pa.table(
            {
                "input_ids": pa.array([*docs, []], type=pa.list_(pa.int32())),
                "skip": ["", "", "", "", "empty"],
                "truncated": [False] * 5,
                "records": [1] * 5,
            }
        ),
        max_length=5,
        packing=True,
        counting=True,
    ).to_pylist()[0]
    counted = (stats["records"], stats["examples"], stats["rows"], stats["tokens"], stats["skip_empty"])
    assert counted == (5, 4, 4, 16, 1)


def test_packed_collate_is_padding_free_and_never_predicts_across_examples():
    blocks = {
        "input_ids": [np.array([1, 5, 2, 1, 7]), np.array([8, 2])],
        "position_ids": [np.array([0, 1, 2, 0, 1]), np.array([0, 1])],
    }
    batch = PackedCollate()(blocks)
    assert batch["input_ids"].tolist() == [[1, 5, 2, 1, 7, 8, 2]] and "attention_mask" not in batch
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 5, 2, IGNORE_INDEX, 7, IGNORE_INDEX, 2]]


def test_packed_documents_do_not_attend_to_each_other(fixtures: Fixtures):
    """The same document gives the same logits alone and packed after another one (sdpa, no attention mask;
    training runs without a KV cache, which is what lets transformers read the boundaries from the positions)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(fixtures.model), dtype=torch.float32, attn_implementation="sdpa")
    first, second = torch.tensor([1, 1784, 1937, 1278, 2]), torch.tensor([1, 1278, 1821, 1932, 1044, 2])
    packed = PackedCollate()(
        {"input_ids": [np.concatenate([first, second])], "position_ids": [np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5])]}
    )
    with torch.no_grad():
        together = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False)
        together = together.logits[0, 5:]
        alone = model(input_ids=second[None]).logits[0]
    assert (together - alone).abs().max().item() < 1e-4


def test_wikitext_lines_join_into_articles_at_top_level_headings():
    lines = [" = Alpha = ", " First para . ", " = = Section = = ", " Second . ", " = Beta = ", " Third . "]
    articles = join_wikitext_articles(lines)
    assert [n for _, n in articles] == [4, 2]
    assert articles[1][0] == " = Beta = \n Third . "


def test_collate_pads_right_and_masks_padding_out_of_the_loss():
    batch = PadCollate(pad_id=11)({"input_ids": np.array([np.array([1, 5, 2]), np.array([1, 2])], dtype=object)})
    assert batch["input_ids"].tolist() == [[1, 5, 2], [1, 2, 11]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[1, 5, 2], [1, 2, IGNORE_INDEX]]
    rounded = PadCollate(pad_id=11, multiple=4, max_length=6)({"input_ids": [np.array([1, 5, 2]), np.array([1, 2])]})
    assert rounded["input_ids"].tolist() == [[1, 5, 2, 11], [1, 2, 11, 11]]  # 3 → 4: a few shapes, not one per batch
    assert rounded["labels"].tolist() == [[1, 5, 2, IGNORE_INDEX], [1, 2, IGNORE_INDEX, IGNORE_INDEX]]
    capped = PadCollate(pad_id=11, multiple=4, max_length=6)({"input_ids": [np.array([1, 5, 2, 7, 2])]})
    assert capped["input_ids"].tolist() == [[1, 5, 2, 7, 2, 11]]  # never beyond max_length


def test_plan_counts_equal_shards_and_partial_accumulation():
    cfg = Config.from_dict(
        {
            "train": {
                "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 2,
                "num_train_epochs": 2,
                "warmup_ratio": 0.1,
            }
        }
    )
    plan = plan_steps(cfg, train_rows=331, validation_rows=42, world_size=2)
    # 165 rows per worker → 42 micro-batches → 21 optimizer steps per epoch
    assert (plan.micro_batches_per_epoch, plan.steps_per_epoch, plan.total_steps) == (42, 21, 42)
    assert plan.warmup_steps == 5 and plan.has_validation
    with pytest.raises(ConfigError, match=r"cannot feed ray\.num_workers=4"):
        plan_steps(cfg, train_rows=3, validation_rows=0, world_size=4)


def test_a_warmup_as_long_as_the_counted_run_is_refused_before_the_workers():
    """Without train.max_steps the run's length is known once the records are counted: 331 rows over 2 workers make
    21 steps an epoch (the test above), 42 in two; a warm-up of 42 steps would never reach the learning rate."""
    raw = {"train": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "num_train_epochs": 2}}
    assert plan_steps(Config.from_dict({"train": {**raw["train"], "warmup_steps": 41}}), 331, 0, 2).warmup_steps == 41
    with pytest.raises(ConfigError) as err:
        plan_steps(Config.from_dict({"train": {**raw["train"], "warmup_steps": 42}}), 331, 0, 2)
    assert str(err.value).startswith("train.warmup_steps 42 is not shorter than the run's 42 steps (2 epoch(s) of 21")


def test_a_utf8_byte_order_mark_is_not_part_of_the_first_record(tmp_path, capsys):
    """Windows editors start UTF-8 files with a BOM: it passes the encoding check and is dropped when lines are read,
    so the first JSON record is not a bad_json skip."""
    from rayft.data.pipeline import _split_lines
    from rayft.data.records import decode_line

    content = "\ufeff".encode() + b'{"text": "first"}\n{"text": "second"}\n'
    lines = _split_lines(pa.table({"bytes": [content]}), json_array_ok=True).column("_raw").to_pylist()
    assert [decode_line(line, "json") for line in lines] == [({"text": "first"}, ""), ({"text": "second"}, "")]
    path = tmp_path / "bom.jsonl"
    path.write_bytes(content)
    from rayft.data.files import check_encoding, json_fields

    check_encoding(path)  # no error
    assert json_fields([path], ["text"]) == ["text"]
