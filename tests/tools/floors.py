"""The floor set: `name==version` for the lower bound of each of rayft's dependencies, read from the installed
package's metadata (pyproject.toml's). torch and Ray are left out: the oldest torch has its own leg
(`make test-torch-floor`), and Ray's floor is the pinned release. `make test-deps-floor` installs these together."""

from __future__ import annotations

import sys
from importlib.metadata import requires, version

from packaging.requirements import Requirement
from packaging.version import Version

OWN_LEG = {"torch", "ray"}


def floors() -> list[str]:
    pins = []
    for text in requires("rayft") or []:
        requirement = Requirement(text)
        if requirement.marker is not None or requirement.name.lower() in OWN_LEG:
            continue
        lower = [s.version for s in requirement.specifier if s.operator == ">="]
        if len(lower) != 1:
            sys.exit(f"{requirement}: no single lower bound (>=) to install as its floor")
        pins.append(f"{requirement.name}=={lower[0]}")
    return pins


def check() -> int:
    """Whether this interpreter imports exactly the floor set (a pinned package left in front of a floor would make
    the floor leg test the pins): 0, or 1 naming each version that differs."""
    wrong = []
    for pin in floors():
        name, floor = pin.split("==")
        if Version(version(name)) != Version(floor):
            wrong.append(f"{name}: {version(name)} imported, floor {floor}")
    print("\n".join(wrong) or f"floor set in use: {', '.join(floors())}")
    return 1 if wrong else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(check())
    print("\n".join(floors()))
