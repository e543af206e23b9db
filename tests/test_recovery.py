"""Checkpoints that survive anything, on a real two-node local Ray cluster with 2 CPU workers (gloo, FSDP2 + LoRA):
retention by eval_loss, exact resume after a killed worker (also mid-save) and after the user reruns a killed job,
and resuming another run's checkpoint on a different world size."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, STEPS, Fixtures, RayCluster, Run, checkpointing_config, write_yaml
from safetensors.torch import load_file

pytestmark = pytest.mark.ray

# Metrics that depend only on what was trained (not on timing): must match the uninterrupted run.
EXACT = ("loss", "eval_loss", "learning_rate", "grad_norm")
RESUMED = re.compile(r"\(RayTrainWorker pid=\d+\).*resumed from \S+/checkpoint-(\d+): step (\d+)")


class Driver:
    """`python jobs/mistral4.py --config X` against the test cluster, as `ray job submit` would run it."""

    def __init__(self, cluster: RayCluster, config: Path, log: Path):
        self.log = log
        env = {**cluster.env, "RAY_ADDRESS": cluster.address}
        with open(log, "a") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "jobs/mistral4.py", "--config", str(config)],
                cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def wait(self, timeout: float = 600) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def start(cluster: RayCluster, cfg: dict, out: Path, log: str = "driver.log") -> tuple[Run, Driver]:
    out.mkdir(parents=True, exist_ok=True)
    config = write_yaml(out / "config.yaml", cfg)
    run = Run(out, out / log)
    return run, Driver(cluster, config, run.log)


def finish(run: Run, driver: Driver) -> str:
    rc = driver.wait()
    text = run.text()
    assert rc == 0 and "rayft: final adapter:" in text, text[-6000:]
    return text


def wait_until(condition, what: str, run: Run, timeout: float = 300, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out waiting for {what}\n{run.text()[-4000:]}")


def train_worker_pids() -> set[int]:
    """Ray names each training-worker process `ray::RayTrainWorker...`."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "adapter_model.safetensors")


def assert_same_adapter(got: Path, want: Path) -> None:
    a, b = adapter(got), adapter(want)
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff < 1e-6, f"{got} differs from {want} by {diff}"


def assert_same_training(run: Run, reference: Run) -> None:
    """Per-step metrics and the adapters match the uninterrupted run: same data order, LR schedule, RNG."""
    got, want = run.metrics(), reference.metrics()
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), got
    for g, w in zip(got, want, strict=True):
        for key in EXACT:
            assert abs(g[key] - w[key]) < 1e-6, f"step {g['step']} {key}: {g[key]} != {w[key]}"
    last = f"checkpoint-{STEPS:06d}"
    assert_same_adapter(run.run_dir / last / "adapter", reference.run_dir / last / "adapter")
    assert_same_adapter(run.out / "final", reference.out / "final")
    assert run.checkpoint_dirs() == reference.checkpoint_dirs()


def test_retention_keeps_the_best_and_latest_and_final_is_the_best(reference_run: Run):
    rows = {r["step"]: r["eval_loss"] for r in reference_run.metrics()}
    assert sorted(rows) == list(range(1, STEPS + 1))
    # Ray's policy with a score: the save_total_limit best by eval_loss, plus the latest.
    ranked = sorted(rows, key=lambda step: (rows[step], -step))
    policy = {f"checkpoint-{s:06d}" for s in ({*ranked[:2], STEPS})}
    assert reference_run.checkpoint_dirs() == policy == reference_run.registered()

    best = ranked[0]
    assert_same_adapter(reference_run.out / "final", reference_run.run_dir / f"checkpoint-{best:06d}" / "adapter")
    assert json.loads((reference_run.out / "best" / "trainer_state.json").read_text())["step"] == best
    assert (reference_run.out / "final" / "tokenizer.json").is_file()


