"""Secure by default on a shared cluster: Ray's token authentication on in every rendered cluster (through the
operator's authOptions where it takes a Secret's name, else each Ray container's environment), and credentials
only by reference to a Secret, never as a value in a config, a flag, an override or a manifest."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rayft import cli
from rayft.config import ConfigError, load_config
from rayft.deploy.crd import validate
from rayft.kube.kuberay import Operator

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "jobs" / "mistral4-3xh200.yaml"
TOKEN_FROM = {"secretKeyRef": {"name": "rayft-ray-auth", "key": "auth_token"}}
PLANTED = "hf_planted0123456789abcdefghijklmnopqrs"  # a credential's value: never to be echoed or rendered


def render(capsys, *args: str) -> tuple[dict[str, dict], str, str]:
    """`rayft k8s render` of the example to stdout → ({kind: manifest}, stdout, stderr)."""
    capsys.readouterr()
    code = cli.main(["k8s", "render", "--config", str(EXAMPLE), *args])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_OK, err
    return {doc["kind"]: doc for doc in yaml.safe_load_all(out)}, out, err


def refused(capsys, *argv: str) -> str:
    """The one error line of a command that must exit 2."""
    capsys.readouterr()
    assert cli.main(list(argv)) == cli.EXIT_CONFIG
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, err
    return lines[0]


def ray_containers(docs: dict[str, dict]) -> dict[str, dict]:
    """Every container rayft renders that talks to Ray: head, GPU workers (RayJob's and RayCluster's), submitter."""
    job, cluster = docs["RayJob"]["spec"], docs["RayCluster"]["spec"]
    found = {"submitter": job["submitterPodTemplate"]["spec"]["containers"][0]}
    for owner, spec in (("job", job["rayClusterSpec"]), ("cluster", cluster)):
        found[f"{owner}-head"] = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
        for group in spec["workerGroupSpecs"]:
            found[f"{owner}-{group['groupName']}"] = group["template"]["spec"]["containers"][0]
    return found


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("version", ["1.4", "1.5"])
def test_operators_without_auth_options_get_the_token_from_a_secret_in_every_ray_container(capsys, version):
    docs, _text, _ = render(capsys, "--kuberay-version", version)
    for where, container in ray_containers(docs).items():
        env = env_of(container)
        assert env["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "token"}, where
        assert env["RAY_AUTH_TOKEN"] == {"name": "RAY_AUTH_TOKEN", "valueFrom": TOKEN_FROM}, where
    assert (
        "authOptions" not in docs["RayJob"]["spec"]["rayClusterSpec"]
        and "authOptions" not in docs["RayCluster"]["spec"]
    )
    for doc in docs.values():
        assert validate(doc, Operator.of(version)) == [], doc["kind"]


@pytest.mark.parametrize("version", ["1.6", "1.7"])
def test_newer_operators_are_handed_the_secret_by_name(capsys, version):
    docs, text, _ = render(capsys, "--kuberay-version", version)
    for spec in (docs["RayJob"]["spec"]["rayClusterSpec"], docs["RayCluster"]["spec"]):
        assert spec["authOptions"] == {"mode": "token", "secretName": "rayft-ray-auth"}
    assert "RAY_AUTH_TOKEN" not in text  # the operator sets the environment, the submitter's included
    for doc in docs.values():
        assert validate(doc, Operator.of(version)) == [], doc["kind"]


def test_the_render_says_how_to_create_the_secret_and_writes_no_token(capsys):
    docs, text, err = render(capsys, "--name", "ft-3", "--namespace", "ml", "--auth-secret", "team-ray-token")
    how = "kubectl create secret generic team-ray-token -n ml --from-literal=auth_token="
    assert how in err and how in text  # on the terminal and in the RayJob's header
    assert '-n ml --from-literal=auth_token="$(openssl rand -hex 32)"' in err
    tokens = [e for c in ray_containers(docs).values() for e in c["env"] if e["name"] == "RAY_AUTH_TOKEN"]
    assert tokens and all(
        e == {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "team-ray-token", "key": "auth_token"}}}
        for e in tokens
    )


def test_auth_none_is_rendered_without_auth_and_warned_about_in_one_line(capsys):
    _docs, text, err = render(capsys, "--auth", "none", "--kuberay-version", "1.7")
    assert "RAY_AUTH" not in text and "authOptions:" not in text
    warnings = [line for line in err.splitlines() if line.startswith("rayft: warning:")]
    assert warnings == [
        "rayft: warning: k8s.auth: none renders a Ray cluster without authentication: whoever reaches its dashboard "
        "(job API) or GCS port runs code with its GPUs, PVC and credentials; set k8s.auth: token"
    ]
    assert "# Warning: k8s.auth: none renders" in text
    _, _, quiet = render(capsys)
    assert "warning" not in quiet


def test_rbac_delegation_is_for_the_raycluster_only(capsys):
    docs, _text, err = render(capsys, "--kuberay-version", "1.7", "--auth-k8s-rbac")
    assert docs["RayCluster"]["spec"]["authOptions"] == {"mode": "token", "enableK8sTokenAuth": True}
    assert docs["RayJob"]["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token", "secretName": "rayft-ray-auth"}
    assert "ray:write" in err
    for doc in docs.values():
        assert validate(doc, Operator.of("1.7")) == [], doc["kind"]


def test_the_operator_rules_for_auth_options_are_checked(capsys):
    docs, _, _ = render(capsys, "--kuberay-version", "1.7", "--auth-k8s-rbac")
    job, cluster = docs["RayJob"], docs["RayCluster"]
    job["spec"]["rayClusterSpec"]["authOptions"] = {"mode": "token", "enableK8sTokenAuth": True}
    assert validate(job, Operator.of("1.7")) == [
        "spec.rayClusterSpec.authOptions.enableK8sTokenAuth: KubeRay refuses it for a RayJob (RayClusters only)"
    ]
    cluster["spec"]["authOptions"]["secretName"] = "s"
    assert validate(cluster, Operator.of("1.7")) == [
        "spec.authOptions: enableK8sTokenAuth and secretName cannot be used together"
    ]
    cluster["spec"]["authOptions"] = {"mode": "disabled", "enableK8sTokenAuth": True}
    assert validate(cluster, Operator.of("1.7")) == ["spec.authOptions.enableK8sTokenAuth: needs mode: token"]
    assert any("authOptions" in p for p in validate(cluster, Operator.of("1.4")))  # no such field in 1.4's CRD


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--auth-k8s-rbac"], "k8s.auth_k8s_rbac: needs KubeRay 1.6 or later (k8s.kuberay_version)"),
        (["--kuberay-version", "1.5", "--auth-k8s-rbac"], "k8s.auth_k8s_rbac: needs KubeRay 1.6 or later"),
        (["--auth", "none", "--auth-secret", "s"], "k8s.auth_secret: given, but k8s.auth is none"),
        (["--auth-secret", "Not_A_Name"], "k8s.auth_secret: 'Not_A_Name' is not a valid object name"),
        (["--env", "RAY_AUTH_MODE=disabled"], "k8s.env.RAY_AUTH_MODE: set by rayft from k8s.auth"),
        (["--secret-env", "RAY_AUTH_TOKEN=s/k"], "k8s.secret_env.RAY_AUTH_TOKEN: set by rayft from k8s.auth"),
    ],
)
def test_auth_settings_that_cannot_work_are_refused_in_one_line(capsys, args, says):
    assert says in refused(capsys, "k8s", "render", "--config", str(EXAMPLE), *args)


# --- credentials only by reference ---------------------------------------------------------------------------------

CREDENTIALS = [
    "HF_TOKEN",
    "WANDB_API_KEY",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "GITHUB_TOKEN",
    "OPENAI_API_KEY",
]


@pytest.mark.parametrize("name", CREDENTIALS)
def test_a_credential_value_in_an_override_or_a_flag_is_refused_naming_the_key(capsys, name):
    for how in (["--override", f"k8s.env.{name}={PLANTED}"], ["--env", f"{name}={PLANTED}"]):
        line = refused(capsys, "k8s", "render", "--config", str(EXAMPLE), *how)
        assert f"k8s.env.{name}: a credential given as a value" in line and "k8s.secret_env" in line, line
        assert PLANTED not in line


def test_a_credential_value_in_the_config_file_is_refused_by_validate_and_render(capsys, tmp_path):
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["k8s"] = {"env": {"HF_HUB_OFFLINE": "1", "WANDB_API_KEY": PLANTED}}
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as e:
        load_config(str(config))
    assert str(config) in str(e.value) and "k8s.env.WANDB_API_KEY" in str(e.value) and PLANTED not in str(e.value)
    for command in (["validate"], ["k8s", "render"]):
        line = refused(capsys, *command, "--config", str(config))
        assert "k8s.env.WANDB_API_KEY: a credential given as a value" in line and PLANTED not in line, line


@pytest.mark.parametrize("version", ["1.4", "1.7"])
def test_secret_env_reaches_every_ray_container_by_reference(capsys, version):
    refs = ["HF_TOKEN=hf-token/token", "WANDB_API_KEY=trackers/wandb", "AWS_SECRET_ACCESS_KEY=s3/secret-key"]
    docs, _text, _ = render(capsys, "--kuberay-version", version, *(a for r in refs for a in ("--secret-env", r)))
    for where, container in ray_containers(docs).items():
        env = env_of(container)
        for ref in refs:
            name, _, target = ref.partition("=")
            secret, _, key = target.partition("/")
            assert env[name] == {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}, where
    for doc in docs.values():
        assert validate(doc, Operator.of(version)) == [], doc["kind"]


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        ("HF_TOKEN=hf-token", "k8s.secret_env.HF_TOKEN: 'hf-token' is not SECRET/KEY"),
        ("HF_TOKEN=Bad_Name/token", "k8s.secret_env.HF_TOKEN: 'Bad_Name' is not a valid object name"),
        ("HF_TOKEN=hf/a key", "is not SECRET/KEY"),
    ],
)
def test_a_secret_reference_that_names_no_secret_key_is_refused(capsys, ref, says):
    assert says in refused(capsys, "k8s", "render", "--config", str(EXAMPLE), "--secret-env", ref)


def test_a_variable_given_both_ways_is_refused(capsys):
    line = refused(
        capsys, "k8s", "render", "--config", str(EXAMPLE), "--env", "HF_HOME_X=1", "--secret-env", "HF_HOME_X=s/k"
    )
    assert "k8s.env.HF_HOME_X: also in k8s.secret_env; give it once" in line


def test_settings_that_are_no_credentials_stay_plain_values():
    names = ["HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "HF_TOKEN_PATH", "AWS_ACCESS_KEY_ID", "WANDB_PROJECT"]
    cfg = load_config(str(EXAMPLE), [f"k8s.env.{name}=x" for name in names])
    assert list(cfg.k8s.env) == names


def _admits(policy: dict, labels: dict[str, str], same_namespace: bool, port: int) -> bool:
    """Whether a NetworkPolicy lets a pod with `labels` reach `port` of the pods it selects, read as the
    networking.k8s.io/v1 API defines it: its rules are alternatives, so are each rule's peers; a peer's pod and
    namespace selectors must both match (a pod selector alone: the policy's own namespace); no ports, every port."""

    def matches(selector: dict | None) -> bool:
        return all(labels.get(k) == v for k, v in (selector or {}).get("matchLabels", {}).items())

    def peer(p: dict) -> bool:
        in_namespace = "namespaceSelector" in p or same_namespace  # `{}` selects every namespace
        return in_namespace and ("podSelector" not in p or matches(p["podSelector"]))

    return any(
        any(peer(p) for p in rule["from"]) and (not rule.get("ports") or any(q["port"] == port for q in rule["ports"]))
        for rule in policy["spec"]["ingress"]
    )


RUN = {"app.kubernetes.io/name": "rayft", "rayft.io/job": "rayft"}
OPERATOR = {"app.kubernetes.io/name": "kuberay-operator"}
CI = {"app": "ci-runner"}
GCS, DASHBOARD, CLIENT, METRICS = 6379, 8265, 10001, 8080


def test_the_network_policy_lets_only_the_runs_pods_the_operator_and_the_admitted_reach_the_head(capsys):
    """The run's pods reach each other on any port; the operator and an admitted CI runner reach the job API alone,
    from any namespace; any other pod, of this namespace or another run, reaches nothing; Prometheus the metrics
    port, with monitoring only."""
    docs, _, _ = render(capsys, "--network-policy", "--network-policy-admit", "app=ci-runner")
    policy = docs["NetworkPolicy"]
    assert validate(policy) == [] and policy["spec"]["podSelector"]["matchLabels"] == RUN
    assert all(_admits(policy, RUN, True, port) for port in (GCS, DASHBOARD, CLIENT, 12345))
    for labels in (OPERATOR, CI):
        assert _admits(policy, labels, False, DASHBOARD)
        assert not any(_admits(policy, labels, False, port) for port in (GCS, CLIENT, METRICS))
    other_run = {**RUN, "rayft.io/job": "another"}
    assert not any(_admits(policy, labels, True, port) for labels in ({}, other_run) for port in (GCS, DASHBOARD))
    assert not _admits(policy, {}, False, METRICS)
    scraped, _, _ = render(capsys, "--network-policy", "--monitoring")
    assert _admits(scraped["NetworkPolicy"], {}, False, METRICS) and not _admits(
        scraped["NetworkPolicy"], {}, False, GCS
    )
    assert "NetworkPolicy" not in render(capsys)[0]  # only where asked for


def test_admitting_pods_without_the_network_policy_is_refused(capsys):
    line = refused(capsys, "k8s", "render", "--config", str(EXAMPLE), "--network-policy-admit", "app=ci-runner")
    assert "k8s.network_policy_admits: given, but k8s.network_policy is false" in line, line
