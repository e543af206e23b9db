"""Checkpoints that survive anything, on a real two-node local Ray cluster with 2 CPU workers (gloo, FSDP2 + LoRA):
retention by eval_loss, exact resume after a killed worker (also mid-save) and after the user reruns a killed job
(that job context-parallel: each packed row split over the 2 workers, its result the same job's uninterrupted on 2
gloo ranks), and resuming another run's checkpoint on a different world size."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import (
    REPO,
    STEPS,
    TEST_RAY_ENV,
    Fixtures,
    RayCluster,
    Run,
    checkpointing_config,
    free_port,
    run_cli,
    write_yaml,
)
from fixtures.cluster import RAY_BIN
from fixtures.ledger import assert_each_record_once, ledger_rows
from fixtures.local_run import LocalRun, train_locally
from safetensors.torch import load_file

pytestmark = pytest.mark.ray

# Metrics that depend only on what was trained (not on timing): must match the uninterrupted run.
EXACT = ("loss", "eval_loss", "learning_rate", "grad_norm")
REORDERED = 1e-4  # the same sums in another order, fp32 (an elastic run at another size; EP against FSDP)
RESUMED = re.compile(r"\(RayTrainWorker pid=\d+\).*resumed from \S+/checkpoint-(\d+): step (\d+)")


class Driver:
    """`python jobs/mistral4.py --config X` against the test cluster, as `ray job submit` would run it."""

    def __init__(self, cluster: RayCluster, config: Path, log: Path):
        self.log = log
        env = {**cluster.env, "RAY_ADDRESS": cluster.address}
        with open(log, "a") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "jobs/mistral4.py", "--config", str(config)],
                cwd=REPO,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

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


def wait_until(condition, what: str, run: Run, timeout: float = 600, every: float = 0.05):
    """Polls `condition` until it is truthy; the generous deadline covers a CI machine running two job tests at once
    on two cores (a run that works returns as soon as the condition holds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out waiting for {what}\n{run.text()[-4000:] if run.log.exists() else ''}")


def train_workers(address: str, driver: Driver) -> dict[int, str]:
    """PID → node id of the live TorchTrainer workers of this driver's job, from Ray's state API on this test's own
    cluster: never a process of another job or of someone else's Ray on the machine."""
    from ray.util.state import list_actors, list_jobs

    jobs = [j.job_id for j in list_jobs(address=address) if j.driver_info and int(j.driver_info.pid) == driver.proc.pid]
    if not jobs:
        return {}
    filters = [("job_id", "=", jobs[0]), ("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")]
    return {a.pid: a.node_id for a in list_actors(address=address, filters=filters) if a.pid}


def adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "adapter_model.safetensors")


def assert_same_adapter(got: Path, want: Path, tolerance: float = 1e-6) -> None:
    a, b = adapter(got), adapter(want)
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"adapter gap {diff:.3g}")
    assert diff < tolerance, f"{got} differs from {want} by {diff}"


def ray_keeps(metrics: list[dict]) -> set[str]:
    """The checkpoint dirs Ray's retention leaves of a run with these per-step metrics, saving every step: the
    save_total_limit (2) best by eval_loss, plus the latest."""
    rows = {r["step"]: r["eval_loss"] for r in metrics}
    ranked = sorted(rows, key=lambda step: (rows[step], -step))
    return {f"checkpoint-{s:06d}" for s in ({*ranked[:2], max(rows)})}


def assert_same_training(run: Run, reference: Run | LocalRun, kept: set[str] | None = None) -> None:
    """Per-step metrics and the adapters match the uninterrupted run: same data order, LR schedule, RNG. `kept`: the
    checkpoint dirs the run must have left (by default the reference's: a Ray run's, retention applied)."""
    got, want = run.metrics(), reference.metrics()
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), got
    for g, w in zip(got, want, strict=True):
        for key in EXACT:
            assert abs(g[key] - w[key]) < 1e-6, f"step {g['step']} {key}: {g[key]} != {w[key]}"
    last = f"checkpoint-{STEPS:06d}"
    assert_same_adapter(run.run_dir / last / "adapter", reference.run_dir / last / "adapter")
    assert_same_adapter(run.out / "final", reference.out / "final")
    assert run.checkpoint_dirs() == (reference.checkpoint_dirs() if kept is None else kept)


