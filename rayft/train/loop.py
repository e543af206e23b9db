"""The training loop each Ray Train worker runs: one readable function from config to final adapter."""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import CheckpointUploadMode

from rayft.config import Config
from rayft.data.pipeline import collate_fn
from rayft.data.tokenizer import load_tokenizer
from rayft.model.build import build_model, cpu_autocast, cpu_bf16, decoder_layers, fused_loss, set_gradient_sync
from rayft.train.checkpoint import Progress, load_adapter_weights, load_checkpoint, save_adapter, save_checkpoint
from rayft.train.metrics import Gauges, Trackers, flop_model, memory, mfu, nan_to_none, peak_flops
from rayft.train.rundir import EVAL_RESULT, RunDir, checkpoint_dir_name
from rayft.train.schedule import Plan, build_optimizer, build_scheduler

log = logging.getLogger("rayft")


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    cfg = Config.from_dict(loop_config["config"])
    plan = Plan(**loop_config["plan"])
    t = cfg.train
    context = ray.train.get_context()
    rank = context.get_world_rank()
    device = ray.train.torch.get_device()
    on_gpu = device.type == "cuda"
    _setup_logging(rank)
    torch.manual_seed(t.seed)
    run = RunDir(cfg.run_uri)
    spool = _checkpoint_spool(cfg.ray.name, rank, clean=context.get_local_rank() == 0)

    tokenizer = load_tokenizer(cfg.model)
    model = build_model(cfg, on_gpu, device)
    not_fused = fused_loss(model, cfg)
    autocast = cpu_autocast(cfg, device)
    model.train()
    optimizer = build_optimizer(model, t, on_gpu)
    scheduler = build_scheduler(optimizer, t, plan)
    flops, peak = flop_model(model, model.config, cfg.data.max_length), peak_flops(device)
    params = loop_config.get("params", {})
    if rank == 0:
        log.info("%s", _flops_line(flops, peak, device))
        log.info("loss: %s", f"from full logits ({not_fused})" if not_fused else "fused with the LM head, chunked")
        log.info("compute: %s", _precision_line(model, cpu_bf16(cfg, device), on_gpu))
    gauges = Gauges(cfg.ray.name) if rank == 0 else None
    trackers = Trackers(cfg.trackers, t.output_dir, cfg.ray.name, _flat(cfg)) if rank == 0 and cfg.trackers else None

    progress, history = _resume(
        loop_config.get("resume_from"), run, model, optimizer, scheduler, plan, t.gradient_accumulation_steps, rank
    )

    collate = collate_fn(cfg.data, tokenizer.pad_token_id)
    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("validation") if plan.has_validation else None
    evaluate_now = partial(evaluate, model, val_shard, t.per_device_eval_batch_size, collate, device, autocast)
    best_metric = loop_config.get("best_metric")

    started, saving_s = time.perf_counter(), 0.0

    def save(metrics: dict[str, Any]) -> None:
        nonlocal saving_s
        if best_metric and best_metric not in metrics:  # every checkpoint must carry its score
            metrics[best_metric] = evaluate_now()
        saving_s += _report_with_checkpoint(
            model, optimizer, scheduler, progress, metrics, spool, cfg.ray.checkpoint_upload
        )

    first_step = progress.step

    def record(metrics: dict[str, Any]) -> None:
        if rank != 0:
            return
        elapsed = time.perf_counter() - started
        done = metrics["step"] - first_step
        eta = elapsed / done * (plan.total_steps - metrics["step"]) if done else None
        _log_progress(metrics, plan, eta)
        # What saving cost so far in this attempt: the share of wall time training stood still.
        row = {**metrics, **params, "checkpoint_stall_s": round(saving_s, 4), "elapsed_s": round(elapsed, 3),
               "time": round(time.time(), 3)}  # fmt: skip
        history.append(row)
        run.write_metrics(history)
        gauges.set(row)
        if trackers is not None:
            trackers.log(row, metrics["step"])

    # loss sum over micro-batches, micro-batches, tokens; stays on the device (no host sync per micro-step)
    window = torch.zeros(3, dtype=torch.float64, device=device)
    window_start, window_steps = time.perf_counter(), 0
    waited = DataWait()
    # A resumed run's starting point is a checkpoint already: never write (and register) it a second time.
    last_saved, last_evaluated = progress.step, -1
    accum = t.gradient_accumulation_steps
    kept_layers = [] if cfg.fsdp.reshards(plan.world_size) else decoder_layers(model)
    one, zero = (torch.tensor(v, dtype=torch.float64, device=device) for v in (1.0, 0.0))
    while progress.step < plan.total_steps:
        skip = progress.batches_in_epoch
        batches = epoch_batches(train_shard, cfg, plan, progress.epoch, skip, collate)
        group: list[dict[str, torch.Tensor]] = []  # the micro-batches of the step being assembled
        for micro, batch in enumerate(waited(batches), start=skip):
            group_start = micro - micro % accum
            group.append({k: v.to(device, non_blocking=True) for k, v in batch.items()})
            if len(group) < min(accum, plan.micro_batches_per_epoch - group_start):
                continue
            # Every target token of the step weighs the same, on every rank and in every micro-batch (as in
            # transformers' Trainer): each loss is a sum over its tokens divided by the step's count per rank.
            per_rank = _step_targets(group, plan.world_size)
            for i, batch in enumerate(group):
                set_gradient_sync(model, i == len(group) - 1, kept_layers)
                with autocast():
                    loss = model(**batch, num_items_in_batch=per_rank).loss
                loss.backward()
                mask = batch.get("attention_mask")  # none in padding-free batches: every token counts
                tokens = mask.sum() if mask is not None else torch.full((), batch["input_ids"].numel(), device=device)
                window += torch.stack([loss.detach().double(), one if i == len(group) - 1 else zero, tokens.double()])
            group = []

            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], t.max_grad_norm
            )
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            progress.step += 1
            window_steps += 1
            progress.batches_in_epoch = micro + 1
            step, done = progress.step, progress.step >= plan.total_steps

            metrics: dict[str, Any] = {}
            if step % t.logging_steps == 0 or done:
                metrics = _train_metrics(window, window_start, window_steps, grad_norm, scheduler, waited.take())
                metrics.update(_hardware_metrics(metrics["tokens_per_s"], plan.world_size, flops, peak, device))
                if (first := waited.take_first()) is not None:
                    metrics["first_batch_wait_s"] = round(first, 3)
                window.zero_()
                window_start, window_steps = time.perf_counter(), 0
            if val_shard is not None and _due(t.eval_strategy, t.eval_steps, step, done, micro, plan):
                metrics["eval_loss"] = evaluate_now()
                metrics["eval_perplexity"] = _perplexity(metrics["eval_loss"])
                last_evaluated = step
            saving = _due(t.save_strategy, t.save_steps, step, done, micro, plan)
            if metrics or saving:
                metrics.update(step=step, epoch=round(progress.epoch + (micro + 1) / plan.micro_batches_per_epoch, 4))
            if saving:  # metrics reach Ray with checkpoints only: a report without one is a cross-rank barrier
                save(metrics)  # through an actor (about a second on a busy machine) that keeps nothing
                last_saved = step
            if "loss" in metrics or "eval_loss" in metrics:
                record(metrics)
            if done:
                break
        else:
            progress.epoch += 1
            progress.batches_in_epoch = 0

    if t.save_strategy != "no" and last_saved != progress.step:
        final_metrics: dict[str, Any] = {"step": progress.step}
        if val_shard is not None and last_evaluated != progress.step:
            final_metrics["eval_loss"] = evaluate_now()
        save(final_metrics)
    final_dir = Path(t.output_dir) / "final"
    save_adapter(model, final_dir, tokenizer)
    if rank == 0:
        log.info("final adapter written to %s", final_dir)
    if trackers is not None:
        trackers.close()


