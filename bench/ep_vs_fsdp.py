"""Expert parallelism against FSDP2 alone on CPU: step time and bytes moved per rank, 2 gloo ranks.

The same tiny hub-layout Mistral-Small-4 (FP8 routed experts, LoRA on attention + shared expert) trains a few steps
with `parallel.expert_parallel: 1` (every expert FSDP-sharded and all-gathered in forward and backward) and `2`
(each rank keeps half the experts, tokens move by all-to-all). Bytes per rank per step, as received from the
other rank: FSDP's all-gathers (every decoder layer and the root, counted at FSDP's all-gather hook), the
all-to-all tally (`rayft.parallel.tally`), and the LoRA gradients' reduce-scatter/all-reduce left out of both.
On 2 CPU ranks the all-gather costs memory copies, not a network: the time column says little about a cluster;
the bytes column is what the planner's model multiplies by the interconnect.

    python bench/ep_vs_fsdp.py [--size small|default] [--out bench/results/ep_vs_fsdp_cpu.json]
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import cli, free_port, machine, run_ranks

SIZES = {
    "default": {
        "hidden_size": 256,
        "moe_intermediate_size": 256,
        "n_routed_experts": 16,
        "num_hidden_layers": 4,
        "vocab_size": 4096,
        "tokens": 512,
    },
    "small": {
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_hidden_layers": 2,
        "vocab_size": 4096,
        "tokens": 64,
    },
}
STEPS, WARMUP = 6, 2


def _count_all_gathers(module, box: list[int]) -> None:
    """FSDP's all-gathers of `module` add what arrived from the other ranks, (W−1)/W of the output, to box."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class Counting(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            world = dist.get_world_size(group)
            box[0] += output_tensor.numel() * output_tensor.element_size() * (world - 1) // world
            return super().__call__(output_tensor, input_tensor, group, async_op)

    module.set_custom_all_gather(Counting())


def _rank(rank: int, world: int, port: int, raw: dict, tokens: int, out: str) -> None:
    from rayft.config import Config
    from rayft.model.build import decoder_layers
    from rayft.parallel.layout import parallel_dims
    from rayft.parallel.parallelize import build_model
    from rayft.parallel.tally import TALLY
    from rayft.train.step import clip_gradients_

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    try:
        cfg = Config.from_dict(raw)
        layout = parallel_dims(cfg, "cpu")
        model = build_model(cfg, on_gpu=False, dims=layout)
        gathered = [0]
        for module in [*decoder_layers(model), model]:
            _count_all_gathers(module, gathered)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        ids = torch.randint(3, 1000, (1, tokens), generator=torch.Generator().manual_seed(rank))
        times, a2a, ag = [], [], []
        for step in range(STEPS):
            TALLY.take()
            before = gathered[0]
            dist.barrier()
            started = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            clip_gradients_(model, 1.0, layout)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            if step >= WARMUP:
                times.append(time.perf_counter() - started)
                a2a.append(TALLY.take()["all_to_all"])
                ag.append(gathered[0] - before)
        result = {
            "step_s_median": round(statistics.median(times), 4),
            "all_to_all_bytes_per_step": a2a,
            "fsdp_all_gather_bytes_per_step": ag,
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run(size: str) -> dict:
    from fixtures.hub_layout import make_tiny_mistral_small4

    shape = dict(SIZES[size])
    tokens = shape.pop("tokens")
    report = {
        **machine(),
        "size": size,
        "model": shape,
        "tokens_per_rank_per_step": tokens,
        "ranks": 2,
        "steps_timed": STEPS - WARMUP,
        "cases": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_mistral_small4(Path(tmp) / "model", **shape)
        for k in (1, 2):
            raw = {
                "model": {"model_name_or_path": str(model_dir), "torch_dtype": "float32"},
                "lora": {"target_modules": ["auto"], "lora_dropout": 0.0},
                "ray": {"num_workers": 2, "use_gpu": False},
                "parallel": {"expert_parallel": k},
            }
            out = Path(tmp) / f"k{k}"
            out.mkdir()
            run_ranks(_rank, (2, free_port(), raw, tokens, str(out)), 2)
            per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
            report["cases"][f"expert_parallel={k}"] = {
                "step_s_median_per_rank": [r["step_s_median"] for r in per_rank],
                "all_to_all_bytes_per_step_per_rank": [
                    statistics.mean(r["all_to_all_bytes_per_step"]) for r in per_rank
                ],
                "fsdp_all_gather_bytes_per_step_per_rank": [
                    statistics.mean(r["fsdp_all_gather_bytes_per_step"]) for r in per_rank
                ],
            }
    return report


if __name__ == "__main__":
    cli(__doc__, SIZES, run, "ep_vs_fsdp_cpu.json")
