"""Validate KubeRay manifests as the API server and the operator would, before a cluster ever sees them.

Strict: the CRDs' OpenAPI schemas with every declared object closed to unknown fields. The API server prunes
unknown fields silently, so a misspelled `template.metdata` would drop the InfiniBand annotation without a word;
here it is an error. Then the operator's own rules, which the schema cannot express (its RayJob and RayCluster
validation), for the operator release and feature gates the manifests are meant for.
"""

from __future__ import annotations

import copy
import functools
import gzip
import re
from pathlib import Path
from typing import Any, cast

import yaml

from rayft import environment
from rayft.kube import apirules
from rayft.kube.kuberay import DELETION_GATE, Operator

CRD_DIR_ENV = environment.KUBERAY_CRDS.name
# The CRDs (RayJob, RayCluster) of every supported KubeRay release ship as package data, gzipped, one directory per
# release (crds/v1.7.0/…), so an installed wheel validates with nothing beside it; RAYFT_KUBERAY_CRDS points at
# other CRDs (ray.io_*.yaml, gzipped or not), used whatever the operator's release.
PACKAGED_CRD_DIR = Path(__file__).resolve().parent / "crds"
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = {"RayCluster": 53, "RayJob": 47}  # KubeRay derives service names from these
RESOURCE_PARAMS = ("num-cpus", "num-gpus", "memory", "resources")
# The parts of ObjectMeta a manifest may carry (the rest is set by the API server).
OBJECT_META = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string"},
        "generateName": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


class ManifestError(ValueError):
    """A manifest the API server or the KubeRay operator would refuse (or silently alter)."""


def crd_dir(operator: Operator | None = None) -> Path:
    """The CRDs to validate against (the operator's release; by default the oldest supported); never absent
    without an error (an unchecked manifest is not a valid one)."""
    given = environment.value(environment.KUBERAY_CRDS)
    directory = Path(given) if given else PACKAGED_CRD_DIR / f"v{(operator or Operator()).crd_release}"
    if not directory.is_dir():
        fix = (
            f"set {CRD_DIR_ENV} to the directory with ray.io_*.yaml (or .yaml.gz)"
            if given
            else "this rayft install lacks its package data (rayft/deploy/crds); reinstall it"
        )
        raise ManifestError(f"no KubeRay CRDs at {directory}: {fix}")
    return directory


@functools.lru_cache(maxsize=8)  # each supported release, and a directory of $RAYFT_KUBERAY_CRDS
def schemas(directory: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) → strict JSON schema, for every served version of every CRD in `directory`."""
    found = {}
    for path in sorted([*directory.glob("*.yaml"), *directory.glob("*.yaml.gz")]):
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        crd = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
            continue
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
            schema["properties"]["metadata"] = OBJECT_META
            schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
            found[(f"{group}/{version['name']}", kind)] = schema
    if not found:
        raise ManifestError(f"{directory} holds no CustomResourceDefinition YAML files (*.yaml, *.yaml.gz)")
    return found


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Close every object that lists its properties, as the API server's pruning effectively does."""
    if isinstance(schema, dict):
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        for key, value in schema.items():
            if key in ("properties", "patternProperties", "definitions"):
                for sub in value.values():
                    strict(sub)
            elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
                strict(value)
            elif key in ("allOf", "anyOf", "oneOf"):
                for sub in value:
                    strict(sub)
    return schema


