"""Peak host memory of each rank while the model is loaded: rayft's sharded loading vs `from_pretrained` everywhere.

Two gloo ranks build the same LoRA + FSDP2 model from the same checkpoint, once per mode:
  sharded  meta init → LoRA → fully_shard → each rank reads only its own rows (rayft's default)
  full     every rank runs `from_pretrained` on the whole checkpoint, then shards (what the seeds' recipe does
           without rank-0 broadcast)
plus `sharded` on an FP8 checkpoint in Mistral-Small-4's hub layout, and both checkpoints loaded sharded into NF4
(`model.frozen_dtype: nf4`: each rank reads its rows, or its experts, and quantises them). Each rank resets the
kernel's RSS high-water mark (/proc/self/clear_refs) just before loading and reports peak minus the RSS it had then.
The NF4 bound is the rank's share of the model as stored (NF4 codes and scales, the rest in bf16) plus the largest
checkpoint tensor plus the margin below.

    python bench/load_memory.py [--size small|default] [--out bench/results/load_memory_cpu.json]
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import MIB, cli, free_port, machine, reset_peak_rss, rss_kib, run_ranks

SIZES = {
    # ~520 MB bf16 dense Mistral (131k vocab: embeddings and head dominate, as in the real model)
    "default": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "hub_hidden": 512},
    # seconds, for the smoke test
    "small": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "hub_hidden": 128},
}
# The hub-layout model's other shapes: every decoder matrix a whole number of NF4 groups (16,384 weights) but MLA's
# kv_a_proj_with_mqa, as in the real model (hub_hidden must be a multiple of 128).
HUB_SHAPES = {
    "moe_intermediate_size": 256, "intermediate_size": 512, "q_lora_rank": 256, "kv_lora_rank": 256,
    "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 64, "head_dim": 64, "n_routed_experts": 16,
}  # fmt: skip
# Stated bound for sharded loading: each rank's peak increase ≤ half the checkpoint (its shard, 2 ranks) + this
# fixed margin (read chunks of weights.CHUNK_BYTES, the LoRA parameters, allocator and Python object overhead).
MARGIN_MIB = 128
NF4 = {"torch_dtype": "bfloat16", "frozen_dtype": "nf4"}


def _rank(rank: int, world: int, port: int, raw: dict, results: str) -> None:
    from rayft.config import Config
    from rayft.parallel.parallelize import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = Config.from_dict(raw)
    dist.barrier()
    before = reset_peak_rss()
    started = time.perf_counter()
    model = build_model(cfg, on_gpu=False)
    dist.barrier()
    seconds = time.perf_counter() - started
    peak = rss_kib("VmHWM")
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    Path(results, f"rank{rank}.json").write_text(
        json.dumps(
            {"peak_minus_start_mib": (peak - before) / 1024, "local_params_mib": local / MIB, "seconds": seconds}
        )
    )
    dist.destroy_process_group()


def measure(raw: dict, world: int = 2) -> list[dict]:
    with tempfile.TemporaryDirectory() as results:
        run_ranks(_rank, (world, free_port(), raw, results), world)
        return [json.loads(Path(results, f"rank{r}.json").read_text()) for r in range(world)]


def checkpoint_mib(model_dir: Path) -> float:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / MIB


def largest_tensor_mib(model_dir: Path) -> float:
    from rayft.model.weights import SafetensorsCheckpoint

    ckpt = SafetensorsCheckpoint(model_dir)
    return (
        max(torch.Size(e.shape).numel() * torch.empty((), dtype=e.dtype).element_size() for e in ckpt.entries.values())
        / MIB
    )


def make_models(root: Path, size: dict) -> tuple[Path, Path]:
    from fixtures import hub_layout
    from transformers import MistralConfig, MistralForCausalLM

    from rayft import demo
    from rayft.data.tokenizer import copy_tokenizer_files

    tokenizer = root / "tokenizer"
    demo.make_tokenizer(tokenizer)
    dense = root / "dense-bf16"
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=131072, hidden_size=size["hidden_size"], intermediate_size=size["intermediate_size"],
        num_hidden_layers=size["num_hidden_layers"], num_attention_heads=8, num_key_value_heads=4,
        head_dim=size["hidden_size"] // 8, tie_word_embeddings=False,
    )  # fmt: skip
    MistralForCausalLM(config).to(torch.bfloat16).save_pretrained(str(dense))
    copy_tokenizer_files(tokenizer, dense)
    hub = hub_layout.make_tiny_mistral_small4(
        root / "mistral-small-4-fp8", tokenizer_from=tokenizer, hidden_size=size["hub_hidden"], **HUB_SHAPES
    )
    return dense, hub


def run(size_name: str) -> dict:
    size = SIZES[size_name]
    with tempfile.TemporaryDirectory() as tmp:
        dense, hub = make_models(Path(tmp), size)
        base = {"lora": {"target_modules": ["auto"], "lora_dropout": 0.0}, "ray": {"use_gpu": False}}
        cases = {
            "sharded": (dense, {"model": {"model_name_or_path": str(dense), "torch_dtype": "bfloat16"}}),
            "full_from_pretrained": (
                dense,
                {"model": {"model_name_or_path": str(dense), "torch_dtype": "bfloat16", "load_mode": "full"}},
            ),
            "sharded_fp8_hub_layout": (hub, {"model": {"model_name_or_path": str(hub), "torch_dtype": "bfloat16"}}),
            "sharded_nf4": (dense, {"model": {"model_name_or_path": str(dense), **NF4}}),
            "sharded_nf4_from_fp8_hub_layout": (hub, {"model": {"model_name_or_path": str(hub), **NF4}}),
        }
        results = {}
        for name, (model_dir, raw) in cases.items():
            ranks = measure({**base, **raw})
            ckpt, largest = checkpoint_mib(model_dir), largest_tensor_mib(model_dir)
            peak = max(r["peak_minus_start_mib"] for r in ranks)
            if "nf4" in name:  # the rank's share as stored + one tensor (the largest) + the margin
                bound = max(r["local_params_mib"] for r in ranks) + largest + MARGIN_MIB
            else:
                bound = ckpt / 2 + MARGIN_MIB
            results[name] = {
                "checkpoint_mib": round(ckpt, 1),
                "bound_mib": round(bound, 1),
                "within_bound": peak <= bound,
                "largest_tensor_mib": round(largest, 1),
                "per_rank": ranks,
                "max_peak_over_checkpoint": round(peak / ckpt, 3),
            }
    sharded, full = results["sharded"], results["full_from_pretrained"]
    return {
        "benchmark": "load_memory",
        "what": "peak host RSS increase per rank while building LoRA+FSDP2 model, 2 gloo ranks",
        **machine(),
        "size": size_name,
        "results": results,
        "nf4_over_bf16_peak": _peak_ratio(results["sharded_nf4"], sharded),
        "nf4_over_fp8_peak_hub_layout": _peak_ratio(
            results["sharded_nf4_from_fp8_hub_layout"], results["sharded_fp8_hub_layout"]
        ),
        "full_over_sharded_peak": round(
            max(r["peak_minus_start_mib"] for r in full["per_rank"])
            / max(max(r["peak_minus_start_mib"] for r in sharded["per_rank"]), 1e-9),
            2,
        ),
    }


def _peak_ratio(a: dict, b: dict) -> float:
    """The larger rank peak of run `a` over that of run `b`."""
    peak = [max(r["peak_minus_start_mib"] for r in run["per_rank"]) for run in (a, b)]
    return round(peak[0] / max(peak[1], 1e-9), 3)


if __name__ == "__main__":
    cli(__doc__, SIZES, run, "load_memory_cpu.json")
