"""rayft against the recipe users would otherwise run: TRL SFTTrainer + accelerate, same model, data and settings.

One invocation, alternating (rayft, baseline, rayft, baseline, ...), each as users start it:
  rayft      `python jobs/mistral4.py --config X` (local Ray, 2 workers, FSDP2 + LoRA on gloo)
  baseline   `torchrun --nproc-per-node 2 bench/trl_baseline.py` (SFTTrainer with the seed script's SFTConfig
             fields, PEFT LoRA; see that file for the few changes today's libraries force)
Both from the seed YAML (../shared/seeds/configs/mistral4small_fsdp_2xH200.yaml) pointed at the same tiny
Mistral-architecture model (real tekken tokenizer, 131k vocab) and the same wikitext-shaped data; same LoRA
(the seed's r, alpha, dropout, targets), sequence length, effective batch (per device × accumulation × 2), AdamW,
LR schedule, seed, bf16 (CPU autocast on both sides). Reported per system (median over repeats): steady-state
tokens/s (real tokens, padding not counted; steps after the first), step time, peak host RSS of the worst process,
time from launch to the first optimizer step, the loss per step; and the ratio rayft/baseline. Then a loss-parity
run: one worker each on the same data order, with rayft under another seed as the noise yardstick.

On CPU accelerate cannot apply FSDP (its FSDP path is for accelerator devices; a CPU run is MULTI_CPU = DDP), so the
baseline runs DDP there: less communication than rayft's FSDP2, which favours the baseline.

    python bench/train_vs_trl.py [--size smoke|default] [--out bench/results/train_vs_trl_cpu.json]

GPU mode (`--size gpu`, run by `make gpu-check STAGE=bench-moe` and `STAGE=bench-dense` on one GPU; `gpu-toy` is the
same code at toy size on CPU), sized so that both parts fit the GPU check's few minutes: a scaled-down
Mistral-Small-4 (MLA, 128 experts, top-4, 2 of its 36 layers, the base kept in FP8) through rayft alone (experts via
`grouped_mm`); then a dense Mistral with Ministral-8B's layer shapes and 12 of its 36 layers (random init in bf16,
saved to local disk, nothing downloaded), LoRA r=16 on all seven linear projections, 4,096-token packed padding-free
rows, activation checkpointing, bf16, fused AdamW: rayft (1 GPU worker, FSDP2 on NCCL), then TRL `SFTTrainer` + PEFT
with its best options (packing with `padding_free`, gradient checkpointing, Liger kernels when installed). Every
layer runs the full model's matmul shapes, so MFU per layer is the full model's; the LM head's share of the FLOPs is
larger. Reported: steady-state tokens/s, LoRA-aware and 6N MFU (the same FLOPs per token for both: rayft's FLOP
model), peak GPU memory. `RAYFT_BENCH_PARTS=moe|dense` runs one part.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import yaml
from _common import TreeCPU, cli, free_port, machine, versions

REPO = Path(__file__).resolve().parents[1]
SEED_YAML = REPO.parent / "shared" / "seeds" / "configs" / "mistral4small_fsdp_2xH200.yaml"
# A dense Mistral big enough that the layers, not only the 131k-vocab head, cost something.
MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2}  # fmt: skip
SIZES = {
    "default": {"steps": 16, "repeats": 2, "articles": 400, "settings": ["seed", "packed"], "parity_steps": 12},
    "smoke": {"steps": 1, "repeats": 1, "articles": 40, "settings": ["seed"], "parity_steps": 0},
}
# "seed": the seed YAML as it is (packing false: each line padded to the longest in its batch) on both sides.
# "packed": packing on both sides (rayft: padding-free blocks; TRL: packing=True, its default strategy).
SETTINGS = {"seed": {"packing": False}, "packed": {"packing": True}}
BASELINE_NOTE = (
    "accelerate applies FSDP only on accelerator devices; on CPU the baseline runs DDP (MULTI_CPU), which "
    "communicates less than rayft's FSDP2 (full shard over both workers, as the seed's accelerate config asks). "
    "Both compute in bf16 as the seed YAML says (bf16: true): CPU autocast over fp32 weights."
)


def seed_settings(root: Path, model: Path, dataset: Path, steps: int, packing: bool) -> dict:
    """The seed YAML with paths and a step count for this machine; rayft reads it as it is."""
    raw = yaml.safe_load(SEED_YAML.read_text())
    raw.setdefault("model", {})["model_name_or_path"] = str(model)
    raw["model"]["torch_dtype"] = "float32"
    raw["data"].update(dataset_name_or_path=str(dataset), max_length=256, packing=packing)
    raw["train"].update(
        output_dir=str(root / "out"), max_steps=steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        logging_steps=1, eval_strategy="no", save_strategy="no",
    )  # fmt: skip
    raw["ray"] = {"num_workers": 2, "placement_strategy": "PACK"}
    return raw


def run_rayft(raw: dict, work: Path, skip: int = 1) -> dict:
    """`python jobs/mistral4.py` as users run it; steady state = the logged steps after the first `skip`."""
    work.mkdir(parents=True)
    raw = json.loads(json.dumps(raw))
    raw["train"]["output_dir"] = str(work / "out")
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    cpu = TreeCPU()
    started = time.time()
    done = cpu.run([sys.executable, "jobs/mistral4.py", "--config", str(config)], cwd=REPO, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"rayft failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (work / "out" / "ray_run" / "metrics.jsonl").read_text().splitlines()]
    result = summarise_rayft(rows, started, skip)
    first_step = started + result["time_to_first_step_s"]
    # the first row written carries rayft's start-up profile (bench/startup.py reports it)
    return {**result, "wall_s": time.time() - started, "profile": rows[0].get("startup"),
            "cpu_s_to_first_step": cpu.at(first_step, partial(rayft_role, cpu.root))}  # fmt: skip


def rayft_role(driver: int, pid: int, command: str) -> str:
    """Whose CPU a process of a rayft run is: the job's driver, Ray Train's workers (the training itself), or Ray's
    own processes (GCS, raylet, dashboard and agents, Train controller, Ray Data's actors and task workers)."""
    if pid == driver:
        return "driver"
    return "train_workers" if "RayTrainWorker" in command else "ray"


def baseline_role(launcher: int, pid: int, command: str) -> str:
    """torchrun itself, or one of the ranks it starts."""
    return "launcher" if pid == launcher else "ranks"


def summarise_rayft(rows: list[dict], started: float, skip: int = 1) -> dict:
    """Steady-state numbers from rayft's metrics.jsonl rows: tokens/s over the steps after the first `skip`, and on
    a known GPU rayft's own FLOPs per token (from its MFU) and its peak GPU memory."""
    rows = [r for r in rows if "loss" in r]
    later = rows[skip:] or rows
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in later)
    seconds = sum(r["step_time_s"] for r in later)
    result = {
        "tokens_per_s": tokens / seconds,
        "step_time_s": seconds / len(later),
        "peak_rss_gib": max(r["host_rss_gib"] for r in rows),
        "time_to_first_step_s": rows[0]["time"] - started,
        "losses": [round(r["loss"], 4) for r in rows],
    }
    if rows[-1].get("mfu_lora") is not None:  # on a known GPU: rayft's own FLOP model and memory peaks
        last = rows[-1]
        per_token = {k: last[f"mfu_{k}"] * last["peak_tflops"] * 1e12 / last["tokens_per_s_per_worker"]
                     for k in ("lora", "6n")}  # fmt: skip
        result.update(flops_per_token_lora=per_token["lora"], flops_per_token_6n=per_token["6n"],
                      peak_tflops=last["peak_tflops"])  # fmt: skip
    if rows[-1].get("memory_allocated_gib") is not None:
        result.update(peak_gpu_allocated_gib=max(r["memory_allocated_gib"] for r in rows),
                      peak_gpu_reserved_gib=max(r["memory_reserved_gib"] for r in rows))  # fmt: skip
    return result


