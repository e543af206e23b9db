"""What checkpointing costs training: seconds paused per checkpoint and the share of training time spent saving.

The tiny demo config trains on a local Ray cluster (2 CPU workers, gloo, FSDP2 + LoRA) with a checkpoint after
every step (the worst case), alternating in one invocation between:
  async   DCP shards written to local disk, copied to the storage path by Ray in the background (the default)
  sync    the same, but training waits for the copy
  none    no checkpoints: the step time the other two are compared with
Each rank's pause is timed around save + `ray.train.report`; rank 0's cumulative pause and elapsed time come
from the run's metrics.jsonl.

    python bench/checkpoint_cost.py [--size small|default] [--out bench/results/checkpoint_cost_cpu.json]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from _common import cli, machine

SIZES = {"default": {"steps": 12, "repeats": 1}, "small": {"steps": 2, "repeats": 1}}
MODES = ("async", "sync", "none")


def summarise(rows: list[dict], saves: int) -> dict:
    """Per-checkpoint pause and saving share from a run's metrics.jsonl rows (cumulative counters, last row)."""
    last = rows[-1]
    first_step_s = rows[0]["elapsed_s"]  # start-up and the first step's data wait, the same in every mode
    stalled = last["checkpoint_stall_s"]
    return {
        "steps": last["step"],
        "checkpoints": saves,
        "paused_s_per_checkpoint": round(stalled / saves, 4) if saves else 0.0,
        "paused_s_total": round(stalled, 3),
        "train_s_after_first_step": round(last["elapsed_s"] - first_step_s, 3),
        "share_of_training_saving": round(stalled / last["elapsed_s"], 4),
    }


def _train_once(root: Path, mode: str, steps: int, index: int) -> dict:
    from rayft import demo
    from rayft.config import Config
    from rayft.launch import train
    from rayft.train.rundir import RunDir

    raw = demo.demo_config(root)
    out = root / f"{mode}-{index}"
    raw["train"].update(
        output_dir=str(out), max_steps=steps, logging_steps=1, save_steps=1, eval_strategy="no",
        save_strategy="no" if mode == "none" else "steps", save_total_limit=2,
    )  # fmt: skip
    raw["ray"].update(name=f"{mode}-{index}", checkpoint_upload="sync" if mode == "sync" else "async")
    cfg = Config.from_dict(raw)
    train(cfg)
    run = RunDir(cfg.run_uri)
    checkpoint = sorted(Path(run.path).glob("checkpoint-*"))
    size = sum(f.stat().st_size for f in checkpoint[-1].rglob("*") if f.is_file()) if checkpoint else 0
    return {**summarise(run.read_metrics(), 0 if mode == "none" else steps), "checkpoint_mib": round(size / 2**20, 3)}


def run(size_name: str) -> dict:
    import ray

    from rayft import demo

    size = SIZES[size_name]
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        demo.make_tiny_mistral(root / "tiny-mistral")
        demo.make_wikitext(root / "wikitext")
        try:
            for index in range(size["repeats"]):
                for mode in MODES:  # alternating, so drift on a noisy machine hits every mode alike
                    results[mode].append(_train_once(root, mode, size["steps"], index))
        finally:
            ray.shutdown()

    def mean(mode: str, key: str) -> float:
        return sum(r[key] for r in results[mode]) / len(results[mode])

    baseline = mean("none", "train_s_after_first_step")
    ratios = {
        f"{mode}_train_time_over_none": round(mean(mode, "train_s_after_first_step") / baseline, 3)
        for mode in ("async", "sync")
        if baseline > 0
    }
    return {
        "benchmark": "checkpoint_cost",
        **machine(),
        "size": size_name,
        "settings": {**size, "checkpoint_every_steps": 1, "workers": 2, "config": "rayft.demo (tiny Mistral)"},
        "runs": results,
        "ratios": ratios,
    }


if __name__ == "__main__":
    cli(__doc__, SIZES, run, "checkpoint_cost_cpu.json")
