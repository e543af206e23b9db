"""`rayft validate` answers every bad input before a cluster starts (in-process: one import of torch for all
cases): exit 2 with one line naming the file / key / tensor, in seconds, and Ray never initialised. The inputs are
real files: model directories whose config.json does not describe their weights, cut-short or inconsistent
safetensors shards, UTF-16 text, corrupt parquet, JSON Lines whose first records lack the field, damaged DCP
checkpoints, YAML with duplicate keys, chat records the tokenizer cannot train, settings the model cannot take."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import Fixtures, free_port, run_cli
from fixtures.chat import CONVERSATION, tekken_model
from fixtures.moe_families import UNKNOWN_MOE, make_tiny_moe, make_unknown_moe
from fixtures.preflight import (
    assert_refused,
    config_file,
    edit_json,
    kv_heads,
    small_embedding,
    truncate,
    variant,
)
from fixtures.small_vocab import FIXTURE_VOCAB

# --- model files: cases build a damaged copy of a real checkpoint and return its directory -----------------------


def _vocab(fx: Fixtures, hub: Path, tmp: Path) -> Path:
    d = variant(fx.model, tmp / "m", copy=("config.json",))
    edit_json(d / "config.json", lambda c: c.update(vocab_size=c["vocab_size"] + 512))
    return d


def _hub_hidden(fx: Fixtures, hub: Path, tmp: Path) -> Path:
    d = variant(hub, tmp / "m", copy=("config.json",))
    edit_json(d / "config.json", lambda c: c["text_config"].update(hidden_size=96))
    return d


def _truncated_shard(fx: Fixtures, hub: Path, tmp: Path) -> Path:
    d = variant(hub, tmp / "m", copy=("model-00002-of-00002.safetensors",))
    truncate(d / "model-00002-of-00002.safetensors")
    return d


def _missing_shard(fx: Fixtures, hub: Path, tmp: Path) -> Path:
    d = variant(hub, tmp / "m")
    (d / "model-00002-of-00002.safetensors").unlink()
    return d


def _unlisted_tensor(fx: Fixtures, hub: Path, tmp: Path) -> Path:
    d = variant(hub, tmp / "m", copy=("model.safetensors.index.json",))
    edit_json(d / "model.safetensors.index.json", lambda c: c["weight_map"].pop("language_model.lm_head.weight"))
    return d


def _index_names_absent_tensor(fx: Fixtures, hub: Path, tmp: Path) -> Path:
    d = variant(hub, tmp / "m", copy=("model.safetensors.index.json",))
    extra = {"language_model.model.extra.weight": "model-00001-of-00002.safetensors"}
    edit_json(d / "model.safetensors.index.json", lambda c: c["weight_map"].update(extra))
    return d


def _garbage_header(fx: Fixtures, hub: Path, tmp: Path) -> Path:
    d = variant(fx.model, tmp / "m", copy=("model.safetensors",))
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"\xff" * 64)
    return d


MODEL_CASES = {
    "num_key_value_heads 2→1": (
        kv_heads,
        r"does not fit the model \(4 tensors\): 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape "
        r"\[32, 64\] in the checkpoint, the model's '.*k_proj\.weight' has \[16, 64\]",
    ),
    "vocab_size +512": (
        _vocab,
        rf"'model\.embed_tokens\.weight' has shape \[{FIXTURE_VOCAB}, 64\] .* has \[{FIXTURE_VOCAB + 512}, 64\]",
    ),
    "hub hidden_size mismatch": (
        _hub_hidden,
        r"'language_model\.model\.embed_tokens\.weight' has shape "
        rf"\[{FIXTURE_VOCAB}, 64\] in the checkpoint, .* has \[{FIXTURE_VOCAB}, 96\]",
    ),
    "truncated shard": (_truncated_shard, r"model-00002-of-00002\.safetensors is truncated: its header declares"),
    "index names a missing shard": (_missing_shard, r"index\.json names shard model-00002-of-00002\.safetensors"),
    "shard holds a tensor the index does not list": (
        _unlisted_tensor,
        r"holds tensor 'language_model\.lm_head\.weight' that model\.safetensors\.index\.json does "
        "not list",
    ),
    "index names a tensor its shard lacks": (
        _index_names_absent_tensor,
        r"puts tensor 'language_model\.model\.extra\.weight' in model-00001",
    ),
    "garbage safetensors header": (_garbage_header, r"model\.safetensors has a corrupt safetensors header"),
    "tokenizer larger than the embedding": (
        small_embedding,
        rf"has {FIXTURE_VOCAB:,} tokens, the model's embedding 1,000 rows",
    ),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_model_files_that_do_not_match_are_refused(case, fixtures, mistral4_hub, base, tmp_path, capsys):
    build, pattern = MODEL_CASES[case]
    model = build(fixtures, mistral4_hub, tmp_path)
    lora = {"target_modules": ["auto"]}  # the hub model has no q_proj: auto picks its set
    config = config_file(tmp_path, base, model={"model_name_or_path": str(model), "torch_dtype": "float32"}, lora=lora)
    assert_refused(run_cli(capsys, "validate", "--config", str(config)), pattern)


def test_tied_lm_head_missing_from_the_checkpoint_is_fine(fixtures, base, tmp_path, capsys):
    from safetensors import safe_open

    from rayft.demo import make_tiny_mistral

    model = make_tiny_mistral(tmp_path / "tied", tie_word_embeddings=True)

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 (safe_open has no __contains__)
    config = config_file(tmp_path, base, model={"model_name_or_path": str(model)})
    result = run_cli(capsys, "validate", "--config", str(config))
    assert result.rc == 0, result.err


TOKENIZER_IDS = FIXTURE_VOCAB  # the fixture tokenizer's: the embedding must have a row for each


@pytest.mark.parametrize("model_type", sorted(UNKNOWN_MOE))
def test_an_moe_family_rayft_does_not_know_is_refused(model_type, fixtures, base, tmp_path, capsys):
    """An MoE model whose blocks no family in rayft.model.families describes; on main it passed validate (and then
    trained its routed experts through whatever the block happened to do)."""
    model = make_unknown_moe(model_type, tmp_path / "m", TOKENIZER_IDS, tokenizer_from=fixtures.model)
    config = config_file(tmp_path, base, model={"model_name_or_path": str(model)}, lora={"target_modules": ["q_proj"]})
    assert_refused(
        run_cli(capsys, "validate", "--config", str(config)),
        rf"model\.model_name_or_path: .*/m is a {model_type} model whose MoE blocks \(\w+SparseMoeBlock\) rayft does "
        r"not support; the supported MoE families are Mistral-Small-4 \(mistral4\), DeepSeek-V3 \(deepseek_v3\), "
        r"Qwen3-MoE \(qwen3_moe\), Mixtral \(mixtral\), GPT-OSS \(gpt_oss\): point model\.model_name_or_path at one",
    )


def test_a_supported_moe_family_with_fused_expert_keys_passes(fixtures, base, tmp_path, capsys):
    """Qwen3-MoE in the fused layout with expert LoRA and EP 2: admitted by the family table."""
    model = make_tiny_moe("qwen3_moe", tmp_path / "m", vocab_size=TOKENIZER_IDS, tokenizer_from=fixtures.model)
    config = config_file(
        tmp_path,
        base,
        model={"model_name_or_path": str(model)},
        lora={"target_modules": ["auto"], "target_experts": True},
        fsdp={"activation_checkpointing": True},
        ray={"num_workers": 2},
        parallel={"expert_parallel": 2},
    )
    result = run_cli(capsys, "validate", "--config", str(config))
    assert result.rc == 0, result.err
    assert "Qwen3MoeForCausalLM" in result.out


# --- YAML ------------------------------------------------------------------------------------------------------


def _yaml_cases(good: str) -> dict[str, tuple[str, str]]:
    return {
        "duplicate key in a section": (
            good.replace("train:\n", "train:\n  learning_rate: 0.1\n  learning_rate: 0.2\n", 1),
            r"key 'learning_rate' appears twice in one mapping \(lines \d+ and \d+\)",
        ),
        "duplicate section": (good + "train:\n  seed: 3\n", r"key 'train' appears twice in one mapping \(lines"),
        "duplicate nested key": (
            good + "ray:\n  resources_per_worker: {CPU: 1, CPU: 2}\n",
            r"key 'CPU' appears twice in one mapping \(line \d+\)",
        ),
        "empty file": ("", r"the file is empty"),
        "only comments": ("# nothing here yet\n", r"the file is empty"),
    }


def test_yaml_with_duplicate_keys_or_nothing_in_it_is_refused(base, tmp_path, capsys):
    import yaml

    good = yaml.safe_dump({k: v for k, v in base.items() if k != "ray"}, sort_keys=False)
    for case, (text, pattern) in _yaml_cases(good).items():
        path = tmp_path / f"{case.replace(' ', '_')}.yaml"
        path.write_text(text)
        result = run_cli(capsys, "validate", "--config", str(path))
        assert_refused(result, pattern)
        assert str(path) in result.err, case


def test_a_val_split_that_does_not_exist_is_refused_unless_val_ratio_is_set(base, tmp_path, capsys):
    config = config_file(tmp_path, base, data={"val_split": "valdation"})
    pattern = r"data\.val_split: no split 'valdation' in .*wikitext-2-raw-v1 \(it has test, train, validation\)"
    assert_refused(run_cli(capsys, "validate", "--config", str(config)), pattern)
    config = config_file(tmp_path, base, data={"val_split": "valdation", "val_ratio": 0.1})
    result = run_cli(capsys, "validate", "--config", str(config))
    assert result.rc == 0, result.err
    assert "validation: none (holding out 10% of the training records for evaluation)" in result.out
    config = config_file(
        tmp_path, base, data={"val_split": "valdation", "val_ratio": 0.1}, train={"eval_strategy": "no"}
    )
    result = run_cli(capsys, "validate", "--config", str(config))
    assert result.rc == 0 and "validation: none (no evaluation)" in result.out, result.out


# --- data files --------------------------------------------------------------------------------------------------

LINES = [f"The old castle was built in {1800 + i} by the church ." for i in range(40)]


def _utf16_bom(tmp: Path) -> dict:
    path = tmp / "train.txt"
    path.write_text("\n".join(LINES), encoding="utf-16")  # with its byte-order mark
    return {"dataset_name_or_path": str(path)}


def _utf16_no_bom(tmp: Path) -> dict:
    path = tmp / "train.jsonl"
    path.write_bytes("\n".join(json.dumps({"text": t}) for t in LINES).encode("utf-16-le"))
    return {"dataset_name_or_path": str(path)}


def _utf32_bom(tmp: Path) -> dict:
    path = tmp / "train.txt"
    path.write_text("\n".join(LINES), encoding="utf-32")
    return {"dataset_name_or_path": str(path)}


def _parquet(tmp: Path, rows: int = 4000) -> Path:
    path = tmp / "train.parquet"
    pq.write_table(
        pa.table({"text": [LINES[i % 40] + f" {i}" for i in range(rows)]}),
        path,
        compression="snappy",
        row_group_size=1000,
    )
    return path


def _truncated_parquet(tmp: Path) -> dict:
    path = _parquet(tmp)
    truncate(path, 0.7)
    return {"dataset_name_or_path": str(path)}


def _garbled_parquet(tmp: Path) -> dict:
    path = _parquet(tmp)
    meta = pq.ParquetFile(path).metadata.row_group(1).column(0)
    assert meta.dictionary_page_offset and meta.data_page_offset - meta.dictionary_page_offset > 2000
    with open(path, "r+b") as f:  # overwrite 1000 bytes of row group 1's compressed dictionary page
        f.seek(meta.dictionary_page_offset + 100)
        f.write(os.urandom(1000))
    return {"dataset_name_or_path": str(path)}


def _no_record_has_the_field(tmp: Path) -> dict:
    path = tmp / "train.jsonl"
    path.write_text("\n".join(json.dumps({"body": t}) for t in LINES))
    return {"dataset_name_or_path": str(path)}


def _one_record(tmp: Path) -> dict:
    path = tmp / "train.jsonl"
    path.write_text(json.dumps({"text": LINES[0]}) + "\n")
    return {"dataset_name_or_path": str(path)}


DATA_CASES = {
    "UTF-16 text with BOM": (_utf16_bom, r"train\.txt is UTF-16LE text \(its byte-order mark says so\).*iconv"),
    "UTF-32 text with BOM": (_utf32_bom, r"train\.txt is UTF-32LE text"),
    "UTF-16 JSON Lines without BOM": (_utf16_no_bom, r"train\.jsonl: [\d,]+ of its first [\d,]+ bytes are NUL"),
    "truncated parquet": (_truncated_parquet, r"train\.parquet: not a readable parquet file"),
    "garbled parquet pages": (_garbled_parquet, r"train\.parquet: row group 1 does not decode"),
    "no record has the field": (
        _no_record_has_the_field,
        r"records have no field 'text' \(data\.text_field\); their "
        r"fields are body",
    ),
    "one record, no validation split": (_one_record, r"has 1 record\(s\) and there is no validation split: too few"),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_bad_data_files_are_refused_by_content(case, base, tmp_path, capsys):
    build, pattern = DATA_CASES[case]
    config = config_file(tmp_path, base, data=build(tmp_path))
    assert_refused(run_cli(capsys, "validate", "--config", str(config)), pattern)


def test_records_lacking_the_field_anywhere_are_skipped_not_fatal(base, tmp_path, capsys):
    """The field check reads every record: opening records without the field, or a first record over 1 MiB, do not
    hide the records that have it (bad_records: skip counts those without)."""
    late = tmp_path / "late.jsonl"
    late.write_text("\n".join([json.dumps({"id": i}) for i in range(500)] + [json.dumps({"text": t}) for t in LINES]))
    huge = tmp_path / "huge.jsonl"
    huge.write_text("\n".join([json.dumps({"text": "word " * 400_000})] + [json.dumps({"text": t}) for t in LINES]))
    said = {}
    for path in (late, huge):  # 500 of the 540 records in `late` are skips: allowed here, and said
        config = config_file(tmp_path, base, data={"dataset_name_or_path": str(path), "max_skipped_share": 1.0})
        said[path.name] = run_cli(capsys, "validate", "--config", str(config))
        assert said[path.name].rc == 0, said[path.name].err
    pattern = r"late\.jsonl: 500 of all 540 records \(93%\) would be skipped \(missing_field 500\)"
    assert re.search(pattern, said["late.jsonl"].err), said["late.jsonl"].err

    from rayft.config import DataConfig
    from rayft.data.sources import resolve_splits

    train, _ = resolve_splits(DataConfig(dataset_name_or_path=str(late)))
    assert "text" in train.columns(["text", "messages"]) and train.rows() == 540


def test_an_output_dir_that_cannot_be_created_is_refused(base, tmp_path, capsys):
    """/proc accepts no new entries, whatever the permission bits (and root's os.access) say."""
    config = config_file(tmp_path, base, train={"output_dir": "/proc/rayft-out"})
    assert_refused(
        run_cli(capsys, "validate", "--config", str(config)),
        r"train\.output_dir: cannot create /proc/rayft-out: creating anything in /proc fails",
    )


# --- a checkpoint to resume from ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory) -> Path:
    """A real DCP state directory (what every rank writes), as torch.distributed.checkpoint saves it."""
    import torch.distributed.checkpoint as dcp

    directory = tmp_path_factory.mktemp("ckpt") / "checkpoint-000004"
    state = {"model": {"w": torch.randn(64, 64), "b": torch.randn(64)}, "progress": {"step": 4}}
    dcp.save(state, checkpoint_id=str(directory / "state"))
    return directory


def _deleted_distcp(ckpt: Path, tmp: Path) -> Path:
    copy = shutil.copytree(ckpt, tmp / ckpt.name)
    next((copy / "state").glob("*.distcp")).unlink()
    return copy


def _truncated_distcp(ckpt: Path, tmp: Path) -> Path:
    copy = shutil.copytree(ckpt, tmp / ckpt.name)
    truncate(next((copy / "state").glob("*.distcp")), 0.5)
    return copy


def _garbled_metadata(ckpt: Path, tmp: Path) -> Path:
    copy = shutil.copytree(ckpt, tmp / ckpt.name)
    (copy / "state" / ".metadata").write_bytes(b"not a pickle")
    return copy


CHECKPOINT_CASES = {
    "deleted .distcp file": (_deleted_distcp, r"checkpoint-000004 is incomplete: .*state/__0_0\.distcp \(missing\)"),
    "truncated .distcp file": (_truncated_distcp, r"is incomplete: .*__0_0\.distcp \([\d,]+ of [\d,]+ bytes\)"),
    "unreadable .metadata": (_garbled_metadata, r"state/\.metadata cannot be read"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_a_damaged_resume_checkpoint_is_refused(case, dcp_checkpoint, base, tmp_path, capsys):
    build, pattern = CHECKPOINT_CASES[case]
    config = config_file(tmp_path, base, train={"resume_from_checkpoint": str(build(dcp_checkpoint, tmp_path))})
    assert_refused(run_cli(capsys, "validate", "--config", str(config)), pattern)


def test_a_complete_checkpoint_passes(dcp_checkpoint, base, tmp_path, capsys):
    config = config_file(tmp_path, base, train={"resume_from_checkpoint": str(dcp_checkpoint)})
    result = run_cli(capsys, "validate", "--config", str(config))
    assert result.rc == 0, result.err


# --- chat records against the tokenizer, and split names -----------------------------------------------------------


def _chat_data(tmp: Path, conversations: list[list[dict]]) -> Path:
    data = tmp / "chat"
    data.mkdir(parents=True)
    (data / "train.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in conversations) + "\n")
    (data / "validation.jsonl").write_text(json.dumps({"messages": conversations[0]}) + "\n")
    return data


@pytest.mark.parametrize("tokenizer", ["tekken", "smollm2"])
def test_chat_records_the_tokenizer_cannot_train_are_refused_with_the_record(
    tokenizer, fixtures, base, tmp_path, capsys, request
):
    """On main `validate` said "config ok" to all of these: SmolLM2's template renders any role (a `narrator` was
    trained on), and the job found out about the rest only after the cluster started."""

    model = tekken_model(tmp_path / "tekken") if tokenizer == "tekken" else request.getfixturevalue(tokenizer)
    narrator = [CONVERSATION[1], {"role": "narrator", "content": "They wait."}, CONVERSATION[2]]
    cases = {
        "narrator": (
            narrator,
            r"record 2 .*role\(s\) narrator unknown to the chat template \(it knows system, user, "
            r"assistant, tool\); fix or drop the record",
        ),
        "user last": (CONVERSATION[:4], r"record 2 .*the last turn is 'user', not 'assistant': nothing to learn"),
    }
    for i, (conversation, pattern) in enumerate(cases.values()):
        data = _chat_data(tmp_path / str(i), [CONVERSATION, CONVERSATION, conversation])
        config = config_file(
            tmp_path,
            base,
            model={"model_name_or_path": str(model)},
            data={"dataset_name_or_path": str(data), "dataset_config_name": None},
        )
        result = run_cli(capsys, "validate", "--config", str(config))
        assert_refused(result, pattern)
        assert f"{data / 'train.jsonl'}: record 2" in result.err
    data = _chat_data(tmp_path / "good", [CONVERSATION, CONVERSATION])
    config = config_file(
        tmp_path,
        base,
        model={"model_name_or_path": str(model)},
        data={"dataset_name_or_path": str(data), "dataset_config_name": None},
    )
    result = run_cli(capsys, "validate", "--config", str(config))
    assert result.rc == 0, result.err
    assert "records: messages, loss on completions only" in result.out


# --- what the job's record pipeline makes of each split's first records ---------------------------------------------

QA = [{"question": f"What is {i} plus {i}?", "answer": f" {2 * i}"} for i in range(30)]
REPLY = [CONVERSATION[1], {"role": "assistant", "content": ""}]  # a chat whose only reply is empty
DPO = {"packing": False}  # preference pairs are never packed


def _jsonl(tmp: Path, records: list, name: str = "train.jsonl") -> Path:
    path = tmp / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _gzip_named_jsonl(tmp: Path) -> Path:
    import gzip

    path = tmp / "train.jsonl"
    path.write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in LINES * 20).encode()))
    return path


def _wrong_type_parquet(tmp: Path) -> Path:
    path = tmp / "train.parquet"
    pq.write_table(pa.table({"text": list(range(40))}), path)
    return path


# (records or a file builder, data settings, train settings, the refusal): each was "config ok" before, and the job
# found out after Ray started, or trained on nothing.
SAMPLE_CASES = {
    "empty assistant replies": (
        [{"messages": CONVERSATION}] + [{"messages": REPLY}] * 9,
        {},
        {},
        r"train\.jsonl: 9 of all 10 records \(90%\) trains on nothing \(assistant replies .*over "
        r"data\.max_no_signal_share 0\.1; first: .*train\.jsonl: record 1 ",
    ),
    "identical preference pairs": (
        [{"prompt": f"Q{i}?", "chosen": " yes", "rejected": " yes"} for i in range(8)],
        DPO,
        {"objective": "dpo"},
        r"8 of all 8 records \(100%\) trains on nothing .*chosen and rejected tokenize alike.*record 0 ",
    ),
    "text and chat records in one file": (
        [{"text": t} for t in LINES[:6]] + [{"messages": CONVERSATION}] * 4,
        {},
        {},
        r"train\.jsonl mixes record kinds in all 10 records: text 6 \(first: .*train\.jsonl: record 0\), messages 4 "
        r"\(first: .*record 6\).*Set data\.format to the kind to train on",
    ),
    "prompt/completion and chat records in one file": (
        [{"prompt": "Say hi.", "completion": " hi"}] * 5 + [{"messages": CONVERSATION}] * 5,
        {},
        {},
        r"mixes record kinds in all 10 records: prompt_completion 5 .*messages 5 ",
    ),
    "messages stored as a string": (
        [{"messages": json.dumps(CONVERSATION)}] * 6,
        {},
        {},
        r"none of all 6 records would train \(not_text 6\); first: .*train\.jsonl: record 0 holds the field in "
        r"another type .*a chat needs a list of \{role, content\} messages",
    ),
    "chat prompts with string completions": (
        [{"prompt": CONVERSATION[:2], "chosen": "Hello!", "rejected": "Go away."}] * 6,
        DPO,
        {"objective": "dpo"},
        r"none of all 6 records would train \(not_text 6\)",
    ),
    "list and string sides of one pair": (
        [{"prompt": "Hi", "chosen": [CONVERSATION[2]], "rejected": "Go away."}] * 6,
        DPO,
        {"objective": "dpo"},
        r"none of all 6 records would train \(not_text 6\)",
    ),
    "parquet column of numbers": (_wrong_type_parquet, {}, {}, r"none of all 40 records would train \(not_text 40\)"),
    "bad_records: error and one undecodable line": (
        [{"text": t} for t in LINES[:5]] + ['{"text": "cut off'] + [{"text": t} for t in LINES[5:9]],
        {"bad_records": "error"},
        {},
        r"1 of all 10 records would be skipped \(bad_json 1\) and data\.bad_records is error; first: "
        r".*train\.jsonl: record 5 is not one JSON object",
    ),
    "most records without the field": (
        [{"body": t} for t in LINES[:30]] + [{"text": t} for t in LINES[30:]],
        {},
        {},
        r"30 of all 40 records \(75%\) would be skipped \(missing_field 30\), over data\.max_skipped_share 0\.5; "
        r"first: .*train\.jsonl: record 0 lacks a field",
    ),
    "gzip data named .jsonl": (
        _gzip_named_jsonl,
        {},
        {},
        r"train\.jsonl is gzip-compressed data, not text: .*decompress it first: gzip -dc < train\.jsonl > ",
    ),
}


@pytest.mark.parametrize("case", list(SAMPLE_CASES))
def test_validate_runs_the_jobs_record_pipeline_over_each_split(case, smollm2, base, tmp_path, capsys):
    records, data, train, pattern = SAMPLE_CASES[case]
    path = records(tmp_path) if callable(records) else _jsonl(tmp_path, records)
    config = config_file(
        tmp_path,
        base,
        model={"model_name_or_path": str(smollm2)},
        train=train,
        data={"dataset_name_or_path": str(path), "dataset_config_name": None, "val_ratio": 0.0, **data},
    )
    result = run_cli(capsys, "validate", "--config", str(config))
    assert_refused(result, pattern)


def test_a_few_bad_or_empty_records_are_warned_with_counts_and_the_sample_is_named(smollm2, base, tmp_path, capsys):
    """Under the thresholds the run is fine, and validate says what the job will leave out or train on nothing, with
    the first record; a split larger than the sample says it was checked by its first records."""
    chats = [{"messages": CONVERSATION}] * 30 + [{"messages": REPLY}] + ["not json"] * 2
    path = _jsonl(tmp_path, chats)
    data = {"dataset_name_or_path": str(path), "dataset_config_name": None, "val_ratio": 0.0}
    config = config_file(tmp_path, base, model={"model_name_or_path": str(smollm2)}, data=data)
    result = run_cli(capsys, "validate", "--config", str(config))
    assert result.rc == 0, result.err
    assert f"checked with the job's pipeline: {path}: all 33 records checked, 31 kept; bad_json 2, no_signal 1" in (
        result.out
    ), result.out
    assert re.search(
        r"warning: data: .*: 2 of all 33 records \(6%\) would be skipped \(bad_json 2, no_signal 1\); "
        r"first: .*train\.jsonl: record 31 is not one JSON object",
        result.err,
    ), result.err
    assert re.search(r"warning: data: .*: 1 of all 33 records \(3%\) trains on nothing .*record 30 ", result.err)

    big = _jsonl(tmp_path, [{"text": LINES[i % 40]} for i in range(1500)], "big.jsonl")
    config = config_file(
        tmp_path, base, data={"dataset_name_or_path": str(big), "dataset_config_name": None, "val_ratio": 0.0}
    )
    result = run_cli(capsys, "validate", "--config", str(config))
    assert result.rc == 0, result.err
    assert f"{big}: the first 1,000 records checked, 1,000 kept" in result.out, result.out


def _split_layouts(tmp: Path) -> dict[str, tuple[dict, str]]:
    flat = tmp / "flat"
    flat.mkdir()
    for split in ("train", "validation"):
        (flat / f"{split}.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in LINES) + "\n")
    broken = tmp / "broken"
    broken.mkdir()
    shutil.copy(flat / "validation.jsonl", broken)
    (broken / "train.jsonl").symlink_to(tmp / "gone" / "train.jsonl")
    loop = tmp / "loop"
    loop.symlink_to(loop)
    return {
        "misspelled train split": (
            {"dataset_name_or_path": str(flat), "train_split": "trian"},
            r"data\.train_split: no split 'trian' in .*flat \(it has train, validation\)",
        ),
        "broken train symlink": (
            {"dataset_name_or_path": str(broken)},
            r"train\.jsonl is a symbolic link to .*gone/train\.jsonl, which does not exist",
        ),
        "symlink loop": ({"dataset_name_or_path": str(loop)}, r"loop is a symbolic link loop"),
    }


def test_split_names_and_unreadable_split_files_are_refused_on_a_flat_folder(base, tmp_path, capsys):
    """On main the first two fell back to every file in the folder, validation records included, and the loop
    was reported as "does not exist"."""
    for data, pattern in _split_layouts(tmp_path).values():
        config = config_file(tmp_path, base, data={"dataset_config_name": None, **data})
        assert_refused(run_cli(capsys, "validate", "--config", str(config)), pattern)


# --- settings against the model and the machine; messages that point the right way ---------------------------------


def _truncated_tokenizer(fx: Fixtures, tmp: Path) -> tuple[dict, str]:
    model = variant(fx.model, tmp / "m", copy=("tokenizer.json",))
    truncate(model / "tokenizer.json")
    return (
        {"model_name_or_path": str(model)},
        r"m/tokenizer\.json: not valid JSON \(.*\): cut short or damaged; copy it again",
    )


def _model_link_loop(fx: Fixtures, tmp: Path) -> tuple[dict, str]:
    (tmp / "loop").symlink_to(tmp / "loop")
    return {"model_name_or_path": str(tmp / "loop")}, r"model\.model_name_or_path: .*loop is a symbolic link loop"


LIMIT_CASES = {
    "max_length over max_position_embeddings": (
        lambda fx, tmp: ({}, {"max_length": 4096}, {}),
        r"data\.max_length: 4,096 is over the model's max_position_embeddings 2,048 \(.*config\.json\) and no rope "
        r"scaling there covers it; set data\.max_length to 2,048 or less",
    ),
    "local Ray too small for the workers": (
        lambda fx, tmp: ({}, {}, {"num_workers": 4, "resources_per_worker": {"CPU": 3}}),
        r"ray\.num_workers: the local Ray cluster this run would start .* cannot place 4 workers × \{CPU 3\} .* "
        r"offers CPU 8, .*\(its CPUs: ray\.local_num_cpus 8\)",
    ),
}


@pytest.mark.parametrize("case", ["truncated tokenizer.json", "model dir symlink loop", *LIMIT_CASES])
def test_model_limits_and_unreadable_files_are_refused_naming_the_key_or_file(case, fixtures, base, tmp_path, capsys):
    """On main: the first said the parser's text without the file, the second "does not exist", and the others
    passed `validate` (the local Ray was refused only after it started)."""
    if case in LIMIT_CASES:
        build, pattern = LIMIT_CASES[case]
        model, data, ray_keys = build(fixtures, tmp_path)
    else:
        model, pattern = (_truncated_tokenizer if case.startswith("truncated") else _model_link_loop)(
            fixtures, tmp_path
        )
        data, ray_keys = {}, {}
    config = config_file(tmp_path, base, model=model, data=data, ray=ray_keys)
    assert_refused(run_cli(capsys, "validate", "--config", str(config)), pattern)


def test_rope_scaling_covers_a_longer_max_length_and_a_large_lora_rank_is_warned(fixtures, base, tmp_path, capsys):
    model = variant(fixtures.model, tmp_path / "m", copy=("config.json",))
    edit_json(
        model / "config.json",
        lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}),
    )
    config = config_file(
        tmp_path, base, model={"model_name_or_path": str(model)}, data={"max_length": 4096}, lora={"r": 128}
    )
    result = run_cli(capsys, "validate", "--config", str(config))
    assert result.rc == 0, result.err
    assert re.search(r"warning: lora\.r 128 is larger than the smaller side of .*k_proj \(32\)", result.err), result.err


