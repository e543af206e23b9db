"""The start watcher: fails a RayJob that has not started running by its pre-running deadline, on KubeRay releases
without `spec.preRunningDeadlineSeconds` (1.4, 1.5). Run in its own small pod beside the RayJob
(`python -m rayft.deploy.start_watch --name N --namespace NS --deadline-s S`); `start_watch_manifests` renders it.

Without it, GPU pods that did start hold their GPUs while one that never schedules keeps the cluster from becoming
ready, until `activeDeadlineSeconds` (days). The watcher makes the operator fail the job its own way, so the user
sees a Failed RayJob with reason DeadlineExceeded and the operator cleans up as its shutdown settings say.

What this relies on, read in KubeRay's ray-operator/controllers/ray/rayjob_controller.go at v1.4.2 and v1.5.2 (the
same at v1.4.0, v1.5.0, v1.5.1):
- `initRayJobStatusIfNeed` sets `status.startTime` to now on every move from New to Initializing: at creation, and
  again after a suspended (Kueue-queued) job is admitted or a failed one is retried. While Suspended the old value
  stays, so the deadline runs only in Initializing, from that startTime.
- The Initializing case calls `checkActiveDeadlineAndUpdateStatusIfNeeded` before anything else but the suspend
  check, on the RayJob it reads afresh at each reconcile (every 3 s while it waits for the cluster): a lowered
  `spec.activeDeadlineSeconds` is seen at once, and a job past it becomes Failed with reason DeadlineExceeded,
  which `checkBackoffLimitAndUpdateStatusIfNeeded` never retries.
- It moves to Running only once the RayCluster is Ready and the submitter Job is created: Running means started.
- Nothing refuses the change: `ValidateRayJobSpec` (controllers/ray/utils/validation.go) wants the active deadline
  positive only; the RayJob webhook (pkg/webhooks/v1/rayjob_webhook.go, 1.5 only) checks metadata on update; the
  CRD's only immutable field is managedBy.
So the watcher lowers `spec.activeDeadlineSeconds` to the deadline it was given, conditional on the resourceVersion
it read (a RayJob that changed since, Running perhaps, is read again and decided again, never failed blindly).

Standard library only (urllib, ssl): the image need not have the kubernetes client. One log line per decision.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MERGE_PATCH = "application/merge-patch+json"
STARTED = ("Running", "Waiting", "Complete", "Failed")  # the cluster was ready, or the job is over
NOT_COUNTING = ("", "New", "Suspending", "Suspended", "Retrying")  # no startTime of this attempt yet

Action = Literal["wait", "done", "fail"]


@dataclass(frozen=True)
class Seen:
    """What the watcher reads of the RayJob; None for a RayJob not found."""

    deployment_status: str
    suspend: bool
    start_time: float | None  # status.startTime, seconds since the epoch
    resource_version: str = ""
    reason: str = ""


@dataclass(frozen=True)
class Decision:
    action: Action
    why: str


def decide(seen: Seen | None, now: float, deadline_s: int) -> Decision:
    """What to do about the RayJob as seen at `now`: wait, stop watching (done), or fail it (its Initializing
    attempt began `deadline_s` or more ago). A suspended job (queued by Kueue) is not failed: its deadline starts
    when it is admitted and initializes."""
    if seen is None:
        return Decision("wait", "RayJob not found (not created yet, or deleted)")
    status = seen.deployment_status or "New"
    if status in STARTED:
        reason = f" ({seen.reason})" if seen.reason else ""
        return Decision("done", f"RayJob is {status}{reason}: nothing left to bound")
    if seen.suspend or status in NOT_COUNTING:
        return Decision("wait", f"RayJob is {status}{', suspended' if seen.suspend else ''}: deadline not running")
    if status != "Initializing" or seen.start_time is None:
        return Decision("wait", f"RayJob is {status} without a start time: deadline not running")
    elapsed = now - seen.start_time
    if elapsed >= deadline_s:
        return Decision("fail", f"RayJob still Initializing {elapsed:.0f} s after its start (deadline {deadline_s} s)")
    return Decision("wait", f"RayJob Initializing for {elapsed:.0f} s of {deadline_s} s")


def seen_from(obj: dict[str, Any]) -> Seen:
    """The RayJob object as the API returns it → what `decide` reads."""
    status, spec = obj.get("status") or {}, obj.get("spec") or {}
    start = status.get("startTime")
    return Seen(
        deployment_status=status.get("jobDeploymentStatus", ""),
        suspend=bool(spec.get("suspend", False)),
        start_time=datetime.fromisoformat(start).timestamp() if start else None,
        resource_version=(obj.get("metadata") or {}).get("resourceVersion", ""),
        reason=status.get("reason", ""),
    )


def fail_patch(seen: Seen, deadline_s: int) -> dict[str, Any]:
    """The merge patch that has KubeRay fail the job: the active deadline lowered to the pre-running one (which the
    job has passed), on condition that the RayJob is still the one seen (its resourceVersion)."""
    return {"metadata": {"resourceVersion": seen.resource_version}, "spec": {"activeDeadlineSeconds": deadline_s}}


class Api:
    """The few calls the watcher makes to the Kubernetes API, with the pod's service-account token (read at each
    call: the kubelet rotates the projected token in place)."""

    def __init__(self, server: str, token_file: Path, ca_file: Path) -> None:
        self.server, self.token_file = server.rstrip("/"), token_file
        self.context = ssl.create_default_context(cafile=str(ca_file)) if ca_file.is_file() else None

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The JSON answer; None for 404. Other HTTP errors raise urllib.error.HTTPError."""
        token = self.token_file.read_text().strip() if self.token_file.is_file() else ""
        headers = {"Accept": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        data = None
        if body is not None:
            headers["Content-Type"] = MERGE_PATCH
            data = json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=30, context=self.context) as answer:
                return dict(json.load(answer))
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise


