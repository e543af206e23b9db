"""rayft on a Ray cluster with token authentication (`RAY_AUTH_MODE=token`, as the rendered clusters have it): `ray
job submit` with the token runs the job to its final adapter; without it, or with another, Ray refuses the
submission; and `rayft train` pointed at the cluster without the token says in one line what is missing."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, Fixtures, RayCluster, submit_job, tiny_config, write_yaml
from fixtures.cluster import TEST_RAY_ENV, _start_head, stop_group

pytestmark = pytest.mark.ray
# Credentials a job's environment may hold; their values must never be written or logged.
PLANTED = ("HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY")


def _without_auth(env: dict[str, str], home: Path) -> dict[str, str]:
    """`env` with none of Ray's token settings, and a home without ~/.ray/auth_token: a stranger's client."""
    return {**{k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}, "HOME": str(home)}


@pytest.fixture(scope="module")
def auth_cluster(tmp_path_factory) -> Iterator[RayCluster]:
    """A one-node Ray (`ray start --head --block`, stopped by its process group) whose every process holds a token
    that this test made; its session directory and logs in a directory of its own."""
    root = tmp_path_factory.mktemp("auth-cluster")
    token = f"rayft-test-{secrets.token_hex(16)}"
    temp_dir = Path("/tmp") / f"rayft-auth-{os.getpid()}"  # short: Ray's socket paths have a length limit
    env = {**os.environ, **TEST_RAY_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "HOME": str(root)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    head = _start_head(temp_dir, env, ["--block", "--num-cpus", "4", "--disable-usage-stats"], root / "head.log")
    try:
        deadline = time.monotonic() + 300
        while True:  # up once it answers; without the token, with a refusal
            try:
                urllib.request.urlopen(f"{head.dashboard}/api/version", timeout=2)
                pytest.fail("the head's job API answered a request without the token")
            except urllib.error.HTTPError as e:
                assert e.code == 401, e
                break
            except OSError:
                if head.proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the token-auth head did not come up:\n{(root / 'head.log').read_text()[-3000:]}")
                time.sleep(1)
        yield RayCluster(head.address, head.dashboard, env, temp_dir=temp_dir)
    finally:
        stop_group(head.proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_refuses_a_submission_without_the_token_or_with_another(auth_cluster: RayCluster, tmp_path):
    stranger = _without_auth(auth_cluster.env, tmp_path)
    for env, says in (
        (stranger, "Unauthorized: Missing authentication token"),
        ({**stranger, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "rayft-not-the-token"}, "Forbidden: Invalid"),
    ):
        job = subprocess.run(
            [
                str(Path(sys.executable).parent / "ray"),
                "job",
                "submit",
                "--address",
                auth_cluster.dashboard,
                "--",
                "python",
                "-c",
                "print('ran')",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        output = job.stdout + job.stderr
        assert job.returncode != 0 and says in output and "ran\n" not in output, output[-3000:]


def test_the_job_runs_with_the_token_to_its_final_adapter_and_writes_no_secret(
    auth_cluster: RayCluster, fixtures: Fixtures, tmp_path
):
    """Two steps, a checkpoint each, with credentials planted in the job's environment (as a pod's `secret_env`
    puts them there): neither they nor the cluster's own token appear in the job's output or in any file the run
    writes (output_dir, which holds the run's storage: checkpoints, rayft_run.json, metrics.jsonl)."""
    out = tmp_path / "out"
    cfg = tiny_config(
        fixtures,
        out,
        max_steps=2,
        logging_steps=1,
        eval_strategy="no",
        save_steps=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
    )
    config = write_yaml(tmp_path / "config.yaml", cfg)
    planted = {name: f"rayft-planted-{name.lower()}-{secrets.token_hex(8)}" for name in PLANTED}
    job = submit_job(auth_cluster, "--config", str(config), timeout=900, env=planted)
    logs = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in logs, logs[-6000:]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (out / "final").iterdir()}
    written = [p for p in out.rglob("*") if p.is_file()]
    assert {"rayft_run.json", "metrics.jsonl"} <= {p.name for p in written}, sorted(p.name for p in written)
    for value in [*planted.values(), auth_cluster.env["RAY_AUTH_TOKEN"]]:
        assert value.encode() not in logs.encode(), value
        assert not [p for p in written if value.encode() in p.read_bytes()], value


def test_rayft_says_in_one_line_what_is_missing(auth_cluster: RayCluster, fixtures: Fixtures, tmp_path):
    cfg = tiny_config(fixtures, tmp_path / "out", max_steps=2)
    cfg["ray"]["address"] = auth_cluster.address
    config = write_yaml(tmp_path / "config.yaml", cfg)
    stranger = _without_auth(auth_cluster.env, tmp_path)
    for env, says in (
        (stranger, "RAY_AUTH_MODE is not token here, so none was sent"),
        ({**stranger, "RAY_AUTH_MODE": "token"}, "this process has no token"),
        ({**stranger, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "rayft-not-the-token"}, "is not the cluster's"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "rayft.cli", "train", "--config", str(config)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
        )
        errors = [line for line in done.stderr.splitlines() if line.startswith("rayft: config error:")]
        assert done.returncode == 2 and len(errors) == 1, done.stderr[-4000:]
        assert f"ray.address: the Ray cluster at {auth_cluster.address} refused rayft: " in errors[0], errors
        assert says in errors[0] and "RAY_AUTH_TOKEN" in errors[0], errors
        assert "Traceback" not in done.stderr, done.stderr[-4000:]
