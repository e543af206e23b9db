"""The table of a DPO run's precomputed reference log-probs, keyed by pair (`dpo.reference: precomputed`): plain
data, which the workers' training collate reads to hand each pair its two values (`rayft.data.preference`) and
which `rayft.train.reference` fills, stores and shares between ranks."""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ReferenceTable:
    """Reference log-probs by pair key: `keys` sorted and unique; `logps[i]` = (chosen, rejected) of `keys[i]`."""

    keys: np.ndarray  # int64, sorted
    logps: np.ndarray  # float64, (n, 2)
    identity: dict[str, Any]  # what the values depend on: model, dtype, length limits

    @classmethod
    def merge(cls, parts: list[tuple[np.ndarray, np.ndarray]], identity: dict[str, Any]) -> ReferenceTable:
        keys = np.concatenate([k for k, _ in parts]) if parts else np.zeros(0, np.int64)
        logps = np.concatenate([v for _, v in parts]) if parts else np.zeros((0, 2))
        keys, first = np.unique(keys, return_index=True)  # a repeated pair scores the same: keep one
        return cls(keys.astype(np.int64), logps[first].astype(np.float64), identity)

    def __len__(self) -> int:
        return len(self.keys)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        """The (chosen, rejected) rows of `keys` (NaN where absent) and how many are absent."""
        at = np.searchsorted(self.keys, keys).clip(max=max(len(self.keys) - 1, 0))
        found = (self.keys[at] == keys) if len(self.keys) else np.zeros(len(keys), bool)
        values = np.full((len(keys), 2), math.nan)
        values[found] = self.logps[at[found]]
        return values, int((~found).sum())

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, keys=self.keys, logps=self.logps, identity=np.array(json.dumps(self.identity)))
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> ReferenceTable:
        with np.load(io.BytesIO(data)) as stored:
            return cls(stored["keys"], stored["logps"], json.loads(str(stored["identity"])))
