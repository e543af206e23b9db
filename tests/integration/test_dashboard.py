"""rayft's Grafana dashboard: a valid dashboard model in Ray's convention, checked in as generated, and every query
in it answered by a real Prometheus that scraped the reference run through Ray's service-discovery file."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from rayft.deploy import grafana
from rayft.train.sinks import GAUGES

DASHBOARD = Path(__file__).resolve().parents[2] / "cluster" / "grafana" / "rayft-dashboard.json"
RUN = "ray_run"  # ray.name of the reference run (tests/conftest.py)
# What rank 0 reports as null on CPU (no CUDA allocator): Ray gets no value, Prometheus no series. The reference
# run states a peak (train.peak_tflops), so both MFUs have values here; test_gpu_job.py covers GPU memory.
NULL_ON_CPU = {"memory_allocated_gib", "memory_reserved_gib"}


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def targets(dash: dict) -> list[dict]:
    return [t for panel in dash["panels"] for t in panel["targets"]]


def gauge_of(expr: str) -> str:
    names = set(re.findall(r"\bray_rayft_(\w+)\{", expr))
    assert len(names) == 1, expr
    return names.pop()


def test_checked_in_dashboard_is_the_generated_one():
    assert DASHBOARD.read_text() == grafana.render(), "regenerate: python -m rayft.deploy.grafana"


def test_dashboard_is_a_grafana_dashboard_in_rays_convention():
    dash = load()
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 27
    assert dash["uid"] and len(dash["uid"]) <= 40 and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    for name in ("run", "SessionName"):
        var = variables[name]
        assert var["type"] == "query" and var["datasource"] == "${datasource}"
        assert var["query"]["query"] == f"label_values(ray_rayft_step, {name})" == var["definition"]
        assert var["includeAll"] and var["allValue"] == ".*"
    assert variables["run"]["hide"] == 0  # the run picker is on the page

    ids, cells = set(), set()
    for panel in dash["panels"]:
        assert panel["type"] == "timeseries" and panel["title"] and panel["datasource"] == "${datasource}"
        assert panel["id"] not in ids
        ids.add(panel["id"])
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not area & cells, f"panel {panel['title']} overlaps another"
        cells |= area
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs)
        for target in panel["targets"]:
            assert '$run"' in target["expr"] and '$SessionName"' in target["expr"], target["expr"]
            assert "{{run}}" in target["legendFormat"]
    # Every gauge rank 0 sets has a chart, and every chart draws a gauge rayft sets.
    assert {gauge_of(t["expr"]) for t in targets(dash)} == set(GAUGES)


def _window(rows: list[dict]) -> tuple[float, float]:
    """From the first logged row to 30 s after the last (Ray exports a worker's metrics every few seconds): this
    run's samples, not those of a later job that reuses its name."""
    times = [r["time"] for r in rows]
    return min(times) - 2, max(times) + 30


def test_prometheus_answers_every_panel_for_the_run(prometheus, reference_run, ray_cluster):
    # Ray's own Prometheus config, which the README tells users to start, reads the same discovery file.
    ray_config = (ray_cluster.temp_dir / "session_latest" / "metrics" / "prometheus" / "prometheus.yml").read_text()
    assert str(prometheus.sd_file.resolve()) in ray_config or str(prometheus.sd_file) in ray_config, ray_config
    rows = reference_run.metrics()
    start, end = _window(rows)
    # Both nodes were scraped while the run trained (plus Ray's own dashboard/autoscaler). Not "up right now": with a
    # 1 s scrape, one slow answer from a busy node marks it down until the next.
    up = prometheus.api("query_range", query="up", start=start, end=end, step=1)["result"]
    scraped = {int(s["metric"]["instance"].rsplit(":", 1)[1]) for s in up if any(v == "1" for _, v in s["values"])}
    assert set(ray_cluster.metrics_ports) <= scraped, scraped
    reported = {key for key in GAUGES if any(_finite(r.get(key)) for r in rows)}
    assert reported == set(GAUGES) - NULL_ON_CPU, set(GAUGES) - reported  # what this CPU run can show

    for target in targets(load()):
        expr = target["expr"].replace("$run", re.escape(RUN)).replace("$SessionName", ".*")
        series = prometheus.api("query_range", query=expr, start=start, end=end, step=1)["result"]
        gauge = gauge_of(expr)
        if gauge in reported:
            assert series, f"no series for {expr} ({gauge} is in metrics.jsonl)"
            assert all(s["metric"] == {"run": RUN} and s["values"] for s in series), series
        else:
            assert not series, f"{expr}: series for a value the run reported as null: {series}"

    # The loss Prometheus holds is the loss the run wrote to metrics.jsonl (rank 0 sets the gauges from that row), at
    # the step the step gauge shows at the same instant. How many steps Prometheus sees depends on Ray's export
    # period against the length of the run, so the check pairs the two gauges instead of counting distinct steps.
    loss_at = _by_instant(
        prometheus.api("query_range", query=f'ray_rayft_loss{{run="{RUN}"}}', start=start, end=end, step=1)
    )
    step_at = _by_instant(
        prometheus.api("query_range", query=f'ray_rayft_step{{run="{RUN}"}}', start=start, end=end, step=1)
    )
    assert loss_at and step_at, (loss_at, step_at)
    logged = {float(r["step"]): r["loss"] for r in rows if _finite(r.get("loss"))}
    assert set(step_at.values()) <= set(logged), (step_at, sorted(logged))
    paired = set(loss_at) & set(step_at)
    assert paired, (loss_at, step_at)
    for instant in paired:
        assert loss_at[instant] == pytest.approx(logged[step_at[instant]], rel=1e-6), (instant, loss_at, step_at)


def _by_instant(answer: dict) -> dict[tuple, float]:
    """A range query's samples keyed by series (its labels but the metric name: rank 0's worker) and evaluation
    time, so that two gauges set from one row pair up."""
    return {(_series(s["metric"]), float(t)): float(v) for s in answer["result"] for t, v in s["values"]}


def _series(labels: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "__name__"))


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def test_regenerating_writes_where_asked_and_help_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        grafana.main(["--help"])
    assert exited.value.code == 0 and "usage" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # once, `--help` was taken for the output path
    grafana.main([str(tmp_path / "d" / "x.json")])
    assert (tmp_path / "d" / "x.json").read_text() == DASHBOARD.read_text()
