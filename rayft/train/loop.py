"""The training loop each Ray Train worker runs: the story of a run from config to final adapter. The parts live
beside it: one optimizer step and evaluation (step.py), checkpoints and resume (checkpoint.py), what is measured
and logged (metrics.py)."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray.train
import torch

from rayft.config import Config, RayConfig, TrainConfig
from rayft.data.tokenizer import load_tokenizer
from rayft.decisions import Decisions
from rayft.logs import quiet_worker_rank, verbose
from rayft.model.build import cpu_bf16, decoder_layers, forward_context
from rayft.model.flops import flop_model, peak_flops
from rayft.model.fp8 import fp8_layers
from rayft.parallel.fsdp_tally import count_fsdp_collectives
from rayft.parallel.layout import ParallelDims, established
from rayft.parallel.parallelize import build_model
from rayft.startup import Profile, process_start_time
from rayft.train import metrics as measured
from rayft.train import reference, sinks
from rayft.train.checkpoint import CheckpointManager, TrainState, load_adapter_weights, publish_adapter
from rayft.train.checkpoint_dir import Progress
from rayft.train.finite import NonFinite
from rayft.train.job import EvalJob, Job
from rayft.train.ledger import RecordLedger
from rayft.train.metrics import LossWindow, ProgressLog
from rayft.train.objectives import Objective, build_objective
from rayft.train.rundir import EVAL_RESULT, RunDir, checkpoint_dir_name, join
from rayft.train.runtime import RayRuntime, Runtime, Shard
from rayft.train.schedule import build_optimizer, build_scheduler
from rayft.train.sinks import Gauges
from rayft.train.step import DataWait, GlobalPart, step_groups, train_step
from rayft.train.steps import StepPlan

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PreTrainedTokenizerBase

    from rayft.train.runtime import Collate
    from rayft.train.step import Autocast

log = logging.getLogger("rayft")


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker's run: set up from the job with what Ray provides, train, save what is left, publish.
    A run stopped by a non-finite step ends here without an error: Ray would retry it from its last checkpoint into
    the same divergence; rank 0 recorded why in metrics.jsonl, and the driver reports it (`rayft.launch`)."""
    entered = time.time()
    try:
        run(loop_config["job"], RayRuntime(), entered)
    except NonFinite:
        return


def run(job: Job, runtime: Runtime, entered: float | None = None) -> Trainer:
    """A worker's run, the story in three lines, whoever launched it (Ray Train, or gloo ranks in the tests). The
    trackers and the checkpoint spool are closed however it ends; a failed run is marked failed in the trackers."""
    with Trainer(job, runtime, entered if entered is not None else time.time()) as trainer:
        trainer.train()
        trainer.finish()
    return trainer


def eval_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker's share of `rayft eval` (`run_eval`), its result reported to Ray Train."""
    ray.train.report(run_eval(loop_config["job"], RayRuntime()))


def run_eval(job: EvalJob, runtime: Runtime) -> dict[str, Any]:
    """`rayft eval` on one worker, whoever launched it (Ray Train, or gloo ranks in the tests): the base model, or
    base + a trained adapter, scored on one split (token-weighted loss). The model is built with the adapter's LoRA
    shape at its zero-delta init, which is the base exactly: `with_base` scores it before the adapter's weights are
    loaded. Rank 0 writes the result into the eval's run directory, where the driver reads it."""
    cfg, rank, device = job.config, runtime.rank, runtime.device
    _setup_logging(rank)
    # Each worker scores its own split of the records whole: no context parallelism (not yet: its groups would
    # have to read the same rows, as training's do).
    layout = replace(_layout(cfg, job.decided(), device), context=1)
    model = build_model(cfg, device.type == "cuda", device, layout, decisions=job.decided())
    objective = build_objective(cfg, model, device)
    collate = objective.collate(load_tokenizer(cfg.model).pad_token_id)
    shard = runtime.shard("validation")
    autocast = forward_context(cfg, device)

    def score() -> dict[str, Any]:
        started = time.perf_counter()
        metrics = objective.evaluate(shard, cfg.train.per_device_eval_batch_size, collate, device, autocast)
        return {**metrics, "eval_s": round(time.perf_counter() - started, 3)}

    base = score() if job.with_base else None
    if job.adapter:
        load_adapter_weights(model, job.adapter, layout)
    result = score()
    if rank == 0:  # Ray keeps reported metrics only with checkpoints: the driver reads the result from storage
        RunDir(job.run_uri).write_file(EVAL_RESULT, json.dumps({**result, "base": base}).encode())
    return result


