"""Driver side: join (or start) a Ray cluster, build the datasets and the TorchTrainer, run it, summarise."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchConfig, TorchTrainer

from rayft.config import Config, ConfigError, RayConfig
from rayft.data import build_datasets
from rayft.loop import train_loop_per_worker
from rayft.preflight import preflight
from rayft.schedule import make_plan

log = logging.getLogger("rayft")

WORKER_ENV = {
    # HF fast tokenizers deadlock after fork when their own thread pool is already running.
    "TOKENIZERS_PARALLELISM": "false",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}


@dataclass
class Outcome:
    final_adapter: Path
    run_dir: Path
    latest_checkpoint: str | None
    metrics: dict[str, Any]


def train(cfg: Config) -> Outcome:
    checked = preflight(cfg)
    log.info(
        "%s: LoRA on %d modules (%s), %s trainable params",
        checked.lora.architecture,
        len(checked.lora.modules),
        ", ".join(checked.lora.names),
        f"{checked.trainable_params:,}",
    )
    if checked.lora.warning:
        log.warning(checked.lora.warning)
    started_locally = connect(cfg.ray)
    use_gpu = resolve_use_gpu(cfg.ray)
    if not use_gpu:
        cfg.check_cpu_precision()
    _check_placement(cfg.ray, cluster_can_grow=not started_locally)

    datasets = build_datasets(cfg)
    plan = make_plan(cfg, datasets.train_rows, datasets.validation_rows, cfg.ray.num_workers)
    log.info(
        "data: %d train / %d validation records → %d steps on %d workers",
        plan.train_rows,
        plan.validation_rows,
        plan.total_steps,
        plan.world_size,
    )
    splits = {"train": datasets.train}
    if plan.has_validation and datasets.validation is not None:
        splits["validation"] = datasets.validation

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": cfg.to_dict(), "plan": asdict(plan)},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.ray.num_workers,
            use_gpu=use_gpu,
            resources_per_worker=cfg.ray.resources_per_worker,
            placement_strategy=cfg.ray.placement_strategy,
        ),
        run_config=ray.train.RunConfig(
            name=cfg.ray.name,
            storage_path=cfg.storage_path,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.train.save_total_limit),
            failure_config=ray.train.FailureConfig(max_failures=cfg.ray.max_failures),
            worker_runtime_env={"env_vars": WORKER_ENV},
        ),
        datasets=splits,
    )
    result = trainer.fit()
    return Outcome(
        final_adapter=Path(cfg.train.output_dir).expanduser().resolve() / "final",
        run_dir=Path(cfg.storage_path) / cfg.ray.name,
        latest_checkpoint=result.checkpoint.path if result.checkpoint else None,
        metrics=dict(result.metrics or {}),
    )


def connect(ray_cfg: RayConfig) -> bool:
    """Join the cluster `ray job submit` runs us in (RAY_ADDRESS), or start a private local one (→ True)."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")  # the dashboard's Train view needs it
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    log.info("no Ray cluster given (ray.address / RAY_ADDRESS): starting a local one")
    ray.init(address="local", num_cpus=ray_cfg.local_num_cpus, runtime_env={"env_vars": WORKER_ENV})
    return True


def resolve_use_gpu(ray_cfg: RayConfig) -> bool:
    gpus = ray.cluster_resources().get("GPU", 0)
    if ray_cfg.use_gpu is None:
        return gpus > 0
    if ray_cfg.use_gpu and gpus == 0:
        raise ConfigError("ray.use_gpu: true but the Ray cluster has no GPUs; set ray.use_gpu: false to train on CPU")
    return ray_cfg.use_gpu


def _check_placement(ray_cfg: RayConfig, cluster_can_grow: bool) -> None:
    """STRICT_SPREAD with fewer nodes than workers waits for nodes: an error where none can ever join."""
    if ray_cfg.placement_strategy != "STRICT_SPREAD":
        return
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    if nodes >= ray_cfg.num_workers:
        return
    if not cluster_can_grow:
        raise ConfigError(
            f"ray.placement_strategy: STRICT_SPREAD puts each of the {ray_cfg.num_workers} workers on its own node, "
            f"but the local Ray cluster has {nodes}; set ray.placement_strategy: PACK to train on one machine"
        )
    log.warning(
        "ray.placement_strategy STRICT_SPREAD needs %d nodes (one per worker) but the cluster has %d now; "
        "the run waits until enough nodes join (set ray.placement_strategy: PACK to share a node)",
        ray_cfg.num_workers,
        nodes,
    )
