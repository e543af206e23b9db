"""The training loop each Ray Train worker runs: one readable function from config to final adapter."""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from rayft.checkpoint import Progress, load_checkpoint, save_adapter, save_checkpoint
from rayft.config import Config
from rayft.data import PadCollate
from rayft.model import build_model, parameter_counts
from rayft.schedule import Plan, build_optimizer, build_scheduler
from rayft.tokenizer import load_tokenizer

log = logging.getLogger("rayft")


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    cfg = Config.from_dict(loop_config["config"])
    plan = Plan(**loop_config["plan"])
    t = cfg.train
    rank = ray.train.get_context().get_world_rank()
    device = ray.train.torch.get_device()
    on_gpu = device.type == "cuda"
    _setup_logging(rank)
    torch.manual_seed(t.seed)

    tokenizer = load_tokenizer(cfg.model)
    model = build_model(cfg, on_gpu, device)
    model.train()
    optimizer = build_optimizer(model, t, on_gpu)
    scheduler = build_scheduler(optimizer, t, plan)
    trainable, total = parameter_counts(model)
    log.info(
        "world %d | trainable params %s / %s (%.3f%%) | %d steps (%d per epoch), warmup %d | "
        "effective batch %d = %d per device x %d accumulation x %d workers",
        plan.world_size,
        f"{trainable:,}",
        f"{total:,}",
        100 * trainable / total,
        plan.total_steps,
        plan.steps_per_epoch,
        plan.warmup_steps,
        t.per_device_train_batch_size * t.gradient_accumulation_steps * plan.world_size,
        t.per_device_train_batch_size,
        t.gradient_accumulation_steps,
        plan.world_size,
    )

    progress = Progress()
    resume_from = ray.train.get_checkpoint()
    if resume_from is not None:
        with resume_from.as_directory() as d:
            progress = load_checkpoint(Path(d), model, optimizer, scheduler)
        log.info("resumed from %s at step %d (epoch %d)", resume_from.path, progress.step, progress.epoch)

    pad_id = tokenizer.pad_token_id
    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("validation") if plan.has_validation else None
    evaluate_now = partial(evaluate, model, val_shard, t.per_device_eval_batch_size, pad_id, device)

    # loss sum over micro-batches, micro-batches, tokens; stays on the device (no host sync per micro-step)
    window = torch.zeros(3, dtype=torch.float64, device=device)
    window_start = time.perf_counter()
    last_saved = last_evaluated = -1
    accum = t.gradient_accumulation_steps
    one = torch.ones((), dtype=torch.float64, device=device)
    while progress.step < plan.total_steps:
        batches = train_shard.iter_torch_batches(
            batch_size=t.per_device_train_batch_size,
            collate_fn=PadCollate(pad_id),
            local_shuffle_buffer_size=cfg.data.shuffle_buffer_size or None,
            local_shuffle_seed=t.seed + progress.epoch,
        )
        for micro, batch in enumerate(batches):
            group_start = micro - micro % accum
            in_group = min(accum, plan.micro_batches_per_epoch - group_start)
            closes_group = micro - group_start + 1 == in_group
            model.set_requires_gradient_sync(closes_group)
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            (loss / in_group).backward()
            window += torch.stack([loss.detach().double(), one, batch["attention_mask"].sum().double()])
            if not closes_group:
                continue

            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], t.max_grad_norm
            )
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            progress.step += 1
            step, done = progress.step, progress.step >= plan.total_steps

            metrics: dict[str, Any] = {}
            if step % t.logging_steps == 0 or done:
                metrics = _train_metrics(window, window_start, grad_norm, scheduler)
                window.zero_()
                window_start = time.perf_counter()
            if val_shard is not None and _due(t.eval_strategy, t.eval_steps, step, done, micro, plan):
                metrics["eval_loss"] = evaluate_now()
                last_evaluated = step
            if metrics:
                metrics.update(step=step, epoch=round(progress.epoch + (micro + 1) / plan.micro_batches_per_epoch, 4))
                _log_progress(metrics, plan)
            if _due(t.save_strategy, t.save_steps, step, done, micro, plan):
                _report_with_checkpoint(model, optimizer, scheduler, progress, metrics)
                last_saved = step
            elif metrics:
                ray.train.report(metrics)
            if done:
                break
        else:
            progress.epoch += 1

    final_metrics: dict[str, Any] = {"step": progress.step}
    if val_shard is not None and last_evaluated != progress.step:
        final_metrics["eval_loss"] = evaluate_now()
    if t.save_strategy != "no" and last_saved != progress.step:
        _report_with_checkpoint(model, optimizer, scheduler, progress, final_metrics)
    final_dir = Path(t.output_dir) / "final"
    save_adapter(model, final_dir, tokenizer)
    if rank == 0:
        log.info("final adapter written to %s", final_dir)


@torch.no_grad()
def evaluate(model, shard, batch_size: int, pad_id: int, device: torch.device) -> float:
    """Token-weighted mean loss over every rank's validation shard."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in shard.iter_torch_batches(batch_size=batch_size, collate_fn=PadCollate(pad_id)):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        predicted = (batch["labels"][:, 1:] != -100).sum()
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


def _train_metrics(window, started: float, grad_norm, scheduler) -> dict[str, Any]:
    """Window means over all ranks: loss per micro-batch, tokens/s of the whole group."""
    totals = window.clone()
    dist.all_reduce(totals)
    elapsed = time.perf_counter() - started
    norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    return {
        "loss": totals[0].item() / max(totals[1].item(), 1),
        "learning_rate": scheduler.get_last_lr()[0],
        "grad_norm": norm.item(),
        "tokens_per_s": totals[2].item() / elapsed if elapsed > 0 else 0.0,
    }


def _report_with_checkpoint(model, optimizer, scheduler, progress: Progress, metrics: dict[str, Any]) -> None:
    """Each rank writes its shards to a local dir; Ray publishes the checkpoint once every rank reported."""
    local = Path(tempfile.mkdtemp(prefix="rayft-ckpt-"))
    try:
        save_checkpoint(local, model, optimizer, scheduler, progress, metrics)
        ray.train.report(
            {**metrics, "step": progress.step},
            checkpoint=ray.train.Checkpoint.from_directory(str(local)),
            checkpoint_dir_name=f"checkpoint-{progress.step:06d}",
        )
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _log_progress(metrics: dict[str, Any], plan: Plan) -> None:
    parts = [f"step {metrics['step']}/{plan.total_steps}", f"epoch {metrics['epoch']:.2f}"]
    for key, fmt in (
        ("loss", "{:.4f}"),
        ("eval_loss", "{:.4f}"),
        ("learning_rate", "{:.2e}"),
        ("grad_norm", "{:.3f}"),
        ("tokens_per_s", "{:.0f}"),
    ):
        if key in metrics:
            parts.append(f"{key} {fmt.format(metrics[key])}")
    log.info(" | ".join(parts))


def _setup_logging(rank: int) -> None:
    """Progress lines from rank 0 only, so the job log reads as one run rather than N."""
    logging.basicConfig(format="%(asctime)s rayft %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
