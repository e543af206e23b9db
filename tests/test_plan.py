"""`rayft plan`: the real Mistral-Small-4 config against the reference figures, and a tiny model's plan."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO, Fixtures

from rayft.config import Config
from rayft.plan import meta_structure, plan_memory

# Mistral-Small-4, bf16, full shard, AC on, r=16, attention + shared-expert LoRA, 1 x 4096 tokens per GPU.
REFERENCE_GIB = {3: 97, 4: 79, 8: 51}


def test_real_config_plan_is_within_10_percent_of_the_reference():
    result = subprocess.run(
        [sys.executable, "-m", "rayft.cli", "plan", "--preset", "mistral-small-4", "--num-nodes", "3", "4", "8",
         "--override", "data.max_length=4096", "--override", "fsdp.activation_checkpointing=true",
         "--override", "model.frozen_dtype=bfloat16"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Mistral4ForCausalLM: 118.97B params" in result.stdout
    totals = [float(x) for x in re.search(r"total GiB/GPU\s+([\d.\s]+)", result.stdout)[1].split()]
    for (nodes, want), got in zip(REFERENCE_GIB.items(), totals, strict=True):
        assert abs(got - want) / want <= 0.10, (nodes, got, want)
    assert re.search(r"on h200 .*fits\s+fits\s+fits", result.stdout)
    # next to it, the same runs with the frozen base in FP8 (1 byte per decoder-matrix weight + row scales)
    fp8 = [float(x) for x in re.search(r"with fp8 base\s+([\d.\s]+)", result.stdout)[1].split()]
    assert all(0.5 * bf16 < f < 0.7 * bf16 for f, bf16 in zip(fp8, totals, strict=True)), (fp8, totals)


def test_plan_rows_follow_the_config(fixtures: Fixtures):
    raw = {"model": {"model_name_or_path": str(fixtures.model), "torch_dtype": "float32"}, "data": {"max_length": 512}}
    cfg = Config.from_dict(raw)
    s = meta_structure(cfg)
    assert s.layers == 2 and s.vocab == 131072 and s.lora > 0
    without = dict(plan_memory(cfg, s, world_size=2, on_gpu=False).rows)
    cfg.fsdp.activation_checkpointing = True
    with_ac = dict(plan_memory(cfg, s, world_size=2, on_gpu=False).rows)
    assert with_ac["activations (AC on)"] < without["activations (AC off)"]
    # fp32 logits + fp32 log-softmax + fp32 gradient: one 128-token chunk with the fused loss, else every token
    assert without["logits + loss"] * 2**30 == 128 * 131072 * 12
    cfg.train.fused_loss = False
    assert dict(plan_memory(cfg, s, world_size=2, on_gpu=False).rows)["logits + loss"] * 2**30 == 512 * 131072 * 12
    assert "CUDA/NCCL/allocator overhead" not in without
