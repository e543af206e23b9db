"""KubeRay manifests: strict validation against the KubeRay CRDs, agreement with the config, renderer errors."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path, PurePosixPath

import pytest
import yaml

from rayft import cli
from rayft.config import load_config
from rayft.deploy.crd import CRD_DIR_ENV, ManifestError, crd_dir, schemas, validate, validate_file
from rayft.deploy.k8s import IMAGE_ROOT, RAY_VERSION
from rayft.kube.kuberay import Operator

REPO = Path(__file__).resolve().parents[2]
CHECKED_IN = sorted((REPO / "cluster").glob("*.yaml"))
EXAMPLE = "jobs/mistral4-3xh200.yaml"
WATCHER_KINDS = ("Job", "ServiceAccount", "Role", "RoleBinding")  # the start watcher's, rendered for KubeRay 1.4
WATCHER_FILES = {"start-watch.yaml", "start-watch-account.yaml", "start-watch-role.yaml", "start-watch-binding.yaml"}


def render(capsys, *args: str) -> dict[str, dict]:
    """`rayft k8s render` to stdout → {kind: manifest}."""
    capsys.readouterr()
    assert cli.main(["k8s", "render", *args]) == cli.EXIT_OK, capsys.readouterr().err
    return {doc["kind"]: doc for doc in yaml.safe_load_all(capsys.readouterr().out)}


def render_error(capsys, *args: str) -> str:
    capsys.readouterr()
    assert cli.main(["k8s", "render", *args]) == cli.EXIT_CONFIG
    return capsys.readouterr().err


def gpu_groups(doc: dict) -> list[dict]:
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    return spec["workerGroupSpecs"]


def image_layout() -> dict[PurePosixPath, Path]:
    """Image path → repository path, from the Containerfile's COPY lines."""
    layout = {}
    for line in (REPO / "cluster" / "Containerfile").read_text().splitlines():
        if line.startswith("COPY"):
            *sources, target = [w for w in line.split()[1:] if not w.startswith("--")]
            for source in sources:
                dest = PurePosixPath(target)
                if not source.endswith("/"):  # a file copied into the target directory
                    dest /= PurePosixPath(source).name
                layout[dest] = REPO / source
    return layout


def in_image(path: str) -> Path | None:
    """The repository file that ends up at `path` in the image, if any."""
    for dest, source in image_layout().items():
        p = PurePosixPath(path)
        if p == dest:
            return source
        if dest in p.parents:
            return source / p.relative_to(dest)
    return None


VARIANTS = [
    [],
    ["--gpus-per-pod", "3", "--override", "ray.workers_per_node=3"],
    ["--network", "none", "--ib-resource", "none"],
    ["--ib-resource", "nvidia.com/hostdev", "--ib-hca", "mlx5_0,mlx5_1", "--socket-ifname", "ib0"],
    ["--ib-resource", "openshift.io/mellanoxnics", "--network", "ssa", "--namespace", "ml", "--name", "ft-3"],
    [
        "--override",
        "ray.num_workers=6",
        "--override",
        "ray.max_failures=-1",
        "--pvc",
        "shared",
        "--mount-path",
        "/data",
    ],
]


