"""DPO: the job trains on preference pairs (the job's own driver pipeline and Trainer on 2 gloo ranks without Ray,
FSDP2 + LoRA, the adapter-free base as reference; `fixtures.local_run`), checkpoints, reports TRL's reward metrics
and writes a `final/` PEFT loads; `rayft eval` on the held-out pairs (its driver part and workers on the same gloo
ranks) then ranks chosen over rejected. The same job with a precomputed reference, stopped and continued, lands on
the live reference's adapter (test_local_trainer.py); what Ray adds to a job or an eval (placement, restarts, Ray
Data's split, submission) is the same for every objective and has its tests on the test cluster (test_recovery.py,
test_job_e2e.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import Fixtures, tiny_config, write_yaml
from fixtures.local_run import LocalRun, eval_locally, train_locally
from fixtures.preference import write_preference_data

from rayft.cli import eval_summary
from rayft.config import load_config

STEPS = 6
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def dpo_config(fx: Fixtures, data: Path, out: Path) -> dict:
    cfg = tiny_config(
        fx,
        out,
        max_steps=STEPS,
        logging_steps=1,
        eval_steps=2,
        save_steps=2,
        save_total_limit=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=2e-2,
        objective="dpo",
    )
    cfg["data"].update(dataset_name_or_path=str(data), max_length=64, packing=False)
    cfg["data"]["dataset_config_name"] = None
    cfg["lora"]["lora_dropout"] = 0.1  # draws from each rank's RNG: exact resume must restore them
    cfg["dpo"] = {"beta": 0.1, "loss_type": "sigmoid"}
    cfg["ray"]["max_failures"] = 1
    return cfg


@pytest.fixture(scope="module")
def dpo_run(fixtures: Fixtures, tmp_path_factory) -> LocalRun:
    """The uninterrupted DPO job, its config beside it for `rayft eval`."""
    root = tmp_path_factory.mktemp("dpo")
    data = write_preference_data(root / "pairs", train=96, validation=16)
    cfg = dpo_config(fixtures, data, root / "out")
    run = train_locally(cfg, 2)
    write_yaml(run.out / "config.yaml", cfg)
    return run


def test_dpo_job_trains_reports_reward_metrics_and_final_loads(dpo_run: LocalRun, fixtures: Fixtures):
    text = dpo_run.text()
    assert "96 records, 96 examples" in text, text[-6000:]  # one row per pair, none skipped
    rows = [r for r in dpo_run.metrics() if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[0]["loss"] == pytest.approx(0.6931, abs=2e-3)  # policy = reference before the first update
    for row in rows:
        assert all(isinstance(row[k], float) for k in METRICS), row
    assert rows[-1]["rewards/margins"] > 0 and rows[-1]["loss"] < rows[0]["loss"]
    evals = [r for r in dpo_run.metrics() if "eval_loss" in r]
    assert evals and all("eval_rewards/accuracies" in r for r in evals)
    assert re.search(r"step \d+/6 \| .*rewards/margins -?[\d.]+ \| rewards/accuracies [\d.]+", text)
    assert all(dpo_run.checkpoint(step).is_dir() for step in (4, 6))

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(fixtures.model), dtype=torch.float32)
    tuned = PeftModel.from_pretrained(base, str(dpo_run.out / "final"))
    lora_b = [p for n, p in tuned.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # trained: B moved from its zero init


def test_rayft_eval_ranks_held_out_pairs_after_training(dpo_run: LocalRun):
    """Rewards of base + adapter against the base on the validation pairs (new prompts, same word sets): `rayft
    eval`'s driver part and workers on 2 gloo ranks (`eval_locally`), the config read as the command reads it, the
    result as it prints it."""
    scored = eval_locally(load_config(dpo_run.out / "config.yaml"), dpo_run.out / "final")
    line = eval_summary(scored.result, adapter=True)
    print(line)
    found = re.search(
        r"on 'validation' \(16 pairs\): DPO loss ([\d.]+), .*rewards/accuracies ([\d.]+), "
        r"rewards/margins (-?[\d.]+)",
        line,
    )
    assert found, line + scored.text()[-3000:]
    loss, accuracy, margin = (float(found[i]) for i in (1, 2, 3))
    assert margin > 0 and accuracy > 0.5 and loss < 0.6931