class Trainer:
    """A worker's run: the sharded model and its optimizer, the data shards, checkpoints, metrics and when each is
    due, held together from set-up (`__init__`) through the steps (`train`) to the final adapter (`finish`). A
    context manager: leaving it closes what the run holds open (`close`), on every path."""

    progress_log: ProgressLog | None
    checkpoints: CheckpointManager
    layout: ParallelDims  # built once at set-up: the meshes and groups, and the parallelism the model is built with
    ledger: RecordLedger | None  # train.record_ledger

    def __init__(self, job: Job, runtime: Runtime, entered: float):
        self.job, self.cfg, self.plan = job, job.config, job.plan
        self.rank, self.device, self.runtime = runtime.rank, runtime.device, runtime
        self.acted_on: tuple[str, ...] = ()  # the draining nodes of the last preemption notice acted on
        _setup_logging(self.rank)
        self.profile: Profile | None = _worker_profile(job, entered)
        torch.manual_seed(self.cfg.train.seed)
        self.decisions = job.decided()
        # Asked for first: each shard's split coordinator (a new actor process) starts while the model builds.
        self.train_shard = runtime.shard("train")
        val_source = runtime.shard("validation") if self.plan.has_validation else None
        self.layout, self.state, self.autocast, self.window, self.tokenizer = self._build()
        # An elastic run's group: any size in ray.num_workers' range.
        self.world_size = self.layout.world
        self.context = self.layout.context_parallel
        # Where this rank reads: the ranks of a context-parallel group read the same rows.
        self.data_place = (
            (self.context.data_rank, self.context.data_ranks) if self.context else (self.rank, self.world_size)
        )
        self.val_shard = self._validation_shard(val_source)
        self.objective: Objective = build_objective(self.cfg, self.state.model, self.device)
        run = RunDir(self.cfg.run_uri)
        ray_cfg = self.cfg.ray
        accum = self.plan.accumulation(self.data_place[1], self.cfg.train.gradient_accumulation_steps)
        self.progress_log = None
        self.checkpoints = CheckpointManager(
            run, job.run_id, ray_cfg.name, ray_cfg.checkpoint_upload, runtime, self.layout
        )
        try:  # from here on the run holds files open: a set-up that fails closes them
            with self.profile.stage("resume"):
                resumed = self.checkpoints.restore(job.resume_from, self.state, self.plan, self.world_size, accum)
            if self.rank == 0:
                _log_group_size(self.cfg, self.plan, self.world_size, accum)
                gauges = runtime.gauges(ray_cfg.name, self.objective.gauges)
                self.progress_log = _progress_log(
                    self.cfg,
                    self.plan,
                    self.state,
                    run,
                    resumed,
                    job.parameter_counts,
                    gauges,
                    self.checkpoints.resumed_metrics,
                    self.decisions,
                )
            self.ledger = self._ledger(run, resumed)
            collate = self.objective.collate(self.tokenizer.pad_token_id)
            self.collate = self.context.collate(collate) if self.context else collate
            self.cadence = Cadence(self.cfg.train, self.cfg.ray, self.plan)
            self.waited = DataWait()
            self.kept_layers = [] if self.cfg.fsdp.reshards() else decoder_layers(self.state.model)
            self.train_collate = self._train_collate(run)
        except BaseException:
            self.close(failed=True)
            raise

    def _ledger(self, run: RunDir, resumed: bool) -> RecordLedger | None:
        if not self.cfg.train.record_ledger:
            return None
        return RecordLedger(run, self.rank, self.world_size, self.state.progress.step if resumed else None)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.close(failed=kind is not None)

    def _validation_shard(self, shard: Shard | None) -> Shard | None:
        """What this rank evaluates: its split of the validation records, or in a run read in global order its
        part of the batches every size scores."""
        if shard is None or self.plan.eval_batches is None:
            return shard
        return GlobalPart(shard, self.plan.eval_batches, *self.data_place)

    def _build(self) -> tuple[ParallelDims, TrainState, Autocast, LossWindow, PreTrainedTokenizerBase]:
        """The run's layout, and on it the model, optimizer and window (`_build_state`), the tokenizer loading beside
        them."""
        import transformers.models.auto.tokenization_auto  # noqa: F401  here: imports racing in two threads can break

        assert self.profile is not None  # set up in __init__; done with only after the first step
        with ThreadPoolExecutor(1, thread_name_prefix="rayft-tokenizer") as pool:
            tokenizer_loading = pool.submit(load_tokenizer, self.cfg.model)  # overlaps the model build and load
            with self.profile.stage("model_build_load"):
                layout = _layout(self.cfg, self.decisions, self.device)
                state, autocast, window = _build_state(self.cfg, self.plan, self.device, layout, self.decisions)
            with self.profile.stage("tokenizer"):  # what is left of it once the model is loaded
                tokenizer = tokenizer_loading.result()
        return layout, state, autocast, window, tokenizer

    def _train_collate(self, run: RunDir) -> Collate:
        """The training batches' collate: with a precomputed DPO reference, one carrying its table, scored now."""
        if not self.objective.precomputed:
            return self.collate
        pad_id = self.tokenizer.pad_token_id
        assert self.profile is not None  # set up in __init__; done with only after the first step
        with self.profile.stage("reference"):
            keyed = self.objective.collate(pad_id, keys=True)
            table = reference.precompute(
                self.state.model,
                self.train_shard,
                self.cfg,
                keyed,
                self.device,
                self.autocast,
                run,
                self.rank,
                self.world_size,
            )
        return self.objective.collate(pad_id, reference=table)

    def train(self) -> None:
        """Optimizer steps until the plan's last; after each, what is due: metrics, evaluation, a checkpoint."""
        state, t = self.state, self.cfg.train
        groups = step_groups(
            self.train_shard,
            self.cfg,
            self.plan,
            state.progress,
            self.train_collate,
            self.waited,
            self.device,
            self.data_place,
        )
        for group in groups:
            stepped = time.time()
            grad_norm = train_step(
                state.model,
                state.optimizer,
                state.scheduler,
                group.batches,
                self.window,
                loss=self.objective.loss,
                layout=self.layout,
                kept_layers=self.kept_layers,
                autocast=self.autocast,
                max_grad_norm=t.max_grad_norm,
                seeds=group.seeds,
            )
            if self.profile is not None:
                _first_step_done(self.profile, stepped, self.waited, self.progress_log)
                self.profile = None  # done with
            progress = state.progress
            progress.step, progress.batches_in_epoch = progress.step + 1, group.last + 1
            self.window.note_step(progress.step, grad_norm)
            if self.ledger is not None:
                self.ledger.add(progress.step, progress.epoch, group.batches)
            self._after_step(progress, group.last, grad_norm)
            if progress.step >= self.plan.total_steps:
                break

    def _after_step(self, progress: Progress, micro: int, grad_norm: torch.Tensor) -> None:
        """The step's metrics when logging is due, evaluation and a checkpoint when due; none of it counts as
        training time in the window."""
        window = self.window
        metrics = (
            _window_metrics(window, self.waited, grad_norm, self.state.scheduler)
            if self.cadence.log_due(progress)
            else {}
        )
        if metrics:
            metrics.update(self.objective.window_metrics())
        if self.window.non_finite is not None:  # read with the window's metrics: no wait of its own
            self._stop(progress, self.window.non_finite, metrics)
        if self.val_shard is not None and self.cadence.evaluation_due(progress, micro):
            with window.paused():  # evaluating and saving are not training: out of the window's time
                metrics.update(self.evaluate())
            self.cadence.last_evaluated = progress.step
        saving = self.cadence.save_due(progress, micro)
        if metrics or saving:
            metrics.update(step=progress.step, epoch=_epoch_position(progress, self.plan))
        if saving:  # metrics reach Ray with checkpoints only: a report without one is a cross-rank barrier
            with window.paused():
                self._save(metrics)
        if self.progress_log is not None and ("loss" in metrics or "eval_loss" in metrics):
            with window.paused():
                self.progress_log.record(metrics, self.checkpoints.stall_s)
        if self.cadence.preemption_check_due(progress):
            with window.paused():
                self._checkpoint_if_draining(progress, {k: v for k, v in metrics.items() if k.startswith("eval_")})

    def _checkpoint_if_draining(self, progress: Progress, evaluated: dict[str, Any]) -> None:
        """Ray's drain notice for a node of the run: a checkpoint now, once per notice (unless this step has one),
        then training goes on; when the node goes, Ray restarts the run from it, losing only the steps since.
        `evaluated`: the step's evaluation, if it had one, so the checkpoint's score is not computed again."""
        notice = self.runtime.preemption()
        if notice is None or notice.nodes == self.acted_on:
            return
        self.acted_on = notice.nodes
        noticed = time.time()
        if self.checkpoints.last_saved != progress.step:
            self._save({**evaluated, "step": progress.step, "epoch": _epoch_position(progress, self.plan)})
        if self.rank == 0:
            log.warning(
                "preemption notice at step %d: %s; checkpoint-%06d holds the run (%.1f s)",
                progress.step,
                notice.describe(noticed),
                self.checkpoints.last_saved,
                time.time() - noticed,
            )

    def evaluate(self) -> dict[str, Any]:
        t = self.cfg.train
        assert self.val_shard is not None  # called only in a run with validation data
        return self.objective.evaluate(
            self.val_shard, t.per_device_eval_batch_size, self.collate, self.device, self.autocast
        )

    def _save(self, metrics: dict[str, Any]) -> None:
        """Every checkpoint carries the score Ray ranks it by: evaluated now where this step had none. Only finite
        weights are saved."""
        self._stop_unless_finite(metrics)
        best = self.job.best_metric
        if best and best not in metrics:
            metrics[best] = self.evaluate()[best]
        if self.ledger is not None:  # first: a checkpoint registered is never ahead of the ledger
            self.ledger.write()
        self.checkpoints.save(self.state, metrics)

    def finish(self) -> None:
        """A last checkpoint where the last step had none, then the final adapter (with the tokenizer). Collective:
        every rank calls it after the last step."""
        step = self.state.progress.step
        if self.cfg.train.save_strategy != "no" and self.checkpoints.last_saved != step:
            final_metrics: dict[str, Any] = {"step": step}
            if self.val_shard is not None and self.cadence.last_evaluated != step:
                final_metrics["eval_loss"] = self.evaluate()["eval_loss"]
            self._save(final_metrics)
        if self.ledger is not None:
            self.ledger.write()
        final_dir = Path(self.cfg.train.output_dir) / "final"
        self._stop_unless_finite({})
        publish_adapter(self.state.model, final_dir, self.layout, self.tokenizer)
        if self.progress_log is not None:
            log.info("final adapter written to %s", final_dir)

    def _stop_unless_finite(self, metrics: dict[str, Any]) -> None:
        """Before anything is written from the weights: every step so far had a finite loss and gradient norm, and
        the trainable weights are finite now (one all-reduce; saving waits on the ranks anyway)."""
        progress, watch = self.state.progress, self.window.finite
        watch.note_weights(progress.step, (p for p in self.state.model.parameters() if p.requires_grad))
        verdict = watch.checked()
        if verdict is not None:
            self._stop(progress, verdict, metrics)

    def _stop(self, progress: Progress, verdict: tuple[int, str], metrics: dict[str, Any]) -> None:
        """End the run on every rank (each has the same verdict): rank 0 records why in metrics.jsonl, with this
        step's metrics where it has them; no checkpoint or final adapter is written from here on."""
        first, what = verdict
        saved = self.checkpoints.last_saved
        kept = (
            f"the last checkpoint, saved before it: {join(self.cfg.run_uri, checkpoint_dir_name(saved))}"
            if saved > 0
            else "no checkpoint was saved before it"
        )
        reason = (
            f"training stopped at step {progress.step}: {what} {'were' if ' and ' in what else 'was'} not finite from "
            f"step {first} (train.learning_rate {self.cfg.train.learning_rate:g}); "
            f"{Path(self.cfg.train.output_dir) / 'final'} not written; {kept}; lower train.learning_rate or look at "
            f"the records of step {first}"
        )
        if self.progress_log is not None:
            metrics.update(step=progress.step, epoch=_epoch_position(progress, self.plan), stopped=reason)
            self.progress_log.record(metrics, self.checkpoints.stall_s)
            log.error("%s", reason)
        raise NonFinite(reason)

    def close(self, failed: bool = False) -> None:
        """What the run holds open, closed on every path and by this rank alone (no collective: after a failure the
        other ranks may be gone): the trackers' runs (marked failed when `failed`) and the checkpoint spool."""
        try:
            if self.progress_log is not None:
                self.progress_log.close(failed)
        finally:
            self.checkpoints.close()


