"""KubeRay manifests rendered from the training config, so that pods, GPUs and paths can never disagree with it.

One Ray worker per GPU (FSDP2 drives one device per rank): `ray.num_workers` = worker pods × GPUs per pod, a pod
holding `ray.workers_per_node` GPUs and the node's CPUs and memory in proportion (`rayft.deploy.nodes`). Every GPU
pod gets a memory-backed /dev/shm and the NCCL environment, and, where the config names an RDMA fabric, the RDMA
plumbing (the device, IPC_LOCK, a secondary network if one is named); head and workers mount one PVC at the same
path, which holds the model, the data and the Ray storage path, so a checkpoint written by any worker is seen by all
and outlives the cluster.
"""

from __future__ import annotations

import copy
import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from rayft import environment
from rayft.config import Config, ConfigError, NcclConfig, is_uri
from rayft.deploy import auth, budget, platform, reach, start_watch_manifests
from rayft.deploy.crd import MAX_NAME, name_problems
from rayft.deploy.nodes import WorkerPods, placement_notes, worker_pods
from rayft.hub import is_hub_name
from rayft.kube.apirules import quantity_bytes
from rayft.kube.kuberay import (
    DELETION_GATE,
    DELETION_STRATEGY_SINCE,
    GATES_ON_BY_DEFAULT_SINCE,
    PRE_RUNNING_DEADLINE_SINCE,
    Operator,
    dotted,
)
from rayft.kube.settings import K8sConfig
from rayft.parallel.backend import nccl_env

RAY_VERSION = "2.60.0"
IMAGE_ROOT = PurePosixPath("/app")  # where cluster/Containerfile puts the repository's jobs/
IMAGE_DIRS = ("jobs",)  # copied into the image as they are: configs there are found by the entrypoint
RDMA_SHARED_DEVICE = "rdma/rdma_shared_device_a"  # the RDMA shared device plugin's resource (its documented default)
MULTUS_INTERFACE = "net1"  # the name Multus gives a pod's first secondary interface
# NCCL_IB_GID_INDEX with roce where nothing names it: on most RoCE NICs (ConnectX with IPv4 addressing) index 3 is
# the RoCE v2 GID of the IPv4 address; 0 and 1 are link-local, RoCE v1 among them, which routed fabrics drop.
ROCE_GID_INDEX = 3
CONFIG_ENV = environment.CONFIG_YAML.name  # the inlined config, read by `--config env:RAYFT_CONFIG_YAML`


