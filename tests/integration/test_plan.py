"""`rayft plan`: the real Mistral-Small-4 config against the reference figures, and a tiny model's plan."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys

import pytest
from conftest import REPO, Fixtures
from fixtures.small_vocab import FIXTURE_VOCAB

from rayft import cli
from rayft.config import Config
from rayft.model.frozen import Held
from rayft.plan import Structure, meta_structure, plan_memory
from rayft.plan.comm import Cluster, Layout, plan_comm
from rayft.plan.preemption import preemption_cost
from rayft.plan.steptime import Hardware, choose_expert_parallel, pass_bytes_per_weight, step_time

# Mistral-Small-4, bf16, full shard, AC on, r=16, attention + shared-expert LoRA, 1 x 4096 tokens per GPU.
REFERENCE_GIB = {3: 97, 4: 79, 8: 51}


def test_real_config_plan_is_within_10_percent_of_the_reference():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rayft.cli",
            "plan",
            "--preset",
            "mistral-small-4",
            "--num-nodes",
            "3",
            "4",
            "8",
            "--override",
            "data.max_length=4096",
            "--override",
            "fsdp.activation_checkpointing=true",
            "--override",
            "model.frozen_dtype=bfloat16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Mistral4ForCausalLM: 118.97B params" in result.stdout
    totals = [float(x) for x in re.search(r"total GiB/GPU\s+([\d.\s]+)", result.stdout)[1].split()]
    for (nodes, want), got in zip(REFERENCE_GIB.items(), totals, strict=True):
        assert abs(got - want) / want <= 0.10, (nodes, got, want)
    assert re.search(r"on h200 .*fits\s+fits\s+fits", result.stdout)
    # next to it, the same runs with the frozen base in FP8 (1 byte per decoder-matrix weight + row scales)
    fp8 = [float(x) for x in re.search(r"with fp8 base\s+([\d.\s]+)", result.stdout)[1].split()]
    assert all(0.5 * bf16 < f < 0.7 * bf16 for f, bf16 in zip(fp8, totals, strict=True)), (fp8, totals)


def test_plan_layouts_for_the_seeds_two_and_three_single_gpu_nodes():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rayft.cli",
            "plan",
            "--preset",
            "mistral-small-4",
            "--num-nodes",
            "2",
            "3",
            "--override",
            "data.max_length=4096",
            "--override",
            "fsdp.activation_checkpointing=true",
            "--override",
            "train.gradient_accumulation_steps=1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    two, three = result.stdout.split("layouts on ")[1:]
    assert two.startswith(
        "2 node(s) x 1 GPU (W=2), h200: 989 TFLOP/s bf16 (1979 FP8) at 40% MFU, network 400 Gb/s (50 GB/s)"
    )
    rows = {
        (m[1].strip(" *"), m[2]): m[3].split() for m in re.finditer(r"^([ *][\w +]+?)\s+(fp8|bf16)\s+(.+)$", two, re.M)
    }
    # columns: GiB/GPU fits AC gather r-scatter all-red a2a network compute comm step serial bound tok/s MFU
    fsdp, ep = rows[("FSDP", "fp8")], rows[("EP 2", "fp8")]
    assert {row[2] for row in rows.values()} == {"full"}, rows  # asked for explicitly: every layout recomputes
    # FSDP on 2 ranks receives half of every decoder layer in forward and half in backward, the last layer once
    # (kept gathered from its forward to its backward): (2 - 1/36) / 2 copies per micro-batch, of which the routed
    # experts alone are 36 layers x 128 x 3 x 4096 x 2048 weights at 1 byte = 116.0 GB a copy
    experts = 36 * 128 * 3 * 4096 * 2048 / 1e9 * (2 - 1 / 36) / 2
    assert experts < float(fsdp[3]) < 1.05 * experts, fsdp
    assert fsdp[12] == "comm" and abs(float(fsdp[10]) - float(fsdp[3]) / 50) < 0.01, fsdp  # 50 GB/s: all network
    # EP 2: 36 MoE layers x 4 passes (AC's recompute reuses the saved exchanges) x 4096 tokens x top-4 x 4096
    # hidden x 2 B, half to the other node
    assert float(ep[6]) == round(36 * 4 * 4096 * 4 * 4096 * 2 / 2 / 1e9, 2) == 9.66, ep
    assert ep[3] == "0.00" and ep[12] == "comp" and float(ep[10]) < float(fsdp[10]) / 2, (ep, fsdp)
    # 119B params in FP8 whole on each H200: it fits, and holds the half of the base FSDP's GPU leaves to the other,
    # less the two gathered layers' FP8 bytes (mostly their 128 x 3 x 4096 x 2048 experts), which a one-rank shard
    # group leaves to the layers instead of copying
    replicated = rows[("replicated", "fp8")]
    assert replicated[1] == "yes" and rows[("replicated", "bf16")][1] == "OOM", replicated
    gathered_fp8 = 2 * 128 * 3 * 4096 * 2048 / 2**30
    assert abs(float(replicated[0]) - float(fsdp[0]) - (118.97e9 / 2 / 2**30 - gathered_fp8)) < 1.5, (replicated, fsdp)
    # multiplied in FP8 on its own bytes, the whole base on each GPU moves nothing but the LoRA gradients, where
    # EP 2 exchanges tokens that its compute cannot hide: the fastest
    assert float(replicated[10]) < float(ep[10]), (replicated, ep)
    assert "* fastest that fits: replicated, fp8 base" in two
    # 3 nodes: no k > 1 divides both 3 workers and 128 experts, so no EP; FSDP is communication-bound, and the FP8
    # base whole on each GPU (fitting as on 2 nodes) only all-reduces the LoRA gradients
    assert "EP " not in three.split("* fastest")[0]
    assert re.search(r"^ FSDP\s+fp8 .* comm\s+[\d,]+\s+\d+%$", three, re.M), three
    assert re.search(r"^\*replicated\s+fp8 .* comp\s+[\d,]+\s+\d+%$", three, re.M), three


def test_plan_layouts_of_an_nf4_base_beside_fp8():
    """The QLoRA example on two single-GPU nodes: NF4's layouts (no expert parallelism, which NF4 does not take)
    beside FP8's, each with what it gathers and what its dequantisation costs the compute stream."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rayft.cli",
            "plan",
            "--config",
            "jobs/mistral4-nf4-1xh200.yaml",
            "--preset",
            "mistral-small-4",
            "--num-nodes",
            "2",
            "--override",
            "train.gradient_accumulation_steps=1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    table = result.stdout.split("layouts on ")[1]
    assert "compute of an NF4 base includes its dequantisation" in table
    assert "an FP8 base is multiplied on its stored bytes at the FP8 peak" in table
    rows = {
        (m[1].strip(" *"), m[2]): m[3].split() for m in re.finditer(r"^([ *][\w +]+?)\s+(fp8|nf4)\s+(.+)$", table, re.M)
    }
    assert {layout for layout, base in rows if base == "nf4"} == {"FSDP", "replicated"}, rows
    assert ("EP 2", "fp8") in rows, rows
    # columns: GiB/GPU fits AC gather r-scatter all-red a2a network compute comm step serial bound tok/s MFU
    nf4, fp8 = rows[("FSDP", "nf4")], rows[("FSDP", "fp8")]
    # the routed experts as FSDP gathers them on 2 ranks, (2 - 1/36) / 2 copies per micro-batch: 36 layers x 128 x
    # 3 x 4096 x 2048 weights at half a byte, an int8 scaler per 64 weights and an fp32 factor per 16,384
    experts = 36 * 128 * 3 * 4096 * 2048 * (0.5 + 1 / 64 + 4 / 16_384) / 1e9 * (2 - 1 / 36) / 2
    assert experts < float(nf4[3]) < 1.05 * experts, nf4
    # less memory; more compute-stream time: NF4 is dequantised for every matmul, FP8 multiplied as stored
    assert float(nf4[0]) < float(fp8[0]) and float(nf4[8]) > float(fp8[8]), (nf4, fp8)


