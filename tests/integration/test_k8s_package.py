"""The KubeRay CRDs travel inside rayft: an installed wheel renders and validates with no ../shared beside it."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from rayft.deploy.crd import CRD_DIR_ENV, PACKAGED_CRD_DIR, ManifestError, crd_dir, schemas
from rayft.kube.kuberay import RELEASES, Operator

REPO = Path(__file__).resolve().parents[2]
WATCHER_FILES = ["start-watch-account.yaml", "start-watch-binding.yaml", "start-watch-role.yaml", "start-watch.yaml"]


def test_default_crds_are_the_packaged_copies_of_the_chosen_release(monkeypatch):
    monkeypatch.delenv(CRD_DIR_ENV, raising=False)
    assert crd_dir() == PACKAGED_CRD_DIR / "v1.4.2" and PACKAGED_CRD_DIR.parent == REPO / "rayft" / "deploy"
    for minor, release in RELEASES.items():
        assert crd_dir(Operator(minor)) == PACKAGED_CRD_DIR / f"v{release}"
        assert {("ray.io/v1", "RayJob"), ("ray.io/v1", "RayCluster")} <= set(schemas(crd_dir(Operator(minor))))
    shared = REPO.parent / "shared" / "kuberay" / "crds"
    if shared.is_dir():  # the packaged v1.7.0 copies are the CRDs the project was given, byte for byte
        packaged = sorted((PACKAGED_CRD_DIR / "v1.7.0").glob("*.yaml.gz"))
        assert [p.name.removesuffix(".gz") for p in packaged] == sorted(p.name for p in shared.glob("*.yaml"))
        for path in packaged:
            assert gzip.decompress(path.read_bytes()) == (shared / path.name.removesuffix(".gz")).read_bytes()


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
        crds = {n for n in z.namelist() if n.startswith("rayft/deploy/crds/")}
        assert crds == {
            f"rayft/deploy/crds/v{r}/ray.io_{k}.yaml.gz" for r in RELEASES.values() for k in ("rayjobs", "rayclusters")
        }
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = elsewhere / "job.yaml"
    config.write_text((REPO / "jobs" / "mistral4-3xh200.yaml").read_text())
    env = {k: v for k, v in os.environ.items() if k != CRD_DIR_ENV} | {"PYTHONPATH": str(site)}
    code = "import sys, rayft.cli; sys.argv[0] = 'rayft'; sys.exit(rayft.cli.main())"
    out = elsewhere / "out"

    def rayft(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code, *args], cwd=elsewhere, env=env, capture_output=True, text=True
        )

    probe = subprocess.run(
        [sys.executable, "-c", "import rayft.deploy.crd as c; print(c.crd_dir())"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(probe.stdout.strip()).is_relative_to(site), probe.stdout
    for version in [None, *(".".join(map(str, minor)) for minor in RELEASES)]:
        named = ["--kuberay-version", version] if version else []
        done = rayft(
            "k8s",
            "render",
            "--config",
            str(config),
            "--config-in-cluster",
            "/data/job.yaml",
            *named,
            "--out",
            str(out / str(version)),
        )
        assert done.returncode == 0, done.stderr
        files = sorted((out / str(version)).glob("*.yaml"))
        watcher = [] if version in ("1.6", "1.7") else WATCHER_FILES  # no preRunningDeadlineSeconds: a watcher
        assert [p.name for p in files] == sorted(["head-budget.yaml", "raycluster.yaml", "rayjob.yaml", *watcher])
        checked = rayft("k8s", "validate", *map(str, files), *named)
        assert checked.returncode == 0 and "valid" in checked.stdout, (version, checked.stderr)
        job = yaml.safe_load((out / str(version) / "rayjob.yaml").read_text())
        assert job["kind"] == "RayJob" and "--config /data/job.yaml" in job["spec"]["entrypoint"]
    # The start watcher's program runs from the installed package alone, as its pod runs it in the image.
    module = [sys.executable, "-m", "rayft.deploy.start_watch", "--help"]
    watcher_help = subprocess.run(module, cwd=elsewhere, env=env, capture_output=True, text=True)
    assert watcher_help.returncode == 0 and "--deadline-s" in watcher_help.stdout, watcher_help.stderr