@dataclass(frozen=True)
class Deployment:
    """The cluster side of a run: what the training config cannot know (flags of `rayft k8s render`)."""

    name: str = "rayft"
    namespace: str = "default"
    image: str = "registry.example.com/rayft:0.1.0"
    pvc: str = "rayft-data"
    mount_path: str = "/data"
    gpus_per_pod: int | None = None  # None: ray.workers_per_node (another value is refused)
    gpu_resource: str = "nvidia.com/gpu"
    worker_cpus: int | None = None  # None: the node's CPUs in proportion to the pod's GPUs (k8s.node)
    worker_memory: str | None = None  # None: likewise of the node's memory
    shm_size: str = "64Gi"  # memory-backed: counted in the pod's memory limit
    head_cpus: int = 8
    head_memory: str = "32Gi"
    head_shm_size: str = "8Gi"  # the head's memory-backed /dev/shm (Ray's object store spills there)
    # NCCL_IB_HCA where the config's nccl.ib_hca leaves it open (None: NCCL's own choice); with a fabric only.
    ib_hca: str | None = None
    # RayJob lifetime: seconds allowed to reach Running (image pull, scheduling), to run, and to keep the finished
    # cluster around for its logs.
    pre_running_deadline_s: int = 1800
    active_deadline_s: int = 3 * 24 * 3600
    ttl_after_finished_s: int = 3600
    # Fresh clusters after a failed job (None: derived from ray.max_failures, see backoff_limit).
    backoff_limit: int | None = None
    # Charts: the Ray dashboard's Metrics tab embeds Grafana once these are set on the head (in-cluster Prometheus
    # and Grafana URLs; the Grafana URL the user's browser reaches); `monitoring` adds a PodMonitor for head and
    # workers and rayft's Grafana dashboard as a ConfigMap for Grafana's sidecar.
    prometheus_host: str | None = None
    grafana_host: str | None = None
    grafana_iframe_host: str | None = None
    monitoring: bool = False

    def check(self) -> None:
        if name_problems("RayJob", self.name):
            raise ConfigError(
                f"--name: '{self.name}' is not a valid RayJob name (lower-case letters, digits and '-', starting "
                f"with a letter, at most {MAX_NAME['RayJob']} characters)"
            )
        if self.gpus_per_pod is not None and self.gpus_per_pod < 1:
            raise ConfigError(f"--gpus-per-pod: must be at least 1, got {self.gpus_per_pod}")
        if self.worker_cpus is not None and self.worker_cpus < 1:
            raise ConfigError(f"--worker-cpus: must be at least 1, got {self.worker_cpus}")
        for flag, size in (
            ("--worker-memory", self.worker_memory),
            ("--shm-size", self.shm_size),
            ("--head-memory", self.head_memory),
            ("--head-shm-size", self.head_shm_size),
        ):
            try:
                if size is not None:
                    quantity_bytes(size)
            except ValueError as e:
                raise ConfigError(f"{flag}: {e}") from None
        if not PurePosixPath(self.mount_path).is_absolute():
            raise ConfigError(f"--mount-path: '{self.mount_path}' must be an absolute path")
        deadlines = {
            "--pre-running-deadline": self.pre_running_deadline_s,
            "--active-deadline": self.active_deadline_s,
            "--ttl": self.ttl_after_finished_s,
        }
        for flag, value in deadlines.items():
            if value < 1:
                raise ConfigError(f"{flag}: must be a positive number of seconds, got {value}")
        hosts = {
            "--prometheus-host": self.prometheus_host,
            "--grafana-host": self.grafana_host,
            "--grafana-iframe-host": self.grafana_iframe_host,
        }
        for flag, url in hosts.items():
            if url is not None and not url.startswith(("http://", "https://")):
                raise ConfigError(f"{flag}: '{url}' is not a URL; give it with its scheme, e.g. http://grafana:3000")
        if self.grafana_iframe_host and not self.grafana_host:
            raise ConfigError("--grafana-iframe-host needs --grafana-host (the in-cluster Grafana the head checks)")


@dataclass(frozen=True)
class JobSource:
    """The config as the job will read it: its path inside the cluster and the overrides given with it; or its
    text (`inline`), carried in the RayJob so that a config change needs no image rebuild and no PVC copy."""

    config_in_cluster: str
    overrides: tuple[str, ...] = ()
    inline: str | None = None


def config_in_cluster(config: Path, repo: Path, mount_path: str, given: str | None = None) -> str:
    """Where the pods find the config: baked into the image (under jobs/) or on the PVC (`given`)."""
    if given is not None:
        path = PurePosixPath(given)
        if not (_under(path, PurePosixPath(mount_path)) or _under(path, IMAGE_ROOT)):
            raise ConfigError(
                f"--config-in-cluster: {given} is neither on the PVC ({mount_path}) nor in the image ({IMAGE_ROOT})"
            )
        return given
    config = config.resolve()
    for directory in IMAGE_DIRS:
        if _under(PurePosixPath(config), PurePosixPath((repo / directory).resolve())):
            return str(IMAGE_ROOT / config.relative_to(repo.resolve()).as_posix())
    raise ConfigError(
        f"--config: {config} is not in the image; put it under {', '.join(f'{repo}/{d}/' for d in IMAGE_DIRS)} "
        f"(and rebuild the image), or copy it to the PVC and name its path there with --config-in-cluster "
        f"{mount_path}/..."
    )