def test_plan_rows_follow_the_config(fixtures: Fixtures):
    tokens = 16_384  # more than one chunk of the fused loss holds
    raw = {"model": {"model_name_or_path": str(fixtures.model), "torch_dtype": "float32"}}
    cfg = Config.from_dict({**raw, "data": {"max_length": tokens}})
    s = meta_structure(cfg)
    assert s.layers == 2 and s.vocab == FIXTURE_VOCAB and s.lora > 0
    without = dict(plan_memory(cfg, s, world_size=2, on_gpu=False).rows)
    cfg.fsdp.activation_checkpointing = True
    with_ac = dict(plan_memory(cfg, s, world_size=2, on_gpu=False).rows)
    assert with_ac["activations (AC on)"] < without["activations (AC off)"]
    # fp32 logits + fp32 log-softmax + fp32 gradient: with the fused loss one chunk of 64 MiB of fp32 logits (a
    # multiple of 128 rows) on CPU, else every token
    chunk = 64 * 2**20 // (4 * FIXTURE_VOCAB)
    assert chunk % 128 == 0 and chunk < tokens
    assert without["logits + loss"] * 2**30 == chunk * FIXTURE_VOCAB * 12
    cfg.train.fused_loss = False
    unfused = dict(plan_memory(cfg, s, world_size=2, on_gpu=False).rows)
    assert unfused["logits + loss"] * 2**30 == tokens * FIXTURE_VOCAB * 12
    assert "CUDA/NCCL/allocator overhead" not in without


# A toy structure whose every count is picked by hand; the expected bytes below are worked out by hand from them.
TOY = Structure(
    architecture="Toy",
    total=10_000,
    largest_layer=5_000,
    layers=2,
    root=1_100,
    lora=300,
    hidden=16,
    vocab=64,
    top_k=2,
    moe_intermediate=8,
    fp8=7_000,
    fp8_rows=500,
    fp8_layer=3_500,
    fp8_layer_rows=250,
    fp8_largest=1_500,
    layers_lora=200,
    experts=6_000,
    expert_rows=400,
    experts_layer=3_000,
    expert_lora=100,
    num_experts=4,
    moe_layers=2,
    active_base=2_000,
    attention_per_position=10.0,
    nf4=6_500,
    nf4_matrices=10,
    nf4_layer=3_250,
    nf4_experts=6_000,
)
# frozen: 9,000 in layers, 1,000 in the root; LoRA: 200 in layers (100 of it on experts), 100 in the root. NF4 holds
# the 8 experts and 2 of the linears (500 weights); FP8 every linear.