def _log_group_size(cfg: Config, plan: StepPlan, world_size: int, accum: int) -> None:
    """An elastic run's group size, each time the group starts: what the run trains on now."""
    if not cfg.ray.elastic:
        return
    r, per_device = cfg.ray, cfg.train.per_device_train_batch_size
    rows = (plan.global_micro_per_step or 0) * per_device
    log.info(
        "elastic run: %d workers (ray.num_workers [%d, %d]), %d micro-batches of %d rows each per step: the global "
        "batch stays %d rows",
        world_size,
        r.fewest_workers,
        r.num_workers,
        accum,
        per_device,
        rows,
    )


def _worker_profile(job: Job, entered: float) -> Profile:
    """The driver's stages plus this worker's wait to be started: from the driver's fit() (or, for a restarted
    group, this worker process's own launch, whichever is later) to the loop's first line."""
    profile = Profile(job.profile.origin, dict(job.profile.stages))
    started = max(job.fit_started or entered, process_start_time())
    profile.add("worker_group_start", entered - started)
    return profile


def _first_step_done(profile: Profile, stepped: float, waited: DataWait, progress_log: ProgressLog | None) -> None:
    """After the first optimizer step: the first batch's wait, the step itself, and (rank 0) the whole profile in
    the log and in metrics.jsonl's first row. The profile is done with after it."""
    profile.add("first_batch", waited.first or 0.0)
    profile.add("first_step", time.time() - stepped)
    if progress_log is not None:
        total = profile.since_origin()
        log.info("%s", profile.line(total))
        progress_log.startup = {**profile.stages, "to_first_step_s": total}


