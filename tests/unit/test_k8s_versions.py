"""Each supported KubeRay release gets manifests that its own CRDs and RayJob validation accept, and the fields it
has: rendered for every release, checked against the CRDs KubeRay released with it (shipped byte for byte)."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import pytest
import yaml

from rayft import cli
from rayft.deploy.crd import PACKAGED_CRD_DIR, schemas, validate
from rayft.kube.kuberay import RELEASES, Operator

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "jobs").glob("*.yaml"))
VERSIONS = ["1.4", "1.5", "1.6", "1.7"]
# `git rev-parse v<release>:ray-operator/config/crd/bases/<file>` in KubeRay's repository: the git blob id of each
# CRD as KubeRay tagged it, which the packaged copy, unzipped, must hash to.
KUBERAY_BLOBS = {
    ("1.4.2", "ray.io_rayjobs.yaml"): "f3dc33c7ef47b5fab79d2a4a30117ae088fc9663",
    ("1.4.2", "ray.io_rayclusters.yaml"): "a8e1f1df8f180db18fcb69034835398f830b312a",
    ("1.5.2", "ray.io_rayjobs.yaml"): "1f4c84321683e1dad850c8244fd61101ca43c170",
    ("1.5.2", "ray.io_rayclusters.yaml"): "45f5406c4115ec36a2477421d2a475b8189f8701",
    ("1.6.2", "ray.io_rayjobs.yaml"): "3faf478c0ac3cec0d2cea389ac9182c5adb9c464",
    ("1.6.2", "ray.io_rayclusters.yaml"): "2f432d40d9cc90132d6107264260e966f503ceb7",
    ("1.7.0", "ray.io_rayjobs.yaml"): "c7d3f081af8cf08c256a8c33a0c3b6ea28b816a0",
    ("1.7.0", "ray.io_rayclusters.yaml"): "ff0be58ada3bd457605eff1f258c16df21e61e21",
}
# Platform settings whose fields sit where releases could differ: queueing (suspend, the deletion form), pods and
# authentication (authOptions or the containers' environment).
SETTINGS = {
    "defaults": [],
    "kueue": ["--queueing", "kueue", "--queue", "team-a"],
    "pods": [
        "--node-selector",
        "pool=h200",
        "--toleration",
        "spot:NoExecute",
        "--run-as-user",
        "1000",
        "--fs-group",
        "1000",
        "--priority-class",
        "train-high",
        "--service-account",
        "rayft",
        "--image-pull-secret",
        "regcred",
        "--config-delivery",
        "inline",
        "--monitoring",
    ],
    # Ray's token from a named Secret, a credential by reference; and auth deliberately off
    "secrets": ["--auth-secret", "team-ray-token", "--secret-env", "HF_TOKEN=hf-token/token"],
    "no-auth": ["--auth", "none"],
}


def render(capsys, config: Path, *args: str) -> tuple[dict[str, dict], str]:
    """`rayft k8s render` to stdout → ({kind: manifest}, the header's comment lines)."""
    capsys.readouterr()
    code = cli.main(["k8s", "render", "--config", str(config), "--config-in-cluster", "/data/job.yaml", *args])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_OK, err
    header = "".join(line for line in out.splitlines(keepends=True) if line.startswith("#"))
    return {doc["kind"]: doc for doc in yaml.safe_load_all(out)}, header


def unexpected(field: str, problems: list[str]) -> bool:
    """Whether the strict schema refused `field` as one the CRD does not have."""
    return any(f"'{field}'" in p and "unexpected" in p for p in problems)


def git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_packaged_crds_are_kuberays_own_for_every_supported_release():
    shipped = {
        (p.parent.name.removeprefix("v"), p.name.removesuffix(".gz")): p
        for p in PACKAGED_CRD_DIR.rglob("*")
        if p.is_file()
    }
    files = ("ray.io_rayjobs.yaml", "ray.io_rayclusters.yaml")
    assert set(shipped) == set(KUBERAY_BLOBS) == {(r, f) for r in RELEASES.values() for f in files}
    for key, path in shipped.items():
        assert git_blob(gzip.decompress(path.read_bytes())) == KUBERAY_BLOBS[key], key
    for release in RELEASES.values():
        assert {("ray.io/v1", "RayJob"), ("ray.io/v1", "RayCluster")} <= set(schemas(PACKAGED_CRD_DIR / f"v{release}"))


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_example_renders_valid_for_every_release(capsys, config, version, setting):
    docs, _ = render(capsys, config, "--kuberay-version", version, *SETTINGS[setting])
    for doc in docs.values():
        assert validate(doc, Operator.of(version)) == [], (doc["kind"], version)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_an_unknown_release_gets_what_every_supported_one_accepts(capsys, config):
    docs, header = render(capsys, config)
    for version in VERSIONS:
        for doc in docs.values():
            assert validate(doc, Operator.of(version)) == [], (doc["kind"], version)
    assert "k8s.kuberay_version unset: rendered for KubeRay 1.4" in header


@pytest.mark.parametrize(
    ("version", "gates", "deadline", "rules"),
    [
        ("1.4.2", [], False, False),
        ("1.5.1", [], False, False),
        ("1.5", ["RayJobDeletionPolicy"], False, True),
        ("1.6.0", [], True, True),
        ("v1.7.0", [], True, True),
    ],
)
def test_each_release_gets_the_fields_it_has(capsys, version, gates, deadline, rules):
    args = ["--kuberay-version", version, *(a for g in gates for a in ("--kuberay-feature-gate", g))]
    docs, header = render(capsys, REPO / "jobs" / "mistral4-3xh200.yaml", *args)
    spec = docs["RayJob"]["spec"]
    assert ("preRunningDeadlineSeconds" in spec) == deadline
    assert ("no preRunningDeadlineSeconds" in header) == (not deadline)
    assert ("Job" in docs) == (not deadline)  # the start watcher, where the operator has no such deadline
    if deadline:  # the operator's own bound on the wait to start: the pods' scheduling and image pulls
        assert spec["preRunningDeadlineSeconds"] == 1800 and spec["activeDeadlineSeconds"] == 3 * 24 * 3600
    else:  # the start watcher bounds it, said with its deadline and that a later operator does it itself
        assert spec["activeDeadlineSeconds"] == 3 * 24 * 3600
        assert "bounded only by" not in header and "--pre-running-deadline (0.5 h)" in header
        assert "rayft-start-watch fails the RayJob (DeadlineExceeded)" in header
    if rules:
        assert {r["policy"] for r in spec["deletionStrategy"]["deletionRules"]} == {"DeleteWorkers", "DeleteCluster"}
        assert "shutdownAfterJobFinishes" not in spec and "no deletion rules" not in header
    else:
        assert "deletionStrategy" not in spec and "no deletion rules" in header
        assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] == 3600
    kueue, _ = render(capsys, REPO / "jobs" / "mistral4-3xh200.yaml", *args, "--queueing", "kueue", "--queue", "q")
    assert "deletionStrategy" not in kueue["RayJob"]["spec"]  # a suspended job needs shutdownAfterJobFinishes