def render(
    cfg: Config, job: JobSource, dep: Deployment, workers: WorkerPods, plat: K8sConfig | None = None
) -> dict[str, dict[str, Any]]:
    """{"rayjob": RayJob, "raycluster": RayCluster} for this config and the worker pods `check_fits` found for it.
    `plat`: the platform's settings (default: the config's `k8s:` section)."""
    plat = plat or cfg.k8s
    spec = cluster_spec(dep, workers, plat, cfg.nccl)
    standalone = copy.deepcopy(spec)
    kuberay = operator(plat)
    secret = auth.secret_name(plat, dep.name)
    auth.secure_cluster(spec, plat, kuberay, secret, standalone=False)
    auth.secure_cluster(standalone, plat, kuberay, secret, standalone=True)
    submitter = platform.submitter_template(dep.image, _labels(dep), plat)
    auth.secure_submitter(submitter, plat, kuberay, secret)
    config = f"env:{CONFIG_ENV}" if job.inline is not None else job.config_in_cluster
    entrypoint = " ".join(
        ["python", str(IMAGE_ROOT / "jobs" / "mistral4.py"), "--config", shlex.quote(config)]
        + [f"--override {shlex.quote(o)}" for o in job.overrides]
    )
    queued = plat.queueing == "kueue"
    job_spec: dict[str, Any] = {
        "entrypoint": entrypoint,
        "submissionMode": "K8sJobMode",
        **({"suspend": True} if queued else {}),  # Kueue admits (unsuspends) it when the queue has room
        **lifetime(dep, plat),
        "activeDeadlineSeconds": dep.active_deadline_s,
        **({"preRunningDeadlineSeconds": dep.pre_running_deadline_s} if kuberay.pre_running_deadline else {}),
        "backoffLimit": backoff_limit(cfg, dep),
        **runtime_env(job, plat),
        "submitterPodTemplate": submitter,
        "rayClusterSpec": spec,
    }
    rayjob = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": _metadata(dep, dep.name, plat),
        "spec": job_spec,
    }
    raycluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": _metadata(dep, f"{dep.name}-cluster", plat),
        "spec": standalone,
    }
    head_budget = budget.head_budget(_metadata(dep, f"{dep.name}-head", plat), _labels(dep))
    policy = reach_manifests(dep, plat)
    return {
        "rayjob": rayjob,
        "raycluster": raycluster,
        "head-budget": head_budget,
        **policy,
        **monitoring_manifests(dep),
        **start_watch(dep, plat),
    }


def lifetime(dep: Deployment, plat: K8sConfig) -> dict[str, Any]:
    """What happens to the cluster once the job ends. Where the operator accepts a deletion strategy, deletion
    rules: on failure the GPU workers go at once (the head stays for its logs) and the whole cluster after the
    TTL; on success the cluster after the TTL. Other operators, and suspended (Kueue) jobs, which KubeRay requires
    to have shutdownAfterJobFinishes, get the pair every release accepts: the whole cluster after the TTL."""
    if uses_deletion_rules(plat):
        ttl = dep.ttl_after_finished_s
        rules = [
            {"condition": {"jobStatus": "FAILED", "ttlSeconds": 0}, "policy": "DeleteWorkers"},
            {"condition": {"jobStatus": "FAILED", "ttlSeconds": ttl}, "policy": "DeleteCluster"},
            {"condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": ttl}, "policy": "DeleteCluster"},
        ]
        return {"deletionStrategy": {"deletionRules": rules}}
    return {"shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": dep.ttl_after_finished_s}


def operator(plat: K8sConfig) -> Operator:
    """The KubeRay operator these settings render for (`k8s.kuberay_version`, `k8s.kuberay_feature_gates`)."""
    return Operator.of(plat.kuberay_version, plat.kuberay_feature_gates)


def uses_deletion_rules(plat: K8sConfig) -> bool:
    return operator(plat).deletion_strategy and plat.queueing != "kueue"