def run_baseline(raw: dict, work: Path, sequential: bool = False, skip: int = 1) -> dict:
    work.mkdir(parents=True)
    settings = work / "settings.json"
    settings.write_text(json.dumps(raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    nproc = raw["ray"]["num_workers"]
    cpu = TreeCPU()
    started = time.time()
    done = cpu.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
         str(free_port()), str(REPO / "bench" / "trl_baseline.py"), "--settings", str(settings), "--out", str(work),
         *(["--sequential"] if sequential else [])],
        cwd=work, env=env, timeout=1800,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"baseline failed:\n{done.stderr[-4000:]}")
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(nproc)]
    steps = ranks[0]["steps"]
    tokens = [sum(rank["steps"][i]["tokens"] for rank in ranks) for i in range(len(steps))]
    if len(steps) > skip:
        first = skip - 1  # the end of the last warm-up step
        seconds = steps[-1]["time"] - steps[first]["time"]
        rate, step_time = (tokens[-1] - tokens[first]) / seconds, seconds / (len(steps) - 1 - first)
    else:
        seconds = steps[0]["time"] - ranks[0]["train_start"]
        rate, step_time = tokens[0] / seconds, seconds
    return {
        "tokens_per_s": rate,
        "step_time_s": step_time,
        "peak_rss_gib": max(rank["peak_rss_gib"] for rank in ranks),
        "time_to_first_step_s": steps[0]["time"] - started,
        "losses": [round(s["loss"], 4) for s in steps if "loss" in s],
        "wall_s": time.time() - started,
        "cpu_s_to_first_step": cpu.at(steps[0]["time"], partial(baseline_role, cpu.root)),
        **_gpu_peaks(ranks),
    }