def eval_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """`rayft eval`: the base model, or base + a trained adapter, scored on one split (token-weighted loss)."""
    cfg = Config.from_dict(loop_config["config"])
    rank = ray.train.get_context().get_world_rank()
    device = ray.train.torch.get_device()
    _setup_logging(rank)
    model = build_model(cfg, device.type == "cuda", device)
    fused_loss(model, cfg)
    if loop_config.get("adapter"):
        load_adapter_weights(model, Path(loop_config["adapter"]))
    collate = collate_fn(cfg.data, load_tokenizer(cfg.model).pad_token_id)
    shard = ray.train.get_dataset_shard("validation")
    started = time.perf_counter()
    loss = evaluate(model, shard, cfg.train.per_device_eval_batch_size, collate, device, cpu_autocast(cfg, device))
    result = {
        "eval_loss": loss,
        "eval_perplexity": _perplexity(loss),
        "eval_s": round(time.perf_counter() - started, 3),
    }
    if rank == 0:  # Ray keeps reported metrics only with checkpoints: the driver reads the result from storage
        RunDir(loop_config["run_uri"]).write_file(EVAL_RESULT, json.dumps(result).encode())
    ray.train.report(result)


def _resume(
    explicit: str | None, run: RunDir, model, optimizer, scheduler, plan: Plan, accum: int, rank: int
) -> tuple[Progress, list[dict[str, Any]]]:
    """Continue from this run's latest registered checkpoint (a restart after a failure, or the same job run
    again), else from `train.resume_from_checkpoint`, else start fresh. Returns the progress and, on rank 0,
    the metrics history up to it."""
    own = ray.train.get_checkpoint()
    checkpoint = own or (ray.train.Checkpoint(explicit) if explicit else None)
    progress = Progress(world_size=plan.world_size)
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            progress = load_checkpoint(Path(d), model, optimizer, scheduler)
        log.info(
            "resumed from %s: step %d, epoch %d, %d batches into the epoch (written by %d workers)",
            checkpoint.path,
            progress.step,
            progress.epoch,
            progress.batches_in_epoch,
            progress.world_size,
        )
        progress = _remap_position(progress, plan, accum)
    if rank != 0:
        return progress, []
    # Checkpoint dirs newer than the resume point (all of them on a fresh start) were never registered:
    # a worker died while saving them. Nothing can resume from them; they would only fill the volume.
    keep = frozenset({Path(explicit).name}) if explicit and own is None else frozenset()
    for name in run.remove_checkpoints_after(progress.step if own else -1, keep):
        log.warning("removed %s/%s: written by an attempt that failed before Ray registered it", run.uri, name)
    history = [row for row in run.read_metrics() if row.get("step", 0) <= progress.step] if checkpoint else []
    return progress, history


