"""Ray Train's own start-up, as a yardstick for bench/startup.py: a job that does nothing but enter its train function.

A fresh local Ray as lean as Ray allows (no dashboard, no preemption watcher, no idle workers started ahead, no Train
state API, a 0.5 s controller poll), a `TorchTrainer` with 2 CPU workers and a gloo process group, and a train
function that only passes one barrier: rank 0 writes the wall time it got there to OUT. No data, no model, no rayft.
Any tool built on Ray Train pays at least this before its first step; bench/startup.py sets it beside rayft and TRL.

    python bench/ray_train_empty.py OUT.json STORAGE_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time

import ray
import ray.train
from ray.train.torch import TorchConfig, TorchTrainer

LEAN_ENV = {
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_ENABLE_STATE_TRACKING": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    # No dashboard, so no state API of its own: its placement-group cleaner must not ask another Ray on the machine
    # (as rayft's local Ray without a dashboard; port 0 serves nothing).
    "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:0",
}


def train_fn(config: dict) -> None:
    import torch.distributed as dist

    dist.barrier()  # every worker is in, with the process group up
    if ray.train.get_context().get_world_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump({"entered": time.time()}, f)


def main(out: str, storage: str) -> None:
    os.environ.update(LEAN_ENV)  # the driver's copy: Ray Train reads some of them here and hands them on
    ray.init(address="local", num_cpus=8, include_dashboard=False, runtime_env={"env_vars": LEAN_ENV},
             _system_config={"prestart_worker_first_driver": False})  # fmt: skip
    TorchTrainer(
        train_fn,
        train_loop_config={"out": out},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(name="empty", storage_path=storage),
    ).fit()


if __name__ == "__main__":
    main(*sys.argv[1:3])
