"""The config's `k8s` section: what a platform requires of every pod (queues, schedulers, placement, security, the
RDMA fabric, the nodes' shape), as data with the rules a value must meet. `rayft.deploy.platform` lays it onto the
rendered manifests."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Annotated, Any, ClassVar, Literal

import pydantic.dataclasses
from annotated_types import Ge

from rayft.kube import apirules, credentials, kuberay
from rayft.schema import (
    SECTION_CONFIG,
    Broken,
    Flag,
    Hint,
    Integer,
    Keyed,
    Listed,
    Section,
    Text,
    broken,
)


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class RdmaConfig(Section):
    """How GPU pods reach an RDMA fabric (`k8s.fabric: infiniband` or `roce`); nothing of it is rendered without one,
    as each setting names something a particular site has installed."""

    section: ClassVar[str] = "k8s.rdma"

    # The device plugin's extended resource that hands a pod the adapters; null: rdma/rdma_shared_device_a (the RDMA
    # shared device plugin's); e.g. nvidia.com/hostdev, openshift.io/mellanoxnics; '' for none (hostNetwork sites).
    resource: Text | None = None
    # A Multus NetworkAttachmentDefinition that gives each pod an interface on the fabric; null: none.
    network: Text | None = None
    # NCCL_SOCKET_IFNAME: that interface in the pod; null: net1 (Multus's first secondary one) with a network,
    # else NCCL's own choice.
    interface: Text | None = None
    # NCCL_IB_GID_INDEX where nccl.ib_gid_index leaves it open: the index of the port's RoCE v2 GID (`show_gids` on
    # a GPU node lists them; site-specific). null: 3 with roce (RoCE v2 over IPv4 on most NICs, said in a note),
    # NCCL's own choice with infiniband (which addresses by LID).
    gid_index: Annotated[Integer, Ge(0), Hint("(or null: 3 with roce)")] | None = None

    def broken(self) -> list[Broken | None]:
        if self.network is None:
            return []
        return [
            broken(p, "network") for p in apirules.dns_subdomain("k8s.rdma.network", self.network.rpartition("/")[2])
        ]


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class NodeShape(Section):
    """The GPU nodes worker pods land on. A pod gets the node's CPUs and memory in proportion to its GPUs, so pods
    of any size fill a node together; `count` lets the renderer refuse a job whose pods would not all fit."""

    section: ClassVar[str] = "k8s.node"

    gpus: Annotated[Integer, Ge(1)] = 8
    # What pods may use of one node: its Allocatable (`kubectl describe node`) less what DaemonSets take.
    cpus: Annotated[Integer, Ge(1)] = 96
    memory: Text = "960Gi"
    # Nodes of this shape the job may use; null: not checked.
    count: Annotated[Integer, Ge(1), Hint("(or null: not checked)")] | None = None

    def broken(self) -> list[Broken | None]:
        try:
            apirules.quantity_bytes(self.memory)
        except ValueError as e:
            return [broken(f"k8s.node.memory: {e}", "memory")]
        return []


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class K8sConfig(Section):
    """What a platform requires of every pod, for `rayft k8s render` (training ignores this section). Flags of
    `rayft k8s render` add to or override these keys; `patches` covers anything no key does."""

    section: ClassVar[str] = "k8s"

    # Queueing: kueue (the RayJob labelled with `queue` and created suspended), volcano or runai (their
    # scheduler and `queue`); none = the default scheduler, or `scheduler_name`.
    queueing: Literal["none", "kueue", "volcano", "runai"] = "none"
    queue: Text | None = None
    scheduler_name: Text | None = None
    priority_class_name: Text | None = None
    service_account_name: Text | None = None
    image_pull_secrets: Listed[Text] = field(default_factory=list)
    # The network NCCL uses between GPU pods: none (the pod network, as the cluster provides it), infiniband or
    # roce (the RDMA device, IPC_LOCK, the IB transport settings, and what `rdma` names).
    fabric: Literal["none", "infiniband", "roce"] = "none"
    rdma: RdmaConfig = field(default_factory=RdmaConfig)
    # The GPU nodes, which size the worker pods (one pod holds ray.workers_per_node GPUs).
    node: NodeShape = field(default_factory=NodeShape)
    # At most one worker pod a node (required anti-affinity), so that each pod has a node's NIC to itself.
    one_pod_per_node: Flag = False
    # When Kubernetes stops a GPU worker pod (its node drained for a spot reclaim, a scale-down, maintenance), the
    # pod first drains its Ray node with this deadline, so the run checkpoints at once (`ray.preemption`), and stays
    # up that long; its termination grace period covers it. 0: no notice.
    preemption_notice_s: Annotated[Integer, Ge(0)] = 30
    # GPU worker placement (the head and the submitter go where the cluster puts CPU pods; `head_node_selector`
    # pins the head). `affinity` is added to rayft's own (`one_pod_per_node`).
    node_selector: Keyed[Text] = field(default_factory=dict)
    head_node_selector: Keyed[Text] = field(default_factory=dict)
    affinity: Keyed[Any] = field(default_factory=dict)
    # On every pod (head, workers, submitter), besides the GPU taint rayft tolerates on the workers.
    tolerations: Listed[Keyed[Any]] = field(default_factory=list)
    labels: Keyed[Text] = field(default_factory=dict)
    annotations: Keyed[Text] = field(default_factory=dict)
    # Pod securityContext of every pod; IPC_LOCK is added to the GPU containers only where RDMA is on.
    run_as_user: Integer | None = None
    run_as_group: Integer | None = None
    fs_group: Integer | None = None
    run_as_non_root: Flag | None = None
    # Extra environment of every Ray container and the submitter; extra volumes (Kubernetes Volume objects) on
    # head and workers, mounted by `volume_mounts` (VolumeMount objects) in their Ray containers. A credential
    # (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, any *_TOKEN, *_PASSWORD, *_API_KEY, ...) is refused in `env`:
    # it goes in a Secret, named in `secret_env` as `VAR: secret-name/key`, which the pods read at start-up.
    env: Keyed[Text] = field(default_factory=dict)
    secret_env: Keyed[Text] = field(default_factory=dict)
    volumes: Listed[Keyed[Any]] = field(default_factory=list)
    volume_mounts: Listed[Keyed[Any]] = field(default_factory=list)
    # The Hugging Face cache of head and workers (HF_HOME, where hub model and dataset names resolve); null =
    # <mount path>/hf-cache on the PVC. hf_offline sets HF_HUB_OFFLINE=1: names resolve from a pre-seeded cache only.
    hf_home: Text | None = None
    hf_offline: Flag = False
    # Ray's token authentication: token (every Ray process, the submitter's included, holds the token from the
    # Secret `auth_secret`, key auth_token, and Ray refuses requests without it), or none (anyone who reaches the
    # head's ports runs code on the cluster: a deliberate choice, warned about). auth_secret null: <--name>-ray-auth.
    # auth_k8s_rbac (KubeRay 1.6 on): the standalone RayCluster lets Kubernetes RBAC decide instead (the `ray:write`
    # verb); KubeRay allows that for RayClusters only, so the RayJob keeps the Secret.
    auth: Literal["token", "none"] = "token"
    auth_secret: Text | None = None
    auth_k8s_rbac: Flag = False
    # A NetworkPolicy over the run's pods: they reach each other on any port, and nothing else reaches them but the
    # pods labelled network_policy_admits (on the dashboard / job API port alone) and, with monitoring, Prometheus
    # on the metrics port. Needs a network plugin that enforces NetworkPolicies.
    network_policy: Flag = False
    network_policy_admits: Keyed[Text] = field(default_factory=dict)
    # The KubeRay operator's version, 1.4 to 1.7 (any patch release): the manifests use what it has and are
    # checked against its CRDs. From 1.6, preRunningDeadlineSeconds, and deletion rules (on failure the GPU
    # workers go at once, the cluster after the TTL; not for Kueue's suspended jobs); 1.5 has the rules only
    # with its RayJobDeletionPolicy feature gate on, named in kuberay_feature_gates. Older, or unknown (null):
    # the form every supported operator accepts (1.4's), shutdownAfterJobFinishes + ttlSecondsAfterFinished,
    # and the time to Running bounded by a start watcher (a small Job beside the RayJob) instead of the operator.
    kuberay_version: Text | None = None
    # Feature gates the operator runs with beyond its release's defaults; rayft reads RayJobDeletionPolicy.
    kuberay_feature_gates: Listed[Text] = field(default_factory=list)
    # How the job finds this config: path (in the image under jobs/, or on the PVC), inline (the config's YAML
    # carried in the RayJob's runtimeEnvYAML), working_dir (a runtime_env working_dir URI holding it).
    config_delivery: Literal["path", "inline", "working_dir"] = "path"
    working_dir: Text | None = None
    # Strategic-merge (YAML mapping, kind + name select the manifest) or RFC 6902 JSON patch files (a list of
    # operations; `target: rayjob|raycluster` beside it), applied after rendering and validated after.
    patches: Listed[Text] = field(default_factory=list)

    def broken(self) -> list[Broken | None]:
        names = {v.get("name") for v in self.volumes}
        return [
            broken(f"k8s.queue: k8s.queueing: {self.queueing} needs the queue's name", "queueing", "queue")
            if self.queueing != "none" and not self.queue
            else None,
            broken("k8s.queue: given without k8s.queueing; set k8s.queueing: kueue, volcano or runai", "queue")
            if self.queueing == "none" and self.queue
            else None,
            broken(
                "k8s.working_dir: needed with k8s.config_delivery: working_dir, and only then",
                "working_dir",
                "config_delivery",
            )
            if (self.config_delivery == "working_dir") != bool(self.working_dir)
            else None,
            broken(f"k8s.hf_home: '{self.hf_home}' must be an absolute path in the pods (on the PVC)", "hf_home")
            if self.hf_home is not None and not self.hf_home.startswith("/")
            else None,
            *(
                broken(f"k8s.volume_mounts[{i}]: name '{m.get('name')}' is none of k8s.volumes", "volume_mounts")
                for i, m in enumerate(self.volume_mounts)
                if m.get("name") not in names
            ),
            *self._kuberay_broken(),
            *self._fabric_broken(),
            *self._api_broken(),
            *self._auth_broken(),
            *self._credentials_broken(),
        ]

    def _auth_broken(self) -> list[Broken | None]:
        release = _release_or_oldest(self.kuberay_version)
        return [
            broken("k8s.auth_secret: given, but k8s.auth is none; set k8s.auth: token", "auth_secret", "auth")
            if self.auth == "none" and self.auth_secret
            else None,
            broken(
                "k8s.network_policy_admits: given, but k8s.network_policy is false; set it true",
                "network_policy_admits",
                "network_policy",
            )
            if self.network_policy_admits and not self.network_policy
            else None,
            broken("k8s.auth_k8s_rbac: needs k8s.auth: token", "auth_k8s_rbac", "auth")
            if self.auth == "none" and self.auth_k8s_rbac
            else None,
            broken(
                f"k8s.auth_k8s_rbac: needs KubeRay {kuberay.dotted(kuberay.AUTH_OPTIONS_SINCE)} or later "
                "(k8s.kuberay_version), whose authOptions has enableK8sTokenAuth",
                "auth_k8s_rbac",
                "kuberay_version",
            )
            if self.auth_k8s_rbac and release is not None and release < kuberay.AUTH_OPTIONS_SINCE
            else None,
            *(
                broken(f"k8s.{where}.{name}: set by rayft from k8s.auth and k8s.auth_secret; remove it", where)
                for where, given in (("env", self.env), ("secret_env", self.secret_env))
                for name in given
                if name in AUTH_NAMES
            ),
        ]

    def _credentials_broken(self) -> list[Broken]:
        both = sorted(set(self.env) & set(self.secret_env))
        return [
            *(broken(p, "env") for p in credentials.literal_problems("k8s.env", self.env) if not _is_auth(p)),
            *(broken(p, "secret_env") for p in credentials.reference_problems("k8s.secret_env", self.secret_env)),
            *(broken(f"k8s.env.{name}: also in k8s.secret_env; give it once", "env", "secret_env") for name in both),
        ]

    def _api_broken(self) -> list[Broken]:
        """What the API server (or Kueue, for the queue-name label) would refuse when the manifests are applied."""
        found = [
            *(broken(p, "labels") for p in apirules.labels("k8s.labels", self.labels)),
            *(broken(p, "annotations") for p in apirules.annotation_keys("k8s.annotations", self.annotations)),
            *(broken(p, "node_selector") for p in apirules.labels("k8s.node_selector", self.node_selector)),
            *(
                broken(p, "head_node_selector")
                for p in apirules.labels("k8s.head_node_selector", self.head_node_selector)
            ),
            *(broken(p, "tolerations") for p in apirules.tolerations("k8s.tolerations", self.tolerations)),
        ]
        named = {
            key: getattr(self, key)
            for key in ("queue", "priority_class_name", "service_account_name", "scheduler_name", "auth_secret")
        }
        named.update({f"image_pull_secrets[{i}]": s for i, s in enumerate(self.image_pull_secrets)})
        for key, value in named.items():
            if value is not None:
                found += [broken(p, key.partition("[")[0]) for p in apirules.dns_subdomain(f"k8s.{key}", value)]
        if self.queue and not apirules.dns_subdomain("k8s.queue", self.queue):
            # Kueue's queue-name label holds it
            found += [broken(p, "queue") for p in apirules.label_value("k8s.queue", self.queue)]
        return found

    def _fabric_broken(self) -> list[Broken]:
        if self.fabric != "none":
            return []
        return [
            broken(
                f"k8s.rdma.{key}: '{value}' is given but k8s.fabric is none, which renders no RDMA; set k8s.fabric: "
                "infiniband or roce (or --fabric)",
                f"rdma.{key}",
                "fabric",
            )
            for key, value in dataclasses.asdict(self.rdma).items()
            if value is not None
        ]

    def _kuberay_broken(self) -> list[Broken]:
        try:
            release = kuberay.minor(self.kuberay_version) or kuberay.OLDEST
        except ValueError as e:
            return [broken(f"k8s.kuberay_version: {e}", "kuberay_version")]
        return [
            broken(f"k8s.kuberay_feature_gates: {problem}", "kuberay_feature_gates")
            for gate in self.kuberay_feature_gates
            if (problem := kuberay.gate_problem(gate, release))
        ]


AUTH_NAMES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")  # Ray's, set from k8s.auth


def _is_auth(problem: str) -> bool:
    """A literal-credential problem about Ray's own token, which the k8s.auth rule reports instead."""
    return any(problem.startswith(f"k8s.env.{name}:") for name in AUTH_NAMES)


def _release_or_oldest(version: str | None) -> tuple[int, int] | None:
    """The operator release `k8s.kuberay_version` names (the oldest when unset); None when it names none (which
    its own rule reports)."""
    try:
        return kuberay.minor(version) or kuberay.OLDEST
    except ValueError:
        return None