def _remap_position(progress: Progress, plan: Plan, accum: int) -> Progress:
    """Express the data position for this run's world size and epoch length."""
    if progress.world_size != plan.world_size:
        consumed = progress.batches_in_epoch * progress.world_size // plan.world_size
        log.warning(
            "checkpoint written by %d workers, resuming on %d: continuing after ~%d of %d batches of epoch %d "
            "(same data share; not bit-identical to an uninterrupted run)",
            progress.world_size,
            plan.world_size,
            consumed,
            plan.micro_batches_per_epoch,
            progress.epoch,
        )
        progress.batches_in_epoch = consumed - consumed % accum
        progress.world_size = plan.world_size
    if progress.batches_in_epoch >= plan.micro_batches_per_epoch:
        progress.epoch += 1
        progress.batches_in_epoch = 0
    return progress


def epoch_batches(shard, cfg: Config, plan: Plan, epoch: int, skip: int, collate) -> Iterator[Any]:
    """One epoch of this rank's micro-batches, reshuffled per epoch (seeded, so a rerun sees the same order).

    A resumed epoch replays the same stream and skips what was already trained on. Every rank gets the same
    number of batches (equal split), and never more than the plan counted, so all ranks leave the epoch at the
    same micro-step and no collective waits on a rank that has run out.
    """
    batches = shard.iter_torch_batches(
        batch_size=cfg.train.per_device_train_batch_size,
        collate_fn=collate,
        local_shuffle_buffer_size=cfg.data.shuffle_buffer_size or None,
        local_shuffle_seed=cfg.train.seed + epoch,
    )
    return islice(batches, skip, plan.micro_batches_per_epoch)