def notes(
    plat: K8sConfig, pods: WorkerPods | None = None, dep: Deployment | None = None, nccl: NcclConfig | None = None
) -> list[str]:
    """What the rendered RayJob cannot ask of this operator, or leaves unused on the nodes, what it chose of the
    site for want of a setting, and what to create before applying it, for the user to read beside the manifests."""
    kuberay = operator(plat)
    dep = dep or Deployment()
    out = auth.notes(plat, kuberay, auth.secret_name(plat, dep.name), dep.namespace)
    out += placement_notes(pods, plat.node) if pods is not None else []
    out += gid_index_note(plat, nccl or NcclConfig())
    if plat.kuberay_version is None:
        out.append(f"k8s.kuberay_version unset: rendered for {kuberay}, which every supported operator accepts")
    out += start_watch_notes(plat, dep)
    if plat.queueing != "kueue" and not uses_deletion_rules(plat):
        since, gated = dotted(GATES_ON_BY_DEFAULT_SINCE[DELETION_GATE]), dotted(DELETION_STRATEGY_SINCE)
        out.append(
            f"{kuberay}: no deletion rules (from {since}; {gated} with the {DELETION_GATE} gate): a failed "
            "job holds its GPUs until the TTL"
        )
    return out


def start_watch_notes(plat: K8sConfig, dep: Deployment) -> list[str]:
    """What bounds the wait for a job that never starts, where the operator has no preRunningDeadlineSeconds; and
    where deletion rules cannot free the GPUs of a job failed that way (they match the Ray job's status, which a job
    that never started lacks: KubeRay 1.5's handleDeletionRules)."""
    kuberay = operator(plat)
    if kuberay.pre_running_deadline:
        return []
    since, deadline = dotted(PRE_RUNNING_DEADLINE_SINCE), _hours(dep.pre_running_deadline_s)
    queued = " (counted from admission under Kueue)" if plat.queueing == "kueue" else ""
    out = [
        f"{kuberay}: no preRunningDeadlineSeconds (from {since}); the Job {dep.name}{start_watch_manifests.SUFFIX} "
        f"fails the RayJob (DeadlineExceeded) that is not running --pre-running-deadline ({deadline}) after it "
        f"began initializing{queued}, by lowering its activeDeadlineSeconds; apply its ServiceAccount, Role and "
        f"RoleBinding with it; from {since} (--kuberay-version) the operator bounds the wait itself"
    ]
    if uses_deletion_rules(plat):
        out.append(
            f"{kuberay}: a RayJob failed before it ran keeps its cluster (deletion rules match the Ray job's "
            f"status, which it never had): delete it, kubectl delete rayjob {dep.name} -n {dep.namespace}"
        )
    return out


def _hours(seconds: int) -> str:
    """A deadline as a note states it: '72 h', '0.5 h'."""
    return f"{seconds / 3600:g} h"


def runtime_env(job: JobSource, plat: K8sConfig) -> dict[str, str]:
    """spec.runtimeEnvYAML: the inlined config as an environment variable of the job's driver, or the
    working_dir URI the config is read from; nothing when the config is a path in the image or on the PVC."""
    env: dict[str, Any] = {}
    if job.inline is not None:
        env["env_vars"] = {CONFIG_ENV: job.inline}
    if plat.config_delivery == "working_dir":
        env["working_dir"] = plat.working_dir
    return {"runtimeEnvYAML": to_yaml(env)} if env else {}


def reach_manifests(dep: Deployment, plat: K8sConfig) -> dict[str, dict[str, Any]]:
    """{"network-policy": …} with `k8s.network_policy`, else nothing."""
    if not plat.network_policy:
        return {}
    meta = _metadata(dep, f"{dep.name}-reach", plat)
    return {"network-policy": reach.network_policy(meta, _labels(dep), plat.network_policy_admits, dep.monitoring)}