# --- values only the next system used to check: transformers, the hub -----------------------------------------------


def _model_type(value: str | None):
    def build(fx: Fixtures, tmp: Path) -> dict:
        d = variant(fx.model, tmp / "m", copy=("config.json",))
        edit_json(d / "config.json", lambda c: c.update(model_type=value) if value else c.pop("model_type"))
        return {"model": {"model_name_or_path": str(d)}}

    return build


VALUE_CASES = {
    "misspelt attention": (
        lambda fx, tmp: {"model": {"attn_implementation": "sdpaa"}},
        r"model\.attn_implementation: 'sdpaa' is none of the implementations transformers offers \(eager, .*sdpa.*\)",
    ),
    "flash attention on CPU workers": (
        lambda fx, tmp: {"model": {"attn_implementation": "flash_attention_2"}, "ray": {"use_gpu": False}},
        r"model\.attn_implementation: flash_attention_2 runs on CUDA GPUs only and ray\.use_gpu is false; use sdpa",
    ),
    "model_type transformers does not know": (
        _model_type("mistrall"),
        r"m/config\.json: model_type 'mistrall' is not one transformers [\d.]+ knows \(close: mistral",
    ),
    "config.json without model_type": (_model_type(None), r"m/config\.json: no model_type"),
    "hub model name with spaces": (
        lambda fx, tmp: {"model": {"model_name_or_path": "mistralai/Mistral Small 4"}},
        r"model\.model_name_or_path: 'mistralai/Mistral Small 4' is no local path, and not a hub repo id either "
        r"\(Repo id must use alphanumeric chars",
    ),
    "hub dataset name with a stray character": (
        lambda fx, tmp: {"data": {"dataset_name_or_path": "org/wiki$text"}},
        r"data\.dataset_name_or_path: 'org/wiki\$text' is no local path, and not a hub repo id either",
    ),
}


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_values_are_checked_where_they_are_defined(case, fixtures, base, tmp_path, capsys):
    """Each passed `validate` before: the attention name and model_type failed as every worker built the model
    (a raw traceback, config.json not named), the hub names were reported as paths that do not exist."""
    build, pattern = VALUE_CASES[case]
    config = config_file(tmp_path, base, **build(fixtures, tmp_path))
    assert_refused(run_cli(capsys, "validate", "--config", str(config)), pattern)


