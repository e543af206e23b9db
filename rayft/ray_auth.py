"""What rayft says when a Ray cluster refuses it for want of its token.

A cluster with Ray's token authentication (`RAY_AUTH_MODE=token`, as rayft's rendered clusters have it) refuses a
driver that brings no token, or another one; Ray answers after its connection retries with a ConnectionError caused
by an AuthenticationError, the same for both, and a page of advice. rayft says in one line which of the two it
is, from what this process holds, and what to set.
"""

from __future__ import annotations

import os
from pathlib import Path

MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"  # Ray's names
DEFAULT_TOKEN_FILE = Path("~/.ray/auth_token")  # where Ray looks when neither variable is set
GCS_REFUSAL = "InvalidAuthToken"  # the status a token-auth GCS refuses a missing or wrong token with


def refused_for_token(error: BaseException) -> bool:
    """Whether `ray.init` failed because the cluster's token authentication refused this process: an
    AuthenticationError raised, or behind what was. Connecting to a GCS, Ray keeps only the text of its last
    failure in the RuntimeError it raises (then a ConnectionError from that), so the GCS's refusal is known there
    by its status name."""
    from ray.exceptions import AuthenticationError

    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, AuthenticationError) or GCS_REFUSAL in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def missing(environ: dict[str, str] | None = None) -> str:
    """One line: what this process lacks to be let in (it does not repeat a token)."""
    env = os.environ if environ is None else environ
    fix = (
        f"set {MODE_ENV}=token and the cluster's token in {TOKEN_ENV} (or in a file named by {TOKEN_PATH_ENV}); on "
        "Kubernetes it is the auth_token key of the Secret k8s.auth_secret names"
    )
    if env.get(MODE_ENV, "").lower() != "token":
        return f"it requires Ray's token authentication, and {MODE_ENV} is not token here, so none was sent: {fix}"
    if not (env.get(TOKEN_ENV) or env.get(TOKEN_PATH_ENV) or DEFAULT_TOKEN_FILE.expanduser().is_file()):
        return f"it requires Ray's token authentication, and this process has no token: {fix}"
    given = TOKEN_ENV if env.get(TOKEN_ENV) else TOKEN_PATH_ENV if env.get(TOKEN_PATH_ENV) else DEFAULT_TOKEN_FILE
    return f"the token in {given} is not the cluster's: {fix}"