def rayjob_path(namespace: str, name: str) -> str:
    return f"/apis/ray.io/v1/namespaces/{namespace}/rayjobs/{name}"


def step(api: Api, path: str, deadline_s: int, failed: bool) -> tuple[Action, bool]:
    """One poll: read the RayJob, decide, act, log one line. Returns the action and whether it has been failed."""
    found = api.request("GET", path)
    seen = seen_from(found) if found is not None else None
    decision = decide(seen, time.time(), deadline_s)
    if decision.action == "fail" and seen is not None and not failed:
        try:
            api.request("PATCH", path, fail_patch(seen, deadline_s))
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise
            log(f"{decision.why}; it changed since it was read (409): reading it again")
            return "wait", failed
        log(f"{decision.why}; set spec.activeDeadlineSeconds={deadline_s} so KubeRay fails it (DeadlineExceeded)")
        return "fail", True
    if decision.action == "fail":
        decision = Decision("wait", f"{decision.why}; waiting for KubeRay to mark it Failed")
    log(decision.why)
    return decision.action, failed


def watch(api: Api, name: str, namespace: str, deadline_s: int, poll_s: float) -> int:
    """Poll until the RayJob has started or is over (0). API errors are logged and retried: the Role may be bound
    after the pod starts; the Job's own active deadline ends a watcher that can never reach the API."""
    path, failed = rayjob_path(namespace, name), False
    while True:
        try:
            action, failed = step(api, path, deadline_s, failed)
        except (urllib.error.URLError, OSError, ValueError) as e:
            log(f"cannot read or patch RayJob {namespace}/{name}: {e}; retrying in {poll_s:g} s")
            action = "wait"
        if action == "done":
            return 0
        time.sleep(poll_s)


def log(line: str) -> None:
    stamp = datetime.now().astimezone().strftime("%Y-%m-%dT%H:%M:%S%z")
    print(f"{stamp} start-watch: {line}", flush=True)


def in_cluster_server() -> str:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise SystemExit("start-watch: KUBERNETES_SERVICE_HOST is unset: not in a pod; give --api-server")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayft.deploy.start_watch", description=__doc__.split("\n")[0])
    parser.add_argument("--name", required=True, help="the RayJob's name")
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--deadline-s", type=int, required=True, help="seconds from Initializing to Running")
    parser.add_argument("--poll-s", type=float, default=10.0)
    parser.add_argument("--api-server", default=None, help="default: the in-cluster API server")
    parser.add_argument("--token-file", type=Path, default=SERVICE_ACCOUNT / "token")
    parser.add_argument("--ca-file", type=Path, default=SERVICE_ACCOUNT / "ca.crt")
    args = parser.parse_args(argv)
    if args.deadline_s < 1:
        parser.error(f"--deadline-s: must be a positive number of seconds, got {args.deadline_s}")
    api = Api(args.api_server or in_cluster_server(), args.token_file, args.ca_file)
    log(f"watching RayJob {args.namespace}/{args.name}: it must be Running {args.deadline_s} s after it initializes")
    return watch(api, args.name, args.namespace, args.deadline_s, args.poll_s)


if __name__ == "__main__":
    sys.exit(main())