def _build_state(
    cfg: Config, plan: StepPlan, device: torch.device, layout: ParallelDims, decisions: Decisions
) -> tuple[TrainState, Autocast, LossWindow]:
    """The LoRA model sharded on `layout`, its optimizer and schedule at step 0, the autocast context for CPU bf16,
    and the logging window that measures it (FLOPs per token, the device's peak)."""
    on_gpu, world_size = device.type == "cuda", layout.world
    model = build_model(cfg, on_gpu, device, layout, decisions=decisions)
    count_fsdp_collectives(model, layout)  # one Python call per collective: always on
    model.train()
    optimizer = build_optimizer(model, cfg.train, on_gpu)
    scheduler = build_scheduler(optimizer, cfg.train, plan)
    flops = flop_model(model, model.config, cfg.data.max_length)
    peak = peak_flops(device, cfg.train.peak_tflops)
    log.info("%s", measured.flops_line(flops, peak, device, stated=cfg.train.peak_tflops is not None))
    log.info("compute: %s", _precision_line(model, cpu_bf16(cfg, device), on_gpu))
    state = TrainState(model, optimizer, scheduler, Progress(world_size=world_size, global_order=plan.global_order))
    return state, forward_context(cfg, device), LossWindow(device, world_size, flops, peak)


def _progress_log(
    cfg: Config,
    plan: StepPlan,
    state: TrainState,
    run: RunDir,
    resumed: bool,
    params: dict[str, Any],
    gauges: Gauges | None,
    resumed_row: dict[str, Any] | None,
    decisions: Decisions,
) -> ProgressLog:
    """Rank 0's logger, with the run's gauges and its trackers (which record the settings as decided)."""
    settings = {**_flat(cfg), **decisions.settings()}
    trackers = sinks.Trackers(cfg.trackers, cfg.train.output_dir, cfg.ray.name, settings) if cfg.trackers else None
    return ProgressLog(run, plan.total_steps, state.progress.step, resumed, params, gauges, trackers, resumed_row)