def test_crd_dir_is_configurable(monkeypatch, tmp_path):
    real = crd_dir()
    monkeypatch.setenv(CRD_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(ManifestError, match=CRD_DIR_ENV):
        crd_dir()
    for crd in real.glob("ray.io_*"):
        (tmp_path / crd.name).symlink_to(crd)
    monkeypatch.setenv(CRD_DIR_ENV, str(tmp_path))
    assert crd_dir() == tmp_path
    assert {("ray.io/v1", "RayJob"), ("ray.io/v1", "RayCluster")} <= set(schemas(tmp_path))


@pytest.mark.parametrize("path", CHECKED_IN, ids=lambda p: p.name)
def test_checked_in_manifests_are_valid_and_exactly_what_the_renderer_writes(path: Path, tmp_path, monkeypatch):
    assert validate_file(path) == []
    header = path.read_text().splitlines()[0]
    command = re.fullmatch(r"# Rendered by: rayft (.*)", header)
    assert command, f"{path} has no '# Rendered by:' header"
    monkeypatch.chdir(REPO)
    assert cli.main([*shlex.split(command.group(1)), "--out", str(tmp_path)]) == cli.EXIT_OK
    assert (tmp_path / path.name).read_text() == path.read_text(), f"{path.name} drifted: render it again"


def test_checked_in_set_is_the_seeds_3xh200_job():
    assert {p.name for p in CHECKED_IN} == {"rayjob.yaml", "raycluster.yaml", "head-budget.yaml", *WATCHER_FILES}
    job = yaml.safe_load((REPO / "cluster" / "rayjob.yaml").read_text())
    assert gpu_groups(job)[0]["replicas"] == 3 and EXAMPLE.split("/")[-1] in job["spec"]["entrypoint"]


def test_the_heads_budget_holds_the_runs_head_and_nothing_else(capsys, monkeypatch):
    """A voluntary eviction (a node drain) may take a GPU worker (a checkpoint and a restart) but not the head (the
    driver): the budget selects the head pods of this run's RayJob and RayCluster, which carry its labels, and
    neither its workers nor another run's head."""
    monkeypatch.chdir(REPO)
    docs = render(capsys, "--config", EXAMPLE, "--name", "run-a")
    budget = docs["PodDisruptionBudget"]
    assert validate(budget) == [] and budget["spec"]["maxUnavailable"] == 0
    selector = budget["spec"]["selector"]["matchLabels"]
    kuberay = {"head": {"ray.io/node-type": "head"}, "worker": {"ray.io/node-type": "worker"}}  # KubeRay's labels
    for doc in (docs["RayJob"], docs["RayCluster"]):
        spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
        head = {**spec["headGroupSpec"]["template"]["metadata"]["labels"], **kuberay["head"]}
        worker = {**gpu_groups(doc)[0]["template"]["metadata"]["labels"], **kuberay["worker"]}
        assert selector.items() <= head.items() and not selector.items() <= worker.items()
    other = render(capsys, "--config", EXAMPLE, "--name", "run-b")["RayJob"]["spec"]["rayClusterSpec"]
    assert (
        not selector.items() <= {**other["headGroupSpec"]["template"]["metadata"]["labels"], **kuberay["head"]}.items()
    )


@pytest.mark.parametrize("extra", VARIANTS, ids=lambda a: " ".join(a) or "defaults")
def test_rendered_manifests_validate_and_agree_with_the_config(capsys, monkeypatch, extra: list[str]):
    monkeypatch.chdir(REPO)
    docs = render(capsys, "--config", EXAMPLE, *extra)
    overrides = [extra[i + 1] for i, a in enumerate(extra) if a == "--override"]
    cfg = load_config(EXAMPLE, overrides)
    flag = dict(zip(extra[::2], extra[1::2], strict=False))
    mount = PurePosixPath(flag.get("--mount-path", "/data"))
    gpus = int(flag.get("--gpus-per-pod", "1"))
    for kind in ("PodDisruptionBudget", *WATCHER_KINDS):
        assert validate(docs.pop(kind)) == [], kind
    assert set(docs) == {"RayJob", "RayCluster"}
    for doc in docs.values():
        assert validate(doc) == []
        (group,) = gpu_groups(doc)
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]
        assert group["replicas"] * gpus == cfg.ray.num_workers  # pods × GPUs = world size
        pod = group["template"]
        (container,) = pod["spec"]["containers"]
        resources = container["resources"]
        assert resources["requests"] == resources["limits"] and resources["limits"]["nvidia.com/gpu"] == str(gpus)
        env = {e["name"]: e.get("value") for e in container["env"]}
        network = flag.get("--network", "ib-network")  # the example's k8s.rdma.network
        assert env.get("NCCL_SOCKET_IFNAME") == flag.get("--socket-ifname", None if network == "none" else "net1")
        assert env.get("NCCL_IB_HCA") == flag.get("--ib-hca", cfg.nccl.ib_hca)  # unset: NCCL's own choice
        assert env["NCCL_DEBUG"] == cfg.nccl.debug == "WARN"  # INFO only when the config asks for it
        assert env["RDMAV_FORK_SAFE"] == "1" and env["TOKENIZERS_PARALLELISM"] == "false"
        assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        assert {"NCCL_IB_QPS_PER_CONNECTION", "NCCL_IB_SPLIT_DATA_ON_QPS", "NCCL_IB_DISABLE"} <= set(env)
        added = container.get("securityContext", {}).get("capabilities", {}).get("add", [])
        assert "IPC_LOCK" in added  # the example names a fabric: RDMA pins memory
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm" and mounts[str(mount)] == "data"
        ib = flag.get("--ib-resource", "rdma/rdma_shared_device_a")
        if ib == "none":
            assert not any("/" in r and r != "nvidia.com/gpu" for r in resources["limits"])
        else:
            assert resources["limits"][ib] == "1"
        annotations = pod["metadata"].get("annotations", {})
        assert annotations.get("k8s.v1.cni.cncf.io/networks") == (None if network == "none" else network)
        spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
        head = spec["headGroupSpec"]
        assert spec["rayVersion"] == RAY_VERSION and head["serviceType"] == "ClusterIP"
        assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert any(p["containerPort"] == 8265 for p in head["template"]["spec"]["containers"][0]["ports"])
        head_mounts = {m["mountPath"] for m in head["template"]["spec"]["containers"][0]["volumeMounts"]}
        assert str(mount) in head_mounts  # the same PVC at the same path on the head (the driver) and workers
        assert {v["name"]: v for v in head["template"]["spec"]["volumes"]}["data"] == volumes["data"]
    storage = PurePosixPath(cfg.storage_path)
    assert mount in storage.parents and mount in PurePosixPath(cfg.train.output_dir).parents

    job = docs["RayJob"]["spec"]
    entry = shlex.split(job["entrypoint"])
    assert entry[:2] == ["python", str(IMAGE_ROOT / "jobs" / "mistral4.py")]
    script, config = in_image(entry[1]), in_image(entry[entry.index("--config") + 1])
    assert script is not None and script.is_file()
    assert config is not None and config.resolve() == (REPO / EXAMPLE).resolve()  # the image holds this config
    assert [entry[i + 1] for i, a in enumerate(entry) if a == "--override"] == overrides
    assert job["shutdownAfterJobFinishes"] and job["ttlSecondsAfterFinished"] > 0
    assert job["activeDeadlineSeconds"] > 0
    assert job["backoffLimit"] == (0 if cfg.ray.max_failures == -1 else 1)