def _toy_cfg() -> Config:
    # GPU, bf16 compute (c = 2), fp32 gradient reduction (r = 4), 32 tokens per micro-batch, 2 micro-batches per step
    return Config.from_dict({"data": {"max_length": 32}, "train": {"gradient_accumulation_steps": 2}})


def test_comm_model_against_hand_computed_bytes():
    cfg, two_by_two = _toy_cfg(), Cluster(nodes=2, gpus_per_node=2)

    def plan(layout: Layout, held: Held = "dtype"):
        return plan_comm(cfg, TOY, layout, two_by_two, on_gpu=True, held=held)

    # FSDP over 4: layers (9,000 + 200) x 2 B gathered forward + backward, but the last of the 2 layers only once
    # (kept from its forward to its backward): 1.5 x, 3/4 from others, x 2 micro-batches; the root holds LoRA, so
    # it is gathered every micro-batch: 1,100 x 2 B x 3/4
    fsdp = plan(Layout(shard=4))
    assert fsdp.per_step("all_gather") == 2 * (1.5 * 18_400 * 3 / 4 + 2_200 * 3 / 4) == 44_700
    assert fsdp.per_step("reduce_scatter") == 300 * 4 * 3 / 4 == 900
    assert fsdp.per_step("all_reduce") == 2 * 8 * 3 / 4 == 12  # the step's target count
    assert fsdp.per_step("all_to_all") == 0
    # over the network: the other node's half of every gathered tensor, shared by this node's 2 GPUs (T · 1/4)
    assert fsdp.per_step(inter_node=True) == 2 * (1.5 * 18_400 / 4 + 2_200 / 4) + 1_200 / 4 + 2 * 8 / 4 == 15_204
    # FP8: 7,000 matrix weights at 1 B + 500 row scales at 4 B (fp32, never cast), the other 2,000 frozen at 2 B,
    # LoRA 400 B
    assert plan(Layout(shard=4), "fp8").per_step("all_gather") == 2 * (1.5 * 13_400 * 3 / 4 + 1_650) == 33_450
    # HSDP: gathered within the node (1/2 from the other GPU), gradient shards all-reduced across the 2 nodes
    hsdp = plan(Layout(shard=2))
    assert hsdp.per_step("all_gather") == 2 * (1.5 * 18_400 / 2 + 2_200 / 2) == 29_800
    assert hsdp.per_step("reduce_scatter") == 1_200 / 2 == 600
    assert hsdp.per_step("all_reduce") == 2 * (1_200 / 2) / 2 + 12 == 612
    # EP 2 on 2 nodes of 2: experts (6,000 x 2 B) and their LoRA (100 x 2 B) are never gathered; each ep-group is
    # one node's pair (ranks 0-1, 2-3); the rest is sharded within the node and replicated across
    ep = plan(Layout.expert(2, two_by_two))
    assert ep.layout == Layout(shard=2, expert_parallel=2)
    assert ep.per_step("all_gather") == 2 * (1.5 * 6_200 / 2 + 2_200 / 2) == 11_500
    assert ep.per_step("reduce_scatter") == 200 * 4 / 2 == 400
    # the non-expert LoRA shards (800 B / 2) across the 2 nodes, the expert LoRA (400 B / 2) over the dp pair of
    # ranks holding the same experts (0 and 2: one on each node)
    assert ep.per_step("all_reduce") == 2 * 400 / 2 + 2 * 200 / 2 + 12 == 612
    # 2 MoE layers x 4 passes x 32 tokens x top-2 x 16 hidden x 2 B = 16,384 B sent, half to the other EP rank,
    # which sits on the same node: none of it over the network
    assert ep.per_step("all_to_all") == 2 * 16_384 / 2 == 16_384
    assert ep.per_step(inter_node=True) == 400 + 200 + 4 == 604
    # EP 4 = W: the ep-group spans both nodes (half of what is sent crosses), the rest still sharded within a node
    whole = plan(Layout.expert(4, two_by_two))
    assert whole.per_step("all_gather") == 11_500 and whole.per_step("reduce_scatter") == 400
    assert whole.per_step("all_reduce") == 2 * 400 / 2 + 12 == 412  # no dp pair: no expert LoRA all-reduce
    assert whole.per_step("all_to_all") == 2 * 16_384 * 3 / 4 == 24_576
    assert whole.per_step(inter_node=True) == 400 + 4 + 2 * 16_384 / 2 == 16_788
    cfg.fsdp.activation_checkpointing = True  # the recompute reuses the saved exchanges: still 4 passes
    assert plan(Layout(shard=2, expert_parallel=2)).per_step("all_to_all") == 2 * 16_384 / 2 == 16_384


