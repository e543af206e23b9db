"""Seconds from launch to the first optimizer step: rayft against the seeds' TRL recipe under `torchrun`.

Each system is started as users start it, alternating (rayft, TRL, yardstick, rayft, TRL, ...):
  rayft      `python jobs/mistral4.py --config X` (starts a local Ray, 2 CPU workers, FSDP2 + LoRA on gloo)
  baseline   `torchrun --nproc-per-node 2 bench/trl_baseline.py` (SFTTrainer + PEFT LoRA, the seed's settings)
  yardstick  `python bench/ray_train_empty.py`: Ray Train alone (a lean local Ray, 2 workers, gloo, a train
             function that does nothing), up to every worker inside its train function
from the seed YAML on the same tiny Mistral and wikitext-shaped data as bench/train_vs_trl.py (which runs the first
two; this file reuses it), one optimizer step each. Measured from the process launch to the end of the first
optimizer step (rayft: its first metrics row; TRL: its first step callback); median of the repeats; rayft's
start-up profile stages (metrics.jsonl's first row) for every run. Every run's CPU-seconds to that moment, per kind
of process (bench/_common.TreeCPU): start-up on this small machine is CPU-bound, so CPU-seconds / cores is a floor
under the wall time that no reordering or overlap gets below. Then `make demo`'s job (the built-in demo in a fresh
directory, after the install): wall time, steps and evaluations.

    python bench/startup.py [--out bench/results/startup_cpu.json]

Never in CI (minutes). Its runs are bench/train_vs_trl.py's at one step, so tests/integration/test_bench_smoke.py checks
`summarise` on the pair of runs of train_vs_trl's smoke (one of each), and the yardstick once, rather than start
the same runs again.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from _common import TreeCPU, cli, machine, versions
from train_vs_trl import MODEL, SEED_YAML, rayft_role, run_baseline, run_rayft, seed_settings

REPO = Path(__file__).resolve().parents[1]
SIZES = {"default": {"repeats": 3, "demo": True}}
TARGET_RATIO = 1.5  # issue 19: rayft's time to the first step at most 1.5x TRL's


def summarise(runs: dict[str, list[dict]]) -> dict:
    """The start-up view of alternating runs (`run_rayft` / `run_baseline` results, in `runs["rayft"]` and
    `runs["baseline"]`; `run_ray_train_empty`'s in `runs["ray_train_empty"]` where it ran): each run's time to the
    first step and wall time, rayft's profile, the medians and the ratio against the target, the yardstick's ratio,
    and the CPU view."""
    kept = {system: [_first_step(r) for r in rs] for system, rs in runs.items()}
    medians = {k: statistics.median(r["time_to_first_step_s"] for r in v) for k, v in kept.items()}
    ratio = medians["rayft"] / medians["baseline"]
    yardstick = {}
    if "ray_train_empty" in medians:
        yardstick["ratio_ray_train_empty_over_trl"] = round(medians["ray_train_empty"] / medians["baseline"], 3)
    return {
        "runs": kept,
        "median_time_to_first_step_s": medians,
        "ratio_rayft_over_trl": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "ratio_ok": ratio <= TARGET_RATIO,
        **yardstick,
        **cpu_floor(kept, medians["baseline"]),
    }


def cpu_floor(kept: dict[str, list[dict]], baseline_s: float) -> dict:
    """The CPU view, where the runs carry it: median CPU-seconds to the first step per system (and per kind of
    process), and the wall time no scheduling can beat on this machine's cores: CPU-seconds / cores. Its ratio to
    TRL's time is the best that start-up work short of removing CPU work could reach."""
    if not all("cpu_s_to_first_step" in r for rs in kept.values() for r in rs):
        return {}
    cores = os.cpu_count() or 1
    cpu = {system: {part: round(statistics.median(r["cpu_s_to_first_step"][part] for r in rs), 2)
                    for part in rs[0]["cpu_s_to_first_step"]} for system, rs in kept.items()}  # fmt: skip
    floor = cpu["rayft"]["total"] / cores
    return {
        "median_cpu_s_to_first_step": cpu,
        "rayft_floor_s": round(floor, 2),
        "floor_ratio_rayft_over_trl": round(floor / baseline_s, 3),
        "cpu_s_for_target": round(TARGET_RATIO * baseline_s * cores, 1),
    }


def _first_step(result: dict) -> dict:
    """What start-up needs of one run's result: its two times, rayft's profile where the run has one, and its
    CPU-seconds per kind of process where they were counted."""
    kept = {"time_to_first_step_s": round(result["time_to_first_step_s"], 2), "wall_s": round(result["wall_s"], 2)}
    for key in ("profile", "cpu_s_to_first_step"):
        if key in result:
            kept[key] = result[key]
    return kept


def run_ray_train_empty(work: Path) -> dict:
    """bench/ray_train_empty.py as a process: its "first step" is every worker inside the train function."""
    work.mkdir(parents=True)
    entered_file, cpu = work / "entered.json", TreeCPU()
    started = time.time()
    done = cpu.run([sys.executable, str(REPO / "bench" / "ray_train_empty.py"), str(entered_file), str(work / "ray")],
                   cwd=work, timeout=600)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the empty Ray Train job failed:\n{done.stderr[-4000:]}")
    entered = json.loads(entered_file.read_text())["entered"]
    return {"time_to_first_step_s": entered - started, "wall_s": time.time() - started,
            "cpu_s_to_first_step": cpu.at(entered, partial(rayft_role, cpu.root))}  # fmt: skip


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
    runs: dict[str, list[dict]] = {"rayft": [], "baseline": [], "ray_train_empty": []}
    for i in range(s["repeats"]):  # alternating, so machine drift hits all alike
        runs["rayft"].append(run_rayft(raw, root / f"rayft-{i}"))
        runs["baseline"].append(run_baseline(raw, root / f"trl-{i}"))
        runs["ray_train_empty"].append(run_ray_train_empty(root / f"empty-{i}"))
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
