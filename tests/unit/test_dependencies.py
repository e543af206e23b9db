"""The dependency ranges in pyproject.toml: true lower bounds (no release below one lacks what rayft uses), upper
bounds where rayft reads a library's internals, and the pinned versions CI tests (constraints.txt) inside them."""

from __future__ import annotations

from importlib.metadata import requires, version

from packaging.requirements import Requirement

# Read from each release's wheel on PyPI (its file list): transformers/models/mistral4/ is absent from 5.0.0, 5.1.0,
# 5.2.0 and 5.3.0 and present from 5.4.0 on.
WITHOUT_MISTRAL4 = ("5.0.0", "5.1.0", "5.2.0", "5.3.0")
FIRST_WITH_MISTRAL4 = "5.4.0"


def requirements() -> dict[str, Requirement]:
    """rayft's own dependencies (not its extras), as the installed package declares them (pyproject.toml's)."""
    found = (Requirement(r) for r in requires("rayft") or [])
    return {r.name.lower().replace("_", "-"): r for r in found if r.marker is None}


def test_transformers_floor_has_mistral4():
    """`transformers>=5.0` let pip pick a release in which rayft's main model does not exist."""
    spec = requirements()["transformers"].specifier
    assert not [v for v in WITHOUT_MISTRAL4 if v in spec], spec
    assert FIRST_WITH_MISTRAL4 in spec


def test_libraries_whose_internals_rayft_reads_have_an_upper_bound():
    """transformers' weight-loading internals and PEFT's private `all-linear` helper (Ray's private functions are
    optional: rayft/ray_private.py)."""
    for name in ("transformers", "peft"):
        assert any(s.operator in ("<", "<=", "~=") for s in requirements()[name].specifier), name


def test_the_pinned_versions_are_inside_the_ranges():
    for name, requirement in requirements().items():
        assert version(name) in requirement.specifier, (name, version(name), str(requirement.specifier))