def test_retention_keeps_the_best_and_latest_and_final_is_the_best(reference_run: Run):
    rows = {r["step"]: r["eval_loss"] for r in reference_run.metrics()}
    assert sorted(rows) == list(range(1, STEPS + 1))
    # Ray's policy with a score: the save_total_limit best by eval_loss, plus the latest.
    policy = ray_keeps(reference_run.metrics())
    assert reference_run.checkpoint_dirs() == policy == reference_run.registered()

    best = min(rows, key=lambda step: (rows[step], -step))
    assert_same_adapter(reference_run.out / "final", reference_run.run_dir / f"checkpoint-{best:06d}" / "adapter")
    assert json.loads((reference_run.out / "best" / "trainer_state.json").read_text())["step"] == best
    assert (reference_run.out / "final" / "tokenizer.json").is_file()


# The reference run is not read here, but asked for: it keeps this test in the `reference` group, on the worker
# of the shorter queue (tests/fixtures/ray_group.py), where the run already exists.
@pytest.mark.usefixtures("reference_run")
def test_killed_workers_and_a_killed_job_resume_exactly(ray_cluster: RayCluster, fixtures: Fixtures, tmp_path):
    """One context-parallel run (each packed row split over the 2 workers: one data-parallel rank) that loses a
    worker after its first checkpoint, then another in the middle of a save (Ray restarts the group: max_failures
    2), then the whole job; the same command run again finishes it. The result is the uninterrupted run's, step for
    step: the same job trained on 2 gloo ranks in this process (its records read by the job's in-process pipeline;
    an uninterrupted Ray run of it gives the same metrics and adapter, bit for bit), and the checkpoints Ray's
    retention keeps of those metrics."""
    out = tmp_path / "out"
    cfg = checkpointing_config(fixtures, out, parallel__context_parallel=2)
    # Its records fit one shuffle buffer, which Ray Data shuffles as one seeded permutation, as the gloo ranks do.
    expected = train_locally(checkpointing_config(fixtures, tmp_path / "expected", parallel__context_parallel=2), 2)
    run, driver = start(ray_cluster, cfg, out)
    try:
        wait_until(lambda: "checkpoint-000001" in run.registered(), "the first checkpoint", run)
        first_group = wait_until(
            lambda: len(w := train_workers(ray_cluster.address, driver)) == 2 and w,
            "the two training workers",
            run,
            every=1.0,
        )
        os.kill(max(first_group), signal.SIGKILL)

        def restarted() -> set[int] | None:
            group = set(train_workers(ray_cluster.address, driver)) - set(first_group)
            return group if len(group) == 2 and resumes(run.text()) else None

        group = wait_until(restarted, "the restarted group to resume", run, every=1.0)
        saving = wait_until(
            lambda: min(run.checkpoint_dirs() - run.registered(), default=None),
            "a checkpoint being saved by the restarted group",
            run,
            every=0.01,
        )
        os.kill(max(group), signal.SIGKILL)
        assert saving not in run.registered(), "the kill landed after the checkpoint was registered"

        wait_until(lambda: len(resumes(run.text())) == 2, "the second restart", run)
        wait_until(lambda: "checkpoint-000003" in run.registered(), "checkpoint 3 after the restarts", run)
    finally:
        driver.kill()  # the whole job: driver, controller and workers
    first_attempts = resumes(run.text())
    assert len(first_attempts) == 2 and 1 <= first_attempts[0] <= first_attempts[1], run.text()[-6000:]
    # the default (quiet) job log still says what happened: each killed worker, and Ray's decision to restart
    decisions = [
        (d, src.strip()) for d, src in re.findall(r"\[FailurePolicy\] (\w+).*?Source: ([^\n]+)", run.text(), re.S)
    ]
    assert decisions[:2] == [("RETRY", "worker group")] * 2, run.text()[-6000:]
    assert len(re.findall(r"ActorDiedError|actor died|worker died|killed", run.text(), re.I)) >= 2, run.text()[-6000:]
    stopped_at = max(r["step"] for r in run.metrics())
    assert stopped_at < STEPS, "the job finished before it was killed"

    rerun, driver = start(ray_cluster, cfg, out, log="rerun.log")  # the same command again
    text = finish(rerun, driver)
    assert "has checkpoints: continuing that run from its latest one" in text, text[-6000:]
    resumed = resumes(text)
    assert len(resumed) == 1 and 3 <= resumed[0] <= stopped_at, text[-6000:]
    # the rows were split: context parallelism's all-to-alls around attention moved bytes at every step
    assert all(r["comm_all_to_all_bytes"] > 0 for r in rerun.metrics()), rerun.metrics()
    assert_same_training(rerun, expected, ray_keeps(expected.metrics()))


