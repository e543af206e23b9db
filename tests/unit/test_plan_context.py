"""The planner's context-parallel arithmetic on a toy model whose every count is picked by hand; each expected value
below is worked out by hand from those counts and the code of `rayft.parallel.context` (what each rank holds and
sends), not taken from the planner."""

from __future__ import annotations

import dataclasses
import math

from rayft.config import Config
from rayft.plan import Structure, plan_memory
from rayft.plan.comm import Cluster, Layout, plan_comm
from rayft.plan.long_context import choose, clusters, degrees, fewest_gpus, with_context
from rayft.plan.memory import activation_bytes, tokens_per_micro_batch
from rayft.plan.recompute import Recompute
from rayft.plan.steptime import Hardware, plan_layouts, step_time
from rayft.plan.ulysses import kv_repeat

# 2 layers of hidden 16; attention: 4 query heads of width 8, 2 key/value heads, values of width 4 (so q, k, v and
# the output each have their own size); dense, so no experts.
TOY = Structure(
    architecture="Toy",
    total=10_000,
    largest_layer=4_000,
    layers=2,
    root=2_000,
    lora=300,
    hidden=16,
    vocab=64,
    top_k=0,
    moe_intermediate=0,
    layers_lora=200,
    active_base=2_000,
    attention_per_position=10.0,
    heads=4,
    kv_heads=2,
    qk_head_dim=8,
    v_head_dim=4,
)


def _cfg(n: int, max_length: int = 32) -> Config:
    # GPU: bf16 compute (c = 2); 2 micro-batches a step; no recompute (`auto` without a GPU's capacity)
    return Config.from_dict(
        {
            "data": {"max_length": max_length, "packing": True},
            "parallel": {"context_parallel": n},
            "ray": {"num_workers": 4},
            "train": {"gradient_accumulation_steps": 2},
        }
    )


def test_a_rank_runs_its_share_of_the_row_padded_to_a_multiple_of_n():
    assert tokens_per_micro_batch(_cfg(1)) == 32
    assert tokens_per_micro_batch(_cfg(4)) == 8
    assert tokens_per_micro_batch(_cfg(4, max_length=30)) == 8  # 30 padded to 32 by a padding document, then / 4


def test_key_and_value_heads_are_repeated_by_the_least_factor_n_divides():
    assert kv_repeat(TOY, 1) == 1 and kv_repeat(TOY, 2) == 1
    assert kv_repeat(TOY, 4) == 2  # 2 heads → 4
    assert kv_repeat(dataclasses.replace(TOY, kv_heads=6), 4) == 2  # 6 → 12
    assert kv_repeat(dataclasses.replace(TOY, kv_heads=3), 4) == 4  # 3 → 12


def test_all_to_all_bytes_of_a_step_by_hand():
    # N = 4, 8 tokens a rank, c = 2. A set of four exchanges sends q 8 x 4 heads x 8 x 2 = 512 B, k 8 x (2 x 2
    # repeated) x 8 x 2 = 512, v 8 x 4 x 4 x 2 = 256, the output 8 x 4 x 4 x 2 = 256: 1,536 B. Forward and backward of
    # 2 layers: 4 sets, 6,144 B sent, 3/4 from the other ranks: 4,608 B a micro-batch, 9,216 a step of 2.
    cfg = _cfg(4)
    one_node = plan_comm(cfg, TOY, Layout(shard=4), Cluster(1, 4), on_gpu=True, held="dtype")
    assert one_node.per_step("all_to_all") == 9_216
    assert one_node.per_step("all_to_all", inter_node=True) == 0
    # the group of 4 over 2 nodes of 2: half of what a rank sends goes to the other node, 6,144 / 2 x 2 micro-batches
    two_nodes = plan_comm(cfg, TOY, Layout(shard=4), Cluster(2, 2), on_gpu=True, held="dtype")
    assert two_nodes.per_step("all_to_all", inter_node=True) == 6_144
    # every layer recomputed exchanges its forward's four again: 6 sets instead of 4
    full = plan_comm(cfg, TOY, Layout(shard=4), Cluster(1, 4), True, "dtype", Recompute(2, 1))
    assert full.per_step("all_to_all") == 9_216 * 6 / 4 == 13_824
    # N = 2 (no repeat): 16 tokens a rank, sets of 16 x (32 + 16 + 8 + 16) x 2 = 2,304 B, 4 sets, 1/2 received, x 2
    assert plan_comm(_cfg(2), TOY, Layout(shard=4), Cluster(2, 2), True, "dtype").per_step("all_to_all") == 9_216
    assert plan_comm(_cfg(1), TOY, Layout(shard=4), Cluster(1, 4), True, "dtype").per_step("all_to_all") == 0