def test_killed_workers_and_a_killed_job_resume_exactly(
    ray_cluster: RayCluster, fixtures: Fixtures, reference_run: Run, tmp_path
):
    """One run that loses a worker after its first checkpoint, then another in the middle of a save (Ray restarts
    the group: max_failures 2), then the whole job; the same command run again finishes it. The result is the
    uninterrupted run's, step for step."""
    out = tmp_path / "out"
    cfg = checkpointing_config(fixtures, out)
    run, driver = start(ray_cluster, cfg, out)
    try:
        wait_until(lambda: "checkpoint-000001" in run.registered(), "the first checkpoint", run)
        first_group = wait_until(train_worker_pids, "training workers", run)
        os.kill(max(first_group), signal.SIGKILL)

        def mid_save() -> tuple[int, str] | None:
            """A worker of the restarted group while a checkpoint is on storage but not registered yet."""
            group = train_worker_pids() - first_group
            if len(group) < 2 or not resumes(run.text()):
                return None
            unregistered = run.checkpoint_dirs() - run.registered()
            return (max(group), min(unregistered)) if unregistered else None

        victim, saving = wait_until(mid_save, "a checkpoint being saved by the restarted group", run, every=0.01)
        os.kill(victim, signal.SIGKILL)
        assert saving not in run.registered(), "the kill landed after the checkpoint was registered"

        wait_until(lambda: len(resumes(run.text())) == 2, "the second restart", run)
        wait_until(lambda: "checkpoint-000003" in run.registered(), "checkpoint 3 after the restarts", run)
    finally:
        driver.kill()  # the whole job: driver, controller and workers
    first_attempts = resumes(run.text())
    assert len(first_attempts) == 2 and 1 <= first_attempts[0] <= first_attempts[1], run.text()[-6000:]
    stopped_at = max(r["step"] for r in run.metrics())
    assert stopped_at < STEPS, "the job finished before it was killed"

    rerun, driver = start(ray_cluster, cfg, out, log="rerun.log")  # the same command again
    text = finish(rerun, driver)
    assert "has checkpoints: continuing that run from its latest one" in text, text[-6000:]
    resumed = resumes(text)
    assert len(resumed) == 1 and 3 <= resumed[0] <= stopped_at, text[-6000:]
    assert_same_training(rerun, reference_run)


def resumes(log: str) -> list[int]:
    """Steps of the `resumed from .../checkpoint-N: step N` lines, each once (both test nodes stream every log)."""
    lines = dict.fromkeys(m[0] for m in RESUMED.finditer(log))
    steps = []
    for line in lines:
        m = RESUMED.search(line)
        assert int(m[1]) == int(m[2]), line
        steps.append(int(m[2]))
    return steps


def test_another_runs_checkpoint_resumes_on_one_worker(
    ray_cluster: RayCluster, fixtures: Fixtures, reference_run: Run, tmp_path
):
    source = reference_run.run_dir / f"checkpoint-{STEPS - 1:06d}"
    out = tmp_path / "one-worker"
    cfg = checkpointing_config(fixtures, out, ray__num_workers=1, train__resume_from_checkpoint=str(source))
    run, driver = start(ray_cluster, cfg, out)
    text = finish(run, driver)
    assert resumes(text) == [STEPS - 1] and f"resumed from {source}: " in text, text[-6000:]
    assert "written by 2 workers" in text and "resuming on 1" in text
    assert [r["step"] for r in run.metrics()] == [STEPS]  # one more step, on one worker
    trained, start_point = adapter(out / "final"), adapter(source / "adapter")
    assert max((trained[k] - start_point[k]).abs().max().item() for k in trained) > 0
    assert (run.run_dir / f"checkpoint-{STEPS:06d}" / "state" / ".metadata").is_file()


def test_lost_node_restarts_the_group_on_the_spare_node(fixtures: Fixtures, reference_run: Run, tmp_path, monkeypatch):
    """Three trainer nodes for two workers (STRICT_SPREAD, one per node): removing a worker's node mid-run, as a
    lost pod would, kills its worker; with max_failures 1 the group restarts on the spare node, from the last
    checkpoint, and ends with the uninterrupted run's result."""
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})  # driver, controller, Ray Data
    try:
        # One CPU each, all taken by the training worker: nothing else lives (and is lost) with the node.
        trainers = [cluster.add_node(num_cpus=1, resources={"trainer": 1}) for _ in range(3)]
        cluster.wait_for_nodes()
        raylets = {n.all_processes["raylet"][0].process.pid: n for n in trainers}
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        test_cluster = RayCluster(address=cluster.address, dashboard="", env=env)

        out = tmp_path / "out"
        cfg = checkpointing_config(
            fixtures, out, ray__placement_strategy="STRICT_SPREAD", ray__max_failures=1,
            ray__resources_per_worker={"CPU": 1, "trainer": 1},
        )  # fmt: skip
        run, driver = start(test_cluster, cfg, out)
        try:
            wait_until(lambda: "checkpoint-000002" in run.registered(), "checkpoint 2", run)
            used = {raylets[p].node_id for p in map(_parent, train_worker_pids()) if p in raylets}
            assert len(used) == 2, "expected one training worker on each of two trainer nodes"
            lost = next(n for n in trainers if n.node_id in used)
            cluster.remove_node(lost, allow_graceful=False)
            text = finish(run, driver)
        finally:
            if driver.proc.poll() is None:
                driver.kill()
    finally:
        cluster.shutdown()

    resumed = resumes(text)
    assert len(resumed) == 1 and resumed[0] >= 2, text[-6000:]
    assert_same_training(run, reference_run)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1
