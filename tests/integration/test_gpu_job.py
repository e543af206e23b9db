"""The tiny job through one real `ray job submit` on one GPU (`make gpu-check STAGE=job`): a local Ray head with
`--num-gpus 1`, `ray.use_gpu: true`, one worker on NCCL, FSDP2 in bf16, a checkpoint and an eval every step, the GPU's
fields in every metrics row, the final adapter. One job, so that the stage fits the GPU check's minutes: a rerun
continuing from its checkpoint is the same code on either device (`test_recovery.py` kills and reruns jobs on CPU
heads), and resuming exactly on the GPU is `test_gpu.py`'s checkpoint test. The CUDA case is marked `gpu` (skipped
with "needs CUDA" where there is no GPU); the same test runs on a CPU-only head in CI, so its fixtures and job
settings cannot rot.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest
from conftest import (
    RAY_BIN,
    STEPS,
    Fixtures,
    RayCluster,
    Run,
    checkpointing_config,
    free_port,
    submit_job,
    write_yaml,
)
from fixtures.cluster import head_command, start_node, stop_group, wait_for_dashboard, wait_for_nodes
from fixtures.devices import DEVICES

pytestmark = [pytest.mark.ray]

RUN_NAME = "gpu_run"


def ray_cli() -> str:
    """The `ray` next to this interpreter (a venv), else the one on PATH (the GPU kit puts its own there)."""
    found = RAY_BIN if RAY_BIN.exists() else shutil.which("ray")
    if not found:
        pytest.fail("no `ray` command: source .gpu-kit/activate.sh on the device, or install rayft")
    return str(found)


class Head(NamedTuple):
    cluster: RayCluster
    cuda: bool  # the head owns the GPU (else: CPU only)


@pytest.fixture(scope="module", params=DEVICES)
def gpu_cluster(request) -> Head:
    """One head node that owns the one GPU (`--num-gpus 1`), or a CPU-only one; only its own process group is
    stopped after."""
    cuda = request.param == "cuda"
    temp_dir = Path(tempfile.gettempdir()) / f"rayft-gpu-{os.getpid()}"
    gcs_port, dashboard_port = free_port(), free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    # `ray job submit -- python ...` resolves `python` through PATH; a device may have only `python3`
    shim = temp_dir.with_name(temp_dir.name + "-bin")
    shim.mkdir(parents=True, exist_ok=True)
    # A script, not a symlink: a venv's interpreter reached through a symlink elsewhere does not find its pyvenv.cfg
    # and starts without the venv's packages.
    (shim / "python").unlink(missing_ok=True)
    (shim / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (shim / "python").chmod(0o755)
    env["PATH"] = f"{shim}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = temp_dir.with_name(temp_dir.name + "-head.log")
    head = start_node(
        [
            *head_command(ray_cli(), temp_dir, gcs_port, dashboard_port),
            "--block",
            "--num-gpus",
            "1" if cuda else "0",
            "--num-cpus",
            str(max(4, min(8, os.cpu_count() or 1))),
            "--disable-usage-stats",
        ],
        env,
        log,
    )
    try:
        dashboard = f"http://127.0.0.1:{dashboard_port}"
        if not wait_for_dashboard(dashboard, head, log):
            pytest.fail(f"ray start --head exited with {head.returncode}; its output:\n{log.read_text()[-3000:]}")
        wait_for_nodes(dashboard, 1)
        yield Head(RayCluster(address=f"127.0.0.1:{gcs_port}", dashboard=dashboard, env=env), cuda)
    finally:
        stop_group(head)
        shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(shim, ignore_errors=True)
        log.unlink(missing_ok=True)


def gpu_job_config(fixtures: Fixtures, out: Path, storage: Path, cuda: bool) -> dict:
    """The test suite's checkpointing job (6 steps, save + eval every step, dropout on) on one GPU worker (or one
    CPU worker), bf16."""
    return checkpointing_config(
        fixtures,
        out,
        ray__use_gpu=cuda,
        ray__num_workers=1,
        ray__placement_strategy="PACK",
        ray__max_failures=0,
        ray__name=RUN_NAME,
        ray__storage_path=str(storage),
        train__bf16=True,
    )


def submit(cluster: RayCluster, cfg: dict, out: Path, log: str) -> tuple[Run, str]:
    out.mkdir(parents=True, exist_ok=True)
    config = write_yaml(out / f"{log}.yaml", cfg)
    job = submit_job(cluster, "--config", str(config), timeout=540, ray_bin=ray_cli())
    text = job.stdout + job.stderr
    (out / f"{log}.log").write_text(text)
    assert job.returncode == 0 and "succeeded" in text, text[-6000:]
    run = Run(out, out / f"{log}.log")
    return run, text


def metrics(storage: Path) -> list[dict]:
    rows = (storage / RUN_NAME / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, rows) if "loss" in r]


def test_gpu_job_checkpoints_and_evaluates_every_step(gpu_cluster, fixtures: Fixtures, tmp_path):
    cluster, cuda = gpu_cluster
    out, storage = tmp_path / "out", tmp_path / "storage"
    _, text = submit(cluster, gpu_job_config(fixtures, out, storage, cuda), out, "job")
    assert f"1 workers ({'GPU' if cuda else 'CPU'})" in text, text[-6000:]
    rows = metrics(storage)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:  # what the GPU adds to every metrics row (on CPU: no peak, no device memory)
        assert row["eval_loss"] is not None, row
        if not cuda:
            assert row["mfu_lora"] is None and row["memory_allocated_gib"] is None, row
            continue
        assert row["mfu_lora"] is not None and 0 < row["mfu_lora"] < row["mfu_6n"] < 1, row
        assert 0 < row["memory_allocated_gib"] <= row["memory_reserved_gib"], row
        assert row["peak_tflops"], row
    snapshot = json.loads((storage / RUN_NAME / "checkpoint_manager_snapshot.json").read_text())
    kept = {r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]}
    assert f"checkpoint-{STEPS:06d}" in kept and len(kept) <= 3, kept  # 2 best + the latest
    assert (out / "final" / "adapter_model.safetensors").is_file()
