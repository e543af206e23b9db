"""Seconds from launch to the first optimizer step: rayft against the seeds' TRL recipe under `torchrun`.

Each system is started as users start it, alternating (rayft, TRL, rayft, TRL, ...):
  rayft      `python jobs/mistral4.py --config X` (starts a local Ray, 2 CPU workers, FSDP2 + LoRA on gloo)
  baseline   `torchrun --nproc-per-node 2 bench/trl_baseline.py` (SFTTrainer + PEFT LoRA, the seed's settings)
from the seed YAML on the same tiny Mistral and wikitext-shaped data as bench/train_vs_trl.py (which runs both
sides; this file reuses it), one optimizer step each. Measured from the process launch to the end of the first
optimizer step (rayft: its first metrics row; TRL: its first step callback); median of the repeats; rayft's
start-up profile stages (metrics.jsonl's first row) for every run. Then `make demo`'s job (the built-in demo in a
fresh directory, after the install): wall time, steps and evaluations.

    python bench/startup.py [--out bench/results/startup_cpu.json]

Never in CI (minutes). Its runs are bench/train_vs_trl.py's at one step, so tests/test_bench_smoke.py checks
`summarise` on the pair of runs of train_vs_trl's smoke (one of each) rather than start the same two runs again.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import cli, machine, versions
from train_vs_trl import MODEL, SEED_YAML, run_baseline, run_rayft, seed_settings

REPO = Path(__file__).resolve().parents[1]
SIZES = {"default": {"repeats": 3, "demo": True}}
TARGET_RATIO = 1.5  # issue 19: rayft's time to the first step at most 1.5x TRL's


def summarise(runs: dict[str, list[dict]]) -> dict:
    """The start-up view of alternating runs (`run_rayft` / `run_baseline` results, in `runs["rayft"]` and
    `runs["baseline"]`): each run's time to the first step and wall time, rayft's profile, the medians and the
    ratio against the target."""
    kept = {system: [_first_step(r) for r in rs] for system, rs in runs.items()}
    medians = {k: statistics.median(r["time_to_first_step_s"] for r in v) for k, v in kept.items()}
    ratio = medians["rayft"] / medians["baseline"]
    return {
        "runs": kept,
        "median_time_to_first_step_s": medians,
        "ratio_rayft_over_trl": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "ratio_ok": ratio <= TARGET_RATIO,
    }


def _first_step(result: dict) -> dict:
    """What start-up needs of one run's result: its two times, and rayft's profile where the run has one."""
    kept = {"time_to_first_step_s": round(result["time_to_first_step_s"], 2), "wall_s": round(result["wall_s"], 2)}
    if "profile" in result:
        kept["profile"] = result["profile"]
    return kept


def demo_wall(root: Path) -> dict:
    """`make demo` after the install: the built-in demo job from a fresh directory (its files, a local Ray, 2
    workers), as `python jobs/mistral4.py` with no arguments; wall time, steps and evaluations done."""
    work = root / "demo"
    work.mkdir()
    started = time.time()
    done = subprocess.run([sys.executable, str(REPO / "jobs" / "mistral4.py")], cwd=work, capture_output=True,
                          text=True, timeout=1800)  # fmt: skip
    wall = time.time() - started
    if done.returncode != 0:
        raise RuntimeError(f"the demo failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (work / "rayft-demo/output/ray_run/metrics.jsonl").read_text().splitlines()]
    return {
        "wall_s": round(wall, 1),
        "steps": max(r["step"] for r in rows),
        "evaluations": sum(1 for r in rows if "eval_loss" in r),
        "profile": rows[0].get("startup"),
        "log_lines": len((done.stdout + done.stderr).splitlines()),
    }


def run(size: str) -> dict:
    from rayft import demo

    s = SIZES[size]
    root = Path(tempfile.mkdtemp(prefix="rayft-startup-"))
    model = demo.make_tiny_mistral(root / "model", **MODEL)
    dataset = demo.make_wikitext(root / "wikitext", train_articles=40, val_articles=4, seed=3)
    raw = seed_settings(root, model, dataset, steps=1, packing=False)
    runs: dict[str, list[dict]] = {"rayft": [], "baseline": []}
    for i in range(s["repeats"]):  # alternating, so machine drift hits both alike
        runs["rayft"].append(run_rayft(raw, root / f"rayft-{i}"))
        runs["baseline"].append(run_baseline(raw, root / f"trl-{i}"))
    report = {
        **machine(),
        "settings": {"repeats": s["repeats"], "model": MODEL, "seed_yaml": SEED_YAML.name, "workers": 2, "steps": 1,
                     "train_articles": 40, "measured": "process launch to the end of the first optimizer step"},
        **summarise(runs),
    }  # fmt: skip
    report["versions"].update(versions("ray", "trl", "accelerate"))
    if s["demo"]:
        report["demo"] = demo_wall(root)
    return report


if __name__ == "__main__":
    cli(__doc__, SIZES, run, "startup_cpu.json")
