"""The training loop each Ray Train worker runs: the story of a run from config to final adapter. The parts live
beside it: one optimizer step and evaluation (step.py), checkpoints and resume (checkpoint.py), what is measured
and logged (metrics.py)."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch

from rayft.config import Config, TrainConfig
from rayft.data.pipeline import collate_fn
from rayft.data.tokenizer import load_tokenizer
from rayft.logs import quiet_worker_rank, verbose
from rayft.model.build import build_model, cpu_autocast, cpu_bf16, decoder_layers, fused_loss
from rayft.model.flops import flop_model, peak_flops
from rayft.model.fp8 import fp8_layers
from rayft.parallel.fsdp_tally import count_fsdp_collectives
from rayft.startup import Profile, process_start_time
from rayft.train import dpo, reference
from rayft.train import metrics as measured
from rayft.train.checkpoint import CheckpointManager, Progress, TrainState, load_adapter_weights, publish_adapter
from rayft.train.metrics import LossWindow, ProgressLog, perplexity
from rayft.train.rundir import EVAL_RESULT, RunDir
from rayft.train.schedule import Plan, build_optimizer, build_scheduler
from rayft.train.step import NEXT_TOKEN, DataWait, StepLoss, evaluate, step_groups, train_step

log = logging.getLogger("rayft")


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    entered = time.time()
    cfg, plan = Config.from_dict(loop_config["config"]), Plan(**loop_config["plan"])
    t, rank, device = cfg.train, ray.train.get_context().get_world_rank(), ray.train.torch.get_device()
    _setup_logging(rank)
    profile = _worker_profile(loop_config, entered)
    torch.manual_seed(t.seed)
    # Asked for first: each shard's split coordinator (a new actor process) starts while the model builds.
    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("validation") if plan.has_validation else None
    import transformers.models.auto.tokenization_auto  # noqa: F401  here: imports racing in two threads can break

    with ThreadPoolExecutor(1, thread_name_prefix="rayft-tokenizer") as pool:
        tokenizer_loading = pool.submit(load_tokenizer, cfg.model)  # overlaps the model build and load
        with profile.stage("model_build_load"):
            state, autocast, window = _build_state(cfg, plan, device)
        with profile.stage("tokenizer"):  # what is left of it once the model is loaded
            tokenizer = tokenizer_loading.result()
    run = RunDir(cfg.run_uri)
    checkpoints = CheckpointManager(run, loop_config.get("run_id"), cfg.ray.name, cfg.ray.checkpoint_upload, rank)
    with profile.stage("resume"):
        resumed = checkpoints.restore(loop_config.get("resume_from"), state, plan, t.gradient_accumulation_steps)
    progress_log = _progress_log(cfg, plan, state, run, resumed, loop_config.get("params", {})) if rank == 0 else None

    objective = Objective(cfg, state.model, device)
    collate = collate_fn(cfg.data, tokenizer.pad_token_id, pairs=objective.dpo)
    evaluate_now = partial(objective.evaluate, val_shard, t.per_device_eval_batch_size, collate, device, autocast)
    cadence = Cadence(t, plan)
    waited = DataWait()
    kept_layers = [] if cfg.fsdp.reshards(plan.world_size) else decoder_layers(state.model)
    train_collate = collate
    if objective.precomputed:
        with profile.stage("reference"):
            keyed = collate_fn(cfg.data, tokenizer.pad_token_id, pairs=True, keys=True)
            table = reference.precompute(state.model, train_shard, cfg, keyed, device, autocast, run, rank)
        train_collate = collate_fn(cfg.data, tokenizer.pad_token_id, pairs=True, reference=table)
    groups = step_groups(train_shard, cfg, plan, state.progress, train_collate, waited, device)
    for group, micro in groups:
        stepped = time.time()
        grad_norm = objective.step(state.model, state.optimizer, state.scheduler, group, window,
                                   world_size=plan.world_size, kept_layers=kept_layers, autocast=autocast,
                                   max_grad_norm=t.max_grad_norm)  # fmt: skip
        if profile is not None:
            profile = _first_step_done(profile, stepped, waited, progress_log)
        progress = state.progress
        progress.step, progress.batches_in_epoch = progress.step + 1, micro + 1
        done = progress.step >= plan.total_steps
        metrics = _window_metrics(window, waited, grad_norm, state.scheduler) if cadence.log(progress) else {}
        if metrics:
            metrics.update(objective.window_metrics())
        if val_shard is not None and cadence.evaluate(progress, micro):
            with window.paused():  # evaluating and saving are not training: out of the window's time
                metrics.update(evaluate_now())
            cadence.last_evaluated = progress.step
        saving = cadence.save(progress, micro)
        if metrics or saving:
            metrics.update(step=progress.step, epoch=_epoch_position(progress, plan))
        if saving:  # metrics reach Ray with checkpoints only: a report without one is a cross-rank barrier
            with window.paused():
                _save(checkpoints, state, metrics, loop_config.get("best_metric"), evaluate_now)
        if progress_log is not None and ("loss" in metrics or "eval_loss" in metrics):
            with window.paused():
                progress_log.record(metrics, checkpoints.stall_s)
        if done:
            break

    if t.save_strategy != "no" and checkpoints.last_saved != state.progress.step:
        final_metrics: dict[str, Any] = {"step": state.progress.step}
        if val_shard is not None and cadence.last_evaluated != state.progress.step:
            final_metrics["eval_loss"] = evaluate_now()["eval_loss"]
        _save(checkpoints, state, final_metrics, loop_config.get("best_metric"), evaluate_now)
    final_dir = Path(t.output_dir) / "final"
    publish_adapter(state.model, final_dir, tokenizer)
    checkpoints.close()
    if progress_log is not None:
        log.info("final adapter written to %s", final_dir)
        progress_log.close()


def eval_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """`rayft eval`: the base model, or base + a trained adapter, scored on one split (token-weighted loss). The
    model is built with the adapter's LoRA shape at its zero-delta init, which is the base exactly: `with_base`
    scores it before the adapter's weights are loaded."""
    cfg = Config.from_dict(loop_config["config"])
    rank = ray.train.get_context().get_world_rank()
    device = ray.train.torch.get_device()
    _setup_logging(rank)
    model = build_model(cfg, device.type == "cuda", device)
    fused_loss(model, cfg)
    objective = Objective(cfg, model, device)
    collate = collate_fn(cfg.data, load_tokenizer(cfg.model).pad_token_id, pairs=objective.dpo)
    shard = ray.train.get_dataset_shard("validation")
    autocast = cpu_autocast(cfg, device)

    def score() -> dict[str, Any]:
        started = time.perf_counter()
        metrics = objective.evaluate(shard, cfg.train.per_device_eval_batch_size, collate, device, autocast)
        return {**metrics, "eval_s": round(time.perf_counter() - started, 3)}

    base = score() if loop_config.get("with_base") else None
    if loop_config.get("adapter"):
        load_adapter_weights(model, Path(loop_config["adapter"]))
    result = score()
    if rank == 0:  # Ray keeps reported metrics only with checkpoints: the driver reads the result from storage
        RunDir(loop_config["run_uri"]).write_file(EVAL_RESULT, json.dumps({**result, "base": base}).encode())
    ray.train.report(result)


