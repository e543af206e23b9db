"""A per-step tally of the bytes collectives moved into this rank, so the planner's predictions can be checked.

Convention (one for every kind, so the numbers add up): bytes this rank *received from other ranks* in the step,
as a ring or pairwise algorithm moves them:
  all_gather      output bytes · (W−1)/W
  reduce_scatter  input bytes · (W−1)/W
  all_reduce      bytes · 2(W−1)/W
  all_to_all      output bytes less the part this rank sent itself
"""

from __future__ import annotations

from collections import Counter

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


class CollectiveTally:
    """Bytes per collective kind since the last `take()`; one per process (collectives run on one thread each)."""

    def __init__(self) -> None:
        self._bytes: Counter[str] = Counter()

    def add(self, kind: str, nbytes: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; one of {', '.join(KINDS)}")
        self._bytes[kind] += int(nbytes)

    def take(self) -> dict[str, int]:
        """The tally since the last call, every kind present (0 where none moved), then start afresh."""
        taken = {kind: self._bytes.get(kind, 0) for kind in KINDS}
        self._bytes.clear()
        return taken


TALLY = CollectiveTally()
