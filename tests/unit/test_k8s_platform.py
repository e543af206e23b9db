"""Platform settings (the config's k8s: section and render flags), patches and config delivery, each checked at
the field path KubeRay reads and against the strict CRD validation of the KubeRay release rendered for."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from rayft import cli
from rayft.config import load_config
from rayft.deploy.crd import validate
from rayft.kube.kuberay import Operator

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "jobs" / "mistral4-3xh200.yaml"
TOLERATION = {"key": "pool", "operator": "Equal", "value": "h200", "effect": "NoSchedule"}
NODE_AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}]
        }
    }
}
PLATFORM = {
    "queueing": "kueue",
    "queue": "team-a",
    "priority_class_name": "train-high",
    "service_account_name": "rayft",
    "image_pull_secrets": ["regcred"],
    "node_selector": {"pool": "h200"},
    "head_node_selector": {"pool": "cpu"},
    "affinity": NODE_AFFINITY,
    "tolerations": [TOLERATION],
    "labels": {"team": "nlp"},
    "annotations": {"cost-center": "42"},
    "run_as_user": 1000,
    "run_as_group": 1000,
    "fs_group": 1000,
    "run_as_non_root": True,
    "env": {"HF_HUB_OFFLINE": "1"},
    "volumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
    "volume_mounts": [{"name": "certs", "mountPath": "/etc/certs", "readOnly": True}],
    "fabric": "infiniband",
    "one_pod_per_node": True,
}


def config_with(tmp_path: Path, k8s: dict) -> Path:
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["k8s"] = k8s
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def render(capsys, *args: str) -> dict[str, dict]:
    capsys.readouterr()
    assert cli.main(["k8s", "render", *args]) == cli.EXIT_OK, capsys.readouterr().err
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(capsys.readouterr().out)}
    flags = dict(itertools.pairwise(args))
    gates = [g for flag, g in itertools.pairwise(args) if flag == "--kuberay-feature-gate"]
    for doc in docs.values():
        assert validate(doc, Operator.of(flags.get("--kuberay-version"), gates)) == [], doc["kind"]
    return docs


def render_error(capsys, *args: str) -> str:
    capsys.readouterr()
    assert cli.main(["k8s", "render", *args]) == cli.EXIT_CONFIG
    return capsys.readouterr().err


def pods(job: dict) -> dict[str, dict]:
    """role → pod template, where KubeRay reads each."""
    spec = job["spec"]
    cluster = spec["rayClusterSpec"]
    return {
        "head": cluster["headGroupSpec"]["template"],
        "worker": cluster["workerGroupSpecs"][0]["template"],
        "submitter": spec["submitterPodTemplate"],
    }


def test_every_platform_key_lands_where_kuberay_reads_it(capsys, tmp_path):
    config = config_with(tmp_path, PLATFORM)
    docs = render(capsys, "--config", str(config), "--config-in-cluster", "/data/job.yaml")
    job, cluster = docs["RayJob"], docs["RayCluster"]
    # Kueue: the queue label on the object it admits, created suspended (with the legacy lifetime KubeRay
    # requires of a suspended job).
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["spec"]["suspend"] is True and job["spec"]["shutdownAfterJobFinishes"] is True
    assert "deletionStrategy" not in job["spec"]
    assert cluster["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["metadata"]["annotations"] == {"cost-center": "42"}
    for role, pod in pods(job).items():
        spec = pod["spec"]
        assert pod["metadata"]["labels"]["team"] == "nlp" and pod["metadata"]["labels"]["rayft.io/job"] == "rayft"
        assert pod["metadata"]["annotations"]["cost-center"] == "42"
        assert TOLERATION in spec["tolerations"], role
        assert spec["priorityClassName"] == "train-high" and spec["serviceAccountName"] == "rayft"
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        # fsGroup without a change policy chowned the whole shared volume at every pod start
        assert spec["securityContext"] == {
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "fsGroupChangePolicy": "OnRootMismatch",
            "runAsNonRoot": True,
        }
        container = spec["containers"][0]
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"], role
        if role != "submitter":
            assert {"name": "certs", "secret": {"secretName": "ca"}} in spec["volumes"]
            assert {"name": "certs", "mountPath": "/etc/certs", "readOnly": True} in container["volumeMounts"]
    head, worker, submitter = pods(job).values()
    assert head["spec"]["nodeSelector"] == {"pool": "cpu"} and worker["spec"]["nodeSelector"] == {"pool": "h200"}
    assert "nodeSelector" not in submitter["spec"]
    # The user's node affinity beside rayft's one-pod-per-node rule, not instead of it.
    affinity = worker["spec"]["affinity"]
    assert affinity["nodeAffinity"] == NODE_AFFINITY["nodeAffinity"]
    assert affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == (
        "kubernetes.io/hostname"
    )
    # The GPU taint rayft tolerates stays; IPC_LOCK on the RDMA worker only.
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in worker["spec"]["tolerations"]
    assert worker["spec"]["containers"][0]["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert "securityContext" not in head["spec"]["containers"][0]
    # Head: no Ray CPUs (no training or data work there), a memory-backed /dev/shm.
    group = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert group["rayStartParams"]["num-cpus"] == "0"
    shm = {v["name"]: v for v in head["spec"]["volumes"]}["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in head["spec"]["containers"][0]["volumeMounts"]
    # The RayCluster carries the same pods.
    assert cluster["spec"] == job["spec"]["rayClusterSpec"]


def test_flags_add_to_the_config_section(capsys, tmp_path):
    config = config_with(tmp_path, {"labels": {"team": "nlp"}, "tolerations": [TOLERATION]})
    docs = render(
        capsys,
        "--config",
        str(config),
        "--config-in-cluster",
        "/data/job.yaml",
        "--label",
        "run=7",
        "--toleration",
        "spot:NoExecute",
        "--queueing",
        "runai",
        "--queue",
        "proj-a",
    )
    for role, pod in pods(docs["RayJob"]).items():
        assert {"team": "nlp", "run": "7", "runai/queue": "proj-a"}.items() <= pod["metadata"]["labels"].items(), role
        assert pod["spec"]["schedulerName"] == "runai-scheduler"
        assert TOLERATION in pod["spec"]["tolerations"]
        assert {"key": "spot", "operator": "Exists", "effect": "NoExecute"} in pod["spec"]["tolerations"]
    assert "suspend" not in docs["RayJob"]["spec"]


def test_volcano_is_named_where_kuberay_reads_it(capsys):
    docs = render(capsys, "--config", str(EXAMPLE), "--queueing", "volcano", "--queue", "q1")
    watcher = {"Job", "ServiceAccount", "Role", "RoleBinding"}  # the start watcher's: it runs while the job queues
    for doc in docs.values():
        queued = doc["kind"] not in watcher
        assert (doc["metadata"]["labels"].get("ray.io/scheduler-name") == "volcano") == queued, doc["kind"]
        assert (doc["metadata"]["labels"].get("volcano.sh/queue-name") == "q1") == queued, doc["kind"]
    assert watcher <= set(docs)


@pytest.mark.parametrize(
    ("version", "gates", "rules"),
    [
        ("1.7.0", [], True),
        ("1.6", [], True),
        ("1.5", ["RayJobDeletionPolicy"], True),
        ("1.5", [], False),
        ("1.4.2", [], False),
        (None, [], False),
    ],
)
def test_deletion_rules_where_the_operator_has_them(capsys, version, gates, rules):
    args = ["--kuberay-version", version] if version else []
    args += [a for g in gates for a in ("--kuberay-feature-gate", g)]
    spec = render(capsys, "--config", str(EXAMPLE), *args)["RayJob"]["spec"]
    if rules:
        assert "shutdownAfterJobFinishes" not in spec and "ttlSecondsAfterFinished" not in spec
        got = {
            (r["condition"]["jobStatus"], r["policy"]): r["condition"]["ttlSeconds"]
            for r in spec["deletionStrategy"]["deletionRules"]
        }
        assert got == {
            ("FAILED", "DeleteWorkers"): 0,
            ("FAILED", "DeleteCluster"): 3600,
            ("SUCCEEDED", "DeleteCluster"): 3600,
        }
    else:
        assert "deletionStrategy" not in spec
        assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] == 3600


def flatten(node, at: str = "") -> dict[str, object]:
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in flatten(value, f"{at}/{key}").items()}
    if isinstance(node, list):
        return {k: v for i, value in enumerate(node) for k, v in flatten(value, f"{at}/{i}").items()}
    return {at: node}


def changed(before: dict, after: dict) -> dict[str, tuple]:
    a, b = flatten(before), flatten(after)
    return {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def test_a_patch_changes_what_it_says_and_nothing_else(capsys, tmp_path):
    plain = render(capsys, "--config", str(EXAMPLE))
    strategic = tmp_path / "sm.yaml"
    strategic.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "ray.io/v1",
                "kind": "RayJob",
                "spec": {
                    "rayClusterSpec": {
                        "workerGroupSpecs": [
                            {
                                "groupName": "gpu",
                                "template": {
                                    "spec": {
                                        "containers": [
                                            {"name": "ray-worker", "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]}
                                        ]
                                    }
                                },
                            }
                        ]
                    }
                },
            }
        )
    )
    json6902 = tmp_path / "jp.yaml"
    json6902.write_text(
        yaml.safe_dump(
            {
                "target": "raycluster",
                "patch": [
                    {"op": "add", "path": "/spec/headGroupSpec/template/spec/hostNetwork", "value": True},
                    {"op": "remove", "path": "/spec/headGroupSpec/template/spec/containers/0/ports/3"},
                ],
            }
        )
    )
    patched = render(capsys, "--config", str(EXAMPLE), "--patch", str(strategic), "--patch", str(json6902))
    env_at = "/spec/rayClusterSpec/workerGroupSpecs/0/template/spec/containers/0/env"
    index = [
        e["name"]
        for e in plain["RayJob"]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0][
            "env"
        ]
    ].index("NCCL_DEBUG")
    assert changed(plain["RayJob"], patched["RayJob"]) == {f"{env_at}/{index}/value": ("WARN", "INFO")}
    head = "/spec/headGroupSpec/template/spec"
    assert changed(plain["RayCluster"], patched["RayCluster"]) == {
        f"{head}/hostNetwork": (None, True),
        f"{head}/containers/0/ports/3/containerPort": (8080, None),
        f"{head}/containers/0/ports/3/name": ("metrics", None),
    }


@pytest.mark.parametrize(
    ("patch", "says"),
    [
        ({"kind": "RayJob", "spec": {"shutdownAfterJobFinished": True}}, "'shutdownAfterJobFinished'"),
        ({"target": "rayjob", "patch": [{"op": "remove", "path": "/spec/nope"}]}, "operation 0: no 'nope'"),
        ({"target": "nothing", "patch": []}, "target 'nothing'"),
        ({"kind": "Deployment"}, "no rendered Deployment"),
    ],
)
def test_a_bad_patch_is_refused_naming_it(capsys, tmp_path, patch, says):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(patch))
    assert says in render_error(capsys, "--config", str(EXAMPLE), "--patch", str(path))


def test_config_inlined_in_the_rayjob_reaches_the_job_unchanged(capsys, tmp_path, monkeypatch):
    config = config_with(tmp_path, {"config_delivery": "inline"})  # not under jobs/, not on the PVC: no image
    job = render(capsys, "--config", str(config), "--override", "train.learning_rate=1e-4")["RayJob"]["spec"]
    assert "--config env:RAYFT_CONFIG_YAML --override train.learning_rate=1e-4" in job["entrypoint"]
    runtime_env = yaml.safe_load(job["runtimeEnvYAML"])
    monkeypatch.setenv("RAYFT_CONFIG_YAML", runtime_env["env_vars"]["RAYFT_CONFIG_YAML"])
    expected = load_config(config, ["train.learning_rate=1e-4"])
    assert load_config("env:RAYFT_CONFIG_YAML", ["train.learning_rate=1e-4"]) == expected


def test_config_from_a_working_dir(capsys, tmp_path):
    config = config_with(tmp_path, {"config_delivery": "working_dir", "working_dir": "s3://bucket/run7.zip"})
    job = render(capsys, "--config", str(config))["RayJob"]["spec"]
    assert yaml.safe_load(job["runtimeEnvYAML"]) == {"working_dir": "s3://bucket/run7.zip"}
    assert job["entrypoint"].endswith("--config job.yaml")


@pytest.mark.parametrize(
    ("k8s", "says"),
    [
        ({"queueing": "kueue"}, "k8s.queue"),
        ({"queueing": "slurm"}, "k8s.queueing: unknown value 'slurm'"),
        ({"kuberay_version": "latest"}, "k8s.kuberay_version"),
        ({"volume_mounts": [{"name": "x", "mountPath": "/x"}]}, "k8s.volume_mounts[0]"),
        ({"tolerations": [{"key": "a", "operatr": "Exists"}]}, "'operatr'"),
    ],
)
def test_bad_platform_settings_are_refused(capsys, tmp_path, k8s, says):
    config = config_with(tmp_path, k8s)
    assert says in render_error(capsys, "--config", str(config), "--config-in-cluster", "/data/job.yaml")


def test_hub_names_with_the_hf_cache_on_the_pvc_and_offline_mode(capsys, tmp_path):
    """Model and dataset by hub name pass the on-the-PVC check (HF_HOME is); k8s.hf_home / --hf-offline reach the
    Ray pods that read the cache, and an HF_HOME off the PVC is refused."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["model"].update(model_name_or_path="mistralai/Mistral-Small-4-119B-2603", revision="main")
    raw["data"]["dataset_name_or_path"] = "Salesforce/wikitext"
    raw["k8s"] = {"hf_home": "/data/shared/hf"}
    config = tmp_path / "hub.yaml"
    config.write_text(yaml.safe_dump(raw))
    args = ("--config", str(config), "--config-in-cluster", "/data/job.yaml")
    plain = pods(render(capsys, *args)["RayJob"])
    offline = pods(render(capsys, *args, "--hf-offline")["RayJob"])
    for role in ("head", "worker"):
        env = {e["name"]: e.get("value") for e in plain[role]["spec"]["containers"][0]["env"]}
        assert env["HF_HOME"] == "/data/shared/hf" and "HF_HUB_OFFLINE" not in env, role
        env = {e["name"]: e.get("value") for e in offline[role]["spec"]["containers"][0]["env"]}
        assert env["HF_HOME"] == "/data/shared/hf" and env["HF_HUB_OFFLINE"] == "1", role
    err = render_error(capsys, *args, "--hf-home", "/scratch/hf")
    assert "k8s.hf_home: /scratch/hf is not on the PVC mounted at /data" in err


