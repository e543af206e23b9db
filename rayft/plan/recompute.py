"""Activation checkpointing as a plan decision (`fsdp.activation_checkpointing: auto`): the fewest decoder layers
recomputed in backward for the run to fit its GPU.

Recompute costs a forward of every layer it covers, so none is cheapest, and layers are recomputed only as far as
memory asks: every n-th layer (transformers' `every_n_layers`: layers 0, n, 2n, ... keep only their input; the
others keep their activations), for the largest n that fits, else every layer. Selective by layer rather than by
operator: it is what transformers' checkpointing does per layer, the expert parallelism's saved exchanges
(`rayft.parallel.alltoall.checkpoint_context`) work inside it unchanged, and both its memory and its time are one
share of the layers, so the planner's rows say what the run will do.

This module decides from a `fits` test the caller makes from the memory plan (`rayft.plan.memory.choose_recompute`);
where no GPU capacity is known (CPU workers, a GPU the planner does not know) `auto` keeps `Config.checkpoint_every`'s
fallback.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from rayft.config import Checkpointing, Config


@dataclass(frozen=True)
class Recompute:
    """Which decoder layers are recomputed: every `every`-th of `layers` (1: all), or none (`every` None)."""

    layers: int
    every: int | None

    @classmethod
    def of(cls, cfg: Config, layers: int) -> Recompute:
        """What the config says as it stands: explicit, resolved, or `auto`'s fallback."""
        return cls(layers, cfg.checkpoint_every())

    @property
    def checkpointed(self) -> int:
        """Layers recomputed in backward: ceil(L / n) of them (layers 0, n, 2n, ...)."""
        return 0 if self.every is None else math.ceil(self.layers / self.every)

    @property
    def share(self) -> float:
        """The share of the forward recomputed: checkpointed layers / L."""
        return self.checkpointed / self.layers if self.layers else 0.0

    @property
    def mode(self) -> Checkpointing:
        if self.checkpointed == 0:
            return "none"
        return "full" if self.checkpointed == self.layers else "selective"

    def describe(self) -> str:
        if self.mode != "selective":
            return self.mode
        return f"selective (one layer in {self.every}: {self.checkpointed} of {self.layers})"

    def short(self) -> str:
        """For a table cell: none, full, or the layers recomputed (12/36)."""
        return self.mode if self.mode != "selective" else f"{self.checkpointed}/{self.layers}"


def options(layers: int, selective_only: bool = False) -> list[Recompute]:
    """From least recompute to most: none, every n-th layer for each n giving a distinct count (n = L, ..., 2), all."""
    every: dict[int, int] = {}
    for n in range(layers, 1, -1):
        every.setdefault(math.ceil(layers / n), n)  # the largest n for each count: the same layers, fewer gaps
    selective = [Recompute(layers, n) for _, n in sorted(every.items()) if math.ceil(layers / n) < layers]
    if selective_only:
        return selective or [Recompute(layers, 1)]
    return [Recompute(layers, None), *selective, Recompute(layers, 1)]


def choose(cfg: Config, layers: int, fits: Callable[[Recompute], bool] | None) -> Recompute:
    """The config's setting where it is explicit (full, none, selective with its period); for `auto` (or
    selective without a period) the least recompute that `fits`, else the most (the memory plan then says OOM).
    Without `fits` (no capacity known), `Config.checkpoint_every`'s fallback."""
    mode = cfg.checkpointing
    explicit = mode in ("full", "none") or (mode == "selective" and cfg.fsdp.checkpoint_every_n_layers)
    if explicit or fits is None:
        return Recompute.of(cfg, layers)
    candidates = options(layers, selective_only=mode == "selective")
    return next((r for r in candidates if fits(r)), candidates[-1])