def resumes(log: str) -> list[int]:
    """Steps of the `resumed from .../checkpoint-N: step N` lines, each once (both test nodes stream every log)."""
    lines = dict.fromkeys(m[0] for m in RESUMED.finditer(log))
    steps = []
    for line in lines:
        m = RESUMED.search(line)
        assert int(m[1]) == int(m[2]), line
        steps.append(int(m[2]))
    return steps


def test_another_runs_checkpoint_resumes_on_one_worker(fixtures: Fixtures, reference_run: Run, tmp_path):
    """The Ray run's checkpoint, written by two workers, continued by another run on one: what is resharded is
    rayft's and DCP's, so the one worker is a gloo rank (the restart of a Ray group: the tests above)."""
    source = reference_run.run_dir / f"checkpoint-{STEPS - 1:06d}"
    out = tmp_path / "one-worker"
    cfg = checkpointing_config(fixtures, out, ray__num_workers=1, train__resume_from_checkpoint=str(source))
    run = train_locally(cfg, 1)
    text = run.text()
    assert run.resumes() == [STEPS - 1] and f"resumed from {source}: " in text, text[-6000:]
    assert "written by 2 workers" in text and "resuming on 1" in text
    assert [r["step"] for r in run.metrics()] == [STEPS]  # one more step, on one worker
    trained, start_point = adapter(out / "final"), adapter(source / "adapter")
    assert max((trained[k] - start_point[k]).abs().max().item() for k in trained) > 0
    assert (run.run_dir / f"checkpoint-{STEPS:06d}" / "state" / ".metadata").is_file()


PRIORITY_PROBE = """
import os, ray
ray.init()
@ray.remote(num_cpus=1)
def niceness():
    return os.nice(0)
print("niceness", ray.get(niceness.remote()))
"""


def test_a_test_clusters_workers_run_at_normal_priority(ray_cluster: RayCluster):
    """Ray's default nice 15 for workers let the rest of a parallel test run starve a job (tests/conftest.py): a
    recovery test then timed out waiting for work that takes a minute. The test clusters' workers run at nice 0."""
    env = {**ray_cluster.env, "RAY_ADDRESS": ray_cluster.address}
    probe = subprocess.run([sys.executable, "-c", PRIORITY_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert "niceness 0" in probe.stdout, probe.stdout


@contextmanager
def trainer_nodes(
    monkeypatch, count: int = 3, env: dict[str, str] | None = None
) -> Iterator[tuple[Any, list, RayCluster]]:
    """A cluster of its own: a head and `count` trainer nodes of one CPU each (two workers, STRICT_SPREAD, leave the
    rest spare), shut down after. `env`: more of the driver's environment."""
    from ray.cluster_utils import Cluster
    from ray.util import get_node_ip_address

    # The nodes' processes inherit this environment: their state API answers for this cluster (conftest.own_state_api).
    gcs_port = free_port()
    monkeypatch.setenv("RAY_ADDRESS", f"{get_node_ip_address()}:{gcs_port}")
    # driver, controller, Ray Data; free agent ports, as conftest.agent_ports gives the session clusters. The GCS
    # checks each node every second and calls it dead after 3 misses (Ray's default: 3 s and 5), so the lost node is
    # noticed in ~3 s rather than ~15 s: what is tested is the restart, not Ray's detection delay.
    # Its own dashboard port too: the state API the tests read workers from is served there, and Ray's default
    # (8265) is another test cluster's when two of these tests run at once.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "gcs_server_port": gcs_port,
            "dashboard_agent_listen_port": free_port(),
            "dashboard_port": free_port(),
            "ray_client_server_port": free_port(),
            "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
        },
    )
    try:
        assert cluster.address == os.environ["RAY_ADDRESS"], cluster.address
        # One CPU each, all taken by the training worker: nothing else lives (and is lost) with the node.
        trainers = [add_trainer(cluster) for _ in range(count)]
        cluster.wait_for_nodes()
        driver_env = {**os.environ, **TEST_RAY_ENV, **(env or {})}
        driver_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{driver_env.get('PATH', '')}"
        yield cluster, trainers, RayCluster(address=cluster.address, dashboard="", env=driver_env)
    finally:
        cluster.shutdown()


