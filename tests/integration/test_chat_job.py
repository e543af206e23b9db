"""Chat fine-tuning through the real stack (`ray job submit` → Ray Data → 2 gloo workers, FSDP2 + LoRA) on the
two-node test cluster, with the tokenizers chat models ship: Mistral's tekken (`MistralCommonBackend`) and SmolLM2's
`tokenizer.json` + chat template (that one on gloo ranks without Ray: test_local_trainer.py, the job's own driver
pipeline and Trainer). Every record is used, with the ids an independent encoding gives (test_chat.py checks the
same encoding's assistant-only loss mask token by token), and the adapter is saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Fixtures, RayCluster, submit_job, tiny_config, write_yaml
from fixtures.chat import CONVERSATION, tekken_expected, tekken_model

pytestmark = pytest.mark.ray

TRAIN, VALIDATION = 24, 4


def chat_config(fx: Fixtures, model: Path, root: Path, **model_keys) -> dict:
    """A 2-step job on `TRAIN` copies of one conversation (and `VALIDATION` held out), output in `root/out`."""
    data = root / "chat"
    data.mkdir(parents=True)
    for split, n in (("train", TRAIN), ("validation", VALIDATION)):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"messages": CONVERSATION}) + "\n" for _ in range(n)))
    out = root / "out"
    out.mkdir()
    cfg = tiny_config(fx, out, max_steps=2, logging_steps=1, eval_steps=2, save_steps=2, per_device_train_batch_size=2,
                      gradient_accumulation_steps=1, learning_rate=1e-3)  # fmt: skip
    cfg["model"].update(model_name_or_path=str(model), **model_keys)
    cfg["data"].update(dataset_name_or_path=str(data), dataset_config_name=None, max_length=128, packing=False)
    return cfg


def assert_adapter_saved(out: Path, logs: str) -> None:
    final = out / "final"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in final.iterdir()}, logs[-3000:]


def _chat_job(cluster: RayCluster, fx: Fixtures, model: Path, root: Path, **model_keys) -> str:
    cfg = chat_config(fx, model, root, **model_keys)
    out = Path(cfg["train"]["output_dir"])
    job = submit_job(cluster, "--config", str(write_yaml(out / "config.yaml", cfg)))
    logs = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in logs, logs[-6000:]
    assert_adapter_saved(out, logs)
    return logs


def test_tekken_chat_job_uses_every_record_and_saves_the_adapter(ray_cluster: RayCluster, fixtures: Fixtures,
                                                                 tmp_path):  # fmt: skip
    """On main every record was skipped (`chat_template`) and the job stopped after the cluster started."""
    model = tekken_model(fixtures, tmp_path / "tekken")
    logs = _chat_job(ray_cluster, fixtures, model, tmp_path)
    ids, _ = tekken_expected(model)
    assert f"{TRAIN} records, {TRAIN} examples, {TRAIN * len(ids):,} tokens" in logs, logs[-6000:]