def test_older_releases_refuse_what_newer_ones_accept(capsys):
    """The check has teeth: 1.7's RayJob fails on 1.4 and 1.5, for the fields they lack or gate (its authOptions
    among them)."""
    docs, _ = render(capsys, REPO / "jobs" / "mistral4-3xh200.yaml", "--kuberay-version", "1.7")
    job = docs["RayJob"]
    for version in ("1.4", "1.5"):
        assert unexpected("preRunningDeadlineSeconds", validate(job, Operator.of(version))), version
    del job["spec"]["preRunningDeadlineSeconds"]
    assert unexpected("authOptions", validate(job, Operator.of("1.4")))
    assert unexpected("secretName", validate(job, Operator.of("1.5")))  # 1.5's authOptions has the mode only
    del job["spec"]["rayClusterSpec"]["authOptions"]
    assert unexpected("deletionStrategy", validate(job, Operator.of("1.4")))
    assert validate(job, Operator.of("1.5")) == [
        "spec.deletionStrategy: KubeRay 1.5 refuses it without the RayJobDeletionPolicy feature gate "
        "(k8s.kuberay_feature_gates, when the operator runs with it)"
    ]
    assert validate(job, Operator.of("1.5", ["RayJobDeletionPolicy"])) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--kuberay-version", "1.3.2"],
            "k8s.kuberay_version: KubeRay 1.3.2 is not supported; rayft renders for "
            "1.4, 1.5, 1.6, 1.7 (any patch release)",
        ),
        (["--kuberay-version", "1.8.0"], "KubeRay 1.8.0 is not supported"),
        (["--kuberay-version", "latest"], "'latest' is not a version such as 1.7.0"),
        (["--kuberay-version", "1.7", "--kuberay-feature-gate", "RayCronJob"], "'RayCronJob' changes nothing"),
        (["--kuberay-version", "1.4", "--kuberay-feature-gate", "RayJobDeletionPolicy"], "needs KubeRay 1.5"),
        (["--kuberay-feature-gate", "RayJobDeletionPolicy"], "needs KubeRay 1.5"),
    ],
)
def test_unsupported_releases_and_gates_are_refused_in_one_line(capsys, args, says):
    capsys.readouterr()
    config = REPO / "jobs" / "mistral4-3xh200.yaml"
    assert cli.main(["k8s", "render", "--config", str(config), *args]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert says in err and len([line for line in err.splitlines() if "k8s.kuberay" in line]) == 1, err


def test_validate_command_checks_against_the_named_release(capsys, tmp_path):
    docs, _ = render(capsys, REPO / "jobs" / "mistral4-3xh200.yaml", "--kuberay-version", "1.7")
    path = tmp_path / "rayjob.yaml"
    path.write_text(yaml.safe_dump(docs["RayJob"]))
    assert cli.main(["k8s", "validate", str(path), "--kuberay-version", "1.7"]) == cli.EXIT_OK
    assert cli.main(["k8s", "validate", str(path), "--kuberay-version", "1.5"]) == cli.EXIT_CONFIG
    assert unexpected("preRunningDeadlineSeconds", capsys.readouterr().err.splitlines())


def test_the_config_section_names_the_release_and_its_gates(capsys, tmp_path):
    raw = yaml.safe_load((REPO / "jobs" / "mistral4-3xh200.yaml").read_text())
    raw["k8s"] = {"kuberay_version": "1.5.1", "kuberay_feature_gates": ["RayJobDeletionPolicy"]}
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(raw))
    docs, header = render(capsys, config)
    assert "deletionRules" in docs["RayJob"]["spec"]["deletionStrategy"] and "unset" not in header
    assert validate(docs["RayJob"], Operator.of("1.5.1", ["RayJobDeletionPolicy"])) == []
