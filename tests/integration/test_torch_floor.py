"""The oldest torch rayft runs on (`rayft.parallel.torch_compat.FLOOR`, FSDP2 holding the FP8 base only through
rayft's patch) against the pinned one: the tiny hub-FP8 Mistral-Small-4 trained through FSDP2 on two gloo ranks
gives the same losses on both. Run by CI's second leg (`make test-torch-floor`), which installs the floor's torch
and names the pinned interpreter in RAYFT_PINNED_PYTHON; the main run deselects it (marker `torch_floor`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, Fixtures, tiny_config
from fixtures.local_run import train_locally

from rayft.parallel.torch_compat import FLOOR, needs_integer_parameter_patch, torch_release

pytestmark = pytest.mark.torch_floor

EXACT = ("loss", "grad_norm", "learning_rate")


def _hub_fp8_config(fixtures: Fixtures, hub: Path, out: Path) -> dict:
    raw = tiny_config(fixtures, out, max_steps=4, logging_steps=1, learning_rate=3e-2)
    raw["model"].update(model_name_or_path=str(hub), torch_dtype="float32", frozen_dtype="auto")  # stays FP8
    raw["lora"].update(target_modules=["auto"], target_experts=True, lora_dropout=0.0)
    raw["fsdp"] = {"activation_checkpointing": True}
    raw["data"]["max_length"] = 32
    return raw


def test_the_fp8_mistral4_trains_the_same_on_the_floor_torch_as_on_the_pinned_one(
    fixtures: Fixtures, mistral4_hub: Path, tmp_path: Path
):
    pinned = os.environ["RAYFT_PINNED_PYTHON"]  # set by `make test-torch-floor`
    assert torch_release() == FLOOR and needs_integer_parameter_patch(), torch.__version__

    here = train_locally(_hub_fp8_config(fixtures, mistral4_hub, tmp_path / "floor"), 2)
    text = here.text()
    assert "stored as FP8 E4M3" in text, text[-4000:]

    config = tmp_path / "pinned.json"
    config.write_text(json.dumps(_hub_fp8_config(fixtures, mistral4_hub, tmp_path / "pinned")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    done = subprocess.run(
        [pinned, "-m", "fixtures.local_run", str(config), "2"],
        cwd=REPO / "tests",
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    there = json.loads(done.stdout.strip().splitlines()[-1])
    assert torch_release(there["torch"]) > FLOOR, there["torch"]

    mine = [r for r in here.metrics() if "loss" in r]
    theirs = [r for r in there["metrics"] if "loss" in r]
    assert [r["step"] for r in mine] == [r["step"] for r in theirs] == [1, 2, 3, 4]
    assert mine[-1]["loss"] < mine[0]["loss"]
    for a, b in zip(mine, theirs, strict=True):
        print(f"step {a['step']}: torch {torch.__version__} loss {a['loss']!r}, torch {there['torch']} {b['loss']!r}")
        for key in EXACT:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])  # the same sums in the same order
