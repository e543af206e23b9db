"""DPO through the real stack on the two-node test cluster: `ray job submit` trains on preference pairs (Ray Data,
2 gloo workers, FSDP2 + LoRA, the adapter-free base as reference), checkpoints, reports TRL's reward metrics and
writes a `final/` PEFT loads; `rayft eval` on the held-out pairs then ranks chosen over rejected. The same job with a
precomputed reference, stopped and continued, lands on the live reference's adapter on gloo ranks without Ray
(test_local_trainer.py); a killed worker's restart by Ray is test_recovery.py's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, Fixtures, RayCluster, Run, submit_job, tiny_config, write_yaml
from fixtures.preference import write_preference_data

pytestmark = pytest.mark.ray

STEPS = 6
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")  # fmt: skip


def dpo_config(fx: Fixtures, data: Path, out: Path) -> dict:
    cfg = tiny_config(fx, out, max_steps=STEPS, logging_steps=1, eval_steps=2, save_steps=2, save_total_limit=2,
                      per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=2e-2,
                      objective="dpo")  # fmt: skip
    cfg["data"].update(dataset_name_or_path=str(data), max_length=64, packing=False)
    cfg["data"]["dataset_config_name"] = None
    cfg["lora"]["lora_dropout"] = 0.1  # draws from each rank's RNG: exact resume must restore them
    cfg["dpo"] = {"beta": 0.1, "loss_type": "sigmoid"}
    cfg["ray"]["max_failures"] = 1
    return cfg


@pytest.fixture(scope="module")
def dpo_run(ray_cluster: RayCluster, fixtures: Fixtures, tmp_path_factory) -> Run:
    """The uninterrupted DPO job, through `ray job submit`."""
    root = tmp_path_factory.mktemp("dpo")
    data = write_preference_data(root / "pairs", train=96, validation=16)
    out = root / "out"
    out.mkdir()
    config = write_yaml(out / "config.yaml", dpo_config(fixtures, data, out))
    job = submit_job(ray_cluster, "--config", str(config))
    log = out / "driver.log"
    log.write_text(job.stdout + job.stderr)
    assert job.returncode == 0 and "succeeded" in job.stdout + job.stderr, log.read_text()[-6000:]
    return Run(out, log)


def test_dpo_job_trains_reports_reward_metrics_and_final_loads(dpo_run: Run, fixtures: Fixtures):
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
    assert {f"checkpoint-{s:06d}" for s in (4, 6)} <= dpo_run.checkpoint_dirs()

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(fixtures.model), dtype=torch.float32)
    tuned = PeftModel.from_pretrained(base, str(dpo_run.out / "final"))
    lora_b = [p for n, p in tuned.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # trained: B moved from its zero init


def test_rayft_eval_ranks_held_out_pairs_after_training(dpo_run: Run, ray_cluster: RayCluster):
    """Rewards of base + adapter against the base on the validation pairs (new prompts, same word sets)."""
    env = {**ray_cluster.env, "RAY_ADDRESS": ray_cluster.address}
    result = subprocess.run(
        [sys.executable, "-m", "rayft.cli", "eval", "--config", str(dpo_run.out / "config.yaml"), "--adapter",
         str(dpo_run.out / "final")], env=env, capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    print(result.stdout)
    found = re.search(r"on 'validation' \(16 pairs\): DPO loss ([\d.]+), .*rewards/accuracies ([\d.]+), "
                      r"rewards/margins (-?[\d.]+)", result.stdout)  # fmt: skip
    assert found, result.stdout + result.stderr[-3000:]
    loss, accuracy, margin = (float(found[i]) for i in (1, 2, 3))
    assert margin > 0 and accuracy > 0.5 and loss < 0.6931