def _worker_profile(loop_config: dict[str, Any], entered: float) -> Profile:
    """The driver's stages plus this worker's wait to be started: from the driver's fit() (or, for a restarted
    group, this worker process's own launch, whichever is later) to the loop's first line."""
    profile = Profile.from_dict(loop_config.get("profile"))
    started = max(loop_config.get("fit_started") or entered, process_start_time())
    profile.add("worker_group_start", entered - started)
    return profile


def _first_step_done(profile: Profile, stepped: float, waited, progress_log) -> None:
    """After the first optimizer step: the first batch's wait, the step itself, and (rank 0) the whole profile in
    the log and in metrics.jsonl's first row. Returns None: the profile is done with."""
    profile.add("first_batch", waited.first or 0.0)
    profile.add("first_step", time.time() - stepped)
    if progress_log is not None:
        total = profile.since_origin()
        log.info("%s", profile.line(total))
        progress_log.startup = {**profile.stages, "to_first_step_s": total}
    return None


def _build_state(cfg: Config, plan: Plan, device: torch.device) -> tuple[TrainState, Any, LossWindow]:
    """The sharded LoRA model, its optimizer and schedule at step 0, the autocast context for CPU bf16, and the
    logging window that measures it (FLOPs per token, the device's peak)."""
    on_gpu = device.type == "cuda"
    model = build_model(cfg, on_gpu, device)
    count_fsdp_collectives(model)  # one Python call per collective: always on
    not_fused = fused_loss(model, cfg)
    model.train()
    optimizer = build_optimizer(model, cfg.train, on_gpu)
    scheduler = build_scheduler(optimizer, cfg.train, plan)
    flops = flop_model(model, model.config, cfg.data.max_length)
    peak = peak_flops(device, cfg.train.peak_tflops)
    log.info("%s", measured.flops_line(flops, peak, device, stated=cfg.train.peak_tflops is not None))
    log.info("loss: %s", f"from full logits ({not_fused})" if not_fused else "fused with the LM head, chunked")
    log.info("compute: %s", _precision_line(model, cpu_bf16(cfg, device), on_gpu))
    state = TrainState(model, optimizer, scheduler, Progress(world_size=plan.world_size))
    return state, cpu_autocast(cfg, device), LossWindow(device, plan.world_size, flops, peak)


def _progress_log(cfg: Config, plan: Plan, state: TrainState, run: RunDir, resumed: bool, params) -> ProgressLog:
    """Rank 0's logger, gauges and trackers."""
    trackers = measured.Trackers(cfg.trackers, cfg.train.output_dir, cfg.ray.name, _flat(cfg)) if cfg.trackers else None
    dpo_run = cfg.train.objective == "dpo"
    gauges = measured.Gauges(cfg.ray.name, measured.PREFERENCE_GAUGES if dpo_run else None)
    return ProgressLog(run, plan.total_steps, state.progress.step, resumed, params, gauges, trackers)


