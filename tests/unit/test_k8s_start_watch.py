"""The start watcher bounds the wait for a RayJob that never starts on KubeRay releases without
preRunningDeadlineSeconds (1.4, 1.5): its manifests as rendered, its decisions, and the program against an API."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from rayft import cli
from rayft.deploy.crd import validate
from rayft.kube.kuberay import Operator

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "jobs/mistral4-3xh200.yaml"
WATCHER_KINDS = {"Job", "ServiceAccount", "Role", "RoleBinding"}


def render(capsys, *args: str) -> tuple[dict[str, dict], str]:
    """`rayft k8s render` to stdout → ({kind: manifest}, its notes on stderr)."""
    capsys.readouterr()
    code = cli.main(["k8s", "render", "--config", EXAMPLE, "--name", "ft", "--namespace", "ml", *args])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_OK, err
    return {doc["kind"]: doc for doc in yaml.safe_load_all(out)}, err


@pytest.mark.parametrize(
    ("version", "extra"),
    [
        ("1.4.2", []),
        ("1.5", []),
        ("1.5.1", ["--kuberay-feature-gate", "RayJobDeletionPolicy"]),
        ("1.5", ["--queueing", "kueue", "--queue", "team-a"]),
    ],
)
def test_operators_without_a_pre_running_deadline_get_the_start_watcher(capsys, monkeypatch, version, extra):
    monkeypatch.chdir(REPO)
    docs, notes = render(capsys, "--kuberay-version", version, "--pre-running-deadline", "900", *extra)
    assert set(docs) >= WATCHER_KINDS and "preRunningDeadlineSeconds" not in docs["RayJob"]["spec"]
    for kind in WATCHER_KINDS:
        assert validate(docs[kind], Operator.of(version)) == [], kind
        assert docs[kind]["metadata"]["namespace"] == "ml" and docs[kind]["metadata"]["name"] == "ft-start-watch"
    # Only this RayJob, only reading it and patching it.
    assert docs["Role"]["rules"] == [
        {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "resourceNames": ["ft"], "verbs": ["get", "patch"]}
    ]
    binding = docs["RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "ft-start-watch"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ft-start-watch", "namespace": "ml"}]
    job = docs["Job"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["serviceAccountName"] == "ft-start-watch" and pod["restartPolicy"] in ("Never", "OnFailure")
    assert container["image"] == docs["RayJob"]["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["image"]
    command = container["command"] + container["args"]
    assert command[:3] == ["python", "-m", "rayft.deploy.start_watch"]
    assert {"--name": "ft", "--namespace": "ml", "--deadline-s": "900"}.items() <= dict(
        zip(command[3::2], command[4::2], strict=True)
    ).items()
    queued = "--queueing" in extra
    # The Job outlives the deadline (and, queued, the RayJob's own active deadline, as admission may come late);
    # it never joins the queue the RayJob waits in.
    assert job["spec"]["activeDeadlineSeconds"] > 900 + (3 * 24 * 3600 if queued else 0)
    assert "kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"]
    assert ("kueue.x-k8s.io/queue-name" in docs["RayJob"]["metadata"]["labels"]) == queued
    assert "ft-start-watch" in notes and "bounded only by activeDeadlineSeconds" not in notes
    assert ("delete it, kubectl delete rayjob ft -n ml" in notes) == ("--kuberay-feature-gate" in extra)


@pytest.mark.parametrize("version", ["1.6", "1.7.0"])
def test_operators_with_a_pre_running_deadline_get_no_watcher(capsys, monkeypatch, version):
    monkeypatch.chdir(REPO)
    docs, notes = render(capsys, "--kuberay-version", version)
    assert not WATCHER_KINDS & set(docs) and docs["RayJob"]["spec"]["preRunningDeadlineSeconds"] == 1800
    assert "start-watch" not in notes


def test_the_watcher_pod_gets_the_platforms_pod_settings_but_no_credentials(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    docs, _ = render(
        capsys,
        "--toleration",
        "spot:NoExecute",
        "--image-pull-secret",
        "regcred",
        "--run-as-user",
        "1000",
        "--service-account",
        "team-sa",
        "--label",
        "team=a",
        "--secret-env",
        "HF_TOKEN=hf-token/token",
    )
    template = docs["Job"]["spec"]["template"]
    pod = template["spec"]
    assert {"key": "spot", "operator": "Exists", "effect": "NoExecute"} in pod["tolerations"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["securityContext"]["runAsUser"] == 1000
    assert template["metadata"]["labels"]["team"] == "a" and docs["Job"]["metadata"]["labels"]["team"] == "a"
    assert template["metadata"]["labels"]["rayft.io/job"] == "ft"  # `kubectl logs -l rayft.io/job=ft` finds it
    assert pod["serviceAccountName"] == "ft-start-watch"  # its own, not the platform's
    assert "env" not in pod["containers"][0]  # the submitter's credentials are not the watcher's


@pytest.mark.parametrize(
    ("kind", "change", "field"),
    [
        ("Role", lambda d: d["rules"][0].pop("verbs"), "verbs"),
        ("RoleBinding", lambda d: d["roleRef"].update(apiGroup="rbac"), "roleRef.apiGroup"),
        ("Job", lambda d: d["spec"]["template"]["spec"].update(restartPolicy="Always"), "restartPolicy"),
        ("Job", lambda d: d["spec"].update(activeDeadline=10), "activeDeadline"),
        ("Job", lambda d: d["spec"]["template"]["spec"].update(nodeSelector={"bad key!": "x"}), "nodeSelector"),
    ],
)
def test_broken_watcher_manifests_are_refused(capsys, monkeypatch, kind, change, field):
    monkeypatch.chdir(REPO)
    doc = render(capsys)[0][kind]
    change(doc)
    problems = validate(doc)
    assert problems and any(field in p for p in problems), problems


def _seen(status: str, suspend: bool = False, start: float | None = 1000.0):
    from rayft.deploy.start_watch import Seen

    return Seen(deployment_status=status, suspend=suspend, start_time=start)


@pytest.mark.parametrize(
    ("seen", "now", "action"),
    [
        (None, 5000.0, "wait"),  # not created yet
        (("", False, None), 5000.0, "wait"),  # New
        (("Initializing", False, 1000.0), 1000.0 + 1799, "wait"),
        (("Initializing", False, 1000.0), 1000.0 + 1800, "fail"),
        (("Initializing", False, 1000.0), 1000.0 + 9000, "fail"),
        (("Initializing", False, None), 9000.0, "wait"),  # no start time: nothing to count from
        (("Initializing", True, 1000.0), 9000.0, "wait"),  # Kueue took it back: suspending
        (("Suspended", True, 1000.0), 9000.0, "wait"),  # queued with a stale startTime
        (("Suspended", False, 1000.0), 9000.0, "wait"),  # admitted, not initializing again yet
        (("Retrying", False, 1000.0), 9000.0, "wait"),
        (("Running", False, 1000.0), 9000.0, "done"),
        (("Complete", False, 1000.0), 9000.0, "done"),
        (("Failed", False, 1000.0), 9000.0, "done"),
    ],
)
def test_decisions(seen, now, action):
    from rayft.deploy.start_watch import decide

    assert decide(_seen(*seen) if seen else None, now, 1800).action == action


class FakeApi:
    """A stand-in for the Kubernetes API server's RayJob endpoint: GETs answer the scripted states in turn (the
    last one repeats); a PATCH answers `patch_code`, and with 200 the RayJob becomes Failed as KubeRay would make it."""

    def __init__(self, states: list[dict[str, Any]], patch_code: int = 200, tls: tuple[Path, Path] | None = None):
        self.states, self.patch_code, self.requests = list(states), patch_code, []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                api.requests.append(("GET", self.path, dict(self.headers), None))
                state = api.states[0] if len(api.states) == 1 else api.states.pop(0)
                self._answer(200, state)

            def do_PATCH(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.requests.append(("PATCH", self.path, dict(self.headers), body))
                if api.patch_code == 200:
                    api.states = [
                        {**api.states[0], "status": {"jobDeploymentStatus": "Failed", "reason": "DeadlineExceeded"}}
                    ]
                self._answer(api.patch_code, {"kind": "Status"})

            def _answer(self, code: int, doc: dict[str, Any]) -> None:
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:  # HTTPS with this certificate and key, as the API server serves
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeApi:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def patches(self) -> list[tuple[Any, ...]]:
        return [r for r in self.requests if r[0] == "PATCH"]


def rayjob(status: str, started_ago_s: float | None, suspend: bool = False, version: str = "7") -> dict[str, Any]:
    stamp = None if started_ago_s is None else datetime.fromtimestamp(time.time() - started_ago_s, UTC)
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": "ft", "namespace": "ml", "resourceVersion": version},
        "spec": {"suspend": suspend, "activeDeadlineSeconds": 259200},
        "status": {
            "jobDeploymentStatus": status,
            **({"startTime": stamp.strftime("%Y-%m-%dT%H:%M:%SZ")} if stamp else {}),
        },
    }


def run_watcher(
    api: FakeApi, tmp_path: Path, deadline_s: int = 60, ca: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The watcher as its pod runs it, with a token file of its own, pointed at the stand-in API: by
    --api-server over HTTP, or with `ca` as in a pod, by KUBERNETES_SERVICE_HOST/PORT over HTTPS trusting `ca`."""
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    args = ["--name", "ft", "--namespace", "ml", "--deadline-s", str(deadline_s), "--poll-s", "0.05"]
    args += ["--token-file", str(token), "--ca-file", str(ca or tmp_path / "no-ca.crt")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if ca is None:
        args += ["--api-server", api.url]
    else:
        env |= {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.server.server_address[1])}
    command = [sys.executable, "-m", "rayft.deploy.start_watch", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, cwd=REPO)


