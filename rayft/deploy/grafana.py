"""rayft's Grafana dashboard, generated from rayft's gauges so that a gauge and its panel cannot drift apart.

The OSS Ray dashboard draws no training charts: its Metrics view embeds Grafana, and only when a Prometheus and a
Grafana are configured (RAY_PROMETHEUS_HOST, RAY_GRAFANA_HOST). This dashboard is rayft's page there. It follows
the convention of Ray's own generated dashboards (ray/dashboard/modules/metrics/dashboards): a hidden `datasource`
variable of type prometheus that every panel names as `${datasource}`, query variables over label values, one
timeseries panel per measured quantity on a 24-column grid of two panels a row.

Regenerate the checked-in file with `python -m rayft.deploy.grafana` (a test compares the two).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayft.train.sinks import GAUGES

DASHBOARD_FILE = Path(__file__).resolve().parents[2] / "cluster" / "grafana" / "rayft-dashboard.json"
UID = "rayftTraining"
PREFIX = "ray_rayft_"  # Ray exports a custom metric `rayft_x` as `ray_rayft_x`
SELECTOR = '{run=~"$run", SessionName=~"$SessionName"}'
PANEL_WIDTH, PANEL_HEIGHT = 12, 8  # two panels per row of Grafana's 24 columns


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    series: tuple[tuple[str, str], ...]  # (gauge, legend) pairs, each one PromQL target
    unit: str = "short"


# Grafana units: percentunit shows 0.47 as 47%, gbytes is GiB (IEC), bytes IEC multiples, s seconds.
PANELS = (
    Panel("Loss", "Training loss (mean over the logging window) and validation loss.",
          (("loss", "train"), ("eval_loss", "eval"))),
    Panel("Learning rate", "The scheduler's learning rate at the logging step.", (("learning_rate", "lr"),)),
    Panel("Gradient norm", "Global gradient norm before clipping.", (("grad_norm", "grad norm"),)),
    Panel("Tokens/s, all workers", "Training tokens per second of the whole worker group.",
          (("tokens_per_s", "all workers"),)),
    Panel("Tokens/s per worker", "Training tokens per second of one worker (all workers / world size).",
          (("tokens_per_s_per_worker", "per worker"),)),
    Panel("Step time", "Seconds per optimizer step, averaged over the logging window.",
          (("step_time_s", "step time"),), "s"),
    Panel("MFU", "Model FLOPs utilisation against the GPU's dense bf16 peak: the usual 6N count and the LoRA-aware "
          "one (a frozen base needs no weight gradients). Absent on CPU and unknown GPUs.",
          (("mfu_6n", "6N"), ("mfu_lora", "LoRA-aware")), "percentunit"),
    Panel("Memory", "Peak GPU memory allocated and reserved (worst worker; absent on CPU) and peak host RSS.",
          (("memory_allocated_gib", "GPU allocated"), ("memory_reserved_gib", "GPU reserved"),
           ("host_rss_gib", "host RSS")), "gbytes"),
    Panel("Data wait", "Share of the logging window the slowest worker waited for its next batch.",
          (("data_wait_share", "data wait"),), "percentunit"),
    Panel("Checkpoint stall", "Seconds training stood still for checkpoints so far in this attempt.",
          (("checkpoint_stall_s", "checkpoint stall"),), "s"),
    Panel("Optimizer step", "Optimizer steps done.", (("step", "step"),)),
    Panel("Bytes received per step", "What the collectives moved into each worker per optimizer step, by kind "
          "(mean over workers): FSDP's all-gathers and reduce-scatters, all-reduces, expert parallelism's "
          "all-to-all; and of the total, what crossed the network between nodes. `rayft plan` predicts the same "
          "numbers.",
          (("comm_all_gather_bytes", "all-gather"), ("comm_reduce_scatter_bytes", "reduce-scatter"),
           ("comm_all_reduce_bytes", "all-reduce"), ("comm_all_to_all_bytes", "all-to-all"),
           ("comm_bytes", "total"), ("comm_inter_node_bytes", "between nodes")), "bytes"),
)  # fmt: skip


def expression(gauge: str) -> str:
    """One series per run: rank 0 sets the gauges, and after a restart the run's rank 0 may be another process."""
    return f"max by (run) ({PREFIX}{gauge}{SELECTOR})"


def dashboard() -> dict[str, Any]:
    """The dashboard model (Grafana's JSON) over every panel of PANELS."""
    missing = {gauge for panel in PANELS for gauge, _ in panel.series} - GAUGES.keys()
    if missing:
        raise ValueError(f"dashboard panels name gauges rayft does not export: {sorted(missing)}")
    return {
        "title": "rayft training",
        "uid": UID,
        "description": "rayft's gauges (rayft/train/metrics.py) per run, as Ray exports them to Prometheus.",
        "tags": ["rayft", "ray"],
        "schemaVersion": 27,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "templating": {
            "list": [
                _datasource_variable(),
                _query_variable("SessionName", "Ray session", hide=2),
                _query_variable("run", "Run (ray.name)", hide=0),
            ]
        },
        "panels": [_panel(i, panel) for i, panel in enumerate(PANELS)],
    }


def _datasource_variable() -> dict[str, Any]:
    return {
        "name": "datasource",
        "type": "datasource",
        "description": "The Prometheus that scrapes the Ray cluster.",
        "query": "prometheus",
        "refresh": 1,
        "hide": 2,
        "includeAll": False,
        "multi": False,
        "current": {"selected": False},
    }


def _query_variable(label: str, title: str, hide: int) -> dict[str, Any]:
    values = f"label_values({PREFIX}step, {label})"
    return {
        "name": label,
        "label": title,
        "type": "query",
        "description": f"Filter the panels by the `{label}` label of rayft's gauges.",
        "datasource": "${datasource}",
        "definition": values,
        "query": {"query": values, "refId": "StandardVariableQuery"},
        "refresh": 2,  # on time range change: a run started since the page was opened shows up
        "hide": hide,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def _panel(index: int, panel: Panel) -> dict[str, Any]:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": "${datasource}",
        "gridPos": {
            "h": PANEL_HEIGHT,
            "w": PANEL_WIDTH,
            "x": PANEL_WIDTH * (index % 2),
            "y": PANEL_HEIGHT * (index // 2),
        },
        "fieldConfig": {
            "defaults": {"unit": panel.unit, "custom": {"drawStyle": "line", "spanNulls": True}},
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"expr": expression(gauge), "legendFormat": f"{legend} {{{{run}}}}", "refId": chr(ord("A") + i)}
            for i, (gauge, legend) in enumerate(panel.series)
        ],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write rayft's Grafana dashboard JSON (regenerates the checked-in file)."
    )
    parser.add_argument(
        "out", nargs="?", type=Path, default=DASHBOARD_FILE, help=f"where to write (default {DASHBOARD_FILE})"
    )
    out = parser.parse_args(argv).out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
