"""The user's patches on rendered manifests, kustomize's two kinds, so nothing needs editing generated files.

A strategic-merge patch is a partial manifest: `kind` (and optionally `metadata.name`) picks the manifest;
mappings merge, `null` deletes a key, lists of named items (containers, env, volumes, worker groups…) merge item by
item on their name, other lists are replaced. A JSON patch (RFC 6902) is `{target: rayjob|raycluster, patch:
[operations]}`. The result is validated like any render, so a patch cannot produce what KubeRay would refuse.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from rayft.config import ConfigError

# The keys that name items in Kubernetes lists strategic merge merges by (the API's patchMergeKey).
MERGE_KEYS = ("name", "groupName", "containerPort", "mountPath")


def apply_file(manifests: dict[str, dict[str, Any]], path: Path) -> dict[str, dict[str, Any]]:
    """The manifests with the patch in `path` applied (a copy; ConfigError naming the file when it cannot be)."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except OSError as e:
        raise ConfigError(f"k8s.patches: cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"k8s.patches: {path} is not valid YAML: {e}") from None
    out = copy.deepcopy(manifests)
    for doc in docs:
        if isinstance(doc, dict) and "patch" in doc and "target" in doc:
            target = doc["target"]
            if target not in out:
                raise ConfigError(f"k8s.patches: {path}: target '{target}' is none of {', '.join(out)}")
            out[target] = json_patch(out[target], doc["patch"], f"{path}")
        elif isinstance(doc, dict) and "kind" in doc:
            name = (doc.get("metadata") or {}).get("name")
            hits = [k for k, m in out.items() if m["kind"] == doc["kind"] and name in (None, m["metadata"]["name"])]
            if not hits:
                raise ConfigError(
                    f"k8s.patches: {path}: no rendered {doc['kind']}" + (f" named {name}" if name else "")
                )
            for key in hits:
                out[key] = strategic_merge(out[key], doc)
        else:
            raise ConfigError(
                f"k8s.patches: {path}: neither a strategic-merge patch (a mapping with kind) nor a JSON patch "
                "({target: rayjob|raycluster, patch: [operations]})"
            )
    return out


def strategic_merge(base: Any, patch: Any) -> Any:
    """`patch` merged into `base` (neither changed)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = strategic_merge(base.get(key), value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        key = _merge_key(base + patch)
        if key is not None:
            merged = list(base)
            for item in patch:
                at = next((i for i, b in enumerate(merged) if b.get(key) == item.get(key)), None)
                if at is None:
                    merged.append(copy.deepcopy(item))
                else:
                    merged[at] = strategic_merge(merged[at], item)
            return merged
    return copy.deepcopy(patch)


def _merge_key(items: list[Any]) -> str | None:
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    return next((k for k in MERGE_KEYS if all(k in i for i in items)), None)


def json_patch(doc: Any, operations: Any, where: str) -> Any:
    """RFC 6902 on a copy of `doc`: add, remove, replace, move, copy, test."""
    if not isinstance(operations, list):
        raise ConfigError(f"k8s.patches: {where}: patch must be a list of operations")
    doc = copy.deepcopy(doc)
    for i, op in enumerate(operations):
        at = f"k8s.patches: {where}: operation {i}"
        if (
            not isinstance(op, dict)
            or "path" not in op
            or op.get("op") not in ("add", "remove", "replace", "move", "copy", "test")
        ):
            raise ConfigError(f"{at}: needs op (add|remove|replace|move|copy|test) and path, got {op!r}")
        kind, path = op["op"], _pointer(op["path"], at)
        if kind in ("add", "replace", "test") and "value" not in op:
            raise ConfigError(f"{at}: {kind} needs a value")
        if kind == "test":
            if _get(doc, path, at) != op["value"]:
                raise ConfigError(f"{at}: test failed at {op['path']}")
        elif kind == "remove":
            _remove(doc, path, at)
        elif kind == "replace":
            _remove(doc, path, at)
            doc = _add(doc, path, copy.deepcopy(op["value"]), at)
        elif kind == "add":
            doc = _add(doc, path, copy.deepcopy(op["value"]), at)
        else:
            source = _pointer(op.get("from", ""), at)
            value = copy.deepcopy(_get(doc, source, at))
            if kind == "move":
                _remove(doc, source, at)
            doc = _add(doc, path, value, at)
    return doc


def _pointer(text: str, at: str) -> list[str]:
    if text == "":
        return []
    if not text.startswith("/"):
        raise ConfigError(f"{at}: path '{text}' is not a JSON pointer (it starts with /)")
    return [p.replace("~1", "/").replace("~0", "~") for p in text[1:].split("/")]


def _step(node: Any, part: str, at: str, end_ok: bool = False) -> Any:
    if isinstance(node, dict):
        return part
    if isinstance(node, list):
        if part == "-" and end_ok:
            return len(node)
        if part.isdigit() and int(part) < len(node) + (1 if end_ok else 0):
            return int(part)
    raise ConfigError(f"{at}: no '{part}' at that place")


def _get(doc: Any, path: list[str], at: str) -> Any:
    node = doc
    for part in path:
        key = _step(node, part, at)
        if isinstance(node, dict) and key not in node:
            raise ConfigError(f"{at}: no '{part}' at that place")
        node = node[key]
    return node


def _remove(doc: Any, path: list[str], at: str) -> None:
    if not path:
        raise ConfigError(f"{at}: cannot remove the whole manifest")
    parent = _get(doc, path[:-1], at)
    key = _step(parent, path[-1], at)
    if isinstance(parent, dict) and key not in parent:
        raise ConfigError(f"{at}: no '{path[-1]}' to remove")
    del parent[key]


def _add(doc: Any, path: list[str], value: Any, at: str) -> Any:
    if not path:
        return value
    parent = _get(doc, path[:-1], at)
    key = _step(parent, path[-1], at, end_ok=True)
    if isinstance(parent, list):
        parent.insert(key, value)
    else:
        parent[key] = value
    return doc
