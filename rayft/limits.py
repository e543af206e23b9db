"""Settings checked against the model and the machine rather than on their own, by `rayft validate` and before every
run: a sequence length the model's positions cover, a LoRA rank its layers can hold, and workers the local Ray
cluster (started with `ray.local_num_cpus`) can place. All from config files: no weights, no Ray."""

from __future__ import annotations

from typing import Any

from torch import nn

from rayft.config import Config, ConfigError


def check_max_length(cfg: Config, config: Any) -> None:
    """`data.max_length` over the positions the model was trained for: packing would build blocks whose later
    positions the model never saw. A rope scaling in the config (factor over its original length) extends them."""
    positions = getattr(config, "max_position_embeddings", None)
    if not positions or cfg.data.max_length <= positions:
        return
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    factor = rope.get("factor") if isinstance(rope, dict) and rope.get("rope_type", "default") != "default" else None
    if factor:
        original = rope.get("original_max_position_embeddings") or positions
        if cfg.data.max_length <= max(positions, int(original * factor)):
            return
    raise ConfigError(
        f"data.max_length: {cfg.data.max_length:,} is over the model's max_position_embeddings {positions:,} "
        f"({cfg.model.model_name_or_path}/config.json) and no rope scaling there covers it; set data.max_length to "
        f"{positions:,} or less"
    )


def lora_rank_warning(cfg: Config, model: nn.Module) -> str | None:
    """A rank above a target layer's smaller side adds parameters that cannot raise the update's rank."""
    too_small: dict[str, int] = {}
    for name, module in model.named_modules():
        base = getattr(module, "base_layer", None)
        sides: tuple[Any, Any] = (getattr(base, "in_features", None), getattr(base, "out_features", None))
        if None in sides or min(sides) >= cfg.lora.r:
            continue
        too_small.setdefault(name.rsplit(".", 1)[-1], min(sides))
    if not too_small:
        return None
    shown = ", ".join(f"{n} ({side})" for n, side in sorted(too_small.items()))
    return (
        f"lora.r {cfg.lora.r} is larger than the smaller side of {shown}: the update's rank cannot exceed it, the "
        "extra rank only adds parameters; lower lora.r or leave those modules out of lora.target_modules"
    )


def local_placement_problem(cfg: Config) -> str | None:
    """Without a cluster to join (ray.address, RAY_ADDRESS) the run starts a local Ray with `ray.local_num_cpus`
    CPUs and this machine's GPUs: whether the workers' bundles fit it is known before Ray starts. None when they
    fit or a cluster is given."""
    if cfg.ray.cluster_address():
        return None
    import torch

    from rayft.placement import Request

    gpus = torch.cuda.device_count()
    use_gpu = cfg.ray.use_gpu if cfg.ray.use_gpu is not None else gpus > 0
    bundle = dict(cfg.ray.resources_per_worker or {})
    if not bundle:
        bundle = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
    node = {"CPU": float(cfg.ray.local_num_cpus), "GPU": float(gpus)}
    request = Request(cfg.ray.fewest_workers, bundle, cfg.ray.placement_strategy)
    if request.fits([node]):
        return None
    where = "the local Ray cluster this run would start (no ray.address / RAY_ADDRESS)"
    return f"{request.refusal([node], where)} (its CPUs: ray.local_num_cpus {cfg.ray.local_num_cpus})"


def local_placement(cfg: Config) -> str | None:
    """Refused for a CPU run (a config for this machine); a warning otherwise: a GPU config checked on a laptop is
    usually meant for `ray job submit`, which gives it a cluster (RAY_ADDRESS) only then."""
    problem = local_placement_problem(cfg)
    if problem and cfg.ray.use_gpu is False:
        raise ConfigError(problem)
    return f"if run without a cluster: {problem}" if problem else None
