"""What is measured about a run: the logging window's loss, throughput, model FLOPs utilisation (two ways), memory
and collective bytes, and the progress line; where the numbers then go is `rayft.train.sinks`.

The FLOPs per token that MFU divides by are the model's (`rayft.model.flops`).
"""

from __future__ import annotations

import logging
import math
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rayft.model.flops import FlopModel, mfu
from rayft.parallel.tally import KINDS, TALLIED
from rayft.train.finite import FiniteWatch, found
from rayft.train.sinks import Gauges, Trackers

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from rayft.train.rundir import RunDir

GIB = 2**30


def attended_keys(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Keys the batch's tokens attend under the causal mask, summed on the device: a token at position p of its
    document sees p + 1. Packed rows restart their position ids at every document (and block); padded rows count
    the tokens of their mask; a row with neither is one document."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return (mask.cumsum(-1) * mask).sum()
    positions = batch.get("position_ids")
    if positions is not None:
        return (positions + 1).sum()
    ids = batch["input_ids"]
    n = ids.shape[-1]
    return torch.full((), ids.numel() // n * n * (n + 1) // 2, device=ids.device)


def memory(device: torch.device) -> tuple[float, float, float]:
    """(peak allocated, peak reserved, peak host RSS) in GiB of this process since `reset_peaks` (on Linux; since
    the process started elsewhere); NaN for what does not apply."""
    rss = peak_rss_gib()
    if device.type != "cuda":
        return math.nan, math.nan, rss
    return torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB, rss


def peak_rss_gib() -> float:
    """This process's peak resident memory: VmHWM on Linux (restarted by `reset_peaks`; ru_maxrss would also keep
    the RSS of the process that exec'd this one), ru_maxrss elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / (GIB / 1024)  # kB
    except OSError:
        pass
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kib / (GIB if sys.platform == "darwin" else GIB / 1024)


def reset_peaks(device: torch.device) -> None:
    """Start the peak-memory counts afresh, so a window reports its own peaks rather than the model load's: the
    CUDA allocator's, and on Linux the process's peak RSS (`clear_refs` 5 restarts VmHWM from the current RSS)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the RSS peak stays the whole process's
        pass


def nan_to_none(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


class Stopwatch:
    """Seconds counted while running: the logging window's clock, stopped until training starts and while the loop
    does what is not training (evaluation, checkpoints)."""

    since: float | None  # when the clock started; None while stopped

    def __init__(self) -> None:
        self.total, self.since = 0.0, None

    @property
    def running(self) -> bool:
        return self.since is not None

    def run(self) -> bool:
        """Count from now on; True when the clock was stopped."""
        if self.since is not None:
            return False
        self.since = time.perf_counter()
        return True

    def stop(self) -> None:
        if self.since is not None:
            self.total, self.since = self.total + time.perf_counter() - self.since, None

    def take(self) -> float:
        """The seconds counted so far; counting restarts from zero (running if it was)."""
        now = time.perf_counter()
        elapsed = self.total + (now - self.since if self.since is not None else 0.0)
        self.total, self.since = 0.0, (now if self.since is not None else None)
        return elapsed


class LossWindow:
    """The logging window's sums, kept on the device (no host sync per micro-step): loss over micro-batches,
    optimizer steps, tokens, keys those tokens attended (the attention FLOPs); plus its clock and step count.

    The clock starts with the first training step (`run`), so set-up, resume and the first batch's wait stay out of
    the first window, and stops while the loop evaluates or saves (`paused`): tokens/s, step time and MFU measure
    training alone. Each window's memory peaks are its own (`reset_peaks` where it starts).

    It also watches that each step's loss and gradient norm are finite (`rayft.train.finite`), read with the
    window's own reductions: `non_finite` is the earliest step that was not, as of the last `take`."""

    def __init__(self, device: torch.device, world_size: int, flops: FlopModel, peak: float | None):
        self.device, self.world_size, self.flops, self.peak = device, world_size, flops, peak
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.one, self.zero = (torch.tensor(v, dtype=torch.float64, device=device) for v in (1.0, 0.0))
        self.clock, self.steps = Stopwatch(), 0
        self.moved = dict.fromkeys(TALLIED, 0)  # this rank's collective bytes in the window (host ints, no sync)
        self.finite = FiniteWatch(device)
        self.non_finite: tuple[int, str] | None = None  # (step, what) over all ranks, as of the last `take`

    def run(self) -> None:
        """A training step begins: the first one starts the clock, and the first window's memory peaks."""
        if self.clock.run():
            reset_peaks(self.device)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """What the loop does in here (evaluation, a checkpoint) is not counted in the window's time."""
        running = self.clock.running
        self.clock.stop()
        try:
            yield
        finally:
            if running:
                self.clock.run()

    def add(self, loss: torch.Tensor, last_of_step: bool, tokens: torch.Tensor, keys: torch.Tensor) -> None:
        """One micro-batch: its loss, its tokens and the keys they attended (`attended_keys`)."""
        step = self.one if last_of_step else self.zero
        self.sums += torch.stack([loss.double(), step, tokens.double(), keys.double()])
        self.steps += last_of_step

    def note_step(self, step: int, grad_norm: torch.Tensor) -> None:
        """Optimizer step `step` is done (its micro-batches `add`ed): whether its loss and gradient norm are finite,
        on the device. The window's loss sum stands for the step's: it stays non-finite from a non-finite term on."""
        self.finite.note(step, self.sums[0], grad_norm)

    def add_moved(self, moved: dict[str, int]) -> None:
        """One optimizer step's collective bytes (`rayft.parallel.tally.TALLY.take()`)."""
        for kind, nbytes in moved.items():
            self.moved[kind] += nbytes

    def take(self, grad_norm: torch.Tensor, scheduler: LRScheduler, data_wait_s: float) -> dict[str, Any]:
        """Window means over all ranks (the loss per target token of each step, tokens/s of the whole group,
        seconds per step, the share of the window the slowest rank spent waiting for data, the bytes collectives
        moved into a rank per step by kind), the hardware's metrics; then a new window."""
        elapsed = self.clock.take()
        moved = torch.tensor([self.moved[kind] for kind in TALLIED], dtype=torch.float64, device=self.device)
        totals = torch.cat([self.sums, moved])
        dist.all_reduce(totals)
        waits = torch.cat([self.sums.new_tensor([data_wait_s]), self.finite.for_max()])
        dist.all_reduce(waits, op=dist.ReduceOp.MAX)
        data_wait, *negated = waits.tolist()
        self.non_finite = found([-v for v in negated])
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        steps = self.steps
        self.sums.zero_()
        self.steps = 0
        self.moved = dict.fromkeys(TALLIED, 0)
        metrics: dict[str, Any] = {
            "loss": totals[0].item() / max(totals[1].item(), 1),
            "learning_rate": scheduler.get_last_lr()[0],
            "grad_norm": norm.item(),
            "tokens_per_s": totals[2].item() / elapsed if elapsed > 0 else 0.0,
            "step_time_s": elapsed / max(steps, 1),
            "data_wait_share": data_wait / elapsed if elapsed > 0 else 0.0,
            **moved_per_step(totals[4:].tolist(), self.world_size, steps),
        }
        keys_per_token = totals[3].item() / totals[2].item() if totals[2].item() > 0 else None
        metrics.update(
            hardware_metrics(
                metrics["tokens_per_s"], self.world_size, self.flops, self.peak, self.device, keys_per_token
            )
        )
        reset_peaks(self.device)  # the next window's peaks are its own
        return metrics


def moved_per_step(summed: list[float], world: int, steps: int) -> dict[str, float]:
    """Bytes each worker received per optimizer step by collective kind, in all and over the network between
    nodes, from the window's sums over all workers (`TALLIED` order)."""
    per_step = {
        f"comm_{kind}_bytes": total / world / max(steps, 1) for kind, total in zip(TALLIED, summed, strict=True)
    }
    return {**per_step, "comm_bytes": sum(per_step[f"comm_{kind}_bytes"] for kind in KINDS)}


def hardware_metrics(
    tokens_per_s: float,
    world: int,
    flops: FlopModel,
    peak: float | None,
    device: torch.device,
    keys_per_token: float | None = None,
) -> dict[str, Any]:
    """Per-worker throughput, the FLOPs per token the MFUs count (attention over `keys_per_token` keys, the
    window's measured mean; full-length documents without one), both MFUs (null without a known GPU peak) and peak
    memory of the worst rank."""
    per_worker = tokens_per_s / world
    per_token = {k: flops.per_token(k == "lora", keys_per_token) for k in ("6n", "lora")}
    worst = torch.tensor([-1.0 if math.isnan(v) else v for v in memory(device)], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    allocated, reserved, rss = (None if v < 0 else round(v, 3) for v in worst.tolist())
    return {
        "tokens_per_s_per_worker": per_worker,
        "flops_per_token_6n": per_token["6n"],
        "flops_per_token_lora": per_token["lora"],
        "mfu_6n": nan_to_none(mfu(per_worker, per_token["6n"], peak)),
        "mfu_lora": nan_to_none(mfu(per_worker, per_token["lora"], peak)),
        "peak_tflops": peak / 1e12 if peak else None,
        "memory_allocated_gib": allocated,
        "memory_reserved_gib": reserved,
        "host_rss_gib": rss,
    }


def perplexity(loss: float) -> float | None:
    """exp(loss); None where it is not a finite number (NaN loss of an empty split, or overflow)."""
    return math.exp(loss) if math.isfinite(loss) and loss < 700 else None


def flops_line(flops: FlopModel, peak: float | None, device: torch.device, stated: bool = False) -> str:
    if stated:
        assert peak is not None  # the stated peak (train.peak_tflops) is the peak
        where = f"peak {peak / 1e12:g} TFLOP/s per worker (train.peak_tflops)"
    elif peak:
        where = f"peak {peak / 1e12:.0f} TFLOP/s bf16 per GPU"
    else:
        where = f"no MFU on {device.type} (no known peak; train.peak_tflops states one)"
    return (
        f"FLOPs/token: {flops.per_token_6n / 1e9:.3f} G (6N), {flops.per_token_lora / 1e9:.3f} G (LoRA-aware) | "
        f"{flops.base_params:,} frozen + {flops.lora_params:,} trainable matmul params per token | {where}"
    )


class ProgressLog:
    """Rank 0's record of the run at each logging step: one log line, a metrics.jsonl row (the history of the
    run, cut back to the resume point), the Prometheus gauges and the trackers."""

    def __init__(
        self,
        run: RunDir,
        total_steps: int,
        first_step: int,
        resumed: bool,
        params: dict[str, Any],
        gauges: Gauges | None,
        trackers: Trackers | None,
        resumed_row: dict[str, Any] | None = None,
    ):
        """`resumed_row`: the metrics this run reported with the checkpoint it continues from. A worker stopped
        after that checkpoint was registered but before its row reached metrics.jsonl would otherwise leave the
        step out of the history for good."""
        self.run, self.total_steps, self.first_step, self.params = run, total_steps, first_step, params
        self.gauges, self.trackers = gauges, trackers
        self.history = [r for r in run.read_metrics() if r.get("step", 0) <= first_step] if resumed else []
        written = {r.get("step") for r in self.history}
        if resumed_row is not None and resumed_row.get("step") == first_step and first_step not in written:
            self.history.append(resumed_row)
        self.started = time.perf_counter()
        self.startup: dict[str, float] | None = None  # the start-up profile: goes into the next row written

    def record(self, metrics: dict[str, Any], checkpoint_stall_s: float) -> None:
        elapsed = time.perf_counter() - self.started
        done = metrics["step"] - self.first_step
        eta = elapsed / done * (self.total_steps - metrics["step"]) if done else None
        logging.getLogger("rayft").info(progress_line(metrics, self.total_steps, eta))
        # What saving cost so far in this attempt: the share of wall time training stood still.
        row = {
            **metrics,
            **self.params,
            "checkpoint_stall_s": round(checkpoint_stall_s, 4),
            "elapsed_s": round(elapsed, 3),
            "time": round(time.time(), 3),
        }
        if self.startup is not None:
            row["startup"], self.startup = self.startup, None
        self.history.append(row)
        self.run.write_metrics(self.history)
        if self.gauges is not None:
            self.gauges.set(row)
        if self.trackers is not None:
            self.trackers.log(row, metrics["step"])

    def close(self, failed: bool = False) -> None:
        if self.trackers is not None:
            self.trackers.close(failed)


_LINE_FIELDS = (
    ("loss", "loss", "{:.4f}"),
    ("eval_loss", "eval_loss", "{:.4f}"),
    ("eval_perplexity", "ppl", "{:.2f}"),
    ("learning_rate", "lr", "{:.2e}"),
    ("grad_norm", "grad_norm", "{:.3f}"),
    *(
        (name, name, "{:.4f}")
        for name in (
            "rewards/margins",
            "rewards/accuracies",
            "rewards/chosen",
            "rewards/rejected",
            "logps/chosen",
            "logps/rejected",
            "eval_rewards/margins",
            "eval_rewards/accuracies",
        )
    ),
    ("tokens_per_s", "tok/s", "{:,.0f}"),
    ("step_time_s", "step", "{:.2f}s"),
    ("mfu_lora", "MFU(LoRA)", "{:.1%}"),
    ("mfu_6n", "MFU(6N)", "{:.1%}"),
    ("data_wait_share", "data wait", "{:.1%}"),
)


def progress_line(metrics: dict[str, Any], total_steps: int, eta_s: float | None) -> str:
    """One line per logging step: where the run is, how well it learns, how fast, how full, how long still."""
    parts = [f"step {metrics['step']}/{total_steps}", f"epoch {metrics['epoch']:.2f}"]
    parts += [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in _LINE_FIELDS if metrics.get(key) is not None]
    if metrics.get("memory_allocated_gib") is not None:
        parts.append(f"mem {metrics['memory_allocated_gib']:.1f}/{metrics['memory_reserved_gib']:.1f} GiB")
    elif metrics.get("host_rss_gib") is not None:
        parts.append(f"rss {metrics['host_rss_gib']:.2f} GiB")
    if eta_s is not None:
        parts.append(f"ETA {duration(eta_s)}")
    return " | ".join(parts)


def duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )
