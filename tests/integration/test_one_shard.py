"""FSDP2 over a shard group of one worker (a single-GPU run, or `fsdp.shard_size: 1`): its "gathered" weights are a
second copy of the worker's own, so a layer that keeps them after forward holds the base twice until backward. By
default every layer but the last frees them after its forward, and the memory plan counts what is kept."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from conftest import Fixtures, tiny_config
from fixtures.cluster import free_port
from fixtures.ranks import spawn_ranks
from torch.distributed.tensor import DTensor

from rayft.config import Config
from rayft.model.build import decoder_layers
from rayft.parallel.parallelize import build_model
from rayft.plan import meta_structure, plan_memory


def _gathered_after_forward(rank: int, world: int, port: int, raw: dict, out: str) -> None:
    """Layers whose parameters are not FSDP's sharded DTensors after a training forward: those still holding their
    gathered copy."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build_model(Config.from_dict(raw), on_gpu=False)
        model.train()
        model(input_ids=torch.tensor([[1, 1784, 1937, 1278, 1812, 2]])).logits.sum()  # no backward yet
        layers = decoder_layers(model)
        kept = [i for i, layer in enumerate(layers) if not all(isinstance(p, DTensor) for p in layer.parameters())]
        Path(out).write_text(json.dumps({"layers": len(layers), "kept": kept}))
    finally:
        dist.destroy_process_group()


def test_one_worker_frees_each_layers_gathered_copy_after_forward_and_the_plan_counts_it(
    fixtures: Fixtures, tmp_path: Path
):
    raw = tiny_config(fixtures, tmp_path / "out")
    raw["ray"]["num_workers"] = 1
    out = tmp_path / "kept.json"
    spawn_ranks(_gathered_after_forward, args=(1, free_port(), raw, str(out)), nprocs=1)
    found = json.loads(out.read_text())
    assert found["layers"] >= 2 and found["kept"] == [found["layers"] - 1], found  # the last: its backward is next

    cfg = Config.from_dict(raw)
    plan = dict(plan_memory(cfg, meta_structure(cfg), world_size=1, on_gpu=False).rows)
    gathered = next(key for key in plan if key.startswith("gathered layers"))
    assert gathered.startswith(f"gathered layers ({1 + cfg.fsdp.forward_prefetch} x"), plan
