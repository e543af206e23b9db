"""Host memory and all-gather bytes per rank with the frozen base in FP8 against bf16 (`model.frozen_dtype`).

Two gloo ranks build the same LoRA + FSDP2 model from one FP8 checkpoint in the hub's Mistral-Small-4 layout
(`tests/fixtures/hub_layout.py`, scaled up so that its routed experts dominate: 3 layers × 32 experts of 1024 × 512,
a 32k vocabulary) twice — `frozen_dtype: bfloat16` (dequantised at load) and `auto` (kept in FP8) — and train 3
steps. Each rank reports its RSS after loading and its peak RSS over loading + training (both as increases over
the RSS it had before building), the bytes of its shards of the decoder's frozen weights, and the bytes its decoder
layers all-gathered per step less LoRA's. The acceptance bound: RSS(fp8) ≤ 0.6 × frozen bf16 bytes + the fixed
overhead, the fixed overhead being the bf16 run's RSS minus its frozen bf16 bytes. Both pairs of runs are made twice:
with glibc's default malloc (what rayft's workers run with) and with its mmap threshold fixed at 1 MiB
(`MALLOC_MMAP_THRESHOLD_`, which makes RSS track live memory: freed temporaries go back to the system at once).

    python bench/fp8_memory.py [--size small|default] [--out bench/results/fp8_memory_cpu.json]
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from _common import MIB, cli, free_port, machine, reset_peak_rss, rss_kib, run_ranks

SIZES = {
    # 151M routed-expert parameters (302 MiB in bf16) next to 2 × 33.5M embedding/head parameters
    "default": {
        "hidden_size": 1024, "moe_intermediate_size": 512, "intermediate_size": 1024, "n_routed_experts": 32,
        "num_experts_per_tok": 4, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 8,
        "q_lora_rank": 256, "kv_lora_rank": 128, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 64,
        "head_dim": 64, "vocab_size": 32768,
    },
    "small": {"vocab_size": 4096},  # the test fixture's shapes
}  # fmt: skip
MALLOC = {"glibc default": None, "mmap threshold 1 MiB": "1048576"}  # MALLOC_MMAP_THRESHOLD_
STEPS = 3


def _rank(rank: int, world: int, port: int, raw: dict, vocab: int, results: str) -> None:
    from rayft.config import Config
    from rayft.model.build import decoder_layers
    from rayft.parallel.parallelize import build_model

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


def measure(raw: dict, vocab: int, mmap_threshold: str | None, world: int = 2) -> list[dict]:
    """The ranks are spawned with `MALLOC_MMAP_THRESHOLD_` as given (None: unset, glibc's dynamic threshold)."""
    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = mmap_threshold
    try:
        with tempfile.TemporaryDirectory() as results:
            run_ranks(_rank, (world, free_port(), raw, vocab, results), world)
            return [json.loads(Path(results, f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def make_model(root: Path, size: dict) -> Path:
    from fixtures.hub_layout import make_tiny_mistral_small4

    return make_tiny_mistral_small4(root / "mistral-small-4", **size)


def _checks(bf16: list[dict], fp8: list[dict]) -> list[dict]:
    checks = []
    for rank, (b, f) in enumerate(zip(bf16, fp8, strict=True)):
        frozen = b["frozen_decoder_local_mib"]
        for key in ("rss_after_load_mib", "peak_rss_mib"):
            fixed = b[key] - frozen
            bound = 0.6 * frozen + fixed
            checks.append({"rank": rank, "measure": key, "fp8": round(f[key], 1), "bf16": round(b[key], 1),
                           "bound": round(bound, 1), "within": f[key] <= bound})  # fmt: skip
    return checks


def run(size_name: str) -> dict:
    size = SIZES[size_name]
    vocab = size["vocab_size"]
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp), size)
        for malloc, threshold in MALLOC.items():
            results[malloc] = {}
            for frozen in ("bfloat16", "auto"):
                raw = {
                    "model": {"model_name_or_path": str(model_dir), "torch_dtype": "bfloat16", "frozen_dtype": frozen},
                    "lora": {"target_modules": ["auto"], "lora_dropout": 0.0},
                    "ray": {"use_gpu": False},
                }
                results[malloc][frozen] = measure(raw, vocab, threshold)
    bf16, fp8 = results["glibc default"]["bfloat16"], results["glibc default"]["auto"]
    return {
        "benchmark": "fp8_memory",
        "what": "per-rank host RSS increase and frozen all-gather bytes, frozen base bf16 vs FP8, 2 gloo ranks, "
        "hub-layout Mistral-Small-4 (FP8 checkpoint)",
        **machine(),
        "size": size_name,
        "model": size,
        "results": results,
        "checks": {malloc: _checks(r["bfloat16"], r["auto"]) for malloc, r in results.items()},
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