def test_activations_divide_by_n_but_the_repeated_key_and_value_heads():
    # a layer's working set on a rank's 8 tokens: 8 x 16 x 17 x 2 = 4,352 B, + the repeated k and v it keeps: one
    # extra copy of 8 tokens x 2 heads x (8 + 4) x 2 B = 384; 2 layers, none recomputed
    assert activation_bytes(_cfg(4), TOY, on_gpu=True) == 2 * (4_352 + 384) == 9_472
    assert activation_bytes(_cfg(2), TOY, on_gpu=True) == 2 * 16 * 16 * 17 * 2 == 17_408  # 2 divides the kv heads
    assert activation_bytes(_cfg(1), TOY, on_gpu=True) == 2 * 32 * 16 * 17 * 2 == 34_816
    rows = dict(plan_memory(_cfg(4), TOY, 4, on_gpu=True).rows)
    # one exchange in flight: the chunks sent and those received of the largest tensor (q or repeated k, 512 B)
    assert rows["context-parallel all-to-all buffers (send + receive)"] * 2**30 == 1_024
    assert rows["activations (AC off, 1/4 of the row)"] * 2**30 == 9_472
    # logits: one chunk of rows, never more than the rank's 8 tokens: 8 x 64 x (2 + 8)
    assert rows["logits + loss"] * 2**30 == 8 * 64 * 10


def test_step_time_runs_a_ranks_share_and_waits_for_the_exchanges():
    cfg, cluster = _cfg(4), Cluster(1, 4)
    hw = Hardware("h200", mfu=0.5, intra_gbytes=4)  # NVLink 4 GB/s both ways: 2e9 B/s received
    comm = plan_comm(cfg, TOY, Layout(shard=4), cluster, True, "dtype")
    time = step_time(cfg, TOY, comm, hw)
    # FLOPs a token: 4 x 2,000 frozen + 6 x 300 LoRA + 3 x 10 x (32 + 1) / 2 (the whole row's causal attention,
    # of which the rank runs H/4 heads for all tokens: per token of its share, the same) = 10,295; 2 x 8 tokens
    assert math.isclose(time.compute_s, 2 * 8 * 10_295 / (989e12 * 0.5))
    assert math.isclose(time.all_to_all_s, 9_216 / 2e9)
    assert math.isclose(time.predicted_s, max(time.busy_s, time.overlapped_comm_s) + 9_216 / 2e9)


def test_context_parallelism_plans_fsdp_over_every_worker_only():
    hw = Hardware("h200")
    (fsdp,) = plan_layouts(_cfg(2), TOY, Cluster(2, 2), hw, "dtype")
    assert fsdp.layout == Layout(shard=4)
    assert plan_layouts(_cfg(4), TOY, Cluster(3, 1), hw, "dtype") == []  # 4 does not divide 3 workers


def test_the_search_tries_degrees_of_the_heads_on_the_fewest_gpus_first():
    assert degrees(TOY) == [1, 2, 4]
    assert [(c.nodes, c.gpus_per_node) for c in clusters(4, max_nodes=3)] == [
        (1, 1),
        (1, 2),
        (1, 3),
        (1, 4),
        (2, 4),
        (3, 4),
    ]
    # a toy fits anywhere: each degree on its own count of GPUs, and the answer is one GPU without splitting
    fits = fewest_gpus(with_context(_cfg(1), 1, 32), TOY, Hardware("h200"), "dtype", 4)
    assert [(f.context, f.cluster.world) for f in fits] == [(1, 1), (2, 2), (4, 4)]
    best = choose(fits)
    assert best is not None and (best.context, best.cluster.world) == (1, 1)
