"""Driver side: join (or start) a Ray cluster, build the datasets and the TorchTrainer, run it, summarise."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import ray
import ray.train
from ray.train import TrainingFailedError
from ray.train.torch import TorchConfig, TorchTrainer

from rayft import environment, ray_auth, ray_private
from rayft.config import Config, ConfigError, RayConfig, check_cpu_precision, is_uri
from rayft.data.pipeline import build_datasets, build_eval_dataset, small_eval_rows, small_rows
from rayft.decisions import Decisions
from rayft.logs import LEVEL_ENV, quiet_worker_output
from rayft.model.files import check_adapter, check_adapter_files, with_adapter_shape
from rayft.parallel.backend import nccl_env, process_group_backend
from rayft.placement import cluster_gpu, resolve_use_gpu, wait_for_placement
from rayft.preflight import Preflight, preflight
from rayft.startup import Profile
from rayft.train.atomic import replace_dir, staging_dir
from rayft.train.checkpoint_dir import ADAPTER_DIR, TRAINER_STATE, check_format, set_aside_damaged
from rayft.train.job import EvalJob, Job
from rayft.train.run_settings import check_continuation, finished_run, last_step, run_settings
from rayft.train.rundir import EVAL_RESULT, LOSS_PLOT, RAY_SNAPSHOT, RunDir, join
from rayft.train.safe_dcp import CheckpointFormatError
from rayft.train.steps import StepPlan, plan_steps
from rayft.workers import eval_worker, train_worker

if TYPE_CHECKING:
    import pyarrow as pa
    from ray.train.base_trainer import GenDataset

    from rayft.data.tokenizer import TokenizerFacts

log = logging.getLogger("rayft")

WORKER_ENV = {
    # HF fast tokenizers deadlock after fork when their own thread pool is already running.
    "TOKENIZERS_PARALLELISM": "false",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}


# Ray Train's controller polls its workers this often (Ray's default 2 s); on a private local Ray, rayft's 0.5 s.
HEALTH_CHECK_ENV, LOCAL_HEALTH_CHECK_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"
DASHBOARD_PORT = 8265  # Ray's default dashboard port, kept for a private local Ray when free


class TrainingStopped(TrainingFailedError):
    """The workers stopped the run themselves (a non-finite loss, gradient norm or weights): the one-line reason
    rank 0 recorded, a failed run (exit 1) that Ray was not asked to retry."""


@dataclass
class Outcome:
    final_adapter: Path
    run_dir: Path
    latest_checkpoint: str | None
    metrics: dict[str, Any]


def train(cfg: Config, profile: Profile | None = None) -> Outcome:
    """`profile` carries the stages timed so far (the CLI's imports); the workers add theirs."""
    profile = profile or Profile()
    cfg = _with_absolute_paths(cfg)
    checked = preflight(cfg, profile)
    for warning in (checked.lora.warning, *checked.warnings):
        if warning:
            log.warning("%s", warning)
    run = RunDir(cfg.run_uri)
    resume_from, run_id = _resume_source(cfg, run)
    sources = (checked.train, checked.validation)
    with profile.stage("data_plan"):  # small splits are counted and planned here: too few rows are refused before Ray
        rows = small_rows(cfg, sources, checked.records, checked.tokenizer)
        plan = plan_steps(cfg, rows.train_stats.rows, rows.validation_rows, cfg.ray.num_workers) if rows else None
    with profile.stage("ray_start"):
        use_gpu = join_cluster(cfg)
    decisions = _plan_recompute(cfg, checked, use_gpu)
    with profile.stage("data_plan"):
        datasets = build_datasets(cfg, sources, checked.records, checked.tokenizer, rows)
    plan = plan or plan_steps(cfg, datasets.train_rows, datasets.validation_rows, cfg.ray.num_workers)
    log.info("%s", startup_summary(cfg, checked, plan, use_gpu, profile))
    finished = _finished(cfg, run, plan.total_steps) if resume_from is None else None
    if finished is not None:
        return finished  # no workers: they would load the model to train nothing
    splits: dict[str, GenDataset] = {"train": datasets.train}
    if plan.has_validation and datasets.validation is not None:
        splits["validation"] = datasets.validation
    best = _best_metric(cfg, plan)
    params = {"trainable_params": checked.structure.lora, "total_params": checked.structure.params}
    job = Job(
        config=cfg,
        plan=plan,
        run_uri=run.uri,
        run_id=run_id,
        resume_from=resume_from,
        best_metric=best[0] if best else None,
        parameter_counts=params,
        profile=profile,
        fit_started=time.time(),
        decisions=decisions,
    )
    trainer = _trainer(job, splits, best, use_gpu)
    try:
        result = trainer.fit()
    except SystemExit as e:  # Ray Train's own Ctrl-C handler aborts the run, then fit() ends with SystemExit
        raise KeyboardInterrupt(f"{run.uri} keeps its checkpoints; the same command continues the run") from e
    finally:
        _plot_losses(run)
    _raise_if_stopped(run)
    final = Path(cfg.train.output_dir) / "final"
    if cfg.train.load_best_model_at_end and best and result.best_checkpoints:
        _install_best(result.best_checkpoints, best, final)
    return Outcome(
        final_adapter=final,
        run_dir=Path(run.uri),
        latest_checkpoint=result.checkpoint.path if result.checkpoint else None,
        # Ray keeps reported metrics with checkpoints only; without them, the run's own record has the last ones
        metrics=dict(result.metrics or {}) or _last_metrics(run),
    )


def _plan_recompute(cfg: Config, checked: Preflight, use_gpu: bool) -> Decisions:
    """Preflight's decisions with `fsdp.activation_checkpointing: auto` decided for the GPU the cluster has: what the
    workers get beside the config."""
    from rayft.model.build import held_as
    from rayft.plan.steptime import planned_recompute

    decided = checked.decisions
    k = decided.expert_parallel
    chosen = planned_recompute(cfg, checked.structure, held_as(cfg.model), cluster_gpu(use_gpu), k)
    return decided.recomputing(chosen.mode, chosen.every)


def _trainer(job: Job, splits: dict[str, GenDataset], best: tuple[str, str] | None, use_gpu: bool) -> TorchTrainer:
    """Ray Train's trainer for the job: its workers, their process group, where checkpoints go, the data splits."""
    return TorchTrainer(
        train_worker,
        train_loop_config={"job": job},
        torch_config=torch_config(job.config, use_gpu),
        scaling_config=_scaling(job.config, use_gpu),
        run_config=_run_config(job.config, best, use_gpu),
        datasets=splits,
        dataset_config=_data_config(job.plan),
    )


def _data_config(plan: StepPlan) -> ray.train.DataConfig | None:
    """Ray Data's split between the workers (its default), except in an elastic run: there every worker reads the
    splits whole, in one global order, and takes its part (`StepPlan`)."""
    return ray.train.DataConfig(datasets_to_split=[]) if plan.global_order else None


def _run_config(cfg: Config, best: tuple[str, str] | None, use_gpu: bool) -> ray.train.RunConfig:
    """Where Ray keeps the run, how many checkpoints (ranked by `best`: metric and order), how often it restarts."""
    return ray.train.RunConfig(  # type: ignore[call-arg]  # a Ray Train v2 field; mypy reads v1's class
        name=cfg.ray.name,
        storage_path=cfg.storage_path,
        checkpoint_config=ray.train.CheckpointConfig(
            num_to_keep=cfg.train.save_total_limit,
            checkpoint_score_attribute=best[0] if best else None,
            checkpoint_score_order=best[1] if best else "max",
        ),
        failure_config=ray.train.FailureConfig(  # type: ignore[call-arg]  # a Ray Train v2 field; mypy reads v1's class
            max_failures=cfg.ray.max_failures,
            max_preemption_failures=cfg.ray.max_preemptions,
            preemption_grace_s=cfg.ray.preemption_grace_s,
        ),
        worker_runtime_env=worker_runtime_env(cfg, use_gpu),
    )


def _with_absolute_paths(cfg: Config) -> Config:
    """Workers do not share the driver's working directory: hand them absolute paths (saying first where a relative
    output or storage path resolves)."""
    for note in cfg.relative_paths():
        log.warning("%s", note)
    cfg = Config.from_dict(cfg.to_dict())
    cfg.train.output_dir = _absolute(cfg.train.output_dir)
    cfg.ray.storage_path = cfg.storage_path
    for section, key in (
        ("model", "model_name_or_path"),
        ("model", "tokenizer_name_or_path"),
        ("data", "dataset_name_or_path"),
    ):
        value = getattr(getattr(cfg, section), key)
        if value and Path(value).expanduser().exists():
            setattr(getattr(cfg, section), key, _absolute(value))
    if cfg.train.resume_from_checkpoint not in (None, "latest") and not is_uri(cfg.train.resume_from_checkpoint):
        cfg.train.resume_from_checkpoint = _absolute(cfg.train.resume_from_checkpoint)
    return cfg


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _best_metric(cfg: Config, plan: StepPlan) -> tuple[str, str] | None:
    """The (metric, order) Ray ranks checkpoints by: kept are the save_total_limit best plus the latest."""
    best = cfg.best_metric
    if best is None or cfg.train.save_strategy == "no":
        return None
    if not plan.has_validation:
        if cfg.train.load_best_model_at_end:
            raise ConfigError(
                f"train.load_best_model_at_end: true, but there is no validation data to compute {best[0]} "
                f"({plan.no_validation()}); add a validation split or raise data.val_ratio"
            )
        log.warning("no validation data: checkpoints are kept newest-first instead of by %s", best[0])
        return None
    log.info(
        "checkpoints ranked by %s (%s is better): Ray keeps the %s best plus the latest; each save evaluates",
        best[0],
        "higher" if best[1] == "max" else "lower",
        cfg.train.save_total_limit or "all",
    )
    return best


def _resume_source(cfg: Config, run: RunDir) -> tuple[str | None, str]:
    """(explicit checkpoint to start from, run id). This run's own checkpoints win (Ray resumes from them);
    resume_from_checkpoint seeds a fresh run. Checkpoint dirs without Ray's registry are never touched: the run
    refuses to start over them rather than guess whether they were registered. A damaged newest registered
    checkpoint is set aside first (`set_aside_damaged`), so Ray continues from the newest intact one."""
    wanted = cfg.train.resume_from_checkpoint
    if run.has_registered_checkpoints():
        check_continuation(cfg, run.settings(), run.uri)
        set_aside_damaged(run)
        log.info("%s has checkpoints: continuing that run from its latest one", run.uri)
        if wanted not in (None, "latest"):
            log.warning("train.resume_from_checkpoint=%s ignored: the run continues from its own checkpoints", wanted)
        return None, run.run_id() or run.new_run_id(run_settings(cfg))
    if wanted == "latest":
        raise ConfigError(
            f"train.resume_from_checkpoint: latest, but {run.uri} has no checkpoint to continue from "
            "(check ray.storage_path and ray.name, or drop the setting to start fresh)"
        )
    _refuse_unregistered(run, wanted)
    if wanted is not None:
        _check_checkpoint(wanted)
        log.info("starting from checkpoint %s", wanted)
    return wanted, run.new_run_id(run_settings(cfg))


def _refuse_unregistered(run: RunDir, wanted: str | None) -> None:
    """Checkpoint dirs in a run dir without Ray's registry (lost, renamed by an upgrade, or never written because
    the first save failed): starting fresh there would write over them. Allowed only when resuming from one of
    them explicitly (its continuation may then replace the later ones)."""
    found = run.checkpoints()
    if not found or (wanted is not None and join(run.uri, Path(wanted).name) == wanted.rstrip("/")):
        return
    newest = join(run.uri, found[max(found)])
    raise ConfigError(
        f"{run.uri} holds {len(found)} checkpoint dirs ({', '.join(sorted(found.values()))}) but no Ray registry "
        f"({RAY_SNAPSHOT}), so Ray will not continue from them and rayft will not delete them: set "
        f"train.resume_from_checkpoint: {newest} to continue, or another ray.name for a fresh run"
    )


def _check_checkpoint(source: str) -> None:
    """A local explicit checkpoint is checked up front (format, readability): exit 2, not max_failures retries."""
    if is_uri(source):
        return
    try:
        check_format(Path(source))
    except CheckpointFormatError as e:
        raise ConfigError(f"train.resume_from_checkpoint: {e}") from None


def _install_best(
    best_checkpoints: list[tuple[ray.train.Checkpoint, dict[str, Any]]], best: tuple[str, str], final: Path
) -> None:
    """load_best_model_at_end: output_dir/final becomes the best checkpoint's adapter; output_dir/best keeps a
    copy with that checkpoint's trainer_state.json (which step, which score). Each is built beside its target and
    swapped in whole."""
    metric, order = best
    checkpoint, metrics = (max if order == "max" else min)(best_checkpoints, key=lambda cm: cm[1][metric])
    with checkpoint.as_directory() as d:
        staged_final = staging_dir(final)
        shutil.copytree(final, staged_final, dirs_exist_ok=True)  # the tokenizer files stay
        shutil.copytree(Path(d) / ADAPTER_DIR, staged_final, dirs_exist_ok=True)
        best_dir = final.parent / "best"
        staged_best = staging_dir(best_dir)
        shutil.copytree(staged_final, staged_best, dirs_exist_ok=True)
        shutil.copy2(Path(d) / TRAINER_STATE, staged_best / TRAINER_STATE)
        replace_dir(staged_final, final)
        replace_dir(staged_best, best_dir)
    log.info("load_best_model_at_end: %s = step %s (%s %.6g)", final, metrics.get("step"), metric, metrics[metric])


@dataclass(frozen=True)
class EvalSetup:
    """What the driver settles for `rayft eval` before it joins a cluster: the job every worker runs, the split's
    rows where it is small enough to tokenize here (else None: the tokenizer actors read it), and the tokenizer."""

    job: EvalJob
    small: pa.Table | None
    tokenizer: TokenizerFacts


def eval_setup(cfg: Config, adapter: Path | None, split: str, with_base: bool) -> EvalSetup:
    """The adapter checked against the config and its LoRA shape taken, preflight, and a missing `--split` or a
    small split too short for the workers answered, all before the cluster is joined."""
    if adapter:
        check_adapter(adapter, cfg)
    cfg = _with_absolute_paths(with_adapter_shape(cfg, adapter) if adapter else cfg)
    checked = preflight(cfg)
    small = small_eval_rows(cfg, split, checked.tokenizer)
    run = RunDir(f"{cfg.storage_path.rstrip('/')}/{cfg.ray.name}-eval")
    job = EvalJob(cfg, run.uri, adapter.resolve() if adapter else None, with_base, checked.decisions)
    return EvalSetup(job, small, checked.tokenizer)


def eval_result(job: EvalJob, rows: int, split: str) -> dict[str, Any]:
    """What rank 0 wrote into the eval's run directory (Ray keeps reported metrics only with checkpoints), with
    the split scored and its row count."""
    return {**json.loads(RunDir(job.run_uri).read_file(EVAL_RESULT)), "rows": rows, "split": split}


def evaluate(cfg: Config, adapter: Path | None, split: str, with_base: bool = False) -> dict[str, Any]:
    """Perplexity of the base model (adapter None) or base + adapter on one split, on the Ray cluster with the
    same sharded loading as training. The adapter brings its own LoRA shape (r, alpha, targets). `with_base`: the
    base is scored first by the same workers (its metrics under "base"), before the adapter's weights are loaded."""
    setup = eval_setup(cfg, adapter, split, with_base)
    cfg = setup.job.config
    use_gpu = join_cluster(cfg)
    dataset, rows = build_eval_dataset(cfg, split, setup.small, setup.tokenizer)
    scored = f" + adapter {adapter}" if adapter else ""
    if with_base:
        scored += " (and the base alone, first)"
    log.info(
        "eval: %s%s on split '%s' (%d rows) with %d workers",
        cfg.model.model_name_or_path,
        scored,
        split,
        rows,
        cfg.ray.num_workers,
    )
    trainer = TorchTrainer(
        eval_worker,
        train_loop_config={"job": setup.job},
        torch_config=torch_config(cfg, use_gpu),
        scaling_config=_scaling(cfg, use_gpu),
        run_config=ray.train.RunConfig(  # type: ignore[call-arg]  # a Ray Train v2 field; mypy reads v1's class
            name=f"{cfg.ray.name}-eval",
            storage_path=cfg.storage_path,
            worker_runtime_env=worker_runtime_env(cfg, use_gpu),
        ),
        datasets={"validation": dataset},
    )
    trainer.fit()
    return eval_result(setup.job, rows, split)


def join_cluster(cfg: Config) -> bool:
    """Connect, decide GPU or CPU, and refuse what this cluster cannot run; returns use_gpu."""
    started_locally = connect(cfg.ray)
    use_gpu = resolve_use_gpu(cfg.ray)
    if not use_gpu:
        check_cpu_precision(cfg.fsdp)
    wait_for_placement(cfg.ray, _worker_bundle(cfg, use_gpu), started_locally)
    return use_gpu


def _scaling(cfg: Config, use_gpu: bool) -> ray.train.ScalingConfig:
    r = cfg.ray
    return ray.train.ScalingConfig(  # type: ignore[call-arg]  # a Ray Train v2 field; mypy reads v1's class
        # Ray Train v2 takes (min, max) for an elastic run; v1's hint, the one mypy reads, says int
        num_workers=(r.fewest_workers, r.num_workers) if r.elastic else r.num_workers,  # type: ignore[arg-type]
        use_gpu=use_gpu,
        resources_per_worker=r.resources_per_worker,
        placement_strategy=r.ray_placement_strategy(),
        elastic_resize_monitor_interval_s=r.resize_check_s,
    )


def _worker_bundle(cfg: Config, use_gpu: bool) -> dict[str, float]:
    """What each worker asks of a node: Ray Train's own reading of the scaling config, else (a Ray that moved it)
    the declared resources, or its default of one GPU or one CPU."""
    declared = cfg.ray.resources_per_worker or ({"GPU": 1} if use_gpu else {"CPU": 1})
    return ray_private.worker_bundle(_scaling(cfg, use_gpu)) or declared


def startup_summary(
    cfg: Config, checked: Preflight, plan: StepPlan, use_gpu: bool, profile: Profile | None = None
) -> str:
    """What the run is about to do, in the job log before the workers start."""
    t, lora, counts = cfg.train, checked.lora, checked.structure
    # ray.nodes is unannotated in Ray 2.60; its untyped call also fails sum()'s overloads (misc)
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))  # type: ignore[no-untyped-call, misc]
    batch = t.per_device_train_batch_size * t.gradient_accumulation_steps * plan.world_size
    tokens = ("" if cfg.data.packing else "≤ ") + f"{batch * cfg.data.max_length:,}"
    return "\n  ".join(
        [
            f"run {cfg.ray.name}: {plan.world_size} workers ({'GPU' if use_gpu else 'CPU'}) on a {nodes}-node "
            f"Ray cluster, storage {cfg.run_uri}",
            f"model {lora.architecture} ({cfg.model.model_name_or_path}): {counts.params:,} params, "
            f"LoRA r={cfg.lora.r} on {len(lora.modules)} modules ({', '.join(lora.names)}), "
            f"{counts.lora:,} trainable ({100 * counts.lora / counts.params:.3f}%)",
            f"effective batch {batch} = {t.per_device_train_batch_size} per device × {t.gradient_accumulation_steps} "
            f"accumulation × {plan.world_size} workers; {tokens} tokens per step ({cfg.data.max_length} per row)",
            f"data {plan.train_rows:,} train / {plan.validation_rows:,} validation rows → {plan.total_steps} steps "
            f"({plan.steps_per_epoch} per epoch, warmup {plan.warmup_steps})",
            *([f"{profile.line()}; workers next"] if profile else []),
        ]
    )


