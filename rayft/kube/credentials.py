"""Credentials reach pods only by reference: an environment variable whose `valueFrom` names a key of a Secret.

A value written into the config's `k8s` section (or given with `--override` or `--env`) would be written into the
RayJob and RayCluster, where whoever may read those objects reads it too, and with `--override` into the job's
entrypoint as well; so such a value is refused where it is given, not rendered.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rayft.kube import apirules

# The credentials of the services a run talks to, by the names their libraries read; any other name ending in one of
# CREDENTIAL_ENDINGS is taken for one too (`GITHUB_TOKEN`, `OPENAI_API_KEY`). Paths to credentials
# (`RAY_AUTH_TOKEN_PATH`, `GOOGLE_APPLICATION_CREDENTIALS`) are not secrets themselves.
CREDENTIALS = frozenset(
    {
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "WANDB_API_KEY",
        "MLFLOW_TRACKING_PASSWORD",
        "MLFLOW_TRACKING_TOKEN",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "RAY_AUTH_TOKEN",
    }
)
CREDENTIAL_ENDINGS = ("_TOKEN", "_PASSWORD", "_PASSWD", "_SECRET", "_API_KEY", "_SECRET_KEY", "_ACCESS_KEY")
# `secret-name/key`: a Secret's name (a DNS subdomain) and one of its data keys.
SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def is_credential(name: str) -> bool:
    """Whether an environment variable of this name carries a credential."""
    upper = name.upper()
    return upper in CREDENTIALS or upper.endswith(CREDENTIAL_ENDINGS) or "SECRET" in upper


def literal_problems(where: str, env: Mapping[str, str]) -> list[str]:
    """One line for each credential among `env`'s literal values (never repeating the value), naming the key and
    the reference to give instead."""
    return [
        f"{where}.{name}: a credential given as a value would be written into the manifests; put it in a Secret "
        f"(kubectl create secret generic NAME --from-literal=KEY=...) and name it in k8s.secret_env: "
        f"{{{name}: NAME/KEY}}"
        for name in env
        if is_credential(name)
    ]


def reference_problems(where: str, refs: Mapping[str, str]) -> list[str]:
    """What is wrong with `VAR: secret-name/key` references."""
    out = []
    for name, ref in refs.items():
        secret, sep, key = ref.partition("/")
        if not sep or not SECRET_KEY.fullmatch(key):
            out.append(f"{where}.{name}: '{ref}' is not SECRET/KEY, a Secret's name and one of its keys")
            continue
        out += apirules.dns_subdomain(f"{where}.{name}", secret)
    return out


def secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    """An EnvVar whose value Kubernetes reads from a Secret's key when the container starts."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def env_from_secrets(refs: Mapping[str, str]) -> list[dict[str, Any]]:
    """`VAR: secret-name/key` references as EnvVars."""
    return [secret_env(name, *ref.split("/", 1)) for name, ref in refs.items()]