def test_step_time_and_the_layout_auto_picks():
    cfg, cluster = _toy_cfg(), Cluster(nodes=2, gpus_per_node=2)
    # 8 Gb/s = 1e9 B/s over the network; NVLink 4 GB/s both directions = 2e9 B/s received
    hw = Hardware("h200", mfu=0.5, inter_gbits=8, intra_gbytes=4)
    # FLOPs/token: 4 x 2,000 frozen + 6 x (200 LoRA + 100 expert LoRA x 2/4) + 3 x 10 x 16.5 attention (causal: a
    # query attends (32 + 1) / 2 keys on average) = 9,995
    compute = 2 * 32 * 9_995 / (989e12 * 0.5)
    fsdp = step_time(cfg, TOY, plan_comm(cfg, TOY, Layout(shard=4), cluster, True, "dtype"), hw)
    assert math.isclose(fsdp.compute_s, compute)
    assert math.isclose(fsdp.overlapped_comm_s, 15_204 / 1e9 + (45_612 - 15_204) / 2e9)
    assert math.isclose(fsdp.predicted_s, fsdp.overlapped_comm_s) and fsdp.comm_bound
    assert math.isclose(fsdp.serial_s, compute + fsdp.overlapped_comm_s)
    ep = step_time(cfg, TOY, plan_comm(cfg, TOY, Layout(2, 2), cluster, True, "dtype"), hw)
    assert math.isclose(ep.all_to_all_s, 16_384 / 2e9)  # the EP pair is one node's: all of it over NVLink
    assert math.isclose(ep.predicted_s, 604 / 1e9 + (12_512 - 604) / 2e9 + 16_384 / 2e9)
    # EP 4: 12,312 B of gathers and reductions (404 B over the network) + 24,576 B of all-to-all (16,384 B over the
    # network): 2.68e-5 s against EP 2's 1.47e-5 s and FSDP's 3.04e-5 s; everything fits (the toy is KiB): `auto`
    # takes the node-local 2
    assert choose_expert_parallel(cfg, TOY, cluster, hw, "dtype") == 2
    # and a GPU fast enough to hide FSDP's bytes behind compute makes the layout compute-bound
    slow = Hardware("h200", mfu=1e-9, inter_gbits=8, intra_gbytes=4)
    assert not step_time(cfg, TOY, plan_comm(cfg, TOY, Layout(shard=4), cluster, True, "dtype"), slow).comm_bound


def test_an_fp8_base_without_fp8_compute_adds_its_dequantisation_at_memory_bandwidth_to_compute():
    cfg, cluster, hw = _toy_cfg(), Cluster(nodes=2, gpus_per_node=2), Hardware("h200", fp8_compute=False)
    per_weight = (1 + 2) / 4.8e12  # the compiled kernel reads the E4M3 byte and writes bf16, at the H200's 4.8 TB/s

    def timed(layout: Layout, held: Held, config: Config = cfg):
        return step_time(config, TOY, plan_comm(config, TOY, layout, cluster, True, held), hw, held)

    bf16, fp8 = timed(Layout(shard=4), "dtype"), timed(Layout(shard=4), "fp8")
    assert bf16.dequant_s == 0 and fp8.compute_s == bf16.compute_s
    # 2 micro-batches x 2 passes (forward, input gradient) x (1,000 linear weights + 6,000 expert weights, each of
    # the 4 experts hit by one of 32 tokens x top-2 = 64 slots with probability 1 - (3/4)^64)
    assert math.isclose(fp8.dequant_s, 2 * 2 * (1_000 + 6_000 * (1 - 0.75**64)) * per_weight)
    assert math.isclose(fp8.busy_s, fp8.compute_s + fp8.dequant_s)
    assert math.isclose(fp8.predicted_s, max(fp8.busy_s, fp8.overlapped_comm_s) + fp8.all_to_all_s)
    # EP 2: each GPU holds 2 of the 4 experts, hit by the pair's 128 slots
    assert math.isclose(timed(Layout(2, 2), "fp8").dequant_s, 2 * 2 * (1_000 + 3_000 * (1 - 0.75**128)) * per_weight)
    # 2 tokens a micro-batch: 4 slots leave an expert idle with probability (3/4)^4; the recompute is a third pass
    short = Config.from_dict(
        {
            "data": {"max_length": 2},
            "train": {"gradient_accumulation_steps": 2},
            "fsdp": {"activation_checkpointing": True},
        }
    )
    assert math.isclose(
        timed(Layout(shard=4), "fp8", short).dequant_s, 2 * 3 * (1_000 + 6_000 * (1 - 0.75**4)) * per_weight
    )


def test_an_fp8_base_with_fp8_compute_multiplies_at_the_fp8_peak_and_dequantises_nothing():
    """`model.fp8_compute` (null: on for a GPU with FP8 tensor cores): the FP8 matmuls of forward and input gradient
    at the dense FP8 peak on the stored bytes, everything else at bf16's; no dequantisation. The toy's counts are
    made consistent: 5,000 frozen weights a token meets, of them the 1,000 FP8 linear weights and 2/4 of the 6,000
    FP8 expert weights."""
    from dataclasses import replace

    cfg, cluster = _toy_cfg(), Cluster(nodes=2, gpus_per_node=2)
    toy = replace(TOY, active_base=5_000)
    comm = plan_comm(cfg, toy, Layout(shard=4), cluster, True, "fp8")
    on = step_time(cfg, toy, comm, Hardware("h200"), "fp8")
    # FP8: 4 x (1,000 + 3,000); bf16: 4 x 1,000 other frozen + 6 x (200 + 50) LoRA + 3 x 10 x 16.5 attention
    per_token = (4 * 1_000 + 6 * 250 + 3 * 10 * 16.5) / 989e12 + 4 * 4_000 / 1979e12
    assert on.dequant_s == 0 and math.isclose(on.compute_s, 2 * 32 * per_token / 0.4)
    # off, or on a GPU without FP8 tensor cores (A100): every matmul at bf16's peak, after the dequantisation
    off = step_time(cfg, toy, comm, Hardware("h200", fp8_compute=False), "fp8")
    assert math.isclose(off.compute_s, 2 * 32 * (4 * 5_000 + 6 * 250 + 3 * 10 * 16.5) / 989e12 / 0.4)
    assert off.dequant_s > 0 and on.busy_s < off.busy_s
    a100 = step_time(cfg, toy, comm, Hardware("a100"), "fp8")
    assert a100.dequant_s > 0 and math.isclose(a100.compute_s, off.compute_s * 989 / 312)
    # the memory plan: the FP8 transient is the bytes of the largest FP8 tensor's transpose, not a bf16 copy
    rows = dict(plan_memory(cfg, toy, 4, True, "h200", held="fp8", fp8_compute=True).rows)
    assert "FP8 weight dequantised for its matmul" not in rows
    assert "FP8 weight transposed for its input gradient" in rows