class Objective:
    """What the run optimises, `train.objective`: the next-token loss (sft) or a preference loss on pairs (dpo,
    `rayft.train.dpo`). Gives the step its loss, the evaluation (a dict of eval metrics) and the window's extra
    metrics; the step itself is one for both (`rayft.train.step.train_step`)."""

    def __init__(self, cfg: Config, model, device: torch.device):
        self.cfg, self.model, self.dpo = cfg, model, cfg.train.objective == "dpo"
        self.precomputed = self.dpo and cfg.dpo.reference == "precomputed"
        self.sums = None
        self.loss: StepLoss = NEXT_TOKEN
        if self.dpo:
            dpo.enable_sequence_logprobs(model)
            self.sums = dpo.PreferenceSums(device)
            self.loss = dpo.PreferenceLoss(cfg.dpo, self.sums)

    def step(self, model, optimizer, scheduler, group, window: LossWindow, **kwargs) -> torch.Tensor:
        return train_step(model, optimizer, scheduler, group, window, loss=self.loss, **kwargs)

    def evaluate(self, shard, batch_size: int, collate, device, autocast) -> dict[str, Any]:
        if self.dpo:
            return dpo.evaluate(self.model, shard, batch_size, collate, device, autocast, dpo=self.cfg.dpo)
        return _eval_metrics(evaluate(self.model, shard, batch_size, collate, device, autocast))

    def window_metrics(self) -> dict[str, Any]:
        """TRL's reward metrics over the logging window (DPO); the loss itself comes from the LossWindow."""
        if self.sums is None:
            return {}
        return {k: v for k, v in self.sums.take().items() if k != "loss"}


@dataclass
class Cadence:
    """When to log, evaluate and save (the `*_strategy` / `*_steps` settings), judged after each step."""

    train: TrainConfig
    plan: Plan
    last_evaluated: int = -1

    def log(self, progress: Progress) -> bool:
        return progress.step % self.train.logging_steps == 0 or self._done(progress)

    def evaluate(self, progress: Progress, micro: int) -> bool:
        return self._due(self.train.eval_strategy, self.train.eval_steps, progress, micro)

    def save(self, progress: Progress, micro: int) -> bool:
        return self._due(self.train.save_strategy, self.train.save_steps, progress, micro)

    def _done(self, progress: Progress) -> bool:
        return progress.step >= self.plan.total_steps

    def _due(self, strategy: str, every: int, progress: Progress, micro: int) -> bool:
        if strategy == "steps":
            return progress.step % every == 0 or self._done(progress)
        if strategy == "epoch":
            return micro + 1 >= self.plan.micro_batches_per_epoch or self._done(progress)
        return False


def _epoch_position(progress: Progress, plan: Plan) -> float:
    return round(progress.epoch + progress.batches_in_epoch / plan.micro_batches_per_epoch, 4)


def _window_metrics(window: LossWindow, waited: DataWait, grad_norm, scheduler) -> dict[str, Any]:
    """The logging window's training and hardware metrics, and the data pipeline's start-up wait once."""
    metrics = window.take(grad_norm, scheduler, waited.take())
    if (first := waited.take_first()) is not None:
        metrics["first_batch_wait_s"] = round(first, 3)
    return metrics


def _eval_metrics(loss: float) -> dict[str, Any]:
    return {"eval_loss": loss, "eval_perplexity": perplexity(loss)}


def _save(checkpoints: CheckpointManager, state: TrainState, metrics: dict[str, Any], best_metric, evaluate_now):
    """Every checkpoint carries the score Ray ranks it by: evaluated now where this step had none."""
    if best_metric and best_metric not in metrics:
        metrics[best_metric] = evaluate_now()[best_metric]
    checkpoints.save(state, metrics)


def _precision_line(model, bf16_on_cpu: bool, on_gpu: bool) -> str:
    stored = next(p for p in model.parameters() if not p.requires_grad).dtype
    if any(fp8_layers(model)):
        stored = f"{stored} (decoder matrices: float8_e4m3fn + row scales)"
    if on_gpu:
        return f"FSDP2 mixed precision, base weights stored as {stored}"
    compute = "bfloat16 (CPU autocast)" if bf16_on_cpu else "float32"
    return f"matmuls in {compute}, base weights stored as {stored}"


def _flat(cfg: Config) -> dict[str, Any]:
    return {f"{section}.{k}": v for section, values in cfg.to_dict().items() for k, v in values.items()
            if isinstance(v, int | float | str | bool)}  # fmt: skip


def _setup_logging(rank: int) -> None:
    """Progress lines from rank 0 only, so the job log reads as one run rather than N."""
    logging.basicConfig(format="%(asctime)s rayft %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.DEBUG if verbose() and rank == 0 else logging.INFO if rank == 0 else logging.WARNING)
    quiet_worker_rank(rank)