def test_the_watcher_fails_a_job_stuck_initializing_past_its_deadline(tmp_path):
    """No API server can run here, so a local HTTP server stands in for it: the watcher reads the RayJob with its
    token, lowers its active deadline by a merge patch conditional on what it read, and stops once it is Failed."""
    with FakeApi([rayjob("Initializing", 30), rayjob("Initializing", 120, version="8")]) as api:
        done = run_watcher(api, tmp_path)
    assert done.returncode == 0, done.stderr
    (patch,) = api.patches()
    _, path, headers, body = patch
    assert path == "/apis/ray.io/v1/namespaces/ml/rayjobs/ft"
    assert headers["Content-Type"] == "application/merge-patch+json"
    assert body == {"metadata": {"resourceVersion": "8"}, "spec": {"activeDeadlineSeconds": 60}}
    assert all(r[2]["Authorization"] == "Bearer t0ken" for r in api.requests)
    methods = [r[0] for r in api.requests]
    assert methods.index("PATCH") == 2 and methods[-1] == "GET"  # patched after the second read; saw it Failed
    assert "DeadlineExceeded" in done.stdout and "activeDeadlineSeconds=60" in done.stdout


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a test certificate")
def test_in_a_pod_the_watcher_reaches_the_api_server_over_https_with_the_service_accounts_ca(tmp_path):
    """As in a pod: no --api-server, the address from KUBERNETES_SERVICE_HOST/PORT, HTTPS verified against the
    service account's CA (here a self-signed certificate for 127.0.0.1, which the stand-in API server serves)."""
    cert, key = tmp_path / "ca.crt", tmp_path / "ca.key"
    make = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
    make += ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)]
    subprocess.run(make, check=True, capture_output=True)
    with FakeApi([rayjob("Initializing", 300)], tls=(cert, key)) as api:
        done = run_watcher(api, tmp_path, ca=cert)
    assert done.returncode == 0, done.stderr
    assert [r[0] for r in api.requests] == ["GET", "PATCH", "GET"] and "DeadlineExceeded" in done.stdout


