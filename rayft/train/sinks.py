"""Where a run's numbers go besides the job log: Ray metrics (Prometheus → the Ray dashboard and Grafana), the
trackers of `train.report_to` (TensorBoard, MLflow, Weights & Biases), and the loss plot in the run directory.
Preflight checks each tracker here first: its package installed, its credentials and endpoint as rank 0 would use
them."""

from __future__ import annotations

import math
import os
from typing import Any

from rayft.config import Config, ConfigError

# The Prometheus gauges (Ray prefixes `ray_`), set by rank 0 at every logging step.
GAUGES = {
    "loss": "training loss (mean over the logging window)",
    "eval_loss": "validation loss",
    "learning_rate": "learning rate",
    "grad_norm": "gradient norm before clipping",
    "tokens_per_s": "training tokens per second, all workers",
    "tokens_per_s_per_worker": "training tokens per second, one worker",
    "step_time_s": "seconds per optimizer step",
    "data_wait_share": "share of the window the slowest worker waited for data",
    "mfu_6n": "model FLOPs utilisation, 6N formula",
    "mfu_lora": "model FLOPs utilisation, LoRA-aware formula",
    "memory_allocated_gib": "peak GPU memory allocated, worst worker",
    "memory_reserved_gib": "peak GPU memory reserved, worst worker",
    "host_rss_gib": "peak host RSS, worst worker",
    "checkpoint_stall_s": "seconds training stood still for checkpoints so far in this attempt",
    **{
        f"comm_{kind}_bytes": f"bytes {what} into each worker per optimizer step (received from the others, mean)"
        for kind, what in (
            ("all_gather", "all-gathered"),
            ("reduce_scatter", "reduce-scattered"),
            ("all_reduce", "all-reduced"),
            ("all_to_all", "all-to-all'ed"),
        )
    },
    "comm_bytes": "bytes all collectives moved into each worker per optimizer step (mean over workers)",
    "comm_inter_node_bytes": "of comm_bytes, what crossed the network between nodes (mean over workers)",
    "step": "optimizer steps done",
}


# DPO runs add TRL's preference metrics (`rewards/chosen` → `ray_rayft_rewards_chosen`).
PREFERENCE_GAUGES = {
    "rewards/chosen": "DPO: beta x log-ratio of the chosen completions (mean over pairs)",
    "rewards/rejected": "DPO: beta x log-ratio of the rejected completions",
    "rewards/accuracies": "DPO: share of pairs whose chosen reward exceeds the rejected one",
    "rewards/margins": "DPO: chosen minus rejected reward",
    "logps/chosen": "DPO: log-probability of the chosen completions under the policy",
    "logps/rejected": "DPO: log-probability of the rejected completions under the policy",
    "eval_rewards/accuracies": "DPO: reward accuracy on the validation pairs",
    "eval_rewards/margins": "DPO: reward margin on the validation pairs",
}


class Gauges:
    """rayft's metrics as Ray metrics: scraped from every node's metrics port by Prometheus, shown in the Ray
    dashboard's Metrics view and Grafana, tagged with the run name. `extra`: more metrics (name → description);
    a `/` in a name becomes `_` in the gauge's."""

    def __init__(self, run: str, extra: dict[str, str] | None = None):
        from ray.util.metrics import Gauge

        self.tags = {"run": run}
        described = {**GAUGES, **(extra or {})}
        self.gauges = {
            k: Gauge(f"rayft_{k.replace('/', '_')}", description=d, tag_keys=("run",)) for k, d in described.items()
        }

    def set(self, metrics: dict[str, Any]) -> None:
        for key, gauge in self.gauges.items():
            value = metrics.get(key)
            if isinstance(value, int | float) and math.isfinite(value):
                gauge.set(float(value), tags=self.tags)


class Trackers:
    """`train.report_to`: TensorBoard event files under output_dir/runs, an MLflow run, a Weights & Biases run under
    output_dir/wandb (rank 0 only)."""

    def __init__(self, report_to: list[str], output_dir: str, run: str, params: dict[str, Any]):
        self.writers: list[Any] = []
        self.mlflow = None
        self.wandb = None
        if "wandb" in report_to:  # WANDB_PROJECT, WANDB_MODE (offline), WANDB_API_KEY as wandb reads them
            import wandb

            project = os.environ.get("WANDB_PROJECT", "rayft")
            self.wandb = wandb.init(project=project, name=run, dir=output_dir, config=params)
        if "tensorboard" in report_to:
            self.writers.append(tensorboard_writer(f"{output_dir}/runs/{run}"))
        if "mlflow" in report_to:
            import mlflow

            mlflow.set_experiment(run)
            mlflow.start_run(run_name=run)
            mlflow.log_params({k: v for k, v in params.items() if v is not None})
            self.mlflow = mlflow

    def log(self, metrics: dict[str, Any], step: int) -> None:
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and k != "step"}
        numbers = tracker_names({k: v for k, v in numbers.items() if math.isfinite(v)})
        for writer in self.writers:
            for key, value in numbers.items():
                writer.add_scalar(key, value, step)
            writer.flush()
        if self.mlflow is not None:
            self.mlflow.log_metrics(numbers, step=step)
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def close(self, failed: bool = False) -> None:
        """End each tracker's run; `failed` marks it failed there (MLflow's FAILED status, a non-zero exit code in
        W&B) rather than leaving it "running" or calling it finished."""
        for writer in self.writers:
            writer.close()
        if self.mlflow is not None:
            self.mlflow.end_run(status="FAILED" if failed else "FINISHED")
        if self.wandb is not None:
            import wandb

            self.wandb.finish(exit_code=1 if failed else 0)
            # The run file is complete only once wandb's service process has closed it, which `finish` does not
            # wait for: `teardown` does. Its exit hook would too, but a Ray worker need not run exit hooks.
            wandb.teardown()


