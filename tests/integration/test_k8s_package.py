"""The KubeRay CRDs travel inside rayft: an installed wheel renders and validates with no ../shared beside it."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from rayft.deploy.crd import CRD_DIR_ENV, PACKAGED_CRD_DIR, ManifestError, crd_dir, schemas

REPO = Path(__file__).resolve().parents[2]


def test_default_crds_are_the_packaged_v1_7_0_copies(monkeypatch):
    monkeypatch.delenv(CRD_DIR_ENV, raising=False)
    assert crd_dir() == PACKAGED_CRD_DIR and PACKAGED_CRD_DIR.parent == REPO / "rayft" / "deploy"
    assert {("ray.io/v1", "RayJob"), ("ray.io/v1", "RayCluster")} <= set(schemas(crd_dir()))
    shared = REPO.parent / "shared" / "kuberay" / "crds"
    if shared.is_dir():  # the packaged copies are the CRDs the project was given, byte for byte
        for packaged in PACKAGED_CRD_DIR.glob("*.yaml"):
            assert packaged.read_bytes() == (shared / packaged.name).read_bytes(), packaged.name


def test_a_missing_schema_is_an_error_never_a_skip(monkeypatch, tmp_path, capsys):
    from rayft import cli

    monkeypatch.setenv(CRD_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(ManifestError, match="nowhere"):
        crd_dir()
    monkeypatch.chdir(REPO)
    assert cli.main(["k8s", "render", "--config", "jobs/mistral4-3xh200.yaml"]) == cli.EXIT_CONFIG
    captured = capsys.readouterr()
    assert "no KubeRay CRDs" in captured.err and captured.out == ""  # nothing written unchecked


@pytest.mark.timeout(600)
def test_render_and_validate_from_a_built_wheel_with_nothing_beside_it(tmp_path):
    """The acceptance: `pip wheel --no-deps`, unpack it alone, run `rayft k8s render` + `validate` from there
    with the working directory elsewhere and no CRD directory named."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(REPO)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("rayft-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
        assert {"rayft/deploy/crds/ray.io_rayjobs.yaml", "rayft/deploy/crds/ray.io_rayclusters.yaml"} <= set(
            z.namelist()
        )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = elsewhere / "job.yaml"
    config.write_text((REPO / "jobs" / "mistral4-3xh200.yaml").read_text())
    env = {k: v for k, v in os.environ.items() if k != CRD_DIR_ENV} | {"PYTHONPATH": str(site)}
    code = "import sys, rayft.cli; sys.argv[0] = 'rayft'; sys.exit(rayft.cli.main())"
    out = elsewhere / "out"

    def rayft(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code, *args], cwd=elsewhere, env=env, capture_output=True,
                              text=True)  # fmt: skip

    probe = subprocess.run([sys.executable, "-c", "import rayft.deploy.crd as c; print(c.crd_dir())"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True)  # fmt: skip
    assert Path(probe.stdout.strip()).is_relative_to(site), probe.stdout
    done = rayft("k8s", "render", "--config", str(config), "--config-in-cluster", "/data/job.yaml", "--out", str(out))
    assert done.returncode == 0, done.stderr
    files = sorted(out.glob("*.yaml"))
    assert [p.name for p in files] == ["raycluster.yaml", "rayjob.yaml"]
    checked = rayft("k8s", "validate", *map(str, files))
    assert checked.returncode == 0 and "valid" in checked.stdout, checked.stderr
    job = yaml.safe_load((out / "rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and "--config /data/job.yaml" in job["spec"]["entrypoint"]