def validate(doc: Any, operator: Operator | None = None, directory: Path | None = None) -> list[str]:
    """Every problem with one manifest, each naming its field path; empty when `operator` (by default the oldest
    supported release, without feature gates) would accept it. `directory`: its CRDs, if not the packaged ones."""
    from jsonschema import Draft7Validator

    if not isinstance(doc, dict):
        return ["not a mapping"]
    from rayft.deploy import budget, monitoring, reach, start_watch_manifests

    api_kind: tuple[Any, Any] = (doc.get("apiVersion"), doc.get("kind"))  # from the manifest: either may be missing
    own = {**monitoring.SCHEMAS, **budget.SCHEMAS, **reach.SCHEMAS, **start_watch_manifests.SCHEMAS}.get(api_kind)
    if own is not None:  # PodMonitor, ConfigMap, PodDisruptionBudget, NetworkPolicy, the start watcher's Job and
        # RBAC: rayft's own shape check, no CRD; a Job's pod template also by the API server's rules
        errors = sorted(Draft7Validator(own).iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
        shape = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]
        if shape or doc["kind"] != "Job":
            return shape
        return name_problems("Job", doc["metadata"]["name"]) + apirules.pod_template(
            "spec.template", doc["spec"]["template"]
        )
    operator = operator or Operator()
    schema = schemas(directory or crd_dir(operator)).get(api_kind)
    if schema is None:
        return [f"unknown apiVersion/kind {doc.get('apiVersion')}/{doc.get('kind')} (no CRD for it in {operator})"]
    problems = [
        f"{_path(e.absolute_path)}: {e.message}"
        for e in sorted(Draft7Validator(schema).iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]
    if problems:
        return problems  # the operator rules assume the shape is right
    return operator_rules(doc, operator)


def operator_rules(doc: dict[str, Any], operator: Operator) -> list[str]:
    kind, spec, meta = doc["kind"], doc["spec"], doc["metadata"]
    problems = name_problems(kind, meta.get("name", ""))
    problems += apirules.labels("metadata.labels", meta.get("labels") or {})
    problems += apirules.annotation_keys("metadata.annotations", meta.get("annotations") or {})
    if kind == "RayJob":
        problems += _rayjob_rules(spec, operator)
        if "submitterPodTemplate" in spec:
            problems += apirules.pod_template("spec.submitterPodTemplate", spec["submitterPodTemplate"])
        if "rayClusterSpec" in spec:
            problems += _cluster_rules(spec["rayClusterSpec"], "spec.rayClusterSpec")
            if spec["rayClusterSpec"].get("authOptions", {}).get("enableK8sTokenAuth"):
                problems.append(
                    "spec.rayClusterSpec.authOptions.enableK8sTokenAuth: KubeRay refuses it for a RayJob "
                    "(RayClusters only)"
                )
    elif kind == "RayCluster":
        problems += _cluster_rules(spec, "spec")
    return problems


def name_problems(kind: str, name: str) -> list[str]:
    limit = MAX_NAME.get(kind, 63)
    if not DNS_1035.match(name) or len(name) > limit:
        return [f"metadata.name: '{name}' must be a DNS-1035 label of at most {limit} characters"]
    return []


def _rayjob_rules(spec: dict[str, Any], operator: Operator) -> list[str]:
    problems = []
    for field in ("deletionStrategy", "deletionPolicy"):
        if field in spec and not operator.gate_on(DELETION_GATE):
            problems.append(
                f"spec.{field}: {operator} refuses it without the {DELETION_GATE} feature gate "
                "(k8s.kuberay_feature_gates, when the operator runs with it)"
            )
    shutdown = spec.get("shutdownAfterJobFinishes", False)
    ttl = spec.get("ttlSecondsAfterFinished", 0)
    if ttl < 0:
        problems.append("spec.ttlSecondsAfterFinished: must not be negative")
    if ttl > 0 and not shutdown:
        problems.append("spec.ttlSecondsAfterFinished: needs spec.shutdownAfterJobFinishes: true (else it is ignored)")
    if spec.get("suspend") and not shutdown:
        problems.append("spec.suspend: needs spec.shutdownAfterJobFinishes: true")
    deletion = spec.get("deletionStrategy") or {}
    if deletion.get("deletionRules") and shutdown:
        problems.append("spec.deletionStrategy.deletionRules: cannot be used with spec.shutdownAfterJobFinishes")
    if deletion.get("deletionRules") and ("onSuccess" in deletion or "onFailure" in deletion):
        problems.append("spec.deletionStrategy: deletionRules and onSuccess/onFailure cannot be used together")
    if deletion and not deletion.get("deletionRules") and not ("onSuccess" in deletion and "onFailure" in deletion):
        problems.append("spec.deletionStrategy: needs both onSuccess and onFailure, or deletionRules")
    if "rayClusterSpec" not in spec and not spec.get("clusterSelector"):
        problems.append("spec: needs rayClusterSpec (a cluster for the job) or clusterSelector (an existing one)")
    if spec.get("activeDeadlineSeconds", 1) <= 0:
        problems.append("spec.activeDeadlineSeconds: must be positive")
    if spec.get("preRunningDeadlineSeconds", 1) <= 0:
        problems.append("spec.preRunningDeadlineSeconds: must be positive")
    if spec.get("backoffLimit", 0) < 0:
        problems.append("spec.backoffLimit: must not be negative")
    mode = spec.get("submissionMode", "K8sJobMode")
    if mode == "InteractiveMode" and spec.get("backoffLimit", 0) > 0:
        problems.append("spec.backoffLimit: must be 0 in InteractiveMode")
    if mode != "InteractiveMode" and not spec.get("entrypoint", "").strip():
        problems.append("spec.entrypoint: empty; the submitter would have nothing to run")
    if "runtimeEnvYAML" in spec:
        try:
            yaml.safe_load(spec["runtimeEnvYAML"])
        except yaml.YAMLError as e:
            problems.append(f"spec.runtimeEnvYAML: not valid YAML: {e}")
    return problems


def _cluster_rules(spec: dict[str, Any], at: str) -> list[str]:
    workers = spec.get("workerGroupSpecs", [])
    groups: list[tuple[str, dict[str, Any], str | None]] = [(f"{at}.headGroupSpec", spec["headGroupSpec"], None)]
    groups += [(f"{at}.workerGroupSpecs[{i}]", g, g.get("groupName")) for i, g in enumerate(workers)]
    problems = _auth_rules(spec.get("authOptions", {}), f"{at}.authOptions")
    names = cast("list[str]", [name for _, _, name in groups[1:]])  # workers': the CRD schema requires groupName
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{at}.workerGroupSpecs: group name '{name}' is used more than once")
    for where, group, _ in groups:
        problems += apirules.pod_template(f"{where}.template", group["template"])
        containers = group["template"].get("spec", {}).get("containers", [])
        if not containers:
            problems.append(f"{where}.template.spec.containers: needs the Ray container (the first one)")
        params = group.get("rayStartParams", {})
        both = [p for p in RESOURCE_PARAMS if p in params] if group.get("resources") else []
        if both:
            problems.append(
                f"{where}: {', '.join(both)} set in both rayStartParams and resources; use only one of them"
            )
        if "labels" in params:
            problems.append(f"{where}.rayStartParams.labels: not allowed; use {where}.labels")
        low, high = group.get("minReplicas"), group.get("maxReplicas")
        if low is not None and high is not None and low > high:
            problems.append(f"{where}: minReplicas {low} > maxReplicas {high}")
        replicas = group.get("replicas")
        if (
            replicas is not None
            and not spec.get("enableInTreeAutoscaling")
            and ((low is not None and replicas < low) or (high is not None and replicas > high))
        ):
            problems.append(f"{where}.replicas: {replicas} outside [minReplicas, maxReplicas] = [{low}, {high}]")
        env = {e["name"] for c in containers[:1] for e in c.get("env", [])}
        if where.endswith("headGroupSpec") and "RAY_REDIS_ADDRESS" in env and "gcsFaultToleranceOptions" not in spec:
            problems.append(f"{where}: RAY_REDIS_ADDRESS turns on GCS fault tolerance; use gcsFaultToleranceOptions")
    return problems


def _auth_rules(options: dict[str, Any], at: str) -> list[str]:
    """The operator's checks of authOptions: Kubernetes-delegated auth is a kind of token auth, and takes no
    Secret."""
    if not options.get("enableK8sTokenAuth"):
        return []
    problems = []
    if options.get("mode", "token") != "token":
        problems.append(f"{at}.enableK8sTokenAuth: needs mode: token")
    if options.get("secretName"):
        problems.append(f"{at}: enableK8sTokenAuth and secretName cannot be used together")
    return problems


def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".") or "(document)"


def validate_file(path: Path, operator: Operator | None = None, directory: Path | None = None) -> list[str]:
    """Problems of every document in a YAML file, prefixed with the file and the document's kind/name."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        return [f"{path}: cannot read: {e}"]
    if not docs:
        return [f"{path}: no documents"]
    out = []
    for doc in docs:
        label = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}" if isinstance(doc, dict) else "?"
        out += [f"{path}: {label}: {problem}" for problem in validate(doc, operator, directory)]
    return out