def _gpu_peaks(ranks: list[dict]) -> dict:
    if ranks[0].get("peak_gpu_allocated_gib") is None:
        return {}
    return {k: max(r[k] for r in ranks) for k in ("peak_gpu_allocated_gib", "peak_gpu_reserved_gib")}


def compare(name: str, runs: dict[str, list[dict]]) -> dict:
    summary = {}
    for system, rs in runs.items():
        summary[system] = {
            key: round(statistics.median(r[key] for r in rs), 3)
            for key in ("tokens_per_s", "step_time_s", "peak_rss_gib", "time_to_first_step_s")
        }
        summary[system]["losses"] = rs[0]["losses"]
    ours, theirs = summary["rayft"], summary["baseline"]
    n = min(len(ours["losses"]), len(theirs["losses"]))
    diffs = [abs(a - b) for a, b in zip(ours["losses"][:n], theirs["losses"][:n], strict=True)]
    return {
        "setting": name,
        **summary,
        "ratio_tokens_per_s": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3),
        "ratio_step_time": round(ours["step_time_s"] / theirs["step_time_s"], 3),
        "loss_first_steps": {
            "rayft": ours["losses"][:n],
            "baseline": theirs["losses"][:n],
            "max_abs_diff": round(max(diffs), 4) if diffs else None,
        },
        "runs": runs,
    }


def loss_parity(root: Path, model: Path, dataset: Path, steps: int) -> dict:
    """Both systems on the same data order (one worker, records in file order, no shuffle), so the loss per step
    is comparable batch for batch. The yardstick for "within noise" is rayft against itself under another seed
    (another LoRA init and dropout draw, same batches)."""
    raw = seed_settings(root, model, dataset, steps, packing=False)
    raw["ray"]["num_workers"] = 1
    raw["data"]["shuffle_buffer_size"] = 0
    ours = run_rayft(raw, root / "parity-rayft")["losses"]
    theirs = run_baseline(raw, root / "parity-trl", sequential=True)["losses"]
    raw["train"]["seed"] += 1
    reseeded = run_rayft(raw, root / "parity-rayft-reseeded")["losses"]

    def gap(a: list[float], b: list[float]) -> float:
        return round(max(abs(x - y) for x, y in zip(a, b, strict=False)), 4)

    return {
        "steps": steps,
        "order": "one worker each, records in file order (rayft shuffle_buffer_size 0, TRL sequential sampler)",
        "rayft": ours,
        "baseline": theirs,
        f"rayft_seed_{raw['train']['seed']}": reseeded,
        "max_abs_diff_rayft_vs_baseline": gap(ours, theirs),
        "max_abs_diff_rayft_vs_reseeded": gap(ours, reseeded),
    }


# ------------------------------------------------------------------------------------------------------------------
# GPU mode: rayft's MFU and speed against TRL on one GPU (`make gpu-check STAGE=bench-moe|bench-dense`)

# Ministral-8B's shapes (36 layers, 4096 hidden, GQA 32/8 heads, 12288 MLP, the tekken vocabulary: 8.02B params)
# with 12 of its layers: 3.39B params, 6.8 GB in bf16 to write and load.
DENSE_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128}  # fmt: skip
DENSE_SCALED = {**DENSE_8B, "num_hidden_layers": 12}
# Mistral-Small-4's text model (transformers' Mistral4Config defaults: MLA, 128 experts, top-4, 2048 expert width)
# with 2 of its 36 layers: 7.6B params (routed experts 6.4B of them), 15.2 GB in bf16 to write and load.
MOE_SCALED = {"num_hidden_layers": 2}
TOY_DENSE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip
TOY_MOE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
           "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 16, "num_experts_per_tok": 4,
           "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
           "head_dim": 16}  # fmt: skip
