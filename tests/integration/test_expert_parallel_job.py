"""Expert parallelism end to end on the test Ray cluster: the tiny hub-layout Mistral-Small-4 (FP8 experts, LoRA on
attention, shared expert and routed experts) with `parallel.expert_parallel: 2` loses a worker after the first
checkpoint, Ray restarts the group and it resumes; it must end where its uninterrupted FSDP-only run (k = 1) ends.
A k = 1 run resuming from the Ray run's checkpoint must end there too. Only the expert-parallel run needs Ray (the
restart of an expert-parallel group, Ray Data's split): the FSDP-only reference and the k = 1 continuation run on
gloo ranks (tests/fixtures/local_run.py), so the comparison also holds the Ray workers to the launcher-agnostic
core. The same numeric properties for a second family (Qwen3-MoE, FP8 by `model.frozen_dtype`) are checked on gloo
ranks alone (test_local_trainer.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import STEPS, Fixtures, RayCluster, checkpointing_config
from fixtures.local_run import train_locally
from safetensors.torch import load_file
from test_recovery import finish, resumes, start, train_workers, wait_until

pytestmark = pytest.mark.ray

TOLERANCE = 1e-4  # EP and FSDP sum the same numbers in another order (fp32)


FROZEN = {"mistral4_hub": "auto", "qwen3_moe": "float8_e4m3fn"}  # FP8 either way: the checkpoint's, or stored so


def ep_config(fixtures: Fixtures, hub: Path, out: Path, k: int, frozen: str = "auto", **overrides) -> dict:
    cfg = checkpointing_config(fixtures, out, **overrides)
    cfg["model"].update(model_name_or_path=str(hub), torch_dtype="float32", frozen_dtype=frozen)
    cfg["lora"].update(target_modules=["auto"], target_experts=True, lora_dropout=0.0)
    cfg["fsdp"] = {"activation_checkpointing": True}
    cfg["train"].update(load_best_model_at_end=False, save_total_limit=None)  # final = the last step, all kept
    cfg["parallel"] = {"expert_parallel": k}
    return cfg


def assert_close_adapters(got: Path, want: Path) -> None:
    a, b = load_file(str(got / "adapter_model.safetensors")), load_file(str(want / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(".experts." in k for k in a)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=TOLERANCE, rtol=1e-3, msg=f"{got}: {key}")


def assert_close_losses(got, want, steps: range) -> None:
    """`got` and `want`: runs with `metrics()` (a Ray `Run`, or a gloo-rank `LocalRun`)."""
    mine = {r["step"]: r["loss"] for r in got.metrics()}
    theirs = {r["step"]: r["loss"] for r in want.metrics()}
    for step in steps:
        assert abs(mine[step] - theirs[step]) <= TOLERANCE, f"step {step}: {mine[step]} vs {theirs[step]}"


def test_expert_parallel_job_survives_a_killed_worker_and_resumes_with_another_k(
    ray_cluster: RayCluster, fixtures: Fixtures, mistral4_hub: Path, tmp_path: Path
):
    hub, frozen = mistral4_hub, FROZEN["mistral4_hub"]
    reference = train_locally(ep_config(fixtures, hub, tmp_path / "fsdp", 1, frozen), 2)  # uninterrupted, k = 1

    # k = 2 on Ray, a worker killed after the first checkpoint: Ray restarts the group, which resumes.
    out = tmp_path / "ep"
    run, driver = start(ray_cluster, ep_config(fixtures, hub, out, 2, frozen), out)
    try:
        wait_until(lambda: "checkpoint-000001" in run.registered(), "the first checkpoint", run)
        workers = wait_until(lambda: len(w := train_workers(ray_cluster.address, driver)) == 2 and w,
                             "the two training workers", run, every=1.0)  # fmt: skip
        os.kill(max(workers), signal.SIGKILL)
        text = finish(run, driver)
    finally:
        if driver.proc.poll() is None:  # a driver that ended has no process group left to kill
            driver.kill()
    assert len(resumes(text)) == 1 and "expert parallel: 2 MoE layers, 4 of 8 experts" in text, text[-6000:]
    assert "stored as FP8 E4M3" in text, text[-6000:]
    assert [r["step"] for r in run.metrics()][-1] == STEPS
    assert_close_losses(run, reference, range(1, STEPS + 1))
    assert_close_adapters(out / "final", reference.out / "final")

    # The Ray run's k = 2 checkpoint continued with k = 1.
    source = run.run_dir / f"checkpoint-{STEPS - 2:06d}"
    again = train_locally(
        ep_config(fixtures, hub, tmp_path / "k1-from-k2", 1, frozen, train__resume_from_checkpoint=str(source)), 2
    )
    assert again.resumes() == [STEPS - 2], again.text()[-6000:]
    assert [r["step"] for r in again.metrics()] == [STEPS - 1, STEPS]
    assert_close_losses(again, reference, range(STEPS - 1, STEPS + 1))
    assert_close_adapters(again.out / "final", reference.out / "final")