def start_watch(dep: Deployment, plat: K8sConfig) -> dict[str, dict[str, Any]]:
    """The start watcher's Job, ServiceAccount, Role and RoleBinding where the operator has no
    preRunningDeadlineSeconds (`start_watch_manifests`), else nothing. Their objects carry rayft's labels and the
    platform's, not the queue's: the watcher must run while the RayJob waits in a queue."""
    if operator(plat).pre_running_deadline:
        return {}
    meta = _metadata(dep, dep.name)
    meta["labels"] = {**meta["labels"], **plat.labels}
    if plat.annotations:
        meta["annotations"] = dict(plat.annotations)
    deadlines = (dep.pre_running_deadline_s, dep.active_deadline_s, dep.ttl_after_finished_s)
    return start_watch_manifests.manifests(dep.name, meta, _labels(dep), dep.image, deadlines, plat)


def monitoring_manifests(dep: Deployment) -> dict[str, dict[str, Any]]:
    """{"podmonitor": …, "grafana-dashboard": …} with `monitoring`, else nothing."""
    if not dep.monitoring:
        return {}
    from rayft.deploy import grafana, monitoring

    return {
        "podmonitor": monitoring.pod_monitor(dep.name, dep.namespace, _labels(dep)),
        "grafana-dashboard": monitoring.dashboard_config_map(dep.name, dep.namespace, _labels(dep), grafana.render()),
    }


def check_fits(cfg: Config, dep: Deployment, plat: K8sConfig | None = None) -> WorkerPods:
    """The GPU worker pods; refuses configs these pods could not run, or nodes could not hold."""
    dep.check()
    plat = plat or cfg.k8s
    r = cfg.ray
    if r.num_workers < 1:
        raise ConfigError(f"ray.num_workers: must be at least 1, got {r.num_workers}")
    if r.use_gpu is False:
        raise ConfigError("ray.use_gpu: false, but these manifests are for GPU pods; set ray.use_gpu: true or null")
    if r.address not in (None, "auto"):
        raise ConfigError(f"ray.address: '{r.address}'; inside the RayJob the job joins its own cluster, set null")
    gpus = (r.resources_per_worker or {}).get("GPU", 1)
    if gpus != 1:
        raise ConfigError(
            f"ray.resources_per_worker.GPU: {gpus}; each worker drives one GPU (one FSDP2 rank), so set it to 1 "
            "and give ray.num_workers = pods × --gpus-per-pod"
        )
    if plat.fabric == "none" and dep.ib_hca:
        raise ConfigError(
            "--ib-hca: names InfiniBand adapters, but k8s.fabric is none; add --fabric infiniband or roce"
        )
    pods = worker_pods(r, plat.node, plat.one_pod_per_node, dep.gpus_per_pod, dep.worker_cpus, dep.worker_memory)
    if quantity_bytes(dep.shm_size) >= pods.memory:
        raise ConfigError(
            f"--shm-size: {dep.shm_size} of /dev/shm is counted in the pod's memory, "
            f"{pods.memory_quantity}; make it smaller"
        )
    mount = PurePosixPath(dep.mount_path)
    for key, path in (
        ("ray.storage_path", cfg.ray.storage_path or cfg.train.output_dir),
        ("train.output_dir", cfg.train.output_dir),
        ("model.model_name_or_path", cfg.model.model_name_or_path),
        ("model.tokenizer_name_or_path", cfg.model.tokenizer_name_or_path),
    ):
        if is_hub_name(path) and key.startswith("model."):
            continue  # a hub name: resolved in the job through HF_HOME, which is on the PVC
        if key == "ray.storage_path" and cfg.ray.storage_path is None:
            key = "ray.storage_path (= train.output_dir)"
        if path is None or (is_uri(path) and key.startswith("ray.storage_path")):
            continue  # no such path, or checkpoints on object storage: every pod reaches it anyway
        if not _under(PurePosixPath(path), mount):
            raise ConfigError(
                f"{key}: {path} is not on the PVC mounted at {dep.mount_path}; every pod must see it (and "
                f"checkpoints must outlive the cluster): use a path under {dep.mount_path}/ or --mount-path"
            )
    data = cfg.data.dataset_name_or_path
    if data.startswith(("/", "./", "../", "~")) and not _under(PurePosixPath(data), mount):
        raise ConfigError(f"data.dataset_name_or_path: {data} is not on the PVC mounted at {dep.mount_path}")
    hf_home = PurePosixPath(platform.hf_env(plat, dep.mount_path)["HF_HOME"])
    if not _under(hf_home, mount):
        raise ConfigError(
            f"k8s.hf_home: {hf_home} is not on the PVC mounted at {dep.mount_path}; every pod must "
            "share one Hugging Face cache"
        )
    return pods