GPU_SIZES = {
    # skip: steps left out of the steady state (allocator warm-up, cuBLAS heuristics, Ray Data ramp-up)
    "gpu": {"device": "cuda", "steps": 6, "skip": 2, "repeats": 1, "articles": 1000, "max_length": 4096,
            "accumulation": 4, "dense": DENSE_SCALED, "moe": MOE_SCALED, "moe_steps": 6},
    "gpu-toy": {"device": "cpu", "steps": 3, "skip": 1, "repeats": 1, "articles": 60, "max_length": 256,
                "accumulation": 2, "dense": TOY_DENSE, "moe": TOY_MOE, "moe_steps": 3},
}  # fmt: skip
SIZES.update(GPU_SIZES)
# The bar the GPU run is measured against, printed with the result.
ACCEPTANCE = {"dense_mfu_lora": 0.40, "dense_ratio_tokens_per_s": 1.3, "moe_mfu_lora": 0.20}


def gpu_settings(root: Path, model: Path, dataset: Path, s: dict, moe: bool = False) -> dict:
    """One config for both systems (rayft reads it as YAML, trl_baseline.py as JSON): the seed's LoRA (r 16, alpha
    32, dropout 0.05) on all linear projections (dense) or rayft's auto set (MoE: MLA + shared expert), packed
    padding-free rows, activation checkpointing, bf16, fused AdamW, one GPU worker. The MoE run is the seeds'
    default base: kept in FP8 (quantised per row at load), so the timed step runs the FP8 expert path
    (`Fp8Experts`), not a bf16 stand-in (LoRA stays on rayft's auto set: expert LoRA needs no dropout)."""
    on_gpu = s["device"] == "cuda"
    targets = ["auto"] if moe else ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    raw = {
        "model": {"model_name_or_path": str(model), "torch_dtype": "bfloat16" if on_gpu else "float32",
                  "attn_implementation": "sdpa"},
        "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": targets, "bias": "none",
                 "task_type": "CAUSAL_LM"},
        "data": {"dataset_name_or_path": str(dataset), "dataset_config_name": demo_config_name(), "text_field": "text",
                 "train_split": "train", "val_split": "validation", "max_length": s["max_length"], "packing": True},
        "train": {"output_dir": str(root / "out"), "max_steps": s["moe_steps" if moe else "steps"],
                  "per_device_train_batch_size": 1, "gradient_accumulation_steps": s["accumulation"],
                  "gradient_checkpointing": True, "optim": "adamw_torch_fused" if on_gpu else "adamw_torch",
                  "learning_rate": 1e-4, "lr_scheduler_type": "cosine", "warmup_ratio": 0.05, "weight_decay": 0.01,
                  "bf16": on_gpu, "logging_steps": 1, "eval_strategy": "no", "save_strategy": "no", "seed": 42},
        "fsdp": {"activation_checkpointing": True},
        "ray": {"num_workers": 1, "use_gpu": on_gpu, "placement_strategy": "PACK", "max_failures": 0},
    }  # fmt: skip
    if moe:
        raw["model"]["frozen_dtype"] = "float8_e4m3fn"
    return raw


def demo_config_name() -> str:
    from rayft.demo import CONFIG_NAME

    return CONFIG_NAME


def make_random_model(directory: Path, kind: str, overrides: dict, device: str) -> Path:
    """A random-init model saved with `save_pretrained` (+ the tekken tokenizer), built in a child process so this
    one never holds GPU memory while the measured runs do."""
    import multiprocessing

    if any(directory.glob("*.safetensors")):
        return directory
    child = multiprocessing.get_context("spawn").Process(target=_save_random_model,
                                                         args=(directory, kind, overrides, device))  # fmt: skip
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"building the random {kind} model in {directory} failed (exit {child.exitcode})")
    return directory


def model_config(kind: str, overrides: dict):
    """The transformers config of a bench model: a dense Mistral, or a Mistral-Small-4 text model (Mistral4)."""
    from transformers import Mistral4Config, MistralConfig

    if kind == "moe":
        return Mistral4Config(**overrides)
    return MistralConfig(vocab_size=131072, max_position_embeddings=32768, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=11, **overrides)  # fmt: skip