def test_config_on_the_pvc(capsys, tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text((REPO / EXAMPLE).read_text())
    assert "--config-in-cluster /data/" in render_error(capsys, "--config", str(config))
    docs = render(capsys, "--config", str(config), "--config-in-cluster", "/data/configs/mine.yaml")
    assert "--config /data/configs/mine.yaml" in docs["RayJob"]["spec"]["entrypoint"]
    assert "neither on the PVC" in render_error(capsys, "--config", str(config), "--config-in-cluster", "/etc/x.yaml")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--override", "ray.num_workers=0"], "ray.num_workers"),
        (["--gpus-per-pod", "2"], "GPU count mismatch: ray.num_workers=3"),
        (["--gpus-per-pod", "0"], "--gpus-per-pod"),
        (["--gpus-per-pod", "3"], "ray.workers_per_node: 1, but --gpus-per-pod=3"),
        (["--override", "ray.resources_per_worker={GPU: 2}"], "ray.resources_per_worker.GPU"),
        (["--override", "ray.storage_path=/scratch/ckpt"], "ray.storage_path: /scratch/ckpt is not on the PVC"),
        (["--override", "train.output_dir=/home/me/out"], "is not on the PVC mounted at /data"),
        (["--mount-path", "/mnt/pvc"], "is not on the PVC mounted at /mnt/pvc"),
        (["--override", "model.model_name_or_path=/models/m4"], "model.model_name_or_path: /models/m4"),
        (["--override", "ray.use_gpu=false"], "ray.use_gpu"),
        (["--override", "ray.address=ray://elsewhere:10001"], "ray.address"),
        (["--name", "Mistral_4"], "--name"),
        (["--ttl", "0"], "--ttl"),
    ],
)
def test_renderer_refuses_what_could_not_work(capsys, monkeypatch, args: list[str], says: str):
    monkeypatch.chdir(REPO)
    assert says in render_error(capsys, "--config", EXAMPLE, *args)


def _job() -> dict:
    return copy.deepcopy(yaml.safe_load((REPO / "cluster" / "rayjob.yaml").read_text()))