class DataWait:
    """Seconds the loop spent waiting for its next batch since the last `take()`. The wait for the very first
    batch is the pipeline's start-up, kept apart until `take_first()`."""

    def __init__(self):
        self.seconds = 0.0
        self.started = False
        self.first: float | None = None

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        while True:
            started = time.perf_counter()
            batch = next(batches, None)
            waited = time.perf_counter() - started
            if batch is None:
                self.seconds += waited
                return
            if self.started:
                self.seconds += waited
            else:
                self.started, self.first = True, waited
                log.info("first batch after %.1f s (data pipeline start-up)", waited)
            yield batch

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def take_first(self) -> float | None:
        first, self.first = self.first, None
        return first


@torch.no_grad()
def evaluate(
    model, shard, batch_size: int, collate, device: torch.device, autocast: Callable[[], Any] = nullcontext
) -> float:
    """Token-weighted mean loss over every rank's validation shard."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in shard.iter_torch_batches(batch_size=batch_size, collate_fn=collate):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        predicted = _targets(batch)
        with autocast():
            loss = model(**batch).loss
        totals += torch.stack([loss.double() * predicted, predicted.double()])
    model.reshard()  # no backward follows: free the root's gathered weights now
    model.train()
    dist.all_reduce(totals)
    return totals[0].item() / totals[1].item() if totals[1] > 0 else math.nan


def _due(strategy: str, every: int, step: int, done: bool, micro: int, plan: Plan) -> bool:
    if strategy == "steps":
        return step % every == 0 or done
    if strategy == "epoch":
        return micro + 1 >= plan.micro_batches_per_epoch or done
    return False


def _targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tokens a batch is scored on: labels other than -100 after the one-position shift."""
    return (batch["labels"][..., 1:] != -100).sum()


def _step_targets(group: list[dict[str, torch.Tensor]], world_size: int) -> torch.Tensor:
    """Next-token targets in this step's micro-batches over all ranks, divided by the ranks (FSDP averages the
    gradients over them); one small all-reduce per step, no host sync."""
    count = sum(_targets(batch) for batch in group).double()
    dist.all_reduce(count)
    return (count / world_size).clamp_min(1.0)


def _train_metrics(window, started: float, steps: int, grad_norm, scheduler, data_wait_s: float) -> dict[str, Any]:
    """Window means over all ranks: the loss per target token of each step, tokens/s of the whole group, seconds
    per step, and the share of the window the slowest rank spent waiting for data."""
    elapsed = time.perf_counter() - started
    totals = window.clone()
    dist.all_reduce(totals)
    waits = window.new_tensor([data_wait_s])
    dist.all_reduce(waits, op=dist.ReduceOp.MAX)
    norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    return {
        "loss": totals[0].item() / max(totals[1].item(), 1),
        "learning_rate": scheduler.get_last_lr()[0],
        "grad_norm": norm.item(),
        "tokens_per_s": totals[2].item() / elapsed if elapsed > 0 else 0.0,
        "step_time_s": elapsed / max(steps, 1),
        "data_wait_share": waits.item() / elapsed if elapsed > 0 else 0.0,
    }


