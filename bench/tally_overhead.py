"""What counting the collectives costs (rayft.parallel.fsdp_tally, always on in training), on CPU.

Two measures:
- per collective: the counting wrapper's own Python (around a comm that does nothing, against that comm alone);
- per step: two gloo ranks train a small dense Mistral with LoRA + FSDP2, alternating blocks of steps with the
  counting hooks installed and with FSDP2's own comms put back; median step time of each.
The per-call figure times the collectives of a Mistral-Small-4 step (36 layers: 2 gathers per micro-batch each,
one reduce-scatter per FSDP unit per step) gives its cost per step there.

    python bench/tally_overhead.py [--size small|default] [--out bench/results/tally_overhead_cpu.json]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import cli, free_port, machine, run_ranks

SIZES = {
    "default": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "max_length": 256, "blocks": 4},
    "small": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "max_length": 64, "blocks": 2},
}
STEPS_PER_BLOCK = 4
CALLS = 20_000


def _per_call_overhead_s() -> float:
    """Seconds the counting wrapper adds to one all-gather call: the wrapper around a comm that does nothing, less
    that comm called directly (best of 5 rounds of 20,000 calls, so the machine's noise does not count)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    from rayft.parallel.fsdp_tally import CountedAllGather
    from rayft.parallel.tally import TALLY

    class Nothing(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return None

    group = dist.new_group([dist.get_rank()])
    out, inp = torch.empty(256), torch.ones(256)
    best = {}
    for _ in range(5):
        for name, comm in (("plain", Nothing()), ("counted", CountedAllGather(Nothing()))):
            started = time.perf_counter()
            for _ in range(CALLS):
                comm(out, inp, group)
            best[name] = min(best.get(name, float("inf")), (time.perf_counter() - started) / CALLS)
    TALLY.take()
    return best["counted"] - best["plain"]


def _rank(rank: int, world: int, port: int, raw: dict, blocks: int, out: str) -> None:
    import os
    from contextlib import nullcontext

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    from rayft.config import Config
    from rayft.model.flops import FlopModel
    from rayft.parallel.fsdp_tally import count_fsdp_collectives
    from rayft.parallel.layout import parallel_dims
    from rayft.parallel.parallelize import build_model
    from rayft.parallel.tally import TALLY
    from rayft.train.metrics import LossWindow
    from rayft.train.objectives import build_objective
    from rayft.train.step import train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = Config.from_dict(raw)
    layout = parallel_dims(cfg, "cpu")
    model = build_model(cfg, on_gpu=False, dims=layout)
    loss = build_objective(cfg, model, torch.device("cpu")).loss  # the loop's
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    window = LossWindow(torch.device("cpu"), world, FlopModel(0, 0, 0.0), None)
    ids = torch.randint(3, 1000, (1, cfg.data.max_length))
    group = [{"input_ids": ids, "labels": ids}]
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    times: dict[str, list[float]] = {"counted": [], "plain": []}
    calls = 0
    for block in range(2 * blocks + 1):  # the first (plain) block warms up and is dropped
        counted = block % 2 == 1
        if counted:
            count_fsdp_collectives(model, layout)
        else:
            for unit in units:
                unit.set_custom_all_gather(DefaultAllGather())
                unit.set_custom_reduce_scatter(DefaultReduceScatter())
        for _ in range(STEPS_PER_BLOCK):
            dist.barrier()
            started = time.perf_counter()
            train_step(model, optimizer, scheduler, group, window, loss=loss, layout=layout, kept_layers=[],
                       autocast=nullcontext, max_grad_norm=1.0)  # fmt: skip
            if block:
                times["counted" if counted else "plain"].append(time.perf_counter() - started)
        TALLY.take()
    calls = sum(1 for _ in units)
    per_call = _per_call_overhead_s()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "per_call_s": per_call, "fsdp_units": calls}))
    dist.destroy_process_group()


def run(size_name: str) -> dict:
    from rayft import demo

    size = dict(SIZES[size_name])
    max_length, blocks = size.pop("max_length"), size.pop("blocks")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        demo.make_tiny_mistral(model_dir, **size)
        raw = {
            "model": {"model_name_or_path": str(model_dir), "torch_dtype": "float32"},
            "lora": {"target_modules": ["auto"], "lora_dropout": 0.0},
            "data": {"max_length": max_length},
            "ray": {"use_gpu": False},
        }
        out = Path(tmp) / "rank0.json"
        run_ranks(_rank, (2, free_port(), raw, blocks, str(out)), 2)
        got = json.loads(out.read_text())
    plain, counted = (statistics.median(got["times"][k]) for k in ("plain", "counted"))
    # Mistral-Small-4, 16 micro-batches per step: 36 layers x 2 gathers x 16 + 37 reduce-scatters
    mistral4_calls = 36 * 2 * 16 + 37
    return {
        "benchmark": "tally_overhead",
        **machine(),
        "size": size_name,
        "per_call_overhead_us": round(got["per_call_s"] * 1e6, 2),
        "step_median_s": {"plain": round(plain, 4), "counted": round(counted, 4)},
        "step_overhead_share": round(counted / plain - 1, 4),
        "steps_each": len(got["times"]["plain"]),
        "mistral_small_4_collectives_per_step": mistral4_calls,
        "mistral_small_4_overhead_ms_per_step": round(mistral4_calls * got["per_call_s"] * 1e3, 3),
    }


if __name__ == "__main__":
    cli(__doc__, SIZES, run, "tally_overhead_cpu.json")