def _breaks(change, says: str, operator: Operator | None = None) -> None:
    doc = _job()
    change(doc)
    problems = validate(doc, operator)
    assert any(says in p for p in problems), problems


def test_strict_schema_rejects_what_the_api_server_would_drop_or_refuse():
    worker = lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]  # noqa: E731
    _breaks(lambda d: worker(d)["template"].update(metdata=worker(d)["template"].pop("metadata")), "'metdata'")
    _breaks(lambda d: d["spec"].update(shutdownAfterJobFinished=True), "'shutdownAfterJobFinished'")
    _breaks(lambda d: worker(d)["template"]["spec"]["containers"][0].update(resource={}), "'resource'")
    _breaks(lambda d: d["metadata"].update(label={}), "'label'")
    _breaks(lambda d: worker(d)["rayStartParams"].update({"num-gpus": 1}), "is not of type 'string'")
    _breaks(lambda d: worker(d).update(replicas="3"), "is not of type 'integer'")
    _breaks(lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"].pop("template"), "'template' is a required")


def test_operator_rules_the_schema_cannot_express():
    worker = lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]  # noqa: E731
    _breaks(lambda d: d["spec"].update(shutdownAfterJobFinishes=False), "needs spec.shutdownAfterJobFinishes")
    _breaks(lambda d: d["spec"].update(backoffLimit=-1), "spec.backoffLimit")
    _breaks(lambda d: d["spec"].update(activeDeadlineSeconds=0), "spec.activeDeadlineSeconds")
    _breaks(
        lambda d: d["spec"].update(preRunningDeadlineSeconds=0), "spec.preRunningDeadlineSeconds", Operator.of("1.7")
    )
    _breaks(lambda d: d["spec"].update(entrypoint=" "), "spec.entrypoint")
    _breaks(lambda d: d["spec"].update(runtimeEnvYAML="a: [b"), "spec.runtimeEnvYAML")
    _breaks(lambda d: d["spec"].pop("rayClusterSpec"), "needs rayClusterSpec")
    _breaks(lambda d: d["metadata"].update(name="x" * 48), "at most 47")
    _breaks(
        lambda d: worker(d).update(resources={"GPU": "1"}) or worker(d)["rayStartParams"].update({"num-gpus": "1"}),
        "num-gpus set in both rayStartParams and resources",
        Operator.of("1.7"),
    )
    _breaks(lambda d: worker(d).update(minReplicas=4), "minReplicas 4 > maxReplicas 3")
    _breaks(lambda d: worker(d).update(replicas=5), "outside [minReplicas, maxReplicas]")
    _breaks(
        lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"].append(copy.deepcopy(worker(d))),
        "group name 'gpu' is used more than once",
    )
    _breaks(lambda d: worker(d)["template"]["spec"].update(containers=[]), "needs the Ray container")
    cluster = yaml.safe_load((REPO / "cluster" / "raycluster.yaml").read_text())
    cluster["metadata"]["name"] = "c" * 54
    assert any("at most 53" in p for p in validate(cluster))