def add_trainer(cluster):
    """A trainer node of one CPU, with free agent ports (Ray's fixed defaults would collide between clusters)."""
    return cluster.add_node(
        num_cpus=1, resources={"trainer": 1}, dashboard_agent_listen_port=free_port(), metrics_export_port=free_port()
    )


def test_lost_node_restarts_the_group_on_the_spare_node(fixtures: Fixtures, reference_run: Run, tmp_path, monkeypatch):
    """Three trainer nodes for two workers (STRICT_SPREAD, one per node): removing a worker's node mid-run, as a
    lost pod would, kills its worker; with max_failures 1 the group restarts on the spare node, from the last
    checkpoint, and ends with the uninterrupted run's result."""
    with trainer_nodes(monkeypatch) as (cluster, trainers, test_cluster):
        out = tmp_path / "out"
        cfg = checkpointing_config(
            fixtures,
            out,
            ray__placement_strategy="STRICT_SPREAD",
            ray__max_failures=1,
            ray__resources_per_worker={"CPU": 1, "trainer": 1},
        )
        run, driver = start(test_cluster, cfg, out)
        try:
            wait_until(lambda: "checkpoint-000002" in run.registered(), "checkpoint 2", run)
            used = set(train_workers(cluster.address, driver).values())
            assert used < {n.node_id for n in trainers} and len(used) == 2, "one training worker per trainer node"
            lost = next(n for n in trainers if n.node_id in used)
            cluster.remove_node(lost, allow_graceful=False)
            text = finish(run, driver)
        finally:
            if driver.proc.poll() is None:
                driver.kill()

    resumed = resumes(text)
    assert len(resumed) == 1 and resumed[0] >= 2, text[-6000:]
    assert_same_training(run, reference_run)


# Ray Train's drain watcher on (the test clusters turn it off), polling every half second instead of 5 s.
PREEMPTION_WATCHED = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"}
NOTICE = re.compile(
    r"preemption notice at step (\d+): node\(s\) (\S+) \(ranks \[(\d+)\]\) draining, deadline in (\d+) s; "
    r"checkpoint-(\d+) holds the run"
)
NO_DEADLINE = re.compile(
    r"preemption notice at step (\d+): node\(s\) \S+ \(ranks \[\d+\]\) draining, no deadline given"
)
RANK0_PID = re.compile(r"pid=(\d+)\) world_rank=0,")  # Ray Train's controller, as it starts a worker group
DEADLINE_S = 15  # the drain's notice: the workers are stopped this long after it (a loaded CI machine included)


