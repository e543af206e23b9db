"""Ray's token authentication on the clusters rayft renders: on by default.

A Ray head runs whatever its job API (the dashboard port) or its GCS is sent, so whoever reaches either from inside
the Kubernetes cluster would own the run's GPUs, its PVC and every credential its pods hold. With `k8s.auth: token`
every Ray process (head, GPU workers, the RayJob's submitter, a worker's `ray drain-node`) holds one token, read
from a Secret the user creates, and Ray refuses requests without it. The token is never in a manifest: KubeRay from
1.6 is handed the Secret's name (`authOptions`), older operators get the Secret as the containers' environment.
"""

from __future__ import annotations

from typing import Any

from rayft.kube.credentials import secret_env
from rayft.kube.kuberay import AUTH_OPTIONS_SINCE, Operator, dotted
from rayft.kube.settings import K8sConfig

TOKEN_KEY = "auth_token"  # the Secret's data key: KubeRay's, so one Secret serves both ways of handing it over
MODE_ENV = "RAY_AUTH_MODE"  # Ray's names (ray._private.authentication)
TOKEN_ENV = "RAY_AUTH_TOKEN"
NAMES = (MODE_ENV, TOKEN_ENV, "RAY_AUTH_TOKEN_PATH")


def secret_name(plat: K8sConfig, job: str) -> str:
    """The Secret holding the token: `k8s.auth_secret`, else `<job name>-ray-auth`."""
    return plat.auth_secret or f"{job}-ray-auth"


def token_env(secret: str) -> list[dict[str, Any]]:
    """What a Ray container needs for token authentication: the mode, and the token from the Secret."""
    return [{"name": MODE_ENV, "value": "token"}, secret_env(TOKEN_ENV, secret, TOKEN_KEY)]


def secure_cluster(spec: dict[str, Any], plat: K8sConfig, kuberay: Operator, secret: str, standalone: bool) -> None:
    """Token authentication on a RayCluster spec: `authOptions` where the operator takes a Secret's name, else the
    token's environment on the head's and every worker group's Ray container. `standalone`: a RayCluster of its
    own (not a RayJob's), the only kind KubeRay lets delegate to Kubernetes RBAC (`k8s.auth_k8s_rbac`)."""
    if plat.auth != "token":
        return
    if kuberay.auth_options:
        delegated = standalone and plat.auth_k8s_rbac
        spec["authOptions"] = {
            "mode": "token",
            **({"enableK8sTokenAuth": True} if delegated else {"secretName": secret}),
        }
        return
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        _add_env(group["template"]["spec"]["containers"][0], token_env(secret))


def secure_submitter(template: dict[str, Any], plat: K8sConfig, kuberay: Operator, secret: str) -> None:
    """The RayJob's submitter pod runs `ray job submit` against the head: it needs the token as much as the head.
    With `authOptions` the operator gives it; else its environment does."""
    if plat.auth == "token" and not kuberay.auth_options:
        _add_env(template["spec"]["containers"][0], token_env(secret))


def _add_env(container: dict[str, Any], env: list[dict[str, Any]]) -> None:
    container["env"] = [*container.get("env", []), *env]


def notes(plat: K8sConfig, kuberay: Operator, secret: str, namespace: str) -> list[str]:
    """How to make the Secret before applying, and where the token is taken from."""
    if plat.auth != "token":
        return []
    how = (
        f"handed to {kuberay} as authOptions.secretName"
        if kuberay.auth_options
        else f"as {MODE_ENV} and {TOKEN_ENV} of every Ray container and the submitter; from KubeRay "
        f"{dotted(AUTH_OPTIONS_SINCE)}, by name in authOptions"
    )
    out = [
        f"Ray token auth: create the Secret before applying: kubectl create secret generic {secret} -n {namespace} "
        f'--from-literal={TOKEN_KEY}="$(openssl rand -hex 32)"; the token is read from it ({how}), never written '
        "into these manifests"
    ]
    if plat.auth_k8s_rbac:
        out.append(
            "k8s.auth_k8s_rbac: the RayCluster delegates to Kubernetes RBAC (its pods' service account needs the "
            f"ray:write verb); the RayJob keeps Secret {secret}, as KubeRay allows delegation for RayClusters only"
        )
    return out


def warning(plat: K8sConfig) -> str | None:
    """One line where authentication is off."""
    if plat.auth != "none":
        return None
    return (
        "k8s.auth: none renders a Ray cluster without authentication: whoever reaches its dashboard (job API) or "
        "GCS port runs code with its GPUs, PVC and credentials; set k8s.auth: token"
    )