def test_validate_command_reports_each_problem(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    text = (REPO / "cluster" / "rayjob.yaml").read_text().replace("shutdownAfterJobFinishes: true", "suspend: true")
    bad.write_text(text)
    assert cli.main(["k8s", "validate", str(bad), *map(str, CHECKED_IN)]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "spec.suspend: needs spec.shutdownAfterJobFinishes" in err and str(bad) in err
    assert all(str(p) not in err for p in CHECKED_IN)
    assert cli.main(["k8s", "validate", *map(str, CHECKED_IN)]) == cli.EXIT_OK


def test_containerfile_builds_on_the_pinned_ray_gpu_image():
    text = (REPO / "cluster" / "Containerfile").read_text()
    base = re.search(r"^FROM (\S+)$", text, re.M).group(1)
    assert re.fullmatch(rf"(docker\.io/)?rayproject/ray:{re.escape(RAY_VERSION)}-py3\d+-cu\d+", base)
    pinned = re.search(r"^ray==(\S+)$", (REPO / "constraints.txt").read_text(), re.M).group(1)
    assert pinned == RAY_VERSION  # image, rayVersion in the manifests and the tested Ray are one version
    assert "-c /app/constraints.txt" in text and in_image("/app/jobs/mistral4.py") == REPO / "jobs" / "mistral4.py"


def test_containerfile_installs_dependencies_before_it_copies_the_package_and_names_its_cuda():
    """A code change rebuilds the layers after `COPY rayft/` only: the dependency install comes before, reading
    nothing but pyproject.toml and constraints.txt; the package goes in with --no-deps. The CUDA the image declares
    is the base image's tag."""
    lines = [line.strip() for line in (REPO / "cluster" / "Containerfile").read_text().splitlines()]
    copies = [i for i, line in enumerate(lines) if line.startswith("COPY")]
    package = next(i for i in copies if "rayft/" in lines[i].split())
    deps = next(i for i, line in enumerate(lines) if "pip install" in line and "-c /app/constraints.txt" in line)
    assert deps < package
    assert all(set(lines[i].split()[2:-1]) <= {"pyproject.toml", "constraints.txt"} for i in copies if i < deps)
    assert any("pip install --no-cache-dir --no-deps /app" in line for line in lines[package:])
    text = "\n".join(lines)
    tag = re.search(r"^FROM \S+-cu(\d+)(\d)$", text, re.M)
    assert re.search(rf'io\.rayft\.cuda="{tag[1]}\.{tag[2]}"', text) and "io.rayft.nccl=" in text


def test_monitoring_flags_render_grafana_settings_a_pod_monitor_and_the_dashboard(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    hosts = {
        "--prometheus-host": "http://prometheus-operated.monitoring:9090",
        "--grafana-host": "http://grafana.monitoring:80",
        "--grafana-iframe-host": "https://grafana.example.com",
    }
    docs = render(
        capsys,
        "--config",
        EXAMPLE,
        "--monitoring",
        "--namespace",
        "ml",
        "--name",
        "ft",
        *[a for kv in hosts.items() for a in kv],
    )
    assert set(docs) == {"RayJob", "RayCluster", "PodDisruptionBudget", "PodMonitor", "ConfigMap", *WATCHER_KINDS}
    for doc in docs.values():
        assert validate(doc) == [], doc["kind"]
    spec = docs["RayCluster"]["spec"]
    head = spec["headGroupSpec"]["template"]
    env = {e["name"]: e.get("value") for e in head["spec"]["containers"][0]["env"]}
    assert env["RAY_PROMETHEUS_HOST"] == hosts["--prometheus-host"]
    assert env["RAY_GRAFANA_HOST"] == hosts["--grafana-host"]
    assert env["RAY_GRAFANA_IFRAME_HOST"] == hosts["--grafana-iframe-host"]

    # The PodMonitor selects the head and the GPU workers, by labels both pod templates carry, on a port both name.
    monitor = docs["PodMonitor"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert monitor["metadata"]["namespace"] == "ml" and monitor["spec"]["namespaceSelector"]["matchNames"] == ["ml"]
    pods = [head, *[g["template"] for g in spec["workerGroupSpecs"]]]
    for pod in pods:
        assert selector.items() <= pod["metadata"]["labels"].items(), pod["metadata"]["labels"]
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0].get("ports", [])}
        assert ports.get(endpoint["port"]) == 8080, ports  # Ray's default --metrics-export-port under KubeRay

    # The ConfigMap carries exactly the checked-in dashboard, labelled for Grafana's sidecar.
    config_map = docs["ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = config_map["data"].values()
    assert text == (REPO / "cluster" / "grafana" / "rayft-dashboard.json").read_text()

    # Without the flags nothing of this is rendered; --out writes one file per manifest.
    plain = render(capsys, "--config", EXAMPLE)
    assert set(plain) == {"RayJob", "RayCluster", "PodDisruptionBudget", *WATCHER_KINDS}
    plain_env = {
        e["name"] for e in plain["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert not {"RAY_PROMETHEUS_HOST", "RAY_GRAFANA_HOST", "RAY_GRAFANA_IFRAME_HOST"} & plain_env
    assert cli.main(["k8s", "render", "--config", EXAMPLE, "--monitoring", "--out", str(tmp_path)]) == cli.EXIT_OK
    written = sorted(p.name for p in tmp_path.glob("*.yaml"))
    plain_files = ["grafana-dashboard.yaml", "head-budget.yaml", "podmonitor.yaml", "raycluster.yaml", "rayjob.yaml"]
    assert written == sorted([*plain_files, *WATCHER_FILES])
    capsys.readouterr()
    assert cli.main(["k8s", "validate", *map(str, tmp_path.glob("*.yaml"))]) == cli.EXIT_OK


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--grafana-host", "grafana:3000"], "--grafana-host: 'grafana:3000' is not a URL"),
        (["--grafana-iframe-host", "https://g.example.com"], "--grafana-iframe-host needs --grafana-host"),
    ],
)
def test_monitoring_flags_refuse_bad_urls(capsys, monkeypatch, args: list[str], says: str):
    monkeypatch.chdir(REPO)
    assert says in render_error(capsys, "--config", EXAMPLE, *args)


def test_pod_monitor_shape_check_names_the_field():
    from rayft.deploy import monitoring

    good = monitoring.pod_monitor("ft", "ml", {"rayft.io/job": "ft"})
    assert validate(good) == []
    bad = copy.deepcopy(good)
    bad["spec"]["podMetricsEndpoints"][0]["port"] = 8080  # the operator wants the port's name
    del bad["spec"]["selector"]
    assert [p.split(":")[0] for p in validate(bad)] == ["spec", "spec.podMetricsEndpoints.0.port"], validate(bad)


def test_api_server_rules_no_schema_states_for_labels_selectors_and_tolerations():
    """The CRDs say only "string" for these: the API server refuses them when the manifests are applied (the pod
    templates' only when the operator creates the pods, and the job waits for its deadline)."""
    worker = lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]  # noqa: E731
    pod = lambda d: worker(d)["spec"]  # noqa: E731
    _breaks(
        lambda d: pod(d)["tolerations"].append({"key": "gpu", "operator": "Exist"}),
        "spec.tolerations[1].operator: 'Exist' is neither of Equal, Exists",
    )
    _breaks(
        lambda d: pod(d)["tolerations"].append({"key": "gpu", "operator": "Exists", "effect": "NoSchedul"}),
        "spec.tolerations[1].effect: 'NoSchedul' is none of NoSchedule, PreferNoSchedule, NoExecute",
    )
    _breaks(
        lambda d: pod(d)["tolerations"].append({"operator": "Equal", "value": "x"}),
        "an empty key (every taint) needs operator Exists",
    )
    _breaks(
        lambda d: pod(d)["tolerations"].append({"key": "a", "operator": "Exists", "value": "x"}),
        "value: must be empty with operator Exists",
    )
    _breaks(
        lambda d: pod(d)["tolerations"].append({"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}),
        "tolerationSeconds: only with effect NoExecute",
    )
    _breaks(
        lambda d: pod(d).update(nodeSelector={"pool": "gpu nodes"}),
        "spec.nodeSelector.pool: value 'gpu nodes' is not a valid label value",
    )
    _breaks(
        lambda d: worker(d)["metadata"].setdefault("labels", {}).update({"team/a/b": "x"}),
        "key 'team/a/b': its prefix 'team/a' must be a DNS subdomain",
    )
    _breaks(
        lambda d: d["metadata"].setdefault("labels", {}).update({"owner": "x" * 64}), "metadata.labels.owner: value"
    )
    _breaks(lambda d: d["metadata"].setdefault("annotations", {}).update({"-bad": "ok"}), "key '-bad'")
    assert validate(_job()) == []  # the checked-in job passes every rule


def test_k8s_values_are_refused_all_at_once_before_rendering(capsys, monkeypatch):
    """Values in the config's k8s section that the API server or Kueue would refuse: every one named at once."""
    monkeypatch.chdir(REPO)
    err = render_error(
        capsys,
        "--config",
        EXAMPLE,
        "--override",
        "k8s.queueing=kueue",
        "--override",
        "k8s.queue=Team_A",
        "--override",
        "k8s.tolerations=[{key: nvidia.com/gpu, operator: exists}]",
        "--override",
        "k8s.labels={cost-center: research lab}",
        "--override",
        "k8s.priority_class_name=High",
    )
    for says in (
        "k8s.queue: 'Team_A' is not a valid object name",
        "k8s.tolerations[0].operator: 'exists'",
        "k8s.labels.cost-center: value 'research lab'",
        "k8s.priority_class_name: 'High'",
    ):
        assert says in err, err