def test_a_drained_node_costs_a_checkpoint_not_the_steps_since_the_last_one(fixtures: Fixtures, tmp_path, monkeypatch):
    """A spot reclaim on a cluster of four trainer nodes for two workers. A drain of a node the run does not use
    changes nothing. Then rank 0's node is drained (Ray's drain API, a preemption reason and a deadline) mid-run, in
    a run that saves no periodic checkpoint: the workers see the notice, save a checkpoint at once and train on; at
    the deadline Ray stops them and restarts the group without the drained nodes (the last spare takes rank 0's
    place) from that checkpoint, on its preemption budget (`ray.max_failures: 0` would end the run on a failure).
    That the continued run trains exactly as an uninterrupted one: the gloo-rank test of the same notice
    (test_local_trainer.py); here the run is long, so it is still training at the deadline on any machine. Once it
    has resumed, a node of the new group is drained without a deadline: a checkpoint at once again, the log saying
    no deadline was given; the run is stopped there."""
    out = tmp_path / "out"
    cfg = checkpointing_config(
        fixtures,
        out,
        ray__placement_strategy="STRICT_SPREAD",
        ray__max_failures=0,
        ray__resources_per_worker={"CPU": 1, "trainer": 1},
        train__max_steps=1000,
        train__save_steps=10_000,
    )
    with trainer_nodes(monkeypatch, 4, PREEMPTION_WATCHED) as (cluster, trainers, test_cluster):
        run, driver = start(test_cluster, cfg, out)
        try:
            wait_until(lambda: len(run.metrics()) >= 1, "step 1", run)
            # rank 0's node: the worker that writes the adapter, metrics.jsonl and the job log's progress lines
            rank0 = int(wait_until(lambda: RANK0_PID.search(run.text()), "rank 0's pid", run)[1])
            used = train_workers(cluster.address, driver)
            drained = next(n for n in trainers if n.node_id == used[rank0])
            # First a node the run does not use: no notice, no checkpoint, for the next two steps at least.
            unused = next(n for n in trainers if n.node_id not in used.values())
            drain_node(cluster.address, unused.node_id, 600)
            steps = len(run.metrics())
            wait_until(lambda: len(run.metrics()) >= steps + 2, "two more steps", run)
            assert "preemption notice" not in run.text() and not run.checkpoint_dirs(), run.text()[-3000:]
            drain_node(cluster.address, drained.node_id, DEADLINE_S)
            notice = wait_until(lambda: NOTICE.search(run.text()), "the preemption notice", run)
            wait_until(lambda: resumes(run.text()), "the restart", run)
            text = run.text()
            assert "PreemptionError" in text and "max allowed: 0" not in text, text[-6000:]
            # Then a drain that gives no deadline, of a node of the restarted group: a checkpoint at once all the
            # same, and the log says so (Ray would stop the group after its own default of 120 s).
            survivor = next(n for n in trainers if n.node_id in train_workers(cluster.address, driver).values())
            drain_node(cluster.address, survivor.node_id, None)
            second = wait_until(lambda: NO_DEADLINE.search(run.text()), "the notice without a deadline", run)
            wait_until(lambda: f"checkpoint-{int(second[1]):06d}" in run.registered(), "its checkpoint", run)
        finally:
            driver.kill()

    step, node, ranks, deadline, saved = notice.groups()
    assert drained.node_id.startswith(node) and ranks == "0" and int(deadline) <= DEADLINE_S, notice[0]
    assert int(saved) == int(step) and f"checkpoint-{int(step):06d}" in run.registered(), text[-6000:]
    assert resumes(text) == [int(step)], text[-6000:]


GROUP = re.compile(r"elastic run: (\d+) workers")  # rank 0's line each time a group starts
ELASTIC_STEPS = 160  # long enough, at the tiny model's step, to still be training when the last node joins
SECOND_DEADLINE_S = 5