def test_a_platform_toleration_rayft_also_adds_appears_once(capsys, tmp_path):
    """Platforms list the GPU taint in their own tolerations too: the worker pods carried it twice."""
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    config = config_with(tmp_path, {"tolerations": [gpu, TOLERATION]})
    docs = render(capsys, "--config", str(config), "--config-in-cluster", "/data/job.yaml")
    for role, pod in pods(docs["RayJob"]).items():
        tolerations = pod["spec"]["tolerations"]
        assert len(tolerations) == len({json.dumps(t, sort_keys=True) for t in tolerations}), (role, tolerations)
        assert gpu in tolerations and TOLERATION in tolerations, role


def worker_of(docs: dict[str, dict]) -> tuple[dict, dict]:
    """(the GPU worker group, its container) of a rendered RayJob."""
    group = docs["RayJob"]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    return group, group["template"]["spec"]["containers"][0]


def test_a_config_that_names_no_fabric_renders_nothing_of_a_site(capsys, tmp_path):
    """Every render asked for a Multus ib-network, an RDMA device, IPC_LOCK and NCCL_SOCKET_IFNAME=net1, and kept
    one single-GPU pod a node: a cluster without that InfiniBand set-up got pods that never started."""
    config = config_with(tmp_path, {})
    group, container = worker_of(render(capsys, "--config", str(config), "--config-in-cluster", "/data/job.yaml"))
    assert "annotations" not in group["template"]["metadata"]
    assert set(container["resources"]["limits"]) == {"cpu", "memory", "nvidia.com/gpu"}
    assert "securityContext" not in container and "affinity" not in group["template"]["spec"]
    env = {e["name"] for e in container["env"]}
    assert not {n for n in env if n.startswith(("NCCL_IB_", "RDMAV_"))} and "NCCL_SOCKET_IFNAME" not in env


