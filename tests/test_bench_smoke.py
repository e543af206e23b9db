"""The benchmarks' code paths, at toy size (the measurements themselves run from bench/, never in CI)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from conftest import REPO


def test_load_memory_benchmark_runs_and_reports_every_case(tmp_path):
    out = tmp_path / "load_memory.json"
    result = subprocess.run(
        [sys.executable, "bench/load_memory.py", "--size", "small", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"sharded", "full_from_pretrained", "sharded_fp8_hub_layout"}
    for case in report["results"].values():
        assert len(case["per_rank"]) == 2 and all(r["peak_minus_start_mib"] > 0 for r in case["per_rank"])
    assert report["versions"]["torch"] and report["machine"]["cpus"]
    assert importlib.util.find_spec("rayft") is not None


def test_plan_accuracy_benchmark_runs_both_cases(tmp_path):
    out = tmp_path / "plan_accuracy.json"
    result = subprocess.run(
        [sys.executable, "bench/plan_accuracy.py", "--size", "small", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"activation_checkpointing=False", "activation_checkpointing=True"}
    assert all(c["measured_peak_mib"] > 0 and c["estimate_mib"] > 0 for c in cases.values())