@dataclass
class Cadence:
    """When to log, evaluate and save (the `*_strategy` / `*_steps` settings), judged after each step."""

    train: TrainConfig
    ray: RayConfig
    plan: StepPlan
    last_evaluated: int = -1

    def log_due(self, progress: Progress) -> bool:
        return progress.step % self.train.logging_steps == 0 or self._done(progress)

    def evaluation_due(self, progress: Progress, micro: int) -> bool:
        return self._due(self.train.eval_strategy, self.train.eval_steps, progress, micro)

    def save_due(self, progress: Progress, micro: int) -> bool:
        return self._due(self.train.save_strategy, self.train.save_steps, progress, micro)

    def preemption_check_due(self, progress: Progress) -> bool:
        """Whether to look at Ray's drain notice after this step (`ray.preemption`, `ray.preemption_check_steps`);
        never after the last step, where the run's own final checkpoint follows, nor in a run that saves none
        (`train.save_strategy: no`)."""
        ray_cfg = self.ray
        if ray_cfg.preemption != "checkpoint" or self.train.save_strategy == "no":
            return False
        return progress.step % ray_cfg.preemption_check_steps == 0 and not self._done(progress)

    def _done(self, progress: Progress) -> bool:
        return progress.step >= self.plan.total_steps

    def _due(self, strategy: str, every: int, progress: Progress, micro: int) -> bool:
        if strategy == "steps":
            return progress.step % every == 0 or self._done(progress)
        if strategy == "epoch":
            return micro + 1 >= self.plan.micro_batches_per_epoch or self._done(progress)
        return False


