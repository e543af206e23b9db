"""The job entrypoint (`python jobs/mistral4.py`, what `ray job submit` runs) refuses a bad model the way
`validate` does, without starting Ray; workers the cluster can never place are refused after the stated wait
(Ctrl-C ends it at once), never retried forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, tiny_config, write_yaml
from fixtures.preflight import (
    config_file,
    kv_heads,
)


def test_the_job_refuses_a_model_config_that_does_not_match_its_weights_without_starting_ray(
    fixtures, mistral4_hub, base, tmp_path
):
    model = kv_heads(fixtures, mistral4_hub, tmp_path)
    config = config_file(tmp_path, base, model={"model_name_or_path": str(model)})
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    start = time.monotonic()
    job = subprocess.run(
        [sys.executable, "jobs/mistral4.py", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    output = job.stdout + job.stderr
    assert job.returncode == 2, output[-3000:]
    assert "k_proj.weight' has shape [32, 64] in the checkpoint" in job.stderr and "Traceback" not in output
    assert "starting a local one" not in output and "Started a local Ray instance" not in output
    print(f"job refused in {time.monotonic() - start:.1f}s")


def test_workers_the_cluster_can_never_place_are_refused_within_the_deadline(ray_cluster, fixtures, tmp_path):
    """The session cluster: 2 nodes × 4 CPUs, no autoscaler. 12 one-CPU workers packed can never be placed: the job
    waits its stated deadline for nodes to join, then exits 2 naming what it asked for and what there is; Ctrl-C
    stops the wait at once."""
    raw = tiny_config(fixtures, tmp_path / "out")
    raw["ray"].update(address=ray_cluster.address, num_workers=12, placement_strategy="PACK", placement_timeout_s=5)
    config = write_yaml(tmp_path / "config.yaml", raw)
    start = time.monotonic()
    job = subprocess.run(
        [sys.executable, "jobs/mistral4.py", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=ray_cluster.env,
    )
    elapsed = time.monotonic() - start
    assert job.returncode == 2, job.stderr[-3000:]
    assert "waiting up to 5s (ray.placement_timeout_s)" in job.stderr
    assert "cannot place 12 workers × {CPU 1} = {CPU 12} (PACK): it offers CPU 8, GPU 0 in total on 2 node(s)" in (
        job.stderr
    )
    assert "Traceback" not in job.stderr
    assert elapsed < 5 + 90, f"{elapsed:.0f}s: start-up and preflight take well under a minute here"

    raw["ray"]["placement_timeout_s"] = 600
    write_yaml(config, raw)
    waiting = subprocess.Popen(
        [sys.executable, "jobs/mistral4.py", "--config", str(config)],
        cwd=REPO,
        env=ray_cluster.env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = []
        for line in waiting.stderr:
            seen.append(line)
            if "waiting up to 600s" in line:
                break
        else:
            pytest.fail("the job never said it was waiting:\n" + "".join(seen[-30:]))
        interrupted = time.monotonic()
        waiting.send_signal(signal.SIGINT)
        rest = waiting.communicate(timeout=60)[1]
        assert waiting.returncode == 130, "".join(seen[-20:]) + rest
        assert "rayft: interrupted" in rest
        assert time.monotonic() - interrupted < 30
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()


def test_the_job_refuses_a_split_too_small_for_its_workers_without_starting_ray(fixtures, tmp_path):
    """A split small enough to be tokenized on the driver is counted there, before Ray: one that cannot give every
    worker a row is refused in one line, as the count on the cluster would, without starting a local Ray."""
    data = tmp_path / "tiny-data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "one short record"}\n')
    raw = tiny_config(fixtures, tmp_path / "out", eval_strategy="no")
    raw["data"] = {"dataset_name_or_path": str(data), "val_split": None, "max_length": 64, "packing": True}
    config = write_yaml(tmp_path / "config.yaml", raw)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    job = subprocess.run(
        [sys.executable, "jobs/mistral4.py", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    output = job.stdout + job.stderr
    assert job.returncode == 2, output[-3000:]
    refusals = [line for line in job.stderr.splitlines() if line.startswith("rayft: config error:")]
    assert len(refusals) == 1 and "data: 1 training records cannot feed ray.num_workers=2 workers" in refusals[0]
    assert "starting a local one" not in output and "Started a local Ray instance" not in output
    assert "Traceback" not in output


def test_eval_refuses_a_split_too_small_for_its_workers_without_starting_ray(fixtures, tmp_path):
    """`rayft eval` on a split small enough to be tokenized on the driver counts it there, before Ray: one record for
    two workers is refused in one line, without starting a local Ray."""
    data = tmp_path / "tiny-data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join('{"text": "a record to train on"}\n' for _ in range(8)))
    (data / "validation.jsonl").write_text('{"text": "one short record"}\n')
    raw = tiny_config(fixtures, tmp_path / "out")
    raw["data"] = {"dataset_name_or_path": str(data), "max_length": 64, "packing": True}
    config = write_yaml(tmp_path / "config.yaml", raw)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [sys.executable, "-m", "rayft.cli", "eval", "--config", str(config)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    refusals = [line for line in done.stderr.splitlines() if line.startswith("rayft: config error:")]
    assert len(refusals) == 1 and "has 1 usable rows, fewer than ray.num_workers=2" in refusals[0], refusals
    assert "starting a local one" not in output and "Started a local Ray instance" not in output
    assert "Traceback" not in output