@pytest.mark.parametrize(
    ("fabric", "rdma", "resource", "interface"),
    [
        ("infiniband", {}, "rdma/rdma_shared_device_a", None),
        ("infiniband", {"network": "ib-network"}, "rdma/rdma_shared_device_a", "net1"),
        (
            "roce",
            {"resource": "nvidia.com/hostdev", "network": "roce-net", "interface": "eth1"},
            "nvidia.com/hostdev",
            "eth1",
        ),
        ("infiniband", {"resource": ""}, None, None),
    ],
)
def test_a_named_fabric_renders_its_rdma_settings(capsys, tmp_path, fabric, rdma, resource, interface):
    config = config_with(tmp_path, {"fabric": fabric, "rdma": rdma})
    group, container = worker_of(render(capsys, "--config", str(config), "--config-in-cluster", "/data/job.yaml"))
    limits = container["resources"]["limits"]
    assert {k for k in limits if k not in ("cpu", "memory", "nvidia.com/gpu")} == ({resource} if resource else set())
    assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    annotations = group["template"]["metadata"].get("annotations", {})
    assert annotations.get("k8s.v1.cni.cncf.io/networks") == rdma.get("network")
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env.get("NCCL_SOCKET_IFNAME") == interface and env["NCCL_IB_DISABLE"] == "0"


