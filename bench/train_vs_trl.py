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
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from _common import cli, free_port, machine

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


def run_rayft(raw: dict, work: Path) -> dict:
    work.mkdir(parents=True)
    raw = json.loads(json.dumps(raw))
    raw["train"]["output_dir"] = str(work / "out")
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    started = time.time()
    done = subprocess.run([sys.executable, "jobs/mistral4.py", "--config", str(config)], cwd=REPO,
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"rayft failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (work / "out" / "ray_run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    later = rows[1:] or rows
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in later)
    seconds = sum(r["step_time_s"] for r in later)
    return {
        "tokens_per_s": tokens / seconds,
        "step_time_s": seconds / len(later),
        "peak_rss_gib": max(r["host_rss_gib"] for r in rows),
        "time_to_first_step_s": rows[0]["time"] - started,
        "losses": [round(r["loss"], 4) for r in rows],
        "wall_s": time.time() - started,
    }


def run_baseline(raw: dict, work: Path, sequential: bool = False) -> dict:
    work.mkdir(parents=True)
    settings = work / "settings.json"
    settings.write_text(json.dumps(raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    nproc = raw["ray"]["num_workers"]
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
         str(free_port()), str(REPO / "bench" / "trl_baseline.py"), "--settings", str(settings), "--out", str(work),
         *(["--sequential"] if sequential else [])],
        cwd=work, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"baseline failed:\n{done.stderr[-4000:]}")
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(nproc)]
    steps = ranks[0]["steps"]
    tokens = [sum(rank["steps"][i]["tokens"] for rank in ranks) for i in range(len(steps))]
    if len(steps) > 1:
        seconds = steps[-1]["time"] - steps[0]["time"]
        rate, step_time = (tokens[-1] - tokens[0]) / seconds, seconds / (len(steps) - 1)
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
    }


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


def run(size: str) -> dict:
    from rayft import demo

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
    return {
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


if __name__ == "__main__":
    cli(__doc__, SIZES, run, "train_vs_trl_cpu.json")
