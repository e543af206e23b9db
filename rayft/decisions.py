"""What the driver decides where the config leaves the choice to rayft (`auto`), handed to the workers beside the
config. The config stays as the user wrote it and rayft validated it: a decision is a fact of its own, made once
(the expert-parallel degree by preflight, the recompute by the memory plan of the cluster's GPU), so nothing that
reads the config later sees a value the user never gave, and nothing edits a validated config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rayft.config import Checkpointing, Config


@dataclass(frozen=True)
class Decisions:
    """`expert_parallel`: k, the workers that share each MoE layer's experts (1: none). `recompute`: activation
    checkpointing as decided (none, full or selective; `auto` while nothing has decided it, the workers then
    take `Config.checkpoint_every`'s fallback), and `recompute_every`: every n-th decoder layer recomputed in
    backward (1: all of them; None: none), what the workers build the model with."""

    expert_parallel: int
    recompute: Checkpointing
    recompute_every: int | None

    @classmethod
    def of(cls, cfg: Config, expert_parallel: int | None = None) -> Decisions:
        """The config's settings as they stand, with `expert_parallel` decided for its `auto` (else its k)."""
        k = cfg.parallel.expert_groups() if expert_parallel is None else expert_parallel
        return cls(k, cfg.checkpointing, cfg.checkpoint_every())

    def recomputing(self, mode: Checkpointing, every: int | None) -> Decisions:
        """With the recompute chosen: `mode` as a word and, for selective, its period (2 where none is given,
        as the config reads it)."""
        period = {"none": None, "full": 1}.get(mode, every or 2)
        return replace(self, recompute=mode, recompute_every=period)

    def settings(self) -> dict[str, int | str]:
        """The decided settings by their config keys, as a run's trackers record its parameters."""
        decided: dict[str, int | str | None] = {
            "parallel.expert_parallel": self.expert_parallel,
            "fsdp.activation_checkpointing": self.recompute,
            "fsdp.checkpoint_every_n_layers": self.recompute_every if self.recompute == "selective" else None,
        }
        return {key: value for key, value in decided.items() if value is not None}
