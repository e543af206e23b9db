"""The collective byte tally (rayft.parallel) against the planner's communication model (rayft.plan.comm).

Two gloo ranks in-process train the tiny dense Mistral and the tiny hub-layout Mistral-Small-4 through the training
loop's own `train_step`; what FSDP2 moved is counted three ways: the tally its hooks fill, a TorchDispatchMode
watching the c10d ops themselves (an independent witness), and the planner's prediction from the meta model.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
from conftest import Fixtures, free_port, tiny_config
from fixtures.ranks import spawn_ranks
from fixtures.work import WorkCounter
from torch.utils._python_dispatch import TorchDispatchMode

from rayft.config import Config
from rayft.model.build import held_as
from rayft.parallel.tally import KINDS
from rayft.plan import meta_structure
from rayft.plan.comm import Cluster, Layout, plan_comm
from rayft.plan.steptime import dequantised_per_micro_batch

STEPS = 2  # the first gathers the frozen root (embeddings, head) once for the run; the second is the steady state
ACCUM = 2
WORLD = 2
PLANNER_TOLERANCE = 0.05  # measured bytes against the planner's, relative


class C10dBytes(TorchDispatchMode):
    """Bytes received from other ranks by the c10d ops dispatched while active (the tally's ring convention)."""

    def __init__(self) -> None:
        super().__init__()
        self.moved = dict.fromkeys(KINDS, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__ if func.namespace == "c10d" else ""
        if name == "_allgather_base_":
            self._add("all_gather", args[0], args[2])
        elif name == "_reduce_scatter_base_":
            self._add("reduce_scatter", args[1], args[2])
        elif name == "allreduce_":
            for t in args[0]:
                self._add("all_reduce", t, args[1], 2)
        return func(*args, **(kwargs or {}))

    def _add(self, kind: str, tensor: torch.Tensor, group, times: int = 1) -> None:
        ranks = dist.ProcessGroup.unbox(group).size()  # the op carries the group as a TorchScript object
        self.moved[kind] += times * tensor.numel() * tensor.element_size() * (ranks - 1) // ranks

    def take(self) -> dict[str, int]:
        taken, self.moved = self.moved, dict.fromkeys(KINDS, 0)
        return taken


def _train_rank(rank: int, world: int, port: int, runs: dict, out: str) -> None:
    from rayft.model.build import decoder_layers
    from rayft.model.flops import FlopModel
    from rayft.parallel.fsdp_tally import count_fsdp_collectives
    from rayft.parallel.layout import parallel_dims
    from rayft.parallel.parallelize import build_model
    from rayft.train.metrics import LossWindow
    from rayft.train.objectives import build_objective
    from rayft.train.step import train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for label, raw in runs.items():
            torch.manual_seed(0)
            cfg = Config.from_dict(raw)
            layout = parallel_dims(cfg, "cpu")
            model = build_model(cfg, on_gpu=False, dims=layout)
            count_fsdp_collectives(model, layout)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
            window = LossWindow(torch.device("cpu"), world, FlopModel(0, 0, 0.0), None)
            kept = [] if cfg.fsdp.reshards() else decoder_layers(model)
            objective = build_objective(cfg, model, torch.device("cpu"))  # the loop's: SFT or DPO by train.objective
            group = [_micro_batch(cfg, rank, cfg.train.objective == "dpo") for _ in range(ACCUM)]
            tallied, witnessed, dequantised, host_copies = [], [], [], []
            for _ in range(STEPS):
                before = dict(window.moved)
                with C10dBytes() as witness, WorkCounter() as work:
                    norm = train_step(
                        model,
                        optimizer,
                        scheduler,
                        group,
                        window,
                        loss=objective.loss,
                        layout=layout,
                        kept_layers=kept,
                        autocast=nullcontext,
                        max_grad_norm=1.0,
                    )
                tallied.append({k: window.moved[k] - before[k] for k in KINDS})
                witnessed.append(witness.take())
                dequantised.append(sum(work.dequantised))
                host_copies.append(dict(work.host_copies))
            metrics = window.take(norm, scheduler, 0.0)
            results[label] = {
                "tallied": tallied,
                "witnessed": witnessed,
                "dequantised": dequantised,
                "host_copies": host_copies,
                "metrics": {k: v for k, v in metrics.items() if k.startswith("comm_")},
            }
            del model, optimizer
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _check_dequantised_against_the_planner(label: str, cfg: Config, s, k: int, counted: list[int]) -> None:
    """FP8 weight elements dequantised per step (the bytes a GPU's kernel reads) against `rayft plan`'s count. The
    planner has every pass need every matrix and uniform routing hit each local expert with 1 − (1 − 1/E)^slots;
    what ran may leave out the input gradient of the first layer's projections of the embeddings (the dense
    fixture's q, k, v: no AC, nothing asks for that gradient) and may hit every expert."""
    passes = 2 + cfg.recomputes_activations
    every_expert = ACCUM * passes * (s.fp8 - s.experts + s.experts / k)
    first_layer_skipped = ACCUM * (dequantised_per_micro_batch(cfg, s, k) - (s.fp8 - s.experts) / s.layers)
    print(label, "dequantised", counted, ACCUM * dequantised_per_micro_batch(cfg, s, k))
    assert counted[0] == counted[-1] > 0, (label, counted)
    assert first_layer_skipped <= counted[-1] <= every_expert, (label, counted, first_layer_skipped, every_expert)


def _micro_batch(cfg: Config, rank: int, pairs: bool) -> dict[str, torch.Tensor]:
    """One row of next-token data, or one preference pair (chosen, rejected) scored on its second half."""
    rows = 2 if pairs else 1
    ids = torch.randint(3, 1000, (rows, cfg.data.max_length), generator=torch.Generator().manual_seed(rank))
    if not pairs:
        return {"input_ids": ids, "labels": ids}
    labels = ids.clone()
    labels[:, : cfg.data.max_length // 2] = -100  # the prompt
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def test_measured_bytes_per_step_match_the_planner_for_fsdp_and_ep(fixtures: Fixtures, mistral4_hub, tmp_path):
    def config(model_dir, frozen: str, hub: bool, shard_size: int | None = None, ep: int = 1, tokens: int = 16) -> dict:
        raw = tiny_config(fixtures, tmp_path)
        raw["model"].update(model_name_or_path=str(model_dir), torch_dtype="float32", frozen_dtype=frozen)
        raw["lora"].update(lora_dropout=0.0)
        raw["data"]["max_length"] = tokens
        raw["parallel"] = {"expert_parallel": ep}
        raw["train"].update(gradient_accumulation_steps=ACCUM, per_device_train_batch_size=1)
        raw["fsdp"] = {"shard_size": shard_size}
        if hub:
            raw["lora"].update(target_modules=["auto"], target_experts=True)
            raw["fsdp"]["activation_checkpointing"] = True
        return raw

    runs = {
        "hub_fp8": config(mistral4_hub, "auto", hub=True),  # the FP8 checkpoint kept FP8 (1 byte + row scales)
        "hub_fp32": config(mistral4_hub, "float32", hub=True),
        "dense_fp8": config(fixtures.model, "float8_e4m3fn", hub=False),
        "dense_fp32": config(fixtures.model, "float32", hub=False),
        "dense_replicated": config(fixtures.model, "float32", hub=False, shard_size=1),  # LoRA grads all-reduced
        # Experts split over both ranks, the rest whole on each: tokens travel (all-to-all), nothing is gathered.
        # The planner assumes uniform routing; the tiny random router is near it at 256 tokens (a few % off; at 128
        # one draw of the model's weights was 5.5 % off).
        "hub_ep2": config(mistral4_hub, "auto", hub=True, ep=2, tokens=256),
        "dense_dpo": {**config(fixtures.model, "float32", hub=False), "dpo": {}},  # the step of preference tuning
    }
    runs["dense_dpo"]["train"] = {**runs["dense_dpo"]["train"], "objective": "dpo"}
    runs["dense_dpo"]["data"] = {**runs["dense_dpo"]["data"], "packing": False}
    out = tmp_path / "results.json"
    spawn_ranks(_train_rank, args=(WORLD, free_port(), runs, str(out)), nprocs=WORLD)
    results = json.loads(out.read_text())
    for label, raw in runs.items():
        cfg, got = Config.from_dict(raw), results[label]
        print(label, "host-to-device copies a step", got["host_copies"])
        if cfg.train.objective == "dpo":
            _check_reported_bytes_are_the_witnessed(label, got)
            # a copy from pageable host memory makes a GPU's host wait: none in a step once AdamW made its state on
            # the first (its step counters)
            assert all(not copies for copies in got["host_copies"][1:]), got["host_copies"]
            continue
        s = meta_structure(cfg)
        held = held_as(cfg.model)
        k = cfg.parallel.expert_groups()
        layout = Layout(shard=1, expert_parallel=k) if k > 1 else Layout(shard=cfg.fsdp.shard_group(WORLD))
        predicted = plan_comm(cfg, s, layout, Cluster(1, WORLD), False, held)
        steady = got["tallied"][-1]
        print(label, {k: (steady[k], round(predicted.per_step(k))) for k in KINDS})
        if held == "fp8":
            _check_dequantised_against_the_planner(label, cfg, s, k, got["dequantised"])
        for kind in KINDS:
            want = predicted.per_step(kind)
            assert abs(steady[kind] - want) <= PLANNER_TOLERANCE * want, (label, kind, steady[kind], want)
        # The hooks saw what went through c10d: gathers and reduce-scatters byte for byte; all-reduces too, but
        # for the scalars of gradient clipping, which the tally leaves out.
        for tallied, witnessed in zip(got["tallied"], got["witnessed"], strict=True):
            assert tallied["all_gather"] == witnessed["all_gather"], (label, tallied, witnessed)
            assert tallied["reduce_scatter"] == witnessed["reduce_scatter"], (label, tallied, witnessed)
            assert 0 <= witnessed["all_reduce"] - tallied["all_reduce"] <= 16, (label, tallied, witnessed)
        # A frozen root (embeddings, head) is gathered once for the run, in step 1: its parameters at 4 bytes, half
        # from the other rank. One with LoRA (the dense fixture's head) is gathered in every micro-batch instead.
        if cfg.fsdp.shard_group(WORLD) > 1 and k == 1:
            first_extra = got["tallied"][0]["all_gather"] - steady["all_gather"]
            once = s.root * 4 // 2 if s.lora == s.layers_lora else 0
            assert abs(first_extra - once) <= 0.05 * once, (label, first_extra, s.root)
        # The metrics the loop logs: per optimizer step, mean over ranks and over the window's steps
        mean = {k: sum(step[k] for step in got["tallied"]) / STEPS for k in KINDS}
        for kind in KINDS:
            assert abs(got["metrics"][f"comm_{kind}_bytes"] - mean[kind]) <= 0.01 * mean[kind] + 8, (label, kind)
    # FP8 storage gathers the decoder matrices at 1 byte per weight, not 4 (row scales and LoRA aside); the dense
    # fixture's gathers are mostly its root (LoRA on the head), which FP8 does not touch.
    fp8, fp32 = (results[f"hub_{x}"]["tallied"][-1]["all_gather"] for x in ("fp8", "fp32"))
    assert fp8 < 0.5 * fp32, (fp8, fp32)
    fp8, fp32 = (results[f"dense_{x}"]["tallied"][-1]["all_gather"] for x in ("fp8", "fp32"))
    assert fp8 < fp32, (fp8, fp32)


def _check_reported_bytes_are_the_witnessed(label: str, got: dict) -> None:
    """The logged per-step gathers and reduce-scatters are what went through c10d (the planner has no DPO model: it
    predicts one forward per micro-batch, and a live reference adds a second)."""
    for kind in ("all_gather", "reduce_scatter"):
        witnessed = sum(step[kind] for step in got["witnessed"]) / STEPS
        assert witnessed > 0, (label, kind, got)
        assert got["metrics"][f"comm_{kind}_bytes"] == witnessed, (label, kind, got["metrics"], witnessed)
