"""The dependency ranges in pyproject.toml: true lower bounds (no release below one lacks what rayft uses), upper
bounds where rayft reads a library's internals, and the pinned versions CI tests (constraints.txt) inside them."""

from __future__ import annotations

from importlib.metadata import requires, version

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

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
    assert floor(requirements()["transformers"]) >= Version(FIRST_WITH_MISTRAL4)


# Run under `make test-deps-floor`: `PreTrainedModel.activation_checkpointing_enable`, which rayft calls to recompute
# activations, is absent from 5.22.0 (AttributeError) and present in 5.23.0.
FIRST_WITH_ACTIVATION_CHECKPOINTING = "5.23.0"


# Likewise: peft 0.17.x imports `HybridCache` from transformers, which transformers 5 no longer has, and 0.18.x's
# ParamWrapper has no `_did_swap_in_out_features`, which expert LoRA on an FP8 base reads (AttributeError there).
PEFT_FLOOR_FOR_FP8_EXPERTS = "0.19.0"
# peft 0.19.x turns `all-linear` on DeepSeek-V3 (its transformers-5 MoE conversion) into a set of letters and fails
# with "Target modules {'a', 'l', ...} not found"; 0.20.0 resolves the shorthand (tests/unit/test_families.py).
PEFT_FLOOR_FOR_ALL_LINEAR_ON_MOE = "0.20.0"
# pydantic 2.5 to 2.8 refuse `Strict` on a list (rayft.schema's `Listed`) when rayft.config is imported.
PYDANTIC_FLOOR_FOR_STRICT_LISTS = "2.9.0"


def test_transformers_floor_has_the_activation_checkpointing_api():
    """`transformers>=5.4` admitted releases on which every run with activation checkpointing failed at wrapping."""
    assert floor(requirements()["transformers"]) >= Version(FIRST_WITH_ACTIVATION_CHECKPOINTING)


def test_peft_floor_runs_expert_lora_on_an_fp8_base():
    """`peft>=0.17` admitted a release that cannot be imported beside any transformers rayft accepts, and one that
    fails the default Mistral-Small-4 path (expert LoRA on the FP8 base)."""
    assert floor(requirements()["peft"]) >= Version(PEFT_FLOOR_FOR_FP8_EXPERTS)


def test_peft_and_pydantic_floors_run_what_rayft_asks_of_them():
    """`peft>=0.19` admitted a release on which `all-linear` fails on DeepSeek-V3; `pydantic>=2.5` admitted releases
    on which rayft's config does not import."""
    assert floor(requirements()["peft"]) >= Version(PEFT_FLOOR_FOR_ALL_LINEAR_ON_MOE)
    assert floor(requirements()["pydantic"]) >= Version(PYDANTIC_FLOOR_FOR_STRICT_LISTS)


def test_libraries_whose_internals_rayft_reads_have_an_upper_bound():
    """transformers' weight-loading internals and PEFT's private `all-linear` helper (Ray's private functions are
    optional: rayft/ray_private.py)."""
    for name in ("transformers", "peft"):
        assert any(s.operator in ("<", "<=", "~=") for s in requirements()[name].specifier), name


def test_the_pinned_versions_are_inside_the_ranges():
    for name, requirement in requirements().items():
        assert version(name) in requirement.specifier, (name, version(name), str(requirement.specifier))


# Read from each floor release's wheel (its METADATA's Requires-Dist): what the floors require of one another.
FLOORS_REQUIRE = {
    ("transformers", "5.23"): {"huggingface-hub": ">=1.31.0,<3.0", "safetensors": ">=0.8.0"},
    ("trl", "1.0"): {"datasets": ">=4.7.0", "accelerate": ">=1.4.0", "transformers": ">=4.56.2"},
    ("datasets", "4.7"): {"pyarrow": ">=21.0.0", "huggingface-hub": ">=0.25.0,<2.0", "filelock": ""},
    ("peft", "0.20"): {"accelerate": ">=0.21.0", "huggingface-hub": ">=0.25.0", "transformers": ""},
    ("accelerate", "1.10"): {"huggingface-hub": ">=0.21.0", "safetensors": ">=0.4.3", "pyyaml": ""},
}
NUMPY_1_ONLY = {"matplotlib": "3.8"}  # its wheels require numpy<2, which no other pinned library installs with


def floor(requirement: Requirement) -> Version:
    (lower,) = [s.version for s in requirement.specifier if s.operator == ">="]
    return Version(lower)


def test_the_floors_can_be_installed_together():
    """huggingface_hub>=1.0 and datasets>=4.0 were floors no install could have: transformers needs a newer
    huggingface_hub, trl 1.0 needs datasets 4.7, which needs pyarrow 21. Each floor must satisfy what the other
    floors require (`make test-deps-floor` installs them together and runs the tests on them)."""
    ours = requirements()
    for (name, release), needs in FLOORS_REQUIRE.items():
        assert floor(ours[name]) == Version(release), (name, str(ours[name].specifier))
        for dependency, spec in needs.items():
            assert floor(ours[dependency]) in SpecifierSet(spec), (name, dependency, spec, str(ours[dependency]))
    for name, release in NUMPY_1_ONLY.items():
        assert floor(ours[name]) > Version(release), (name, str(ours[name].specifier))