def test_fabric_flags_override_the_config_and_need_a_fabric(capsys, tmp_path):
    config = config_with(tmp_path, {})
    args = ("--config", str(config), "--config-in-cluster", "/data/job.yaml")
    err = render_error(capsys, *args, "--network", "ib-network")
    assert "k8s.rdma.network: 'ib-network' is given but k8s.fabric is none" in err and "--fabric" in err
    assert "--ib-hca" in render_error(capsys, *args, "--ib-hca", "=mlx5_0")
    _, container = worker_of(
        render(
            capsys,
            *args,
            "--fabric",
            "roce",
            "--ib-resource",
            "openshift.io/mellanoxnics",
            "--ib-hca",
            "=mlx5_0",
            "--socket-ifname",
            "net2",
        )
    )
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NCCL_IB_HCA"] == "=mlx5_0" and env["NCCL_SOCKET_IFNAME"] == "net2"
    assert container["resources"]["limits"]["openshift.io/mellanoxnics"] == "1"


def test_a_flags_problem_names_the_flag_that_sets_it(capsys, tmp_path):
    """A value a flag gives is reported at the flag, as a file's is at its line; a key the config sets, at its key."""
    config = config_with(tmp_path, {})
    args = ("--config", str(config), "--config-in-cluster", "/data/job.yaml")
    err = render_error(capsys, *args, "--node-gpus", "0", "--queueing", "kueue")
    assert "2 problems:" in err and "k8s:" not in err, err
    assert "  - --node-gpus: k8s.node.gpus must be >= 1, got 0" in err, err
    assert "  - --queueing: k8s.queue: k8s.queueing: kueue needs the queue's name" in err, err