def test_a_flash_kernel_not_installed_here_is_a_warning_for_a_gpu_config(base, tmp_path, capsys):
    """A GPU config checked where flash_attn is not installed (a laptop): the workers' image must have it."""
    import importlib.util

    config = config_file(tmp_path, base, model={"attn_implementation": "flash_attention_2"}, ray={"use_gpu": True})
    result = run_cli(capsys, "validate", "--config", str(config))
    assert result.rc == 0, result.err
    said = "model.attn_implementation: flash_attention_2 needs the flash_attn package, which is not installed here"
    assert (said in result.err) == (importlib.util.find_spec("flash_attn") is None), result.err
    config = config_file(tmp_path, base, model={"attn_implementation": "sdpa"})
    assert run_cli(capsys, "validate", "--config", str(config)).rc == 0


def test_validate_says_which_attention_kernel_the_job_runs_and_why(base, tmp_path, capsys):
    """model.attn_implementation unset: packed rows on GPUs get a varlen kernel (flash-attention where flash_attn is
    installed, else FlexAttention), CPU workers and padded rows SDPA; validate names the kernel and the reason."""
    import importlib.util

    varlen = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "flex_attention (packed rows on GPUs"
    cases = [
        ({"packing": True}, {"use_gpu": True}, f"  attention: {varlen}"),
        ({"packing": True}, {"use_gpu": False}, "  attention: sdpa (CPU workers: flash-attention is CUDA-only"),
        ({"packing": False}, {"use_gpu": True}, "  attention: sdpa (rows padded per batch, data.packing false"),
    ]
    for data, ray, said in cases:
        result = run_cli(capsys, "validate", "--config", str(config_file(tmp_path, base, data=data, ray=ray)))
        assert result.rc == 0, result.err
        assert said in result.out, result.out


