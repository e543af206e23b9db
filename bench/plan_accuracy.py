"""How close `rayft plan`'s weights + activations estimate comes to memory really used, on CPU.

Two gloo ranks build a small dense Mistral (131k vocab, so logits matter as on the real model) with LoRA + FSDP2,
then run one forward/backward/optimizer step on a full-length sequence; rank 0 reports its peak host RSS increase
from before the model was built. The plan for the same config (CPU: fp32, no GPU runtime overhead) is printed next
to it with the ratio, with activation checkpointing off and on.

    python bench/plan_accuracy.py [--size small|default] [--out bench/results/plan_accuracy_cpu.json]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from _common import cli, free_port, machine, reset_peak_rss, rss_kib, run_ranks

SIZES = {
    "default": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "max_length": 1024},
    "small": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "max_length": 128},
}


def _rank(rank: int, world: int, port: int, raw: dict, out: str) -> None:
    import os

    from rayft.config import Config
    from rayft.parallel.parallelize import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = Config.from_dict(raw)
    ids = torch.randint(3, 1000, (1, cfg.data.max_length))
    dist.barrier()
    before = reset_peak_rss()
    model = build_model(cfg, on_gpu=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"peak_minus_start_mib": (rss_kib("VmHWM") - before) / 1024}))
    dist.destroy_process_group()


def run(size_name: str) -> dict:
    from rayft import demo
    from rayft.config import Config
    from rayft.plan import meta_structure, plan_memory

    size = dict(SIZES[size_name])
    max_length = size.pop("max_length")
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        demo.make_tiny_mistral(model_dir, **size)
        for checkpointing in (False, True):
            raw = {
                "model": {"model_name_or_path": str(model_dir), "torch_dtype": "float32"},
                "lora": {"target_modules": ["auto"], "lora_dropout": 0.0},
                "data": {"max_length": max_length},
                "fsdp": {"activation_checkpointing": checkpointing},
                "ray": {"use_gpu": False},
            }
            out = Path(tmp) / "rank0.json"
            run_ranks(_rank, (2, free_port(), raw, str(out)), 2)
            measured = json.loads(out.read_text())["peak_minus_start_mib"]
            cfg = Config.from_dict(raw)
            plan = plan_memory(cfg, meta_structure(cfg), world_size=2, on_gpu=False)
            estimate = plan.total_gib * 1024
            cases[f"activation_checkpointing={checkpointing}"] = {
                "measured_peak_mib": round(measured, 1),
                "estimate_mib": round(estimate, 1),
                "estimate_over_measured": round(estimate / measured, 3),
                "within_25_percent": abs(estimate / measured - 1) <= 0.25,
                "rows_mib": {name: round(gib * 1024, 1) for name, gib in plan.rows},
            }
    return {"benchmark": "plan_accuracy", **machine(), "size": size_name, "sequence": max_length, "cases": cases}


if __name__ == "__main__":
    cli(__doc__, SIZES, run, "plan_accuracy_cpu.json")
