"""What one look at Ray Train's drain notice costs (`ray.train.get_preemption_info`, a barrier across the workers):
the seconds per call on a local Ray with 2 workers, beside `ray.train.collective.barrier` and a gloo all-reduce of
one number (the step's own per-step collective), so `ray.preemption_check_steps` can be chosen from it.

    python bench/preemption_poll.py [--calls 200] [--out bench/results/preemption_poll_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _common import machine, versions

REPO = Path(__file__).resolve().parents[1]


def worker(config: dict) -> None:
    import ray.train
    import ray.train.collective
    import torch
    import torch.distributed as dist

    calls, timings = config["calls"], {}
    one = torch.ones(1)
    looks = {
        "get_preemption_info": ray.train.get_preemption_info,
        "ray_barrier": ray.train.collective.barrier,
        "gloo_all_reduce": lambda: dist.all_reduce(one),
    }
    for name, look in looks.items():
        look()  # the first call sets things up
        seconds = []
        for _ in range(calls):
            started = time.perf_counter()
            look()
            seconds.append(time.perf_counter() - started)
        timings[name] = seconds
    if ray.train.get_context().get_world_rank() == 0:
        Path(config["out"]).write_text(json.dumps(timings))


def run(calls: int) -> dict:
    import tempfile

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "timings.json"
        ray.init(num_cpus=8, include_dashboard=False)
        try:
            TorchTrainer(
                worker,
                train_loop_config={"calls": calls, "out": str(out)},
                scaling_config=ScalingConfig(num_workers=2),
                run_config=RunConfig(storage_path=tmp, name="poll"),
            ).fit()
        finally:
            ray.shutdown()
        timings = json.loads(out.read_text())
    summary = {
        name: {
            "median_ms": round(1000 * statistics.median(s), 3),
            "p90_ms": round(1000 * sorted(s)[int(0.9 * len(s))], 3),
        }
        for name, s in timings.items()
    }
    base = summary["gloo_all_reduce"]["median_ms"]
    return {
        "benchmark": "preemption_poll",
        "what": "seconds per call on rank 0 of a 2-worker TorchTrainer on a local Ray (calls after a first one)",
        **machine(),
        "versions": versions("torch", "ray"),
        "calls": calls,
        "per_call": summary,
        "ratio_notice_over_all_reduce": round(summary["get_preemption_info"]["median_ms"] / base, 1) if base else None,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "preemption_poll_cpu.json")
    args = parser.parse_args()
    report = run(args.calls)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