def test_a_remote_storage_path_is_written_to_before_anything_starts(base, tmp_path, capsys, monkeypatch):
    """A bucket nothing can reach passed `validate` and failed at the first checkpoint with a raw traceback: now a
    probe object is written and deleted first. (An S3 endpoint on a closed local port; a file:// URI for a reachable
    store, which must be left as it was.)"""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")  # no credential lookup: the refusal is the connection's
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    closed = f"s3://runs/m4?endpoint_override=127.0.0.1:{free_port()}&scheme=http"
    config = config_file(tmp_path, base, ray={"storage_path": closed})
    refused = rf"ray\.storage_path: writing a probe object under {re.escape(closed)} failed \(.*connect"
    assert_refused(run_cli(capsys, "validate", "--config", str(config)), refused)
    store = tmp_path / "store"
    store.mkdir()
    config = config_file(tmp_path, base, ray={"storage_path": f"file://{store}"})
    result = run_cli(capsys, "validate", "--config", str(config))
    assert result.rc == 0, result.err
    assert list(store.iterdir()) == []  # the probe object went again


def test_tracker_credentials_are_checked_where_the_workers_would_use_them(base, tmp_path, capsys, monkeypatch):
    """`report_to: wandb` without a key passed `validate`; the job then started its workers and rank 0 died in
    wandb.init with a 40-line traceback. A local cluster's workers inherit this environment: refused here. A joined
    cluster has its own: a warning."""
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    config = config_file(tmp_path, base, train={"report_to": ["wandb"]})
    assert_refused(
        run_cli(capsys, "validate", "--config", str(config)),
        r"train\.report_to: wandb has no credentials .* set WANDB_API_KEY, run `wandb login`",
    )
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert run_cli(capsys, "validate", "--config", str(config)).rc == 0  # what `wandb login` writes
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert run_cli(capsys, "validate", "--config", str(config)).rc == 0
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # validate never connects; the job would join it
    joined = run_cli(capsys, "validate", "--config", str(config))
    assert joined.rc == 0 and "wandb has no credentials" in joined.err and "unless the cluster's workers" in joined.err


def test_an_mlflow_server_that_does_not_answer_or_no_server_at_all():
    """mlflow itself is not installed in CI (the library check comes first): the credential rule on its own."""
    from rayft.train.sinks import tracker_problem

    closed = f"http://127.0.0.1:{free_port()}"
    problem, fatal = tracker_problem("mlflow", {"MLFLOW_TRACKING_URI": closed})
    assert fatal and f"MLFLOW_TRACKING_URI {closed} does not answer" in problem
    problem, fatal = tracker_problem("mlflow", {})
    assert not fatal and "writes ./mlruns in rank 0's working directory" in problem
    assert tracker_problem("mlflow", {"MLFLOW_TRACKING_URI": "/shared/mlruns"}) is None
