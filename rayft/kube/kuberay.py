"""The KubeRay releases rayft renders for, and what separates them in a RayJob.

The facts come from KubeRay's own sources at each release tag: the RayJob CRD (which fields exist), the feature
gates (`pkg/features`: which are on by default) and the operator's RayJob validation (which fields need a gate).
Their CRDs ship in `crds/` so that a manifest is checked against the operator it is meant for.

- `spec.preRunningDeadlineSeconds` exists from 1.6. Before that the operator bounds the time to Running only by
  `activeDeadlineSeconds`, which counts from the job's start, the pre-running phase included; rayft renders a start
  watcher beside such a RayJob (`start_watch`), which lowers that deadline once the pre-running one has passed.
- `spec.deletionStrategy` (`onSuccess`/`onFailure`, `deletionRules`) exists from 1.5; 1.4 has only
  `spec.deletionPolicy`, one policy for success and failure alike. The operator refuses either unless its
  RayJobDeletionPolicy feature gate is on: an alpha gate, off by default, in 1.4 and 1.5; beta, on, from 1.6.
- `shutdownAfterJobFinishes` + `ttlSecondsAfterFinished` (the whole cluster after the TTL) work in every release,
  and are the only form a suspended (Kueue) job may use.
- `spec.authOptions` (Ray's token authentication, set up by the operator on every Ray container and the submitter)
  exists from 1.5.1 with `mode` only, the operator then generating a Secret named after the RayCluster; from 1.6
  also `secretName` (a Secret the user made, its token under the key `auth_token`) and `enableK8sTokenAuth` (Ray
  asks the API server instead: standalone RayClusters only, not RayJobs). rayft hands the operator the Secret it
  names from 1.6; before (1.5.0 has no authOptions, and rayft renders any patch of a minor alike), the pods get
  the token from that Secret through their own environment.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# Each minor release rayft renders for → the patch release whose CRDs ship. Patch releases of one minor differ at
# most in fields rayft does not render, so any patch of a supported minor is accepted.
RELEASES: dict[tuple[int, int], str] = {(1, 4): "1.4.2", (1, 5): "1.5.2", (1, 6): "1.6.2", (1, 7): "1.7.0"}
# An unknown operator gets what every supported one accepts: the oldest's form, checked against its CRDs.
OLDEST = min(RELEASES)
PRE_RUNNING_DEADLINE_SINCE = (1, 6)
DELETION_STRATEGY_SINCE = (1, 5)
DELETION_GATE = "RayJobDeletionPolicy"
AUTH_OPTIONS_SINCE = (1, 6)
# The feature gates that change what rayft renders → the minor release from which each is on by default.
GATES_ON_BY_DEFAULT_SINCE: dict[str, tuple[int, int]] = {DELETION_GATE: (1, 6)}


def supported() -> str:
    """The supported minors as users write them: '1.4, 1.5, 1.6, 1.7'."""
    return ", ".join(dotted(m) for m in sorted(RELEASES))


def minor(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a version such as 1.5, 1.5.1 or v1.7.0; None when unknown. ValueError, naming the
    supported releases, for anything else."""
    if version is None:
        return None
    found = re.fullmatch(r"v?(\d+)\.(\d+)(\.\d+)?", version)
    if not found:
        raise ValueError(f"'{version}' is not a version such as 1.7.0")
    key = (int(found.group(1)), int(found.group(2)))
    if key not in RELEASES:
        raise ValueError(f"KubeRay {version} is not supported; rayft renders for {supported()} (any patch release)")
    return key


def gate_problem(gate: str, release: tuple[int, int]) -> str | None:
    """Why declaring `gate` for an operator of `release` would be a mistake, or None when it is fine."""
    if gate not in GATES_ON_BY_DEFAULT_SINCE:
        return f"'{gate}' changes nothing rayft renders; the gates it reads: {', '.join(GATES_ON_BY_DEFAULT_SINCE)}"
    if gate == DELETION_GATE and release < DELETION_STRATEGY_SINCE:
        return (
            f"{gate} needs KubeRay {dotted(DELETION_STRATEGY_SINCE)} or later (k8s.kuberay_version) for rayft's "
            "deletion rules; older operators have no spec.deletionStrategy"
        )
    return None


@dataclass(frozen=True)
class Operator:
    """The KubeRay operator that manifests are rendered for and checked against: its minor release, and the
    feature gates it runs with that its release leaves off by default."""

    release: tuple[int, int] = OLDEST
    gates: frozenset[str] = frozenset()

    @classmethod
    def of(cls, version: str | None, gates: Iterable[str] = ()) -> Operator:
        """From `k8s.kuberay_version` and `k8s.kuberay_feature_gates`; an unknown version is the oldest."""
        return cls(minor(version) or OLDEST, frozenset(gates))

    @property
    def crd_release(self) -> str:
        """The release whose CRDs ship for this operator, e.g. 1.5.2."""
        return RELEASES[self.release]

    def gate_on(self, gate: str) -> bool:
        return gate in self.gates or self.release >= GATES_ON_BY_DEFAULT_SINCE[gate]

    @property
    def pre_running_deadline(self) -> bool:
        """Whether the RayJob has spec.preRunningDeadlineSeconds."""
        return self.release >= PRE_RUNNING_DEADLINE_SINCE

    @property
    def deletion_strategy(self) -> bool:
        """Whether the operator accepts spec.deletionStrategy: the field exists and its gate is on."""
        return self.release >= DELETION_STRATEGY_SINCE and self.gate_on(DELETION_GATE)

    @property
    def auth_options(self) -> bool:
        """Whether the RayCluster has spec.authOptions with secretName and enableK8sTokenAuth."""
        return self.release >= AUTH_OPTIONS_SINCE

    def __str__(self) -> str:
        gates = f" with {', '.join(sorted(self.gates))}" if self.gates else ""
        return f"KubeRay {dotted(self.release)}{gates}"


def dotted(release: tuple[int, int]) -> str:
    """(1, 6) → '1.6'."""
    return ".".join(map(str, release))
