"""`rayft k8s render`'s flags for the config's `k8s` section, derived from `K8sConfig`'s fields.

Each flag names its key; its type, choices and how repeated values gather (a list, `KEY=VALUE` pairs) come from
the key's type, so a setting is declared once, in the section, and a flag only adds its help line.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from rayft.deploy.platform import key_values, toleration
from rayft.kube.settings import K8sConfig


def _none_is_null(value: str) -> str | None:
    """`--network none`: no network, whatever the config names."""
    return None if value.lower() == "none" else value


def _none_is_empty(value: str) -> str:
    """`--ib-resource none`: no RDMA resource (hostNetwork sites), rather than the default one."""
    return "" if value.lower() == "none" else value


@dataclass(frozen=True)
class KeyFlag:
    """A flag for one key of the `k8s` section (dotted below it: `rdma.network`)."""

    key: str
    help: str = ""
    name: str = ""  # where the flag is not the key's own name: `--priority-class` for priority_class_name
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # one value as the key takes it, where the type cannot say

    @property
    def flag(self) -> str:
        return self.name or "--" + self.key.rpartition(".")[2].replace("_", "-")

    @property
    def dest(self) -> str:
        return self.key.replace(".", "__")


PLATFORM_FLAGS = (
    KeyFlag("queueing"),
    KeyFlag("queue", "the Kueue LocalQueue, Volcano queue or Run:ai project queue"),
    KeyFlag("scheduler_name", "schedulerName of every pod"),
    KeyFlag("priority_class_name", name="--priority-class"),
    KeyFlag("service_account_name", name="--service-account"),
    KeyFlag("image_pull_secrets", name="--image-pull-secret", metavar="NAME"),
    KeyFlag("run_as_user", "pod securityContext", metavar="ID"),
    KeyFlag("run_as_group", "pod securityContext", metavar="ID"),
    KeyFlag("fs_group", "pod securityContext", metavar="ID"),
    KeyFlag("node_selector", "GPU worker pods", name="--node-selector"),
    KeyFlag("tolerations", "every pod", name="--toleration", metavar="KEY[=VALUE][:EFFECT]"),
    KeyFlag("labels", "every pod and object", name="--label"),
    KeyFlag("annotations", "every pod and object", name="--annotation"),
    KeyFlag("env", "every Ray container (no credentials: --secret-env)"),
    KeyFlag("secret_env", "every Ray container, from a Secret's key", metavar="VAR=SECRET/KEY"),
    KeyFlag("auth", "Ray's token authentication (default token; none: anyone reaching the head runs code)"),
    KeyFlag("auth_secret", "the Secret with the Ray token under key auth_token (default <name>-ray-auth)"),
    KeyFlag("auth_k8s_rbac", "the RayCluster lets Kubernetes RBAC authorise Ray requests (KubeRay 1.6 on)"),
    KeyFlag("network_policy", "a NetworkPolicy: the run's pods are reached by each other alone (and the admitted)"),
    KeyFlag(
        "network_policy_admits",
        "pods (by label) admitted to the dashboard / job API port",
        name="--network-policy-admit",
        metavar="LABEL=VALUE",
    ),
    KeyFlag(
        "fabric", "none (default: the pod network), or an RDMA fabric: the RDMA device, IPC_LOCK and NCCL's IB settings"
    ),
    KeyFlag("rdma.network", "a Multus NetworkAttachmentDefinition on the fabric", parse=_none_is_null),
    KeyFlag(
        "rdma.resource",
        "the RDMA extended resource (default with a fabric: rdma/rdma_shared_device_a; or nvidia.com/hostdev, "
        "openshift.io/mellanoxnics, none)",
        name="--ib-resource",
        parse=_none_is_empty,
    ),
    KeyFlag(
        "rdma.interface",
        "NCCL_SOCKET_IFNAME, the pods' interface on the fabric (default: net1 with --network)",
        name="--socket-ifname",
    ),
    KeyFlag(
        "rdma.gid_index",
        "NCCL_IB_GID_INDEX where nccl.ib_gid_index is unset: the RoCE v2 GID's index (`show_gids`; default with "
        "roce: 3, said in a note)",
        name="--ib-gid-index",
    ),
    KeyFlag("node.gpus", "GPUs of a GPU node (default 8)", name="--node-gpus"),
    KeyFlag("node.cpus", "CPUs pods may use on a GPU node (default 96)", name="--node-cpus"),
    KeyFlag(
        "node.memory", "memory pods may use on a GPU node (default 960Gi)", name="--node-memory", metavar="QUANTITY"
    ),
    KeyFlag("node.count", "GPU nodes the job may use; pods they cannot hold are refused", name="--nodes"),
    KeyFlag("one_pod_per_node", "at most one worker pod a node (required anti-affinity)"),
    KeyFlag("hf_home", "the pods' shared Hugging Face cache (default <mount>/hf-cache)"),
    KeyFlag("hf_offline", "HF_HUB_OFFLINE=1 (hub names from the pre-seeded cache only)"),
    KeyFlag("config_delivery", "inline carries the config in the RayJob (no image rebuild)"),
    KeyFlag("working_dir", "runtime_env working_dir URI holding the config"),
    KeyFlag(
        "patches", "strategic-merge or JSON patch file applied after rendering (validated after)", "--patch", "FILE"
    ),
)
KUBERAY_FLAGS = (
    KeyFlag(
        "kuberay_version",
        "the operator's version, 1.4 to 1.7 (default: the form every supported release accepts); the manifests use "
        "its fields and are checked against its CRDs",
    ),
    KeyFlag(
        "kuberay_feature_gates",
        "one the operator runs with beyond its release's defaults "
        "(RayJobDeletionPolicy: deletion rules on KubeRay 1.5)",
        name="--kuberay-feature-gate",
        metavar="GATE",
    ),
)


def add_flags(group: argparse.ArgumentParser | argparse._ArgumentGroup, flags: Iterable[KeyFlag]) -> None:
    """One argparse option a key: a choice of the key's `Literal`, an integer, a switch for true, repeated for a
    list or a mapping (`KEY=VALUE` each)."""
    for f in flags:
        kind = _key_type(f.key)
        # a flag left out leaves no attribute: `--network none` (a null) is then told apart from no --network
        options: dict[str, Any] = {"dest": f.dest, "default": argparse.SUPPRESS}
        options["help"] = f"k8s.{f.key}" + (f": {f.help}" if f.help else "")
        choices = _literal(kind)
        if choices:
            options["choices"] = choices
        elif bool in _members(kind):
            options.update(action="store_const", const=True)
        elif int in _members(kind):
            options.update(type=int, metavar=f.metavar or "N")
        elif _container(kind) in (list, dict):
            metavar = f.metavar or ("KEY=VALUE" if _container(kind) is dict else None)
            options.update(action="append", metavar=metavar)
        else:
            options.update(type=f.parse or str, metavar=f.metavar or f.flag[2:].replace("-", "_").upper())
        group.add_argument(f.flag, **options)


def given(args: argparse.Namespace, flags: Iterable[KeyFlag]) -> dict[str, Any]:
    """What the command line sets, by dotted key, in the form the key takes (mappings from `KEY=VALUE`s,
    tolerations from kubectl's spelling); flags left out are not there."""
    out: dict[str, Any] = {}
    for f in flags:
        if f.dest not in vars(args):
            continue
        value = getattr(args, f.dest)
        if f.key == "tolerations":
            value = [toleration(item) for item in value]
        elif _container(_key_type(f.key)) is dict:
            value = key_values(f.flag, value)
        out[f.key] = value
    return out


def flags_set(args: argparse.Namespace, flags: Iterable[KeyFlag]) -> dict[str, str]:
    """Dotted key (`k8s.node.gpus`) → the flag that sets it on this command line: where a problem is reported."""
    return {f"k8s.{f.key}": f.flag for f in flags if f.dest in vars(args)}


def _key_type(key: str) -> Any:
    """The type of a dotted key of the section (`rdma.network`: `RdmaConfig.network`'s)."""
    kind: Any = K8sConfig
    for part in key.split("."):
        kind = typing.get_type_hints(kind)[part]
    return kind


def _members(kind: Any) -> tuple[Any, ...]:
    """The types a key takes: `int | None` → (int, NoneType)."""
    return typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)


def _literal(kind: Any) -> list[str] | None:
    for member in _members(kind):
        if typing.get_origin(member) is Literal:
            return list(typing.get_args(member))
    return None


def _container(kind: Any) -> type | None:
    for member in _members(kind):
        origin = typing.get_origin(member)
        if origin in (list, dict):
            return typing.cast(type, origin)
    return None