def backoff_limit(cfg: Config, dep: Deployment) -> int:
    """Ray Train already survives `ray.max_failures` worker or node losses inside one cluster; the RayJob adds one
    fresh cluster (resuming from the latest checkpoint on the PVC) for what Ray cannot survive, such as losing the
    head pod. With unlimited Ray retries (-1) a failed job is not worth a new cluster."""
    if dep.backoff_limit is not None:
        return dep.backoff_limit
    return 0 if cfg.ray.max_failures == -1 else 1


def cluster_spec(
    dep: Deployment, pods: WorkerPods, plat: K8sConfig | None = None, nccl: NcclConfig | None = None
) -> dict[str, Any]:
    """The RayCluster spec: one head group (driver, dashboard) and one GPU worker group of these pods, with the
    platform's settings applied to both pod templates."""
    plat = plat or K8sConfig()
    head, worker = _head_group(dep, plat), _worker_group(dep, pods, plat, nccl or NcclConfig())
    platform.apply_to_pod(head["template"], plat, "head")
    platform.apply_to_pod(worker["template"], plat, "worker")
    return {"rayVersion": RAY_VERSION, "headGroupSpec": head, "workerGroupSpecs": [worker]}


def _pvc(dep: Deployment, shm_size: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A pod's volumes and their mounts: the shared PVC, and a memory-backed /dev/shm of `shm_size`."""
    volumes = [
        {"name": "data", "persistentVolumeClaim": {"claimName": dep.pvc}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
    ]
    mounts = [{"name": "data", "mountPath": dep.mount_path}, {"name": "dshm", "mountPath": "/dev/shm"}]
    return volumes, mounts


def _head_group(dep: Deployment, plat: K8sConfig) -> dict[str, Any]:
    volumes, mounts = _pvc(dep, dep.head_shm_size)
    container = {
        "name": "ray-head",
        "image": dep.image,
        "ports": [
            {"containerPort": 6379, "name": "gcs-server"},
            {"containerPort": reach.DASHBOARD_PORT, "name": "dashboard"},
            {"containerPort": 10001, "name": "client"},
            {"containerPort": 8080, "name": "metrics"},
        ],
        "env": _env(head_env(dep, plat)),
        "resources": _requests_are_limits({"cpu": str(dep.head_cpus), "memory": dep.head_memory}),
        "volumeMounts": mounts,
    }
    return {
        "serviceType": "ClusterIP",
        # Ray's own dashboard and job API on all interfaces, for `kubectl port-forward` and the submitter pod;
        # no CPUs or GPUs for Ray to schedule there, so no training or data task lands beside the driver.
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0", "num-gpus": "0"},
        "template": {"metadata": {"labels": _labels(dep)}, "spec": {"containers": [container], "volumes": volumes}},
    }


def _worker_group(dep: Deployment, pods: WorkerPods, plat: K8sConfig, nccl: NcclConfig) -> dict[str, Any]:
    volumes, mounts = _pvc(dep, dep.shm_size)
    rdma = plat.fabric != "none"
    limits = {"cpu": str(pods.cpus), "memory": pods.memory_quantity, dep.gpu_resource: str(pods.gpus)}
    resource = rdma_resource(plat)
    if resource:
        limits[resource] = "1"
    labels = {**_labels(dep), "rayft.io/role": "gpu-worker"}
    metadata: dict[str, Any] = {"labels": labels}
    if rdma and plat.rdma.network:
        metadata["annotations"] = {"k8s.v1.cni.cncf.io/networks": plat.rdma.network}
    container = {
        "name": "ray-worker",
        "image": dep.image,
        "env": _env(gpu_env(dep, plat, nccl)),
        **({"ports": [{"containerPort": 8080, "name": "metrics"}]} if dep.monitoring else {}),
        "resources": _requests_are_limits(limits),
        # RDMA pins memory for the NIC: without IPC_LOCK, ibv_reg_mr fails and NCCL drops to TCP.
        # Without RDMA the capability is not asked for (restricted pod security refuses it).
        **({"securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}} if rdma else {}),
        "volumeMounts": mounts,
        **preemption_notice(plat.preemption_notice_s),
    }
    spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "tolerations": [{"key": dep.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}],
    }
    if plat.preemption_notice_s:
        spec["terminationGracePeriodSeconds"] = plat.preemption_notice_s + STOP_MARGIN_S
    if plat.one_pod_per_node:  # each pod owns its node's NIC, and a lost node takes one pod's ranks
        term = {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}
        spec["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {
        "groupName": "gpu",
        # KubeRay keeps `replicas` pods, creating each lost one again (Pending until there is capacity); an
        # elastic run goes on with at least minReplicas of them meanwhile, and grows back when they return.
        "replicas": pods.pods,
        "minReplicas": pods.fewest,
        "maxReplicas": pods.pods,
        "rayStartParams": {},
        "template": {"metadata": metadata, "spec": spec},
    }


STOP_MARGIN_S = 30  # after the notice: Ray's own shutdown on SIGTERM, before Kubernetes kills the container
GCS_PORT = 6379  # the head's GCS, KubeRay's default port


def preemption_notice(seconds: int) -> dict[str, Any]:
    """A GPU worker container's preStop hook: a stopping pod drains its own Ray node (Ray Core's drain API, a
    preemption with a deadline of `seconds`), which Ray Train passes to the workers as a preemption notice, then
    waits out the deadline. The drain is asked through `ray drain-node` (Ray's CLI for that API) at the head's GCS
    (KubeRay's FQ_RAY_IP in worker pods); a pod whose drain fails still waits, and stops as it would have."""
    if not seconds:
        return {}
    address = f"${{FQ_RAY_IP:+--address $FQ_RAY_IP:{GCS_PORT}}}"
    reason = '--reason DRAIN_NODE_REASON_PREEMPTION --reason-message "pod $HOSTNAME stopping"'
    drain = f"ray drain-node {address} {reason} --deadline-remaining-seconds {seconds}"
    return {"lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", f"{drain} || true; sleep {seconds}"]}}}}