NODE = {"gpus": 4, "cpus": 100, "memory": "1000Gi"}


@pytest.mark.parametrize("per_pod", [1, 2, 4])
def test_pods_get_the_nodes_cpus_and_memory_per_gpu(capsys, tmp_path, per_pod):
    """Pods were 32 CPUs and 512 Gi whatever their GPUs: an 8-GPU pod starved, eight 1-GPU pods overfilled a node."""
    config = config_with(tmp_path, {"node": NODE})
    sizes = ("--override", f"ray.num_workers={4 * per_pod}", "--override", f"ray.workers_per_node={per_pod}")
    docs = render(capsys, "--config", str(config), "--config-in-cluster", "/data/job.yaml", *sizes)
    group, container = worker_of(docs)
    share = {1: ("25", "250Gi"), 2: ("50", "500Gi"), 4: ("100", "1000Gi")}[per_pod]  # NODE's quarter, half, whole
    limits = container["resources"]["limits"]
    assert (limits["cpu"], limits["memory"], limits["nvidia.com/gpu"]) == (*share, str(per_pod))
    assert group["replicas"] == 4 and "affinity" not in group["template"]["spec"]


def test_two_eight_gpu_nodes_get_two_pods_of_eight_gpus(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    docs = render(
        capsys,
        "--config",
        "jobs/mistral4-3xh200.yaml",
        "--override",
        "ray.num_workers=16",
        "--override",
        "ray.workers_per_node=8",
        "--nodes",
        "2",
        "--node-cpus",
        "192",
        "--node-memory",
        "2000Gi",
    )
    group, container = worker_of(docs)
    assert group["replicas"] == 2
    assert container["resources"]["limits"] == {
        "cpu": "192",
        "memory": "2000Gi",
        "nvidia.com/gpu": "8",
        "rdma/rdma_shared_device_a": "1",
    }


def test_pods_the_declared_nodes_cannot_hold_are_refused_with_the_arithmetic(capsys, monkeypatch):
    """num_workers 16 on 2 × 8-GPU nodes rendered 16 one-GPU pods, one a node: 14 stayed Pending, with no word."""
    monkeypatch.chdir(REPO)
    args = ("--config", "jobs/mistral4-3xh200.yaml", "--override", "ray.num_workers=16", "--nodes", "2")
    err = render_error(capsys, *args)  # the example asks for one pod a node
    assert "16 worker pods" in err and "need 16 nodes, but 2 are declared: 14 pods would stay Pending" in err
    assert "set ray.workers_per_node: 8" in err and "k8s.one_pod_per_node: false" in err
    group, _ = worker_of(render(capsys, *args, "--override", "k8s.one_pod_per_node=false"))
    assert group["replicas"] == 16 and "affinity" not in group["template"]["spec"]  # eight a node
    err = render_error(
        capsys, *args, "--node-cpus", "40", "--worker-cpus", "12", "--override", "k8s.one_pod_per_node=false"
    )
    assert "at 3 a node (limited by its CPUs) need 6 nodes" in err  # 40 // 12 = 3 pods a node, 16 / 3 → 6
    err = render_error(capsys, *args, "--override", "ray.workers_per_node=16", "--override", "ray.num_workers=16")
    assert "ray.workers_per_node: a worker pod of 16 GPUs does not fit a node of 8" in err


@pytest.mark.parametrize(
    ("k8s", "says"),
    [
        ({"fabric": "ib"}, "k8s.fabric: unknown value 'ib'"),
        ({"rdma": {"network": "ib-network"}}, "k8s.rdma.network: 'ib-network' is given but k8s.fabric is none"),
        ({"node": {"gpus": 0}}, "k8s.node.gpus must be >= 1"),
        ({"node": {"memory": "1TB"}}, "k8s.node.memory: '1TB' is not a memory quantity"),
        ({"node": {"gpu": 8}}, "unknown key 'k8s.node.gpu' (did you mean 'gpus'?)"),
    ],
)
def test_bad_fabric_and_node_settings_are_refused(capsys, tmp_path, k8s, says):
    config = config_with(tmp_path, k8s)
    assert says in render_error(capsys, "--config", str(config), "--config-in-cluster", "/data/job.yaml")


def test_a_stopping_gpu_pod_gives_ray_a_preemption_notice_first(capsys, tmp_path):
    """A GPU worker pod that Kubernetes stops (its node drained for a spot reclaim, a scale-down) first drains its
    own Ray node, as a preemption with the configured deadline, so the run checkpoints at once (`ray.preemption`),
    and waits that long inside its grace period. The command the shell runs is one the installed Ray's
    `ray drain-node` accepts: its options and reason parsed by Ray's own CLI definition."""
    from ray.scripts.scripts import drain_node

    config = config_with(tmp_path, {"preemption_notice_s": 45})
    group, container = worker_of(render(capsys, "--config", str(config), "--config-in-cluster", "/data/job.yaml"))
    shell, flag, script = container["lifecycle"]["preStop"]["exec"]["command"]
    drain, wait = script.split(" || true; ")
    assert (shell, flag, wait) == ("/bin/sh", "-c", "sleep 45")
    assert group["template"]["spec"]["terminationGracePeriodSeconds"] > 45
    env = {"PATH": os.environ["PATH"], "FQ_RAY_IP": "rayft-head-svc.ml.svc.cluster.local", "HOSTNAME": "gpu-0"}
    words = subprocess.run(
        [shell, flag, drain.replace("ray drain-node", "printf '%s\\n'", 1)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    params = drain_node.make_context("drain-node", words).params
    assert params["address"] == "rayft-head-svc.ml.svc.cluster.local:6379" and params["node_id"] is None
    assert (params["reason"], params["deadline_remaining_seconds"]) == ("DRAIN_NODE_REASON_PREEMPTION", 45)
    assert params["reason_message"] == "pod gpu-0 stopping"


def test_no_preemption_notice_when_it_is_off(capsys, tmp_path):
    config = config_with(tmp_path, {"preemption_notice_s": 0})
    group, container = worker_of(render(capsys, "--config", str(config), "--config-in-cluster", "/data/job.yaml"))
    assert "lifecycle" not in container and "terminationGracePeriodSeconds" not in group["template"]["spec"]


@pytest.mark.parametrize("version", ["1.4.2", "1.7.0"])
def test_an_elastic_run_keeps_its_pods_and_may_go_on_with_fewer(capsys, tmp_path, version):
    """`ray.num_workers: [2, 3]`: KubeRay keeps three worker pods (each lost one is created again, Pending until
    there is capacity) while the run may go on with two; the group's range is the run's, and the manifests pass
    the CRD validation of the oldest and newest operator supported."""
    args = ("--config", str(config_with(tmp_path, {})), "--config-in-cluster", "/data/job.yaml")
    docs = render(capsys, *args, "--override", "ray.num_workers=[2, 3]", "--kuberay-version", version)
    for doc in (docs["RayJob"], docs["RayCluster"]):
        spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
        (group,) = spec["workerGroupSpecs"]
        assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (3, 2, 3)
    fixed = worker_of(render(capsys, *args, "--kuberay-version", version))[0]
    assert (fixed["replicas"], fixed["minReplicas"], fixed["maxReplicas"]) == (3, 3, 3)


# Keys set only in the config file: structured values (Kubernetes objects) or settings no site changes per run.
FILE_ONLY_KEYS = {
    "head_node_selector",
    "affinity",
    "run_as_non_root",
    "volumes",
    "volume_mounts",
    "preemption_notice_s",
}


def test_render_flags_follow_the_k8s_keys_they_set():
    """Each platform flag is made from its key: its choices and type are the key's, and every key but the file-only
    ones has one (a key added to the section without a flag, or a choice added to a key, shows here)."""
    import argparse
    import dataclasses
    import typing

    from rayft.deploy.flags import KUBERAY_FLAGS, PLATFORM_FLAGS, add_flags, given
    from rayft.kube.settings import K8sConfig

    hints = typing.get_type_hints(K8sConfig)
    keys = set()
    for name, kind in ((f.name, hints[f.name]) for f in dataclasses.fields(K8sConfig)):
        keys |= {f"{name}.{f.name}" for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else {name}
    flags = (*PLATFORM_FLAGS, *KUBERAY_FLAGS)
    assert keys - {f.key for f in flags} == FILE_ONLY_KEYS
    parser = argparse.ArgumentParser()
    add_flags(parser, flags)
    by_dest = {a.dest: a for a in parser._actions}
    for key in ("queueing", "fabric", "config_delivery"):
        assert by_dest[key].choices == list(typing.get_args(hints[key])), key
    argv = ["--queueing", "kueue", "--queue", "q", "--node-gpus", "4", "--label", "a=b", "--network", "none"]
    assert given(parser.parse_args(argv), flags) == {
        "queueing": "kueue",
        "queue": "q",
        "node.gpus": 4,
        "labels": {"a": "b"},
        "rdma.network": None,
    }


def test_roce_renders_a_gid_index_and_says_where_it_came_from(capsys, tmp_path):
    """`--fabric roce` rendered no NCCL_IB_GID_INDEX and said nothing: NCCL on RoCE then picks a GID that may be
    the link-local or RoCE v1 one. Unset, it is the usual RoCE v2 IPv4 index with a note naming the key; given
    (the key, its flag, or the config's nccl section, which wins), it is that."""
    args = ("--config", str(config_with(tmp_path, {})), "--config-in-cluster", "/data/job.yaml")

    def gid(*more: str) -> str | None:
        _, container = worker_of(render(capsys, *args, *more))
        return {e["name"]: e.get("value") for e in container["env"]}.get("NCCL_IB_GID_INDEX")

    capsys.readouterr()
    assert cli.main(["k8s", "render", *args, "--fabric", "roce"]) == cli.EXIT_OK
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if "gid_index" in line]
    assert len(notes) == 1 and "NCCL_IB_GID_INDEX=3" in notes[0] and "--ib-gid-index" in notes[0], err
    assert "# Note: k8s.fabric: roce" in out
    assert gid("--fabric", "roce") == "3"
    assert gid("--fabric", "roce", "--ib-gid-index", "5") == "5"
    assert gid("--fabric", "roce", "--ib-gid-index", "5", "--override", "nccl.ib_gid_index=1") == "1"
    assert gid("--fabric", "infiniband") is None  # InfiniBand addresses by LID: no index unless given
    assert cli.main(["k8s", "render", *args, "--fabric", "roce", "--ib-gid-index", "5"]) == cli.EXIT_OK
    assert "gid_index" not in capsys.readouterr().err
    err = render_error(capsys, *args, "--ib-gid-index", "3")
    assert "k8s.rdma.gid_index: '3' is given but k8s.fabric is none" in err, err
    config = config_with(tmp_path, {"fabric": "roce", "rdma": {"gid_index": 0}})
    _, container = worker_of(render(capsys, "--config", str(config), "--config-in-cluster", "/data/job.yaml"))
    assert {e["name"]: e.get("value") for e in container["env"]}["NCCL_IB_GID_INDEX"] == "0"