def test_activation_checkpointing_auto_recomputes_as_few_layers_as_fit():
    """Mistral-Small-4 in FP8 over 2 H200s (FSDP) at three context lengths: the choice against the fit worked out
    by hand from the plan's rows without recompute. A layer keeps its working set (the AC-off row / 36), a
    recomputed one its input (tokens x 4096 hidden x 2 B) and one working set is live while a recomputed layer runs;
    every n-th layer recomputes ceil(36 / n) of them."""
    from transformers import Mistral4Config

    from rayft.plan.memory import choose_recompute
    from rayft.plan.recompute import Recompute

    cfg = Config.from_dict({})
    s = meta_structure(cfg, Mistral4Config())
    counts = sorted({0, 36} | {math.ceil(36 / n) for n in range(2, 37)})  # 0, 1, 2, 3, 4, 5, 6, 8, 9, 12, 18, 36
    chosen = {}
    for tokens in (4096, 16_384, 32_768):
        cfg.data.max_length = tokens
        bare = plan_memory(cfg, s, 2, True, "h200", "fp8", 1, Recompute(36, None), True)
        rest = bare.total_gib - dict(bare.rows)["activations (AC off)"]
        working, kept = dict(bare.rows)["activations (AC off)"] / 36, tokens * 4096 * 2 / 2**30
        need = {k: rest + k * kept + (36 - k) * working + (working if k else 0) for k in counts}
        expected = min(k for k in counts if need[k] <= 139.8 or k == 36)
        got = choose_recompute(cfg, s, 2, True, "h200", "fp8", fp8_compute=True)
        assert got.checkpointed == expected, (tokens, got, need)
        chosen[tokens] = got.mode
        full = dict(plan_memory(cfg, s, 2, True, "h200", "fp8", 1, Recompute(36, 1), True).rows)
        assert math.isclose(full["activations (AC on)"], 36 * kept + working)
    assert chosen == {4096: "none", 16_384: "selective", 32_768: "full"}
    # an explicit setting wins, however the memory stands
    cfg.fsdp.activation_checkpointing = "none"
    assert choose_recompute(cfg, s, 2, True, "h200", "fp8", fp8_compute=True).mode == "none"
    cfg.data.max_length, cfg.fsdp.activation_checkpointing = 4096, "full"
    assert choose_recompute(cfg, s, 2, True, "h200", "fp8", fp8_compute=True).mode == "full"
    # no GPU capacity known (CPU workers): auto keeps rayft's former default, no recompute
    cfg.fsdp.activation_checkpointing = "auto"
    assert choose_recompute(cfg, s, 2, False, None, "fp8").mode == "none"