def head_env(dep: Deployment, plat: K8sConfig) -> dict[str, str]:
    """The driver runs on the head: Ray Train's run state for the dashboard, Hugging Face caches on the PVC; the
    dashboard (also on the head) finds Prometheus and Grafana through RAY_*_HOST."""
    env = {
        "RAY_TRAIN_ENABLE_STATE_TRACKING": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **platform.hf_env(plat, dep.mount_path),
    }
    hosts = {
        "RAY_PROMETHEUS_HOST": dep.prometheus_host,
        "RAY_GRAFANA_HOST": dep.grafana_host,
        "RAY_GRAFANA_IFRAME_HOST": dep.grafana_iframe_host,
    }
    return {**env, **{k: v for k, v in hosts.items() if v}}


def rdma_resource(plat: K8sConfig) -> str | None:
    """The RDMA device resource a GPU pod asks for: none without a fabric, '' (given) for none at all."""
    if plat.fabric == "none":
        return None
    return plat.rdma.resource if plat.rdma.resource is not None else RDMA_SHARED_DEVICE


def gid_index(plat: K8sConfig, nccl: NcclConfig) -> int | None:
    """NCCL_IB_GID_INDEX of the GPU pods: the config's `nccl` section's (which the workers also get through Ray),
    else `k8s.rdma.gid_index`, else with RoCE the usual RoCE v2 index: without one NCCL may pick a link-local or
    RoCE v1 GID, whose traffic a routed fabric drops, and the job hangs in its first collective."""
    if nccl.ib_gid_index is not None:
        return nccl.ib_gid_index
    if plat.rdma.gid_index is not None:
        return plat.rdma.gid_index
    return ROCE_GID_INDEX if plat.fabric == "roce" else None