def _hardware_metrics(tokens_per_s: float, world: int, flops, peak: float | None, device) -> dict[str, Any]:
    """Per-worker throughput, both MFUs (null without a known GPU peak) and peak memory of the worst rank."""
    per_worker = tokens_per_s / world
    worst = torch.tensor([-1.0 if math.isnan(v) else v for v in memory(device)], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    allocated, reserved, rss = (None if v < 0 else round(v, 3) for v in worst.tolist())
    return {
        "tokens_per_s_per_worker": per_worker,
        "mfu_6n": nan_to_none(mfu(per_worker, flops.per_token_6n, peak)),
        "mfu_lora": nan_to_none(mfu(per_worker, flops.per_token_lora, peak)),
        "peak_tflops": peak / 1e12 if peak else None,
        "memory_allocated_gib": allocated,
        "memory_reserved_gib": reserved,
        "host_rss_gib": rss,
    }


def _perplexity(loss: float) -> float | None:
    return math.exp(loss) if math.isfinite(loss) and loss < 700 else None


def _precision_line(model, bf16_on_cpu: bool, on_gpu: bool) -> str:
    stored = next(p for p in model.parameters() if not p.requires_grad).dtype
    if on_gpu:
        return f"FSDP2 mixed precision, base weights stored as {stored}"
    compute = "bfloat16 (CPU autocast)" if bf16_on_cpu else "float32"
    return f"matmuls in {compute}, base weights stored as {stored}"


def _flops_line(flops, peak: float | None, device) -> str:
    where = f"peak {peak / 1e12:.0f} TFLOP/s bf16 per GPU" if peak else f"no MFU on {device.type} (no known peak)"
    return (
        f"FLOPs/token: {flops.per_token_6n / 1e9:.3f} G (6N), {flops.per_token_lora / 1e9:.3f} G (LoRA-aware) | "
        f"{flops.base_params:,} frozen + {flops.lora_params:,} trainable matmul params per token | {where}"
    )


def _flat(cfg: Config) -> dict[str, Any]:
    return {f"{section}.{k}": v for section, values in cfg.to_dict().items() for k, v in values.items()
            if isinstance(v, int | float | str | bool)}  # fmt: skip


def _report_with_checkpoint(
    model, optimizer, scheduler, progress: Progress, metrics: dict[str, Any], spool: Path, upload: str
) -> float:
    """Every rank writes its shards to local disk, then Ray copies them into one step-named dir on storage.

    Ray registers the checkpoint (for retention and resume) only once every rank's copy finished, so a crash
    mid-save leaves the previous checkpoint in charge. With async upload training goes on during the copy.
    Returns the seconds training stood still.
    """
    started = time.perf_counter()
    name = checkpoint_dir_name(progress.step)
    local = spool / name
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    save_checkpoint(local, model, optimizer, scheduler, progress, metrics)
    written = time.perf_counter() - started
    ray.train.report(
        dict(metrics),
        checkpoint=ray.train.Checkpoint.from_directory(str(local)),
        checkpoint_dir_name=name,
        checkpoint_upload_mode=CheckpointUploadMode.ASYNC if upload == "async" else CheckpointUploadMode.SYNC,
        delete_local_checkpoint_after_upload=True,
    )
    stalled = time.perf_counter() - started
    log.info("%s: training paused %.2f s (state written in %.2f s, %s upload)", name, stalled, written, upload)
    return stalled


def _checkpoint_spool(run_name: str, rank: int, clean: bool) -> Path:
    """Local staging dir for this rank's checkpoint shards. A killed worker leaves its half-written ones
    behind: the first worker on each node clears the run's leftovers before anyone saves again."""
    root = Path(tempfile.gettempdir()) / "rayft-checkpoints"
    if clean:
        for stale in root.glob(f"{run_name}-rank*"):
            shutil.rmtree(stale, ignore_errors=True)
    spool = root / f"{run_name}-rank{rank}"
    spool.mkdir(parents=True, exist_ok=True)
    return spool


def _log_progress(metrics: dict[str, Any], plan: Plan, eta_s: float | None) -> None:
    """One line per logging step: where the run is, how well it learns, how fast, how full, how long still."""
    parts = [f"step {metrics['step']}/{plan.total_steps}", f"epoch {metrics['epoch']:.2f}"]
    for key, label, fmt in (
        ("loss", "loss", "{:.4f}"),
        ("eval_loss", "eval_loss", "{:.4f}"),
        ("eval_perplexity", "ppl", "{:.2f}"),
        ("learning_rate", "lr", "{:.2e}"),
        ("grad_norm", "grad_norm", "{:.3f}"),
        ("tokens_per_s", "tok/s", "{:,.0f}"),
        ("step_time_s", "step", "{:.2f}s"),
        ("mfu_lora", "MFU(LoRA)", "{:.1%}"),
        ("mfu_6n", "MFU(6N)", "{:.1%}"),
        ("data_wait_share", "data wait", "{:.1%}"),
    ):
        if metrics.get(key) is not None:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    if metrics.get("memory_allocated_gib") is not None:
        parts.append(f"mem {metrics['memory_allocated_gib']:.1f}/{metrics['memory_reserved_gib']:.1f} GiB")
    elif metrics.get("host_rss_gib") is not None:
        parts.append(f"rss {metrics['host_rss_gib']:.2f} GiB")
    if eta_s is not None:
        parts.append(f"ETA {_duration(eta_s)}")
    log.info(" | ".join(parts))


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def _setup_logging(rank: int) -> None:
    """Progress lines from rank 0 only, so the job log reads as one run rather than N."""
    logging.basicConfig(format="%(asctime)s rayft %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