def test_the_fp8_step_of_the_two_h200_example_is_no_slower_than_the_bf16_one():
    """`rayft plan --preset mistral-small-4 --num-nodes 2 --gpu h200`: for every layout where both bases fit, the
    FP8-resident base computes and steps no slower than the bf16 one (its matmuls run in FP8 on the stored bytes;
    dequantised every micro-batch it was 3.06 s against 1.87 s a step for EP 2)."""
    result = subprocess.run(
        [sys.executable, "-m", "rayft.cli", "plan", "--preset", "mistral-small-4", "--num-nodes", "2", "--gpu", "h200"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    table = result.stdout.split("layouts on ")[1]
    found = re.finditer(r"^([ *][\w +]+?)\s+(fp8|bf16)\s+(.+)$", table, re.M)
    rows = {(m[1].strip(" *"), m[2]): m[3].split() for m in found}
    # columns: GiB/GPU fits AC gather r-scatter all-red a2a network compute comm step serial bound tok/s MFU
    both = [layout for layout, base in rows if base == "fp8" and rows.get((layout, "bf16"), ["", "OOM"])[1] == "yes"]
    assert both == ["FSDP", "EP 2"] and rows[("EP 2", "fp8")][1] == "yes", rows
    for layout in both:
        fp8, bf16 = rows[(layout, "fp8")], rows[(layout, "bf16")]
        assert float(fp8[8]) <= float(bf16[8]) and float(fp8[10]) <= float(bf16[10]), (layout, fp8, bf16)


def test_the_dense_bench_configuration_is_predicted_at_the_assumed_mfu_with_auto_recompute(tmp_path):
    """bench/gpu_mfu.py's dense configuration (Mistral 8B shapes with 12 layers, bf16, LoRA r 16 on every linear, 4
    micro-batches of 4,096 tokens, one H200), with `auto` instead of the full recompute it was run with: its
    activations fit, so nothing is recomputed, and one GPU moves nothing: the step is its compute, and the MFU the
    run would report is the matmuls' assumed 40 %. With every layer recomputed it would be 40 % x model FLOPs /
    (model FLOPs + a second forward)."""
    sys.path.insert(0, str(REPO / "bench"))
    from train_vs_trl import DENSE_SCALED, GPU_SIZES, gpu_settings, model_config

    from rayft.plan.steptime import plan_layouts

    raw = gpu_settings(tmp_path, tmp_path / "model", tmp_path / "data", GPU_SIZES["gpu"])
    raw["fsdp"]["activation_checkpointing"], raw["train"]["gradient_checkpointing"] = "auto", False
    cfg = Config.from_dict(raw)
    s = meta_structure(cfg, model_config("dense", DENSE_SCALED))
    (plan,) = plan_layouts(cfg, s, Cluster(1, 1), Hardware("h200"), "dtype", [Layout(shard=1)])
    assert plan.fits and plan.recompute.mode == "none" and plan.time.comm_s == 0
    assert plan.mfu >= 0.40 and math.isclose(plan.mfu, 0.40)
    model = 4 * s.active_base + 6 * s.lora + 3 * s.attention_per_position * 4097 / 2
    forward = 2 * s.active_base + 2 * s.lora + s.attention_per_position * 4097 / 2
    cfg.fsdp.activation_checkpointing = "full"
    (full,) = plan_layouts(cfg, s, Cluster(1, 1), Hardware("h200"), "dtype", [Layout(shard=1)])
    assert math.isclose(full.mfu, 0.40 * model / (model + forward)) and full.mfu < 0.34


def test_an_nf4_base_gathers_its_codes_and_pays_its_eager_dequantisation():
    cfg, cluster, hw = _toy_cfg(), Cluster(nodes=2, gpus_per_node=2), Hardware("h200")
    comm = plan_comm(cfg, TOY, Layout(shard=4), cluster, True, "nf4")
    # Gathered per layer set: 6,500 NF4 weights at half a byte + an int8 scaler per 64 + a 4-byte factor per 16,384,
    # a 4-byte mean for each of the 10 matrices; the other 2,500 frozen at 2 B, LoRA 400 B. FSDP over 4 as for bf16.
    layers = 6_500 * (0.5 + 1 / 64 + 4 / 16_384) + 10 * 4 + 2_500 * 2 + 400
    assert math.isclose(comm.per_step("all_gather"), 2 * (1.5 * layers * 3 / 4 + 1_650))
    nf4 = step_time(cfg, TOY, comm, hw, "nf4")
    # 2 micro-batches x 2 passes x (500 linear weights + 6,000 expert weights hit as FP8's are), each read by the
    # compiled kernel as half a byte of code and 2/64 of a bf16 scale and written as 2 bytes of bf16, at 4.8 TB/s
    assert math.isclose(nf4.dequant_s, 2 * 2 * (500 + 6_000 * (1 - 0.75**64)) * (0.5 + 2 / 64 + 2) / 4.8e12)
    with pytest.raises(ValueError, match="no expert parallelism"):
        plan_comm(cfg, TOY, Layout(2, 2), cluster, True, "nf4")


def test_expert_parallel_memory_holds_e_over_k_experts_whole():
    cfg = _toy_cfg()
    cfg.fsdp.shard_size = 2  # as the planner sets it for 2 GPUs a node: the rest is sharded within the node
    rows = dict(plan_memory(cfg, TOY, 4, on_gpu=True, expert_parallel=2).rows)
    # bf16 storage: 6,000 expert weights x 2 B over 2 ranks; the other 4,000 frozen x 2 B sharded over the node's 2
    assert rows["routed experts (2 of 4 whole)"] * 2**30 == 6_000
    assert rows["non-expert weights (/2)"] * 2**30 == 4_000
    assert rows["LoRA params+grads+AdamW"] * 2**30 == (200 / 2 + 100 / 2) * 16
    cfg.fsdp.shard_size = 1  # one GPU a node: the rest whole on each
    rows = dict(plan_memory(cfg, TOY, 4, on_gpu=True, expert_parallel=4).rows)
    assert rows["non-expert weights (/1)"] * 2**30 == 8_000
    assert "gathered root (embeddings, head)" not in rows


def test_fp8_transient_is_one_chunk_of_experts_not_a_whole_stack():
    """rayft.model.fp8 dequantises a layer's experts at most 2**28 elements at a time (whole experts, at least one):
    at Mistral-Small-4's 128 experts of 4096 x 4096 that is 16 experts, not 128; with 16-way EP, all 8 local ones."""
    from rayft.plan.memory import dequantised_at_once

    s = Structure(
        architecture="x",
        total=0,
        largest_layer=0,
        layers=1,
        root=0,
        lora=0,
        hidden=1,
        vocab=1,
        top_k=4,
        moe_intermediate=1,
        num_experts=128,
        fp8_expert_numel=4096 * 4096,
        fp8_linear_largest=4096 * 1024,
    )
    assert dequantised_at_once(s) == 16 * 4096 * 4096
    assert dequantised_at_once(s, expert_parallel=16) == 8 * 4096 * 4096
    huge = Structure(**{**s.__dict__, "fp8_expert_numel": 2**29})  # one expert over the budget: still whole
    assert dequantised_at_once(huge) == 2**29
    dense = Structure(**{**s.__dict__, "num_experts": 0, "fp8_expert_numel": 0})
    assert dequantised_at_once(dense) == 4096 * 1024


def test_the_planner_offers_only_expert_parallel_groups_that_keep_to_nodes():
    """On 3 nodes of 4 GPUs with 12 experts, k = 3 and 6 would cut a node's workers between groups (their all-to-all
    straddling the network), and the config refuses them: the planner must not offer them either."""
    from dataclasses import replace

    from rayft.plan.comm import layouts

    twelve = replace(TOY, num_experts=12)
    offered = sorted({layout.expert_parallel for layout in layouts(Cluster(nodes=3, gpus_per_node=4), twelve)})
    assert offered == [1, 2, 4, 12]  # the divisors of 12 that divide 4 or that 4 divides
    assert sorted({lay.expert_parallel for lay in layouts(Cluster(nodes=12, gpus_per_node=1), twelve)}) == [
        1,
        2,
        3,
        4,
        6,
        12,
    ]


def test_plan_follows_the_configs_nodes_and_knows_gpus_beyond_h100_and_h200(capsys):
    """`rayft plan` planned 3 single-GPU nodes whatever ray.workers_per_node said, and offered h100 and h200 only."""
    from rayft import cli

    capsys.readouterr()
    argv = [
        "plan",
        "--preset",
        "mistral-small-4",
        "--override",
        "ray.num_workers=16",
        "--override",
        "ray.workers_per_node=8",
        "--gpu",
        "b200",
    ]
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert re.search(r"^component\s+W=16$", out, re.M)  # 16 workers, 8 a node: 2 nodes of 8
    # B200: 2,250 dense bf16 TFLOP/s and 1,800 GB/s of NVLink 5 per GPU (NVIDIA's figures), ~178 GiB reported
    assert "layouts on 2 node(s) x 8 GPU (W=16), b200: 2250 TFLOP/s" in out and "NVLink 1800 GB/s" in out
    assert re.search(r"^on b200 \(17\d\.\d GiB\)", out, re.M)


def test_a_preemptions_cost_from_hand_counted_bytes():
    """The toy's bytes by hand (bf16 storage, p = 2). Checkpoint: 300 LoRA parameters x (fp32 weight + AdamW's two
    moments + the adapter) = 4,800. FP8 base: 3,000 x 2 + 7,000 + 4 x 500 scales = 15,000; its routed experts
    6,000 + 4 x 400 = 7,600 of it. A restart reads every copy the layout keeps."""
    cfg = _toy_cfg()
    two, four = Cluster(nodes=2, gpus_per_node=1), Cluster(nodes=2, gpus_per_node=2)
    fsdp = preemption_cost(cfg, TOY, "fp8", Layout(shard=2), two, storage_gbytes_s=1e-6)  # 1 kB/s
    assert fsdp.checkpoint_bytes == 4_800 and fsdp.base_bytes == 15_000
    assert (fsdp.save_s, fsdp.reload_s) == pytest.approx((4.8, 15.0))
    assert preemption_cost(cfg, TOY, "fp8", Layout(shard=1), two).base_bytes == 30_000  # replicated: two copies
    assert preemption_cost(cfg, TOY, "dtype", Layout(shard=2), two).base_bytes == 20_000  # bf16: 10,000 x 2
    # EP 2 on 2 nodes x 2: the rest (7,400) HSDP within a node (two copies), the experts split in pairs (two copies)
    assert preemption_cost(cfg, TOY, "fp8", Layout.expert(2, four), four).base_bytes == 2 * 7_400 + 2 * 7_600


def test_plan_prints_what_a_preemption_costs(capsys):
    argv = ["plan", "--preset", "mistral-small-4", "--num-nodes", "2", "--gpus-per-node", "8", "--storage-gbps", "4"]
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "preemption: a drain notice saves a checkpoint of" in out and "at 4 GB/s of storage" in out
    assert "the run restarts at its 16 workers" in out
    assert cli.main([*argv, "--override", "ray.preemption=ignore"]) == cli.EXIT_OK
    assert "a drain notice saves nothing" in capsys.readouterr().out


def test_plan_says_how_far_an_elastic_run_can_shrink(capsys):
    """`ray.num_workers: [8, 16]` on nodes of 8 H200s: the run may go on with one node or two; the plan names the
    fewest of those whose memory plan fits (the memory table's own verdict for that size, FP8 base as the preset
    keeps it) and the accumulation that keeps the global batch there (16 steps x 16 workers of micro-batches)."""
    from transformers import Mistral4Config

    ray = {"num_workers": [8, 16], "workers_per_node": 8}
    argv = ["plan", "--preset", "mistral-small-4", "--num-nodes", "2", "--gpus-per-node", "8", "--gpu", "h200"]
    argv += ["--override", "ray.num_workers=[8, 16]", "--override", "ray.workers_per_node=8"]
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    cfg = Config.from_dict({"ray": ray})
    s = meta_structure(cfg, Mistral4Config())
    plans = {n: plan_memory(cfg, s, n, True, "h200", held="fp8") for n in (8, 16)}
    fewest = min(n for n, p in plans.items() if p.total_gib <= p.capacity_gib)
    said = (
        f"an elastic run (ray.num_workers [8, 16]) goes on with the workers left: the fewest whose memory plan fits "
        f"a h200 are {fewest}, each accumulating {16 * 16 // fewest} micro-batches a step"
    )
    assert said in out, out[-2000:]


def test_a_restart_reads_the_checkpoints_bytes_not_the_storage_the_job_holds(tmp_path):
    """FP8 storage of a bf16 checkpoint (Mistral-Small-4's shapes, a config.json without weights): a restart reads
    the checkpoint's bf16 files, every frozen parameter at 2 bytes, one copy on one GPU."""
    from accelerate import init_empty_weights
    from transformers import Mistral4Config, Mistral4ForCausalLM

    config = Mistral4Config()
    config.save_pretrained(tmp_path)
    with init_empty_weights():
        frozen = sum(p.numel() for p in Mistral4ForCausalLM(config).parameters())
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rayft.cli",
            "plan",
            "--config",
            "jobs/mistral4-nf4-1xh200.yaml",
            "--num-nodes",
            "1",
            "--override",
            f"model.model_name_or_path={tmp_path}",
            "--override",
            "model.frozen_dtype=float8_e4m3fn",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "* fastest that fits: FSDP, fp8 base" in result.stdout, result.stdout
    assert f"the restart reads {frozen * 2 / 1e9:.1f} GB of the frozen base" in result.stdout, result.stdout


def test_a_one_rank_shard_group_gathers_no_fp8_storage_and_fp8_matmuls_hold_a_transposed_stack():
    """Memory with the base whole on each GPU (`fsdp.shard_size: 1`): a gathered layer is only its non-FP8 part
    (FSDP leaves the storage to the layers); with FP8 matmuls the transient is the input gradient's transposed copy
    of the largest FP8 tensor, a whole stack of the 4 experts at 1 byte a weight (the grouped kernel takes it at
    once). A pass moves at most 3 bytes per FP8 weight on its bytes, 1 + 2c dequantised."""
    toy = dataclasses.replace(TOY, fp8_expert_numel=500, fp8_linear_largest=300)
    cfg = Config.from_dict({"data": {"max_length": 32}, "fsdp": {"shard_size": 1}})
    plan = plan_memory(cfg, toy, 4, True, "h200", held="fp8", fp8_compute=True)
    rows = {name: gib * 2**30 for name, gib in plan.rows}
    gathered = next(v for k, v in rows.items() if k.startswith("gathered layers"))
    assert math.isclose(gathered, 2 * (5_000 - 3_500) * 2)  # 2 layers (this one and the prefetched) x non-FP8 x c
    assert math.isclose(rows["FP8 weight transposed for its input gradient"], 4 * 500)
    cfg.fsdp.shard_size = 2
    rows = {name: gib * 2**30 for name, gib in plan_memory(cfg, toy, 4, True, "h200", held="fp8").rows}
    gathered = next(v for k, v in rows.items() if k.startswith("gathered layers"))
    assert math.isclose(gathered, 2 * ((5_000 - 3_500) * 2 + 3_500 + 4 * 250))  # FSDP over 2 gathers the bytes
    assert "FP8 weight dequantised for its matmul" in rows
    assert pass_bytes_per_weight(cfg, on_bytes=True) == 3 < pass_bytes_per_weight(cfg, on_bytes=False) == 5


def test_plan_answers_how_many_gpus_a_sequence_length_needs_and_over_how_many_to_split_it(capsys):
    """`rayft plan --context-parallel auto`: for each --max-length, the fewest GPUs that fit and the degree there."""
    capsys.readouterr()
    argv = ["plan", "--preset", "mistral-small-4", "--max-length", "262144", "--context-parallel", "auto"]
    argv += ["--gpus-per-node", "8", "--override", "train.gradient_accumulation_steps=1"]
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+\*?(\d+)\s+(\d+)\s+\d+ x \d+\s+([\d.]+)\s", out, re.M)
    assert [int(n) for n, _, _ in rows] == [1, 2, 4, 8, 16, 32]  # the divisors of Mistral-Small-4's 32 heads
    answer = re.search(
        r"^\* 262,144 tokens a row: parallel.context_parallel (\d+) on (\d+) h200 .*?([\d.]+) GiB/GPU", out, re.M
    )
    assert answer, out
    # the answer is the fewest GPUs of any degree, and fits an H200
    assert int(answer[2]) == min(int(gpus) for _, gpus, _ in rows) and float(answer[3]) <= 139.8
    # its activations with every layer recomputed, from Mistral-Small-4's shapes: 131,072 tokens a GPU at N = 2;
    # 36 layers keep their input (hidden 4,096, bf16), one layer runs again: 17 x hidden x 2 B a token, and each
    # token's 4 routed experts' gate, up and activation (2,048 wide, 2 B)
    tokens = 262_144 // int(answer[1])
    held = 36 * tokens * 4_096 * 2 + tokens * 4_096 * 17 * 2 + tokens * 4 * 2_048 * 3 * 2
    assert f"activations {held / 2**30:.2f}" in out
    # a degree the heads do not take is refused, naming those they do
    assert cli.main(["plan", "--preset", "mistral-small-4", "--context-parallel", "3", "--no-layouts"]) == 2
    assert "valid: [1, 2, 4, 8, 16, 32]" in capsys.readouterr().err
