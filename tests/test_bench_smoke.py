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


def test_checkpoint_cost_summary_reads_the_runs_cumulative_counters():
    """bench/checkpoint_cost.py trains for minutes (never in CI); its arithmetic over metrics.jsonl is checked here."""
    sys.path.insert(0, str(REPO / "bench"))
    from checkpoint_cost import summarise

    rows = [
        {"step": 1, "elapsed_s": 10.0, "checkpoint_stall_s": 0.5},
        {"step": 2, "elapsed_s": 12.0, "checkpoint_stall_s": 1.0},
        {"step": 3, "elapsed_s": 14.0, "checkpoint_stall_s": 1.5},
    ]
    summary = summarise(rows, saves=3)
    assert summary["paused_s_per_checkpoint"] == 0.5 and summary["paused_s_total"] == 1.5
    assert summary["train_s_after_first_step"] == 4.0
    assert summary["share_of_training_saving"] == round(1.5 / 14.0, 4)
    assert summarise(rows[:1], saves=0)["paused_s_per_checkpoint"] == 0.0


def test_data_throughput_baseline_tokenizes_exactly_what_rayft_does(fixtures):
    """The single-process `datasets.map` baseline of bench/data_throughput.py does the same work as rayft's
    tokenizer stage (same tokens, bos/eos included), and its wait arithmetic over metrics.jsonl holds."""
    import dataclasses

    import pyarrow.parquet as pq

    sys.path.insert(0, str(REPO / "bench"))
    from data_throughput import _config, datasets_map, wait_summary

    from rayft.config import ModelConfig
    from rayft.data.pipeline import Tokenize
    from rayft.data.records import RecordFormat
    from rayft.data.tokenizer import tokenizer_facts

    raw = _config(fixtures.model, fixtures.dataset)
    baseline = datasets_map(raw, pack=True)
    facts = dataclasses.asdict(tokenizer_facts(ModelConfig(**raw["model"])))
    tok = Tokenize(raw["model"], facts, dataclasses.asdict(RecordFormat("text")), "parquet", 1024, True, "truncate")
    table = pq.read_table(next(fixtures.dataset.glob("*/train-*.parquet")))
    ours = sum(len(r["input_ids"]) for r in tok(table).to_pylist())
    assert baseline["tokens"] == ours > 0

    rows = [
        {"step": 1, "elapsed_s": 10.0, "data_wait_share": 0.0, "first_batch_wait_s": 4.0},
        {"step": 2, "elapsed_s": 12.0, "data_wait_share": 0.5},
        {"step": 3, "elapsed_s": 20.0, "data_wait_share": 0.125},
    ]
    summary = wait_summary(rows)
    assert summary["data_wait_share"] == round((1.0 + 1.0) / 20.0, 4) and summary["first_batch_wait_s"] == 4.0


def test_train_vs_trl_benchmark_runs_one_step_of_each(tmp_path):
    """rayft (`python jobs/mistral4.py`) and the seeds' SFTTrainer recipe (torchrun), one optimizer step each."""
    out = tmp_path / "train_vs_trl.json"
    result = subprocess.run(
        [sys.executable, "bench/train_vs_trl.py", "--size", "smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    (seed,) = report["results"]
    for system in ("rayft", "baseline"):
        numbers = seed[system]
        assert numbers["tokens_per_s"] > 0 and numbers["step_time_s"] > 0 and numbers["peak_rss_gib"] > 0.1
        assert numbers["time_to_first_step_s"] > 0 and len(numbers["losses"]) == 1 and numbers["losses"][0] > 1
    assert seed["ratio_tokens_per_s"] > 0 and "DDP" in report["settings"]["baseline_note"]