def _finished(cfg: Config, run: RunDir, total_steps: int) -> Outcome | None:
    """For a rerun of a run that already trained its `total_steps`: the line saying so, and what the run left."""
    done = last_step(run) if run.has_registered_checkpoints() else 0
    if done < total_steps:
        return None
    found = run.checkpoints()
    final = Path(cfg.train.output_dir) / "final"
    try:
        check_adapter_files(final, f"the final adapter {final}")
    except ConfigError as e:
        last = join(run.uri, found[max(found)], ADAPTER_DIR) if found else None
        again = f"copy {last} there (the last checkpoint's adapter), or " if last else ""
        raise ConfigError(
            f"{run.uri} finished at step {done} of {total_steps}, but {e}; {again}set ray.name (or "
            "train.output_dir) to train a new run"
        ) from None
    log.warning("%s", finished_run(run.uri, done, total_steps))
    return Outcome(
        final_adapter=final,
        run_dir=Path(run.uri),
        latest_checkpoint=join(run.uri, found[max(found)]) if found else None,
        metrics=_last_metrics(run),
    )


def _raise_if_stopped(run: RunDir) -> None:
    """A run whose workers stopped it (`rayft.train.finite`) ends with their reason, the last row of its record:
    rows after a resumed checkpoint are dropped when the run goes on, so an older stop is never read as this one's."""
    rows = run.read_metrics()
    if rows and isinstance(rows[-1].get("stopped"), str):
        raise TrainingStopped(rows[-1]["stopped"])