def gid_index_note(plat: K8sConfig, nccl: NcclConfig) -> list[str]:
    """The note that a RoCE render chose the GID index itself: a site fact the user should confirm, as the
    operator's release is when `k8s.kuberay_version` is unset."""
    if plat.fabric != "roce" or nccl.ib_gid_index is not None or plat.rdma.gid_index is not None:
        return []
    return [
        f"k8s.fabric: roce without k8s.rdma.gid_index (--ib-gid-index) or nccl.ib_gid_index: rendered "
        f"NCCL_IB_GID_INDEX={ROCE_GID_INDEX}, RoCE v2 over IPv4 on most NICs; check `show_gids` on a GPU node"
    ]


def gpu_env(dep: Deployment, plat: K8sConfig, nccl: NcclConfig) -> dict[str, str]:
    """NCCL's settings (the seeds' socket settings; with a fabric, their InfiniBand transport settings, and the
    fabric's interface and `--ib-hca` where the config's `nccl` section, which the training workers also get through
    Ray, leaves them open) and the allocator settings."""
    rdma: dict[str, str] = {}
    if plat.fabric != "none":
        interface = plat.rdma.interface or (MULTUS_INTERFACE if plat.rdma.network else None)
        nccl = dataclasses.replace(
            nccl,
            ib_hca=nccl.ib_hca or dep.ib_hca,
            ib_gid_index=gid_index(plat, nccl),
            socket_ifname=nccl.socket_ifname or interface,
        )
        rdma = {
            "NCCL_IB_DISABLE": "0",
            "NCCL_IB_QPS_PER_CONNECTION": "1",
            "NCCL_IB_SPLIT_DATA_ON_QPS": "1",
            "RDMAV_FORK_SAFE": "1",
        }
    return {
        **rdma,
        "NCCL_SOCKET_NTHREADS": "2",
        "NCCL_NSOCKS_PERTHREAD": "2",
        **nccl_env(nccl),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        **platform.hf_env(plat, dep.mount_path),
    }


def _metadata(dep: Deployment, name: str, plat: K8sConfig | None = None) -> dict[str, Any]:
    plat = plat or K8sConfig()
    labels = {**_labels(dep), **plat.labels, **platform.object_labels(plat)}
    meta: dict[str, Any] = {"name": name, "namespace": dep.namespace, "labels": labels}
    if plat.annotations:
        meta["annotations"] = dict(plat.annotations)
    return meta


def _labels(dep: Deployment) -> dict[str, str]:
    return {"app.kubernetes.io/name": "rayft", "rayft.io/job": dep.name}


def _env(values: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in values.items()]


def _requests_are_limits(values: dict[str, str]) -> dict[str, dict[str, str]]:
    """Guaranteed QoS: the kubelet never evicts a training pod for using what it asked for."""
    return {"requests": dict(values), "limits": dict(values)}


def _under(path: PurePosixPath, root: PurePosixPath) -> bool:
    return path.is_absolute() and (path == root or root in path.parents) and ".." not in path.parts


def deployment_from_flags(**flags: Any) -> Deployment:
    """A Deployment from CLI flags, where None means the default."""
    return dataclasses.replace(Deployment(), **{k: v for k, v in flags.items() if v is not None})


class _PlainDumper(yaml.SafeDumper):
    """No &anchors/*aliases for repeated parts: manifests are read by people and by `kubectl diff`."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def to_yaml(doc: dict[str, Any]) -> str:
    """A manifest as block-style YAML in the order it was built, wrapped at 120 columns."""
    return yaml.dump(doc, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False, width=120)
