"""rayft on a Ray cluster with token authentication (`RAY_AUTH_MODE=token`, as the rendered clusters have it; every
test cluster has it on, fixtures/cluster.py): `ray job submit` with the token runs the job to its final adapter;
without it, or with another, Ray refuses the submission; and `rayft train` pointed at the cluster without the token
says in one line what is missing. The recovery, drain, elastic and metrics tests run on such clusters too."""

from __future__ import annotations

import secrets
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, Fixtures, RayCluster, submit_job, tiny_config, write_yaml
from fixtures.cluster import dashboard_get

pytestmark = pytest.mark.ray
# Credentials a job's environment may hold; their values must never be written or logged.
PLANTED = ("HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY")


def _without_auth(env: dict[str, str], home: Path) -> dict[str, str]:
    """`env` with none of Ray's token settings, and a home without ~/.ray/auth_token: a stranger's client."""
    return {**{k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}, "HOME": str(home)}


def test_ray_refuses_a_submission_without_the_token_or_with_another(ray_cluster: RayCluster, tmp_path):
    dashboard_get(f"{ray_cluster.dashboard}/api/version", timeout=30)  # answers with the token
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{ray_cluster.dashboard}/api/version", timeout=30)
    assert refused.value.code == 401, refused.value
    stranger = _without_auth(ray_cluster.env, tmp_path)
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
                ray_cluster.dashboard,
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
    ray_cluster: RayCluster, fixtures: Fixtures, tmp_path
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
    job = submit_job(ray_cluster, "--config", str(config), timeout=900, env=planted)
    logs = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in logs, logs[-6000:]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (out / "final").iterdir()}
    written = [p for p in out.rglob("*") if p.is_file()]
    assert {"rayft_run.json", "metrics.jsonl"} <= {p.name for p in written}, sorted(p.name for p in written)
    for value in [*planted.values(), ray_cluster.env["RAY_AUTH_TOKEN"]]:
        assert value.encode() not in logs.encode(), value
        assert not [p for p in written if value.encode() in p.read_bytes()], value


def test_rayft_says_in_one_line_what_is_missing(ray_cluster: RayCluster, fixtures: Fixtures, tmp_path):
    cfg = tiny_config(fixtures, tmp_path / "out", max_steps=2)
    cfg["ray"]["address"] = ray_cluster.address
    config = write_yaml(tmp_path / "config.yaml", cfg)
    stranger = _without_auth(ray_cluster.env, tmp_path)
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
        assert f"ray.address: the Ray cluster at {ray_cluster.address} refused rayft: " in errors[0], errors
        assert says in errors[0] and "RAY_AUTH_TOKEN" in errors[0], errors
        assert "Traceback" not in done.stderr, done.stderr[-4000:]
