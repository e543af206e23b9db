"""Context parallelism as the planner counts it: what a rank of an N-way Ulysses group holds and exchanges
(`rayft.parallel.context` is what runs).

A rank holds a contiguous 1/N of the packed row (padded to a multiple of N), so every per-token activation is its
share of the row's: the projections, norms, MLP and experts, the loss. Attention turns q, k and v from this rank's
tokens of every head into every token of H/N heads: (s/N)·H·d and s·(H/N)·d are the same bytes, so what Ulysses
gathers divides by N too. What does not divide: when the key and value heads do not divide N, k and v are repeated
by the least factor that makes them (`repeat`), so each rank holds `repeat` times its share of them.

Exchanges, per attention layer and micro-batch, each rank sending its tokens' share: forward q, k, v to heads and
the output back to tokens (four all-to-alls), backward the gradient of each (four more, the same sizes), and the
forward's four again in every layer activation checkpointing recomputes (the exchange's outputs are not saved
across the checkpoint). A rank sends `(s/N)·(H·d_qk + H_kv·repeat·(d_qk + d_v) + H·d_v)·c` bytes per four and
receives (N−1)/N of it from the others.
"""

from __future__ import annotations

import math

from rayft.config import Config
from rayft.plan.structure import Structure


def degree(cfg: Config) -> int:
    """N: the ranks each packed row is split over (`parallel.context_parallel`; 1: none)."""
    return int(getattr(cfg.parallel, "context_parallel", 1) or 1)


def kv_repeat(s: Structure, n: int) -> int:
    """The least factor by which the key and value heads are repeated so that N divides them (1 when it does)."""
    return n // math.gcd(s.kv_heads, n) if s.kv_heads and n > 1 else 1


def exchanged(s: Structure, tokens: int, c: int, n: int) -> tuple[int, int, int, int]:
    """Bytes of q, k, v and attention's output as a rank of tokens `tokens` (its share of the row) sends them to
    the all-to-all, k and v repeated as the exchange takes them."""
    kv = s.kv_heads * kv_repeat(s, n)
    return (
        tokens * s.heads * s.qk_head_dim * c,
        tokens * kv * s.qk_head_dim * c,
        tokens * kv * s.v_head_dim * c,
        tokens * s.heads * s.v_head_dim * c,
    )


def repeated_kv_bytes(s: Structure, tokens: int, c: int, n: int) -> int:
    """What one layer keeps of k and v beyond its share when they are repeated: (repeat − 1) copies, which the
    kernel saves for backward in the heads layout."""
    return (kv_repeat(s, n) - 1) * tokens * s.kv_heads * (s.qk_head_dim + s.v_head_dim) * c


def exchanges_per_micro_batch(layers: int, recomputed: int) -> int:
    """Sets of four all-to-alls per micro-batch: forward and backward in every layer, and the forward's again in
    each recomputed one."""
    return 2 * layers + recomputed