def test_an_elastic_run_goes_on_with_the_nodes_left_and_grows_back(fixtures: Fixtures, tmp_path, monkeypatch):
    """`ray.num_workers: [2, 3]` on three trainer nodes. Rank 0's node is drained (a spot reclaim: a preemption
    reason and a deadline): the workers save a checkpoint at once and train on; at the deadline the node is
    reclaimed (removed). While Ray restarts the group, a second node is drained and reclaimed: one node is left,
    fewer than ray.num_workers' minimum, and the run waits. A node joins: the group restarts on two, from the
    latest checkpoint, each worker accumulating 3 micro-batches a step instead of 2. Another joins: within
    ray.resize_check_s Ray grows the group back to three, from the latest checkpoint. The run ends with the losses
    and the adapter of an uninterrupted three-worker run of the same job (on gloo ranks), up to the order of the
    workers' sums; and the run's record ledger is the uninterrupted run's: every step trained on the same records,
    each record once an epoch."""
    elastic = {
        "ray__num_workers": [2, 3],
        "ray__resize_check_s": 5,
        "ray__max_failures": 0,
        "ray__placement_strategy": "STRICT_SPREAD",
        "ray__resources_per_worker": {"CPU": 1, "trainer": 1},
        "train__max_steps": ELASTIC_STEPS,
        "train__save_steps": 8,
        "train__eval_steps": 16,
        "train__per_device_eval_batch_size": 1,
        "train__learning_rate": 3e-3,
        "data__shuffle_buffer_size": 0,
        "train__record_ledger": True,
        "data__packing": False,  # each sequence a record, counted in the ledger
        "data__max_length": 64,  # at 32 tokens a few of the fixture's records share their truncated ids
    }
    reference = train_locally(checkpointing_config(fixtures, tmp_path / "reference", **elastic), 3)
    out = tmp_path / "out"
    cfg = checkpointing_config(fixtures, out, **elastic)
    # Ray sizes a restart by the nodes alive, the drained one included until it is gone: a group of three asked for
    # then cannot be placed, and is given up after 20 s (Ray's default 60) for the size the cluster has.
    env = {**PREEMPTION_WATCHED, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20"}
    with trainer_nodes(monkeypatch, 3, env) as (cluster, trainers, test_cluster):
        run, driver = start(test_cluster, cfg, out)
        try:
            wait_until(lambda: len(run.metrics()) >= 1, "step 1", run)
            rank0 = int(wait_until(lambda: RANK0_PID.search(run.text()), "rank 0's pid", run)[1])
            drained = next(n for n in trainers if n.node_id == train_workers(cluster.address, driver)[rank0])
            drain_node(cluster.address, drained.node_id, DEADLINE_S)
            notice = wait_until(lambda: NOTICE.search(run.text()), "the preemption notice", run)
            # At the deadline Ray stops the group; then the node is reclaimed. (Gone before Ray stopped the group,
            # its workers' end would reach the others as a failed collective first: a failure, not a preemption.)
            wait_until(lambda: "PreemptionError" in run.text(), "the deadline", run)
            cluster.remove_node(drained, allow_graceful=False)
            # A second reclaim while Ray restarts the group: one of the two nodes left, drained with a short
            # deadline, removed after it. One node cannot hold min_workers 2: the run waits for another.
            second = next(n for n in trainers if n is not drained)
            drain_node(cluster.address, second.node_id, SECOND_DEADLINE_S)
            time.sleep(SECOND_DEADLINE_S + 3)
            cluster.remove_node(second, allow_graceful=False)
            started = len(GROUP.findall(run.text()))
            add_trainer(cluster)  # a node joins: two again
            wait_until(lambda: GROUP.findall(run.text())[started:] == ["2"], "a group of two", run)
            add_trainer(cluster)  # and another: three
            wait_until(lambda: GROUP.findall(run.text())[-1] == "3", "the group of three again", run)
            text = finish(run, driver)
        finally:
            if driver.proc.poll() is None:
                driver.kill()

    sizes = GROUP.findall(text)  # a group of two may have started on the second node before its drain
    assert sizes[0] == sizes[-1] == "3" and set(sizes[1:-1]) == {"2"} and len(sizes) in (3, 4), text[-6000:]
    step, saved = int(notice[1]), int(notice[5])  # a checkpoint at once (a periodic one after it may be newer)
    assert saved == step and resumes(text)[0] >= step, text[-6000:]
    assert "max allowed: 0" not in text  # neither the reclaim nor the growth counted as a failure
    assert [r["step"] for r in run.metrics()] == list(range(1, ELASTIC_STEPS + 1))
    for got, want in zip(run.metrics(), reference.metrics(), strict=True):
        for key in ("loss", "eval_loss", "learning_rate"):
            if key in want:
                assert abs(got[key] - want[key]) < REORDERED, f"step {got['step']} {key}: {got[key]} != {want[key]}"
        # The gradient's norm (a sum of squares over every parameter) is the touchiest figure: it moved by up to
        # 1.2e-4 of itself in a step here while the losses stayed within 5e-6.
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3), got["step"]
    assert_same_adapter(out / "final", reference.out / "final", REORDERED)
    # Every step's sequences, counted: each record once an epoch, in the uninterrupted run's order.
    ledger = ledger_rows(run.run_dir)
    assert ledger == ledger_rows(reference.run_dir)
    t = cfg["train"]
    assert_each_record_once(
        ledger, ELASTIC_STEPS, t["per_device_train_batch_size"] * t["gradient_accumulation_steps"] * 3
    )


def drain_node(address: str, node_id: str, deadline_s: int | None) -> None:
    """Ray Core's drain of a node for a preemption, with a deadline (or none), as a spot reclaim's handler would
    ask it."""
    drain = [
        str(RAY_BIN),
        "drain-node",
        "--address",
        address,
        "--node-id",
        node_id,
        "--reason",
        "DRAIN_NODE_REASON_PREEMPTION",
        "--reason-message",
        "spot reclaim",
    ]
    if deadline_s is not None:
        drain += ["--deadline-remaining-seconds", str(deadline_s)]
    subprocess.run(drain, check=True, capture_output=True, timeout=120)