def tracker_names(numbers: dict[str, float]) -> dict[str, float]:
    """The names transformers' Trainer gives the same values in trackers (`eval_loss` → `eval/loss`, `loss` →
    `train/loss`), so a team's rayft runs sit in the same panels as its TRL runs. metrics.jsonl and the job log
    keep the short names."""
    return {(f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}"): v for k, v in numbers.items()}


def tensorboard_writer(logdir: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer needs the tensorboard package; tensorboardX writes the same files
        from tensorboardX import SummaryWriter as SummaryWriterX

        return SummaryWriterX(logdir)
    return SummaryWriter(logdir)


TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "mlflow": ("mlflow",), "wandb": ("wandb",)}


def missing_tracker(name: str) -> str | None:
    """The pip package to install when `report_to` names a tracker whose library is absent, else None."""
    import importlib.util

    if any(importlib.util.find_spec(module) for module in TRACKER_PACKAGES[name]):
        return None
    return TRACKER_PACKAGES[name][0]


WANDB_NO_KEY_MODES = ("offline", "disabled", "dryrun")
TRACKER_PROBE_S = 5.0


def tracker_problem(name: str, env: dict[str, str]) -> tuple[str, bool] | None:
    """What rank 0 would lack to report to `name` with environment `env`: (the problem with its fix, whether the
    run is lost for it: True where it would fail, False where it trains but the tracker's record would be lost)."""
    if name == "wandb":
        if env.get("WANDB_MODE", "").lower() in WANDB_NO_KEY_MODES or env.get("WANDB_API_KEY"):
            return None
        if env.get("WANDB_IDENTITY_TOKEN_FILE") or _netrc_has(_host(env.get("WANDB_BASE_URL", "https://api.wandb.ai"))):
            return None
        return (
            "train.report_to: wandb has no credentials (no WANDB_API_KEY, no `wandb login` entry in ~/.netrc) and "
            "rank 0 would fail as it starts: set WANDB_API_KEY, run `wandb login`, or WANDB_MODE=offline",
            True,
        )
    if name == "mlflow":
        uri = env.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            return (
                "train.report_to: mlflow without MLFLOW_TRACKING_URI writes ./mlruns in rank 0's working directory, "
                "which goes with the worker: set MLFLOW_TRACKING_URI to the tracking server (or a shared path)",
                False,
            )
        if uri.startswith(("http://", "https://")) and not _answers(uri):
            return (
                f"train.report_to: mlflow: MLFLOW_TRACKING_URI {uri} does not answer (no connection within "
                f"{TRACKER_PROBE_S:.0f} s) and rank 0 would fail as it starts: check the URI and the network",
                True,
            )
    return None


def _host(url: str) -> str:
    from urllib.parse import urlparse

    return urlparse(url).hostname or url


def _netrc_has(host: str) -> bool:
    import netrc

    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _answers(url: str) -> bool:
    """A TCP connection to the URL's host and port: a tracking server that is there at all."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=TRACKER_PROBE_S).close()
        return True
    except OSError:
        return False


def check_trackers(trackers: list[str]) -> None:
    """Every tracker of `train.report_to` installed here: a missing one is named with its pip package."""
    for name in trackers:
        package = missing_tracker(name)
        if package:
            raise ConfigError(
                f"train.report_to: {name} needs the {package} package, which is not installed; pip install "
                f"{package} (in the cluster's image too), or set train.report_to: none"
            )


def check_tracker_access(cfg: Config) -> list[str]:
    """Credentials and endpoints of the trackers, as rank 0 would use them. A local cluster's workers inherit this
    environment, so a missing key is refused; a cluster joined (ray.address, RAY_ADDRESS) has its own, so there it
    is a warning."""
    joins = cfg.ray.cluster_address() is not None
    warnings = []
    for name in cfg.trackers:
        found = tracker_problem(name, dict(os.environ))
        if found is None:
            continue
        problem, fatal = found
        if fatal and not joins:
            raise ConfigError(problem)
        warnings.append(problem + (" (unless the cluster's workers have it)" if fatal else ""))
    return warnings


def plot_losses(rows: list[dict[str, Any]]) -> bytes:
    """Loss curves (train and eval against step) as a PNG."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for key, label, style in (("loss", "train loss", "-"), ("eval_loss", "eval loss", "o-")):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out.getvalue()