def _last_metrics(run: RunDir) -> dict[str, Any]:
    return {k: v for row in run.read_metrics() for k, v in row.items()}  # the latest value of every key


def _plot_losses(run: RunDir) -> None:
    """loss.png next to metrics.jsonl: also after a failed run, which is when people look at the curve. Runs in
    a `finally`: whatever goes wrong here is a warning, never an error that would hide the run's own."""
    try:
        rows = run.read_metrics()
        if rows:
            from rayft.train.sinks import plot_losses

            run.write_file(LOSS_PLOT, plot_losses(rows))
            log.info("loss curve: %s", f"{run.uri}/{LOSS_PLOT}")
    except Exception as e:
        log.warning("no loss curve: %s: %s", type(e).__name__, e)


def connect(ray_cfg: RayConfig) -> bool:
    """Join the cluster `ray job submit` runs us in (RAY_ADDRESS), or start a private local one (→ True)."""
    if ray.is_initialized():
        return False
    address = ray_cfg.cluster_address()
    if address:
        os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")  # the Train state API (dashboard REST) needs it
        try:
            ray.init(address=address, log_to_driver=True)
        except Exception as e:  # Ray's ConnectionError, or its AuthenticationError where no token is found here
            if not ray_auth.refused_for_token(e):
                raise
            where = "ray.address" if ray_cfg.address else "RAY_ADDRESS"
            raise ConfigError(f"{where}: the Ray cluster at {address} refused rayft: {ray_auth.missing()}") from None
        quiet_worker_output()
        return False
    log.info("no Ray cluster given (ray.address / RAY_ADDRESS): starting a local one")
    start_local_ray(ray_cfg.local_num_cpus)
    quiet_worker_output()
    start_data_singletons()
    return True