def _save_random_model(directory: Path, kind: str, overrides: dict, device: str) -> None:
    import torch
    from transformers import Mistral4ForCausalLM, MistralForCausalLM

    from rayft import demo

    demo.make_tokenizer(directory)
    torch.manual_seed(0)
    cls = Mistral4ForCausalLM if kind == "moe" else MistralForCausalLM
    with torch.device(device):
        model = cls._from_config(model_config(kind, overrides), dtype=torch.bfloat16)
    model.save_pretrained(str(directory))


def drop_weights(directory: Path) -> None:
    """Free the disk (the device has 64 GiB): `rayft plan` needs config.json only."""
    for file in directory.glob("*.safetensors*"):
        file.unlink()


def mfu(result: dict, flops: dict | None, world: int = 1) -> dict:
    """LoRA-aware and 6N MFU from tokens/s and rayft's FLOPs per token (the same yardstick for both systems)."""
    if not flops:
        return {"mfu_lora": None, "mfu_6n": None}
    per_gpu = result["tokens_per_s"] / world
    return {f"mfu_{k}": round(per_gpu * flops[f"flops_per_token_{k}"] / (flops["peak_tflops"] * 1e12), 4)
            for k in ("lora", "6n")}  # fmt: skip


GPU_KEYS = ("tokens_per_s", "step_time_s", "peak_gpu_allocated_gib", "peak_gpu_reserved_gib", "peak_rss_gib",
            "time_to_first_step_s", "wall_s")  # fmt: skip


def summarise_gpu(runs: dict[str, list[dict]], flops: dict | None) -> dict:
    summary = {}
    for system, rs in runs.items():
        numbers = {k: round(statistics.median(r[k] for r in rs), 3) for k in GPU_KEYS if all(k in r for r in rs)}
        summary[system] = {**numbers, **mfu(numbers, flops), "losses": rs[0]["losses"], "runs": rs}
    return summary