@pytest.mark.parametrize(
    "states",
    [
        [("Running", 5000)],  # already started: read once, left alone
        [("Initializing", 10), ("Initializing", 20), ("Running", 5000)],
        # queued by Kueue with the startTime of its first attempt, then admitted: the deadline counts afresh
        [("Suspended", 5000, True), ("", 5000), ("Initializing", 5), ("Running", 9)],
    ],
    ids=["running", "starts-in-time", "queued-then-admitted"],
)
def test_the_watcher_never_patches_a_job_that_started_or_waits_in_a_queue(tmp_path, states):
    # The RayJobs are made as the test runs: their start times count back from now, not from collection.
    with FakeApi([rayjob(*state) for state in states]) as api:
        done = run_watcher(api, tmp_path)
    assert done.returncode == 0, done.stderr
    assert api.patches() == [] and "Running" in done.stdout.splitlines()[-1]


def test_a_job_that_changed_since_it_was_read_is_read_again_not_failed(tmp_path):
    """The RayJob became Running between the watcher's read and its patch: the API server refuses the patch (409,
    the resourceVersion moved), and the watcher reads it again and leaves it alone."""
    with FakeApi([rayjob("Initializing", 600), rayjob("Running", 601, version="9")], patch_code=409) as api:
        done = run_watcher(api, tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(api.patches()) == 1 and [r[0] for r in api.requests] == ["GET", "PATCH", "GET"]
    assert "409" in done.stdout