PORT_TAKEN = ("already occupied", "address already in use")  # Ray's check of the port; the dashboard's own bind


def start_local_ray(num_cpus: int, attempts: int = 3) -> None:
    """`ray.init` of a private local Ray. Its dashboard port is chosen free just before; another Ray started on this
    machine in between can take it, before Ray's own check of the port (ValueError) or before its dashboard binds
    it (an Exception carrying the dashboard's log): then another port is chosen."""
    for attempt in range(1, attempts + 1):
        options = local_ray_options()
        try:
            ray.init(address="local", num_cpus=num_cpus, **options)
            return
        except Exception as e:  # Ray raises a bare Exception when its dashboard fails to start
            if not any(taken in str(e) for taken in PORT_TAKEN) or attempt == attempts:
                raise
            ray.shutdown()
            log.info(
                "local Ray: dashboard port %s was taken meanwhile (another Ray?); choosing another",
                options.get("dashboard_port"),
            )


def start_data_singletons() -> None:
    """Ask a Ray just started for Ray Data's two cluster-wide actors now (no waiting): Ray Train's controller waits
    on the autoscaling coordinator, and the first batch on the stats actor, each a new process (~1 s here) that then
    starts while the driver plans the data. Private Ray Data functions (`rayft.ray_private`): where they have
    moved, both actors start on first use as before."""
    for start in ray_private.data_actor_starters() or []:
        start()


