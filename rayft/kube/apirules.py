"""What the Kubernetes API server checks of names, labels, selectors and tolerations, which no OpenAPI schema states
(the schemas only say "string"): a manifest that breaks one is refused when applied, or, for a RayJob's pod
templates, only when the operator creates the pods, and the job then waits for its deadline.

The rules are Kubernetes' own (k8s.io/apimachinery/pkg/util/validation and the core API's toleration validation):
DNS-1123 labels and subdomains for object names, qualified names for label and annotation keys, label values, and
the toleration operators and effects. Each function returns every problem, naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")  # a qualified name's name; a label value
LABEL_MAX, SUBDOMAIN_MAX = 63, 253
TOLERATION_OPERATORS = ("Equal", "Exists")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
# The JSON schema of an object's metadata as rayft writes it, for the core kinds checked without a CRD (a
# PodDisruptionBudget, a NetworkPolicy, a PodMonitor's and a ConfigMap's metadata).
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA_SCHEMA = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "namespace": {"type": "string"},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
}


def manifest_schema(spec: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a manifest of such a kind whose `spec` has the schema `spec`."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"metadata": METADATA_SCHEMA, "spec": spec},
    }


def dns_subdomain(where: str, value: Any) -> list[str]:
    """An object's name (a queue, a priority class, a service account, a secret)."""
    if isinstance(value, str) and len(value) <= SUBDOMAIN_MAX and DNS_1123_SUBDOMAIN.match(value):
        return []
    return [
        f"{where}: '{value}' is not a valid object name: lower-case letters, digits, '-' and '.', starting and "
        f"ending with a letter or digit, at most {SUBDOMAIN_MAX} characters"
    ]


def qualified_name(where: str, key: Any) -> list[str]:
    """A label or annotation key: `name` or `prefix/name`, the prefix a DNS subdomain."""
    if not isinstance(key, str):
        return [f"{where}: key {key!r} is not a string"]
    prefix, _, name = key.rpartition("/")
    problems = []
    if "/" in key and (not prefix or len(prefix) > SUBDOMAIN_MAX or not DNS_1123_SUBDOMAIN.match(prefix)):
        problems.append(f"{where}: key '{key}': its prefix '{prefix}' must be a DNS subdomain (e.g. example.com)")
    if len(name) > LABEL_MAX or not NAME_PART.match(name):
        problems.append(
            f"{where}: key '{key}': the name part must be at most {LABEL_MAX} characters of letters, digits, '-', "
            "'_' and '.', starting and ending with a letter or digit"
        )
    return problems


def label_value(where: str, value: Any) -> list[str]:
    if value == "" or (isinstance(value, str) and len(value) <= LABEL_MAX and NAME_PART.match(value)):
        return []
    return [
        f"{where}: value {value!r} is not a valid label value: at most {LABEL_MAX} characters of letters, "
        "digits, '-', '_' and '.', starting and ending with a letter or digit (or empty)"
    ]


def labels(where: str, mapping: Any) -> list[str]:
    """Labels or a node selector: qualified keys, label values."""
    if not isinstance(mapping, Mapping):
        return [f"{where}: must be a mapping of keys to values"]
    problems = []
    for key, value in mapping.items():
        problems += qualified_name(f"{where}", key) + label_value(f"{where}.{key}", value)
    return problems


def annotation_keys(where: str, mapping: Any) -> list[str]:
    if not isinstance(mapping, Mapping):
        return [f"{where}: must be a mapping of keys to values"]
    return [p for key in mapping for p in qualified_name(where, key)]


def tolerations(where: str, items: Iterable[Any]) -> list[str]:
    problems = []
    for i, t in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(t, Mapping):
            problems.append(f"{at}: must be a mapping (key, operator, value, effect)")
            continue
        operator, key, value = t.get("operator") or "Equal", t.get("key") or "", t.get("value") or ""
        effect = t.get("effect") or ""
        if operator not in TOLERATION_OPERATORS:
            problems.append(f"{at}.operator: '{operator}' is neither of {', '.join(TOLERATION_OPERATORS)}")
        if effect and effect not in TAINT_EFFECTS:
            problems.append(f"{at}.effect: '{effect}' is none of {', '.join(TAINT_EFFECTS)} (or empty: all)")
        if key:
            problems += qualified_name(f"{at}.key", key)
        elif operator != "Exists":
            problems.append(f"{at}: an empty key (every taint) needs operator Exists")
        if operator == "Exists" and value:
            problems.append(f"{at}.value: must be empty with operator Exists")
        elif operator == "Equal":
            problems += label_value(f"{at}.value", value)
        if t.get("tolerationSeconds") is not None and effect != "NoExecute":
            problems.append(f"{at}.tolerationSeconds: only with effect NoExecute")
    return problems


def pod_template(where: str, template: Mapping[str, Any]) -> list[str]:
    """A pod template's labels, annotation keys, node selector and tolerations."""
    meta, spec = template.get("metadata") or {}, template.get("spec") or {}
    return (
        labels(f"{where}.metadata.labels", meta.get("labels") or {})
        + annotation_keys(f"{where}.metadata.annotations", meta.get("annotations") or {})
        + labels(f"{where}.spec.nodeSelector", spec.get("nodeSelector") or {})
        + tolerations(f"{where}.spec.tolerations", spec.get("tolerations") or [])
    )


QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|[eE][-+]?[0-9]+)?$")
SUFFIX_BYTES = {
    **{s: 1024 ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: 1000 ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
}


def quantity_bytes(value: str) -> int:
    """A memory quantity ('960Gi', '1.5T', '512e6', '2048') in bytes; ValueError naming the forms when it is none."""
    match = QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"'{value}' is not a memory quantity; write e.g. 960Gi, 1Ti or 1000G")
    number, suffix = match.groups()
    if suffix and suffix[0] in "eE":
        return int(float(number) * 10 ** int(suffix[1:]))
    return int(float(number) * SUFFIX_BYTES.get(suffix or "", 1))


def memory_quantity(nbytes: int) -> str:
    """Bytes as the largest binary unit that states them exactly (whole Gi where it can), rounded down to Mi."""
    mib = nbytes // 2**20
    for unit, size in (("Ti", 2**20), ("Gi", 2**10)):
        if mib % size == 0:
            return f"{mib // size}{unit}"
    return f"{mib}Mi"