def run_gpu(size: str) -> dict:
    """The MoE run, then the dense comparison (`RAYFT_BENCH_PARTS=moe|dense` runs one of them: the GPU check runs
    each as a stage of its own); after each part the report so far goes to `RAYFT_BENCH_PARTIAL` when set, so a
    run cut short still leaves its numbers."""
    from rayft import demo

    s = GPU_SIZES[size]
    parts = os.environ.get("RAYFT_BENCH_PARTS", "moe,dense").split(",")
    root = Path(os.environ.get("RAYFT_BENCH_DIR") or tempfile.mkdtemp(prefix="rayft-gpu-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    dataset = demo.make_wikitext(root / "wikitext", train_articles=s["articles"], val_articles=4, seed=3)
    report = {
        **machine(),
        **gpu_facts(),
        "size": size,
        "settings": {
            **{k: v for k, v in s.items() if k not in ("dense", "moe")},
            "dense_model": s["dense"],
            "moe_model": {**_shape(model_config("moe", s["moe"])), "overrides": s["moe"]},
            "baseline": baseline_options(s["device"] == "cuda"),
        },
        "timings": {},
    }
    for part in parts:
        report[part] = BENCH_PARTS[part](root, dataset, s, report["timings"])
        _write_partial(report)
    report["acceptance"] = acceptance(report)
    return report


def dense_part(root: Path, dataset: Path, s: dict, timings: dict) -> dict:
    started = time.time()
    model = make_random_model(root / "dense", "dense", s["dense"], s["device"])
    timings["dense_model_s"] = round(time.time() - started, 1)
    raw = gpu_settings(root, model, dataset, s)
    runs: dict[str, list[dict]] = {"rayft": [], "baseline": []}
    for i in range(s["repeats"]):  # alternating when repeated, so drift (clocks, page cache) hits both alike
        runs["rayft"].append(run_rayft(raw, root / f"dense-rayft-{i}", skip=s["skip"]))
        runs["baseline"].append(run_baseline(raw, root / f"dense-trl-{i}", skip=s["skip"]))
    flops = _flops(runs["rayft"][0])
    dense = summarise_gpu(runs, flops)
    dense["ratio_tokens_per_s"] = round(dense["rayft"]["tokens_per_s"] / dense["baseline"]["tokens_per_s"], 3)
    drop_weights(model)
    return {**dense, **(flops or {}), "settings": raw}


def moe_part(root: Path, dataset: Path, s: dict, timings: dict) -> dict:
    started = time.time()
    model = make_random_model(root / "moe", "moe", s["moe"], s["device"])
    timings["moe_model_s"] = round(time.time() - started, 1)
    raw = gpu_settings(root, model, dataset, s, moe=True)
    run = run_rayft(raw, root / "moe-rayft", skip=s["skip"])
    drop_weights(model)
    return {**summarise_gpu({"rayft": [run]}, _flops(run)), **(_flops(run) or {}), "settings": raw}


BENCH_PARTS = {"moe": moe_part, "dense": dense_part}


def _write_partial(report: dict) -> None:
    path = os.environ.get("RAYFT_BENCH_PARTIAL")
    if path:
        Path(path).write_text(json.dumps({**report, "partial": True}, indent=2))


def _shape(config) -> dict:
    keys = ("hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "q_lora_rank", "kv_lora_rank", "num_attention_heads", "vocab_size")  # fmt: skip
    return {k: getattr(config, k) for k in keys}


def _flops(result: dict) -> dict | None:
    keys = ("flops_per_token_lora", "flops_per_token_6n", "peak_tflops")
    return {k: result[k] for k in keys} if all(k in result for k in keys) else None


def baseline_options(on_gpu: bool) -> dict:
    """What trl_baseline.py turns on in GPU mode (Liger only where the package is installed)."""
    import importlib.util

    if not on_gpu:
        return {"device": "cpu (toy)", "packing": True, "gradient_checkpointing": True, "launcher": "torchrun"}
    return {"padding_free": True, "packing": True, "packing_strategy": "bfd", "gradient_checkpointing": True,
            "use_liger_kernel": os.environ.get("RAYFT_TRL_LIGER", "auto") != "0"
            and importlib.util.find_spec("liger_kernel") is not None, "torch_dtype": "bfloat16",
            "optim": "adamw_torch_fused", "launcher": "torchrun --nproc-per-node 1"}  # fmt: skip


def gpu_facts() -> dict:
    """The GPU and the CUDA stack the numbers were taken on (null fields on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return {"gpu": None}
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
            "nccl": _version(torch.cuda.nccl.version()),
            "cudnn": torch.backends.cudnn.version(),
        }
    }


def _version(v) -> str:
    return ".".join(map(str, v)) if isinstance(v, tuple | list) else str(v)


def acceptance(report: dict) -> dict:
    """Each acceptance number with its bar and a verdict (None where it could not be measured, e.g. on CPU)."""
    dense, moe = report.get("dense", {}), report.get("moe", {})
    measured = {
        "dense_mfu_lora": dense.get("rayft", {}).get("mfu_lora"),
        "dense_ratio_tokens_per_s": dense.get("ratio_tokens_per_s"),
        "moe_mfu_lora": moe.get("rayft", {}).get("mfu_lora"),
    }
    on_gpu = report.get("gpu") is not None  # a toy run on CPU exercises the code, it measures nothing
    return {k: {"value": v, "bar": ACCEPTANCE[k], "ok": v >= ACCEPTANCE[k] if on_gpu and v is not None else None}
            for k, v in measured.items()}  # fmt: skip


def run(size: str) -> dict:
    from rayft import demo

    if size in GPU_SIZES:
        return run_gpu(size)
    s = SIZES[size]
    root = Path(tempfile.mkdtemp(prefix="rayft-vs-trl-"))
    model = demo.make_tiny_mistral(root / "model", **MODEL)
    dataset = demo.make_wikitext(root / "wikitext", train_articles=s["articles"], val_articles=4, seed=3)
    results = []
    for name in s["settings"]:
        raw = seed_settings(root, model, dataset, s["steps"], **SETTINGS[name])
        runs: dict[str, list[dict]] = {"rayft": [], "baseline": []}
        for i in range(s["repeats"]):  # alternating, so machine drift hits both alike
            runs["rayft"].append(run_rayft(raw, root / f"{name}-rayft-{i}"))
            runs["baseline"].append(run_baseline(raw, root / f"{name}-trl-{i}"))
        results.append(compare(name, runs))
    parity = loss_parity(root, model, dataset, s["parity_steps"]) if s["parity_steps"] else None
    report = {
        **machine(),
        "settings": {
            **s,
            "model": MODEL,
            "seed_yaml": SEED_YAML.name,
            "workers": 2,
            "max_length": 256,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "baseline_note": BASELINE_NOTE,
        },
        "results": results,
        "loss_parity": parity,
    }
    report["versions"].update(versions("ray", "trl", "accelerate"))
    return report


if __name__ == "__main__":
    cli(__doc__, SIZES, run, "train_vs_trl_cpu.json")