def copy_of(reference: Run, out: Path, **train_overrides) -> tuple[dict, Run]:
    """The reference run's output dir copied (run dir, final, best), its config pointed at the copy."""
    shutil.copytree(reference.out, out)
    cfg = yaml.safe_load((reference.out / "config.yaml").read_text())
    cfg["train"].update(output_dir=str(out), **train_overrides)
    return cfg, Run(out, out / "rerun.log")


def test_rerun_without_rays_registry_deletes_nothing_and_refuses(ray_cluster: RayCluster, reference_run: Run, tmp_path):
    """Ray's run state gone before a rerun (renamed by an upgrade, lost): not a fresh start that wipes the run's
    checkpoints, but exit 2 naming the newest one to continue from. Stops before any worker starts."""
    cfg, copy = copy_of(reference_run, tmp_path / "out")
    (copy.run_dir / "checkpoint_manager_snapshot.json").unlink()
    write_yaml(copy.out / "config.yaml", cfg)
    before = {str(p.relative_to(copy.out)): p.stat().st_mtime_ns for p in copy.out.rglob("*") if p.is_file()}
    job = subprocess.run(
        [sys.executable, "jobs/mistral4.py", "--config", str(copy.out / "config.yaml")],
        cwd=REPO,
        env={**ray_cluster.env, "RAY_ADDRESS": ray_cluster.address},
        capture_output=True,
        text=True,
        timeout=600,
    )
    newest = copy.run_dir / f"checkpoint-{STEPS:06d}"
    assert job.returncode == 2, job.stdout[-3000:] + job.stderr[-3000:]
    assert "no Ray registry (checkpoint_manager_snapshot.json)" in job.stderr, job.stderr[-3000:]
    assert f"set train.resume_from_checkpoint: {newest} to continue" in job.stderr
    after = {str(p.relative_to(copy.out)): p.stat().st_mtime_ns for p in copy.out.rglob("*") if p.is_file()}
    assert after == before, "a file of the run was changed or deleted"


def test_a_changed_config_over_a_run_is_refused_before_anything_starts(reference_run: Run, tmp_path, capsys):
    """The finished reference run's directory under a config that changed. Another learning rate would continue the
    run from its last checkpoint with the new schedule: `rayft validate` refuses it (exit 2, one line naming the
    change and both ways on) unless `train.resume: continue` asks for it. Another LoRA rank cannot load that
    checkpoint at all: refused either way. The same config validates, with a warning that the run has finished and
    how to train further (continuing as before: the other tests)."""
    cfg, copy = copy_of(reference_run, tmp_path / "out")
    config = str(write_yaml(copy.out / "config.yaml", cfg))
    same = run_cli(capsys, "validate", "--config", config)  # the run has finished: said, with both ways on
    assert same.rc == 0, same.err
    assert f"holds a run that finished at step {STEPS} of {STEPS}: this config trains nothing more" in same.err
    assert "raise train.max_steps (or num_train_epochs) with train.resume: continue" in same.err, same.err
    longer = ("--override", f"train.max_steps={STEPS + 2}", "--override", "train.resume=continue")
    extended = run_cli(capsys, "validate", "--config", config, *longer)
    assert extended.rc == 0 and "finished at" not in extended.err, extended.err
    lr, rank = cfg["train"]["learning_rate"], cfg["lora"]["r"]
    faster = ("--override", f"train.learning_rate={lr * 2}")
    refused = run_cli(capsys, "validate", "--config", config, *faster)
    assert refused.rc == 2 and refused.err.strip().count("\n") == 0, refused.err
    assert f"train.learning_rate {lr!r} → {lr * 2!r}" in refused.err and "train.resume: continue" in refused.err
    assert run_cli(capsys, "validate", "--config", config, *faster, "--override", "train.resume=continue").rc == 0
    other_shape = run_cli(
        capsys,
        "validate",
        "--config",
        config,
        "--override",
        f"lora.r={rank * 2}",
        "--override",
        "train.resume=continue",
    )
    assert other_shape.rc == 2 and f"lora.r {rank} → {rank * 2}" in other_shape.err, other_shape.err
    assert "cannot be loaded" in other_shape.err


