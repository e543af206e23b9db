"""Host memory and all-gather bytes per rank with the frozen base in FP8 against bf16 (`model.frozen_dtype`).

Two gloo ranks build the same LoRA + FSDP2 model from one bf16 checkpoint (a dense Mistral whose decoder matrices
dominate: small vocabulary) twice — `frozen_dtype: bfloat16` and `float8_e4m3fn` (quantised at load) — and train 3
steps. Each rank reports its RSS after loading and its peak RSS over loading + training (both as increases over
the RSS it had before building; glibc's mmap threshold fixed, see `measure`), the bytes of its shards of the
decoder's frozen weights, and the bytes its decoder layers all-gathered per step less LoRA's. The acceptance bound:
RSS(fp8) ≤ 0.6 × frozen bf16 bytes + the fixed overhead, the fixed overhead being the bf16 run's RSS minus its
frozen bf16 bytes.

    python bench/fp8_memory.py [--size small|default] [--out bench/results/fp8_memory_cpu.json]
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import MIB, cli, free_port, machine, reset_peak_rss, rss_kib

SIZES = {
    # ~250 MB of bf16 decoder matrices (8 layers × 15.7M) next to 2 × 33.5M embedding/head parameters
    "default": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8, "vocab_size": 32768},
    "small": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 4096},
}
STEPS = 3


def _rank(rank: int, world: int, port: int, raw: dict, vocab: int, results: str) -> None:
    from rayft.config import Config
    from rayft.model.build import build_model, decoder_layers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    dist.barrier()
    before = reset_peak_rss()
    model = build_model(Config.from_dict(raw), on_gpu=False)
    dist.barrier()
    after_load = rss_kib("VmRSS")
    layers = decoder_layers(model)
    frozen = sum(
        p.to_local().numel() * p.element_size() for layer in layers for p in layer.parameters() if not p.requires_grad
    )
    gathered = [0]
    for layer in layers:
        _count_frozen_all_gathers(layer, gathered)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(3, vocab, (1, 256), generator=torch.Generator().manual_seed(rank))
    for _ in range(STEPS):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peak = rss_kib("VmHWM")
    Path(results, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rss_after_load_mib": (after_load - before) / 1024,
                "peak_rss_mib": (peak - before) / 1024,
                "frozen_decoder_local_mib": frozen / MIB,
                "frozen_gathered_per_step_mib": gathered[0] / STEPS / MIB,
            }
        )
    )
    dist.destroy_process_group()


def _count_frozen_all_gathers(layer, box: list[int]) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    lora = sum(p.numel() for p in layer.parameters() if p.requires_grad) * 4  # CPU: FSDP gathers LoRA in fp32

    class Counting(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            box[0] += output_tensor.numel() * output_tensor.element_size() - lora
            return super().__call__(output_tensor, input_tensor, group, async_op)

    layer.set_custom_all_gather(Counting())


def measure(raw: dict, vocab: int, world: int = 2) -> list[dict]:
    # glibc raises its mmap threshold after freeing a large block, so freed temporaries (a dequantised weight, a
    # quantised read chunk) then stay resident and RSS stops tracking live memory; a fixed threshold (both runs)
    # returns them, so RSS measures what is actually held.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 * MIB))
    with tempfile.TemporaryDirectory() as results:
        mp.spawn(_rank, args=(world, free_port(), raw, vocab, results), nprocs=world)
        return [json.loads(Path(results, f"rank{r}.json").read_text()) for r in range(world)]


def make_model(root: Path, size: dict) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    from rayft import demo

    model_dir = root / "dense-bf16"
    demo.make_tokenizer(model_dir)
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=size["vocab_size"], hidden_size=size["hidden_size"], intermediate_size=size["intermediate_size"],
        num_hidden_layers=size["num_hidden_layers"], num_attention_heads=8, num_key_value_heads=4,
        head_dim=size["hidden_size"] // 8, tie_word_embeddings=False,
    )  # fmt: skip
    MistralForCausalLM(config).to(torch.bfloat16).save_pretrained(str(model_dir))
    return model_dir


def run(size_name: str) -> dict:
    size = SIZES[size_name]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp), size)
        results = {}
        for frozen in ("bfloat16", "float8_e4m3fn"):
            raw = {
                "model": {"model_name_or_path": str(model_dir), "torch_dtype": "bfloat16", "frozen_dtype": frozen},
                "lora": {"target_modules": ["auto"], "lora_dropout": 0.0},
                "ray": {"use_gpu": False},
            }
            results[frozen] = measure(raw, size["vocab_size"])
    bf16, fp8 = results["bfloat16"], results["float8_e4m3fn"]
    checks = []
    for rank, (b, f) in enumerate(zip(bf16, fp8, strict=True)):
        frozen = b["frozen_decoder_local_mib"]
        for key in ("rss_after_load_mib", "peak_rss_mib"):
            fixed = b[key] - frozen
            bound = 0.6 * frozen + fixed
            checks.append({"rank": rank, "measure": key, "fp8": round(f[key], 1), "bf16": round(b[key], 1),
                           "bound": round(bound, 1), "within": f[key] <= bound})  # fmt: skip
    return {
        "benchmark": "fp8_memory",
        "what": "per-rank host RSS increase and frozen all-gather bytes, frozen base bf16 vs FP8, 2 gloo ranks",
        **machine(),
        "size": size_name,
        "results": results,
        "checks": checks,
        "frozen_local_fp8_over_bf16": round(
            fp8[0]["frozen_decoder_local_mib"] / bf16[0]["frozen_decoder_local_mib"], 3
        ),
        # on CPU FSDP gathers bf16 weights as fp32 (gloo has no bf16 all-gather): bf16 bytes are half of those
        "gathered_fp8_over_bf16": round(
            fp8[0]["frozen_gathered_per_step_mib"] / (bf16[0]["frozen_gathered_per_step_mib"] / 2), 3
        ),
    }


if __name__ == "__main__":
    cli(__doc__, SIZES, run, "fp8_memory_cpu.json")
