"""Chat fine-tuning with the tokenizers chat models ship: Mistral's tekken (`MistralCommonBackend`) here and SmolLM2's
`tokenizer.json` + chat template (test_local_trainer.py), each through the job's own driver pipeline and Trainer on 2
gloo ranks without Ray (FSDP2 + LoRA; `fixtures.local_run`): what Ray adds to a job is the same for every record
format, and its own tests run on the test cluster. Every record is used, with the ids an independent encoding gives
(test_chat.py checks the same encoding's assistant-only loss mask token by token), and the adapter is saved."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import Fixtures, tiny_config
from fixtures.chat import CONVERSATION, tekken_expected, tekken_model
from fixtures.local_run import train_locally

TRAIN, VALIDATION = 24, 4


def chat_config(fx: Fixtures, model: Path, root: Path, **model_keys) -> dict:
    """A 2-step job on `TRAIN` copies of one conversation (and `VALIDATION` held out), output in `root/out`."""
    data = root / "chat"
    data.mkdir(parents=True)
    for split, n in (("train", TRAIN), ("validation", VALIDATION)):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"messages": CONVERSATION}) + "\n" for _ in range(n)))
    out = root / "out"
    out.mkdir()
    cfg = tiny_config(
        fx,
        out,
        max_steps=2,
        logging_steps=1,
        eval_steps=2,
        save_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        learning_rate=1e-3,
    )
    cfg["model"].update(model_name_or_path=str(model), **model_keys)
    cfg["data"].update(dataset_name_or_path=str(data), dataset_config_name=None, max_length=128, packing=False)
    return cfg


def assert_adapter_saved(out: Path, logs: str) -> None:
    final = out / "final"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in final.iterdir()}, logs[-3000:]


def test_tekken_chat_job_uses_every_record_and_saves_the_adapter(fixtures: Fixtures, tmp_path):
    """Every record was once skipped (`chat_template`) and the job stopped after the cluster started."""
    model = tekken_model(tmp_path / "tekken")
    cfg = chat_config(fixtures, model, tmp_path)
    run = train_locally(cfg, 2)
    logs = run.text()
    assert [r["step"] for r in run.metrics() if "loss" in r] == [1, 2], run.metrics()
    assert_adapter_saved(run.out, logs)
    ids, _ = tekken_expected(model)
    assert f"{TRAIN} records, {TRAIN} examples, {TRAIN * len(ids):,} tokens" in logs, logs[-6000:]