def local_ray_options() -> dict[str, Any]:
    """A private local Ray with only what the job needs: no preemption watcher (an extra actor per run; a single
    local node is never preempted), no idle workers started ahead of the first driver (one per CPU, most never used:
    3 % faster to the first step on 2 cores, 5 alternating pairs in bench/startup.py), no Train state API unless
    RAY_TRAIN_ENABLE_STATE_TRACKING=1 asks for it: its TrainState actor sits on the worker group's start path (3-5 s
    of 30 to the first step here) and serves a cluster that ends with the job, and Ray Train's controller polling
    its workers every 0.5 s instead of 2 s: it notices a finished or failed worker group on that poll, half a gap
    later on average, 0.25 s instead of 1 s (a missed poll is not a failure; only 10 minutes of them are). The
    dashboard stays (RAYFT_LOCAL_DASHBOARD=0 drops it, 2 s of start-up here): without it Ray Train's placement-group
    cleaner polls the state API it serves every second and logs a warning each time it is not there.

    That cleaner asks the state API for its controller with no address: where several Rays run on one machine, Ray
    picks the one last started by `ray start`, not finding the controller there, and removes this run's placement
    group (its workers die). So the job's processes are pointed at this Ray's own dashboard
    (RAY_API_SERVER_ADDRESS), on a port chosen here: Ray's usual 8265 when it is free; without a dashboard, at port 0,
    where nothing can listen, so the cleaner's question fails and it asks again."""
    dashboard: bool = environment.value(environment.LOCAL_DASHBOARD)
    poll = os.environ.get(HEALTH_CHECK_ENV, LOCAL_HEALTH_CHECK_S)  # the user's own value wins
    env = {**worker_env(), "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", HEALTH_CHECK_ENV: poll}
    port = local_port(preferred=DASHBOARD_PORT) if dashboard else 0
    env["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    served = {"dashboard_host": "127.0.0.1", "dashboard_port": port} if dashboard else {}
    return {
        "include_dashboard": dashboard,
        **served,
        "runtime_env": {"env_vars": env},
        **ray_private.no_prestarted_workers(),
    }


def local_port(preferred: int) -> int:
    """`preferred` if nothing listens on it on this machine, else a free port the system picks."""
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return cast(int, s.getsockname()[1])
    raise OSError("no free local port")  # binding port 0 fails only when the system has none left


def torch_config(cfg: Config, use_gpu: bool) -> TorchConfig:
    return TorchConfig(backend=process_group_backend(cfg, use_gpu))


def worker_runtime_env(cfg: Config, use_gpu: bool) -> dict[str, Any]:
    """The training workers' runtime environment: `worker_env`, and on GPUs the `nccl` section's variables, so
    NCCL is set up the same on any Ray cluster (Ray merges them over the job's own env_vars)."""
    return {"env_vars": {**worker_env(), **(nccl_env(cfg.nccl) if use_gpu else {})}}


def worker_env() -> dict[str, str]:
    """Environment of every worker process: WORKER_ENV, plus the log level when it was raised."""
    level = os.environ.get(LEVEL_ENV)
    return {**WORKER_ENV, **({LEVEL_ENV: level} if level else {})}
