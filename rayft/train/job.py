"""What the driver hands every worker: one frozen, typed object per run (Ray pickles it to each worker), so a worker
reads fields the type checker knows instead of keys of a dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rayft.config import Config
from rayft.decisions import Decisions
from rayft.startup import Profile
from rayft.train.steps import StepPlan


@dataclass(frozen=True)
class Job:
    """A training run as the driver fixed it before the workers start."""

    config: Config  # checked, with absolute paths (workers do not share the driver's working directory)
    plan: StepPlan  # step arithmetic every worker agrees on
    run_uri: str  # the run directory on storage (Ray's own run directory)
    run_id: str | None = None  # the Ray run being continued, when the same job runs again
    resume_from: str | None = None  # a checkpoint to start from (`train.resume_from_checkpoint`), else None
    best_metric: str | None = None  # the metric Ray ranks checkpoints by, when there is one
    parameter_counts: dict[str, int] = field(default_factory=dict)  # trainable and total, for the log
    profile: Profile = field(default_factory=Profile)  # the driver's start-up stages; the workers add theirs
    fit_started: float | None = None  # wall time of the driver's `fit()`: the workers' start is measured from it
    decisions: Decisions | None = None  # what the driver decided for `auto` (None: the config decides everything)

    def decided(self) -> Decisions:
        """The driver's decisions, or where it made none the config's own settings."""
        return self.decisions or Decisions.of(self.config)


@dataclass(frozen=True)
class EvalJob:
    """`rayft eval`: one split scored by the base model and/or base + adapter."""

    config: Config
    run_uri: str  # where rank 0 writes the result for the driver
    adapter: Path | None = None  # the trained adapter to score; None scores the base alone
    with_base: bool = False  # score the base model first, then the adapter
    decisions: Decisions | None = None  # what preflight decided for `auto` (None: the config decides everything)

    def decided(self) -> Decisions:
        """Preflight's decisions, or where it made none the config's own settings."""
        return self.decisions or Decisions.of(self.config)