def _epoch_position(progress: Progress, plan: StepPlan) -> float:
    return round(progress.epoch + progress.batches_in_epoch / plan.micro_batches_per_epoch, 4)


def _window_metrics(
    window: LossWindow, waited: DataWait, grad_norm: torch.Tensor, scheduler: LRScheduler
) -> dict[str, Any]:
    """The logging window's training and hardware metrics, and the data pipeline's start-up wait once."""
    metrics = window.take(grad_norm, scheduler, waited.take())
    if (first := waited.take_first()) is not None:
        metrics["first_batch_wait_s"] = round(first, 3)
    return metrics


def _precision_line(model: torch.nn.Module, bf16_on_cpu: bool, on_gpu: bool) -> str:
    stored: torch.dtype | str = next(p for p in model.parameters() if not p.requires_grad).dtype
    if any(fp8_layers(model)):
        stored = f"{stored} (decoder matrices: float8_e4m3fn + row scales)"
    if on_gpu:
        return f"FSDP2 mixed precision, base weights stored as {stored}"
    compute = "bfloat16 (CPU autocast)" if bf16_on_cpu else "float32"
    return f"matmuls in {compute}, base weights stored as {stored}"


def _flat(cfg: Config) -> dict[str, Any]:
    return {
        f"{section}.{k}": v
        for section, values in cfg.to_dict().items()
        for k, v in values.items()
        if isinstance(v, int | float | str | bool)
    }


def _layout(cfg: Config, decisions: Decisions, device: torch.device) -> ParallelDims:
    """The run's layout on its workers: where Ray placed each rank (checked against `ray.workers_per_node`, in the
    job log) and the groups the config and the driver's `decisions` cut from it. Built once, at set-up."""
    return established(cfg, device.type, decisions)


def _setup_logging(rank: int) -> None:
    """Progress lines from rank 0 only, so the job log reads as one run rather than N."""
    logging.basicConfig(format="%(asctime)s rayft %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.DEBUG if verbose() and rank == 0 else logging.INFO if rank == 0 else logging.WARNING)
    quiet_worker_rank(rank)