def test_rerunning_a_finished_run_says_so_and_ends_without_training(
    ray_cluster: RayCluster, reference_run: Run, tmp_path
):
    """The same job run again after it finished: one line saying so (with the ways to train further), exit 0, no
    worker started, and the run's files as they were: the final adapter, the history, the checkpoints."""
    cfg, copy = copy_of(reference_run, tmp_path / "out")

    def files() -> dict[str, bytes]:  # the run's files, not the config `start` writes nor the driver's log
        found = {str(p.relative_to(copy.out)): p.read_bytes() for p in copy.out.rglob("*") if p.is_file()}
        return {k: v for k, v in found.items() if k not in ("config.yaml", "rerun.log")}

    before = files()
    run, driver = start(ray_cluster, cfg, copy.out, log="rerun.log")
    text = finish(run, driver)
    assert f"holds a run that finished at step {STEPS} of {STEPS}: this config trains nothing more" in text, text
    assert "RayTrainWorker" not in text and "resumed from" not in text, text[-6000:]
    assert files() == before  # nothing the run had changed, nothing added
    # Its final adapter lost: exit 0 printed a path that did not exist; now the line says what is missing and how to
    # make it again, and still nothing is trained or changed.
    shutil.rmtree(copy.out / "final")
    before = files()
    run, driver = start(ray_cluster, cfg, copy.out, log="rerun.log")
    assert driver.wait() == 2
    last = copy.run_dir / f"checkpoint-{STEPS:06d}" / "adapter"
    refusal = f"finished at step {STEPS} of {STEPS}, but the final adapter {copy.out / 'final'}: not a PEFT adapter"
    assert refusal in run.text() and f"copy {last} there" in run.text(), run.text()[-3000:]
    assert "RayTrainWorker" not in run.text() and files() == before


def test_rerun_with_a_torn_metrics_line_resumes_and_tidies_only_its_own(
    ray_cluster: RayCluster, reference_run: Run, tmp_path
):
    """The finished reference run, trained 2 steps further, after a kill tore the last line of its metrics.jsonl
    and with two checkpoint dirs Ray never registered: one this run wrote (removed on resume), one nobody can
    prove was its (kept). The history keeps every complete row, takes the torn one back from what the resumed
    checkpoint was reported with, and goes on."""
    cfg, copy = copy_of(reference_run, tmp_path / "out", max_steps=STEPS + 2, resume="continue")
    metrics = copy.run_dir / "metrics.jsonl"
    text = metrics.read_bytes()
    metrics.write_bytes(text[: text.rstrip(b"\n").rfind(b"\n") + 40])  # the step-6 row cut 40 bytes in
    run_id = json.loads((copy.run_dir / "rayft_run.json").read_text())["run_id"]
    ours, unknown = copy.run_dir / "checkpoint-000010", copy.run_dir / "checkpoint-000011"
    shutil.copytree(copy.run_dir / f"checkpoint-{STEPS:06d}", ours)
    state = json.loads((ours / "trainer_state.json").read_text())
    assert state["run_id"] == run_id  # what the reference run wrote into its checkpoints
    shutil.copytree(copy.run_dir / f"checkpoint-{STEPS:06d}" / "state", unknown / "state")
    run, driver = start(ray_cluster, cfg, copy.out, log="rerun.log")
    text = finish(run, driver)

    assert resumes(text) == [STEPS], text[-6000:]
    assert f"goes on with changed settings: train.max_steps {STEPS} → {STEPS + 2}" in text, text[-6000:]
    assert f"removed {copy.run_dir}/checkpoint-000010" in text and f"kept {copy.run_dir}/checkpoint-000011" in text
    assert not ours.exists() and (unknown / "state" / ".metadata").is_file()
    want = reference_run.metrics()[: STEPS - 1]
    got = run.metrics()
    assert [r["step"] for r in got] == list(range(1, STEPS + 3))
    assert got[: STEPS - 1] == want, "the complete rows of the history changed"
    torn = reference_run.metrics()[STEPS - 1]
    assert {k: got[STEPS - 1][k] for k in ("loss", "eval_loss", "grad_norm")} == {
        k: torn[k] for k in ("loss", "eval_loss", "grad_norm")
    }, got[STEPS - 1]
    assert f"checkpoint-{STEPS + 2:06d}" in run.registered()  # the latest: Ray keeps it whatever its score
