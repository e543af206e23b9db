"""The benchmarks' code paths, at toy size (the measurements themselves run from bench/, never in CI)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO


def _small_bench(script: str, out) -> None:
    """`bench/SCRIPT.py --size small --out OUT`, which must succeed."""
    result = subprocess.run(
        [sys.executable, f"bench/{script}.py", "--size", "small", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_load_memory_benchmark_runs_and_reports_every_case(tmp_path):
    out = tmp_path / "load_memory.json"
    _small_bench("load_memory", out)
    report = json.loads(out.read_text())
    assert set(report["results"]) == {
        "sharded",
        "full_from_pretrained",
        "sharded_fp8_hub_layout",
        "sharded_nf4",
        "sharded_nf4_from_fp8_hub_layout",
    }
    for case in report["results"].values():
        assert len(case["per_rank"]) == 2 and all(r["peak_minus_start_mib"] > 0 for r in case["per_rank"])
    assert report["versions"]["torch"] and report["machine"]["cpus"]
    assert importlib.util.find_spec("rayft") is not None


def test_plan_accuracy_benchmark_runs_both_cases(tmp_path):
    out = tmp_path / "plan_accuracy.json"
    _small_bench("plan_accuracy", out)
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"activation_checkpointing=False", "activation_checkpointing=True"}
    assert all(c["measured_peak_mib"] > 0 and c["estimate_mib"] > 0 for c in cases.values())


def test_context_parallel_benchmark_predicts_a_ranks_activations_at_four_within_10_percent(tmp_path):
    out = tmp_path / "context_parallel.json"
    _small_bench("context_parallel_memory", out)
    report = json.loads(out.read_text())
    measured = max(report["cases"]["context_parallel=4"]["saved_activation_bytes_per_rank"])
    four = report["plan"]["context_parallel=4"]
    assert four["measured_bytes"] == measured > 0
    assert abs(four["predicted_bytes"] / measured - 1) <= 0.10, four
    assert report["plan"]["within_10_percent"] is True
    # the exchanges: what the planner counts is what the ranks' all-to-alls received, byte for byte
    for n in (2, 4):
        case, plan = report["cases"][f"context_parallel={n}"], report["plan"][f"context_parallel={n}"]
        assert set(case["all_to_all_received_bytes_per_rank"]) == {plan["all_to_all_predicted_bytes"]}
        assert plan["all_to_all_predicted_bytes"] > 0


def test_fp8_quantise_benchmark_times_both_ways_on_the_same_bytes(tmp_path):
    out = tmp_path / "fp8_quantise.json"
    _small_bench("fp8_quantise", out)
    report = json.loads(out.read_text())
    assert report["identical_bytes_and_scales"] is True and set(report["threads"]) == {"1", "2"}
    for case in report["threads"].values():
        assert case["before_g_elements_per_s"]["best"] > 0 and case["after_g_elements_per_s"]["best"] > 0


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


def test_train_vs_trl_and_startup_benchmarks_on_one_pair_of_runs(tmp_path):
    """`bench/train_vs_trl.py --size smoke`: rayft (`python jobs/mistral4.py`) and the seeds' SFTTrainer recipe
    (torchrun), one optimizer step each. bench/startup.py repeats exactly these runs (seed YAML, one step, the same
    model and data), so its summary is checked on this pair plus one run of its Ray Train yardstick: launch to the
    first optimizer step, with rayft's start-up profile (every stage, each a part of the whole), and the CPU-seconds
    of every run's processes (each kind of process present; no more than the cores could give in that time)."""
    out = tmp_path / "train_vs_trl.json"
    result = subprocess.run(
        [sys.executable, "bench/train_vs_trl.py", "--size", "smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    (seed,) = report["results"]
    for system in ("rayft", "baseline"):
        numbers = seed[system]
        assert numbers["tokens_per_s"] > 0 and numbers["step_time_s"] > 0 and numbers["peak_rss_gib"] > 0.1
        assert numbers["time_to_first_step_s"] > 0 and len(numbers["losses"]) == 1 and numbers["losses"][0] > 1
    assert seed["ratio_tokens_per_s"] > 0 and "DDP" in report["settings"]["baseline_note"]
    assert report["versions"]["ray"] and report["versions"]["trl"] and "cpus" in report["machine"]

    sys.path.insert(0, str(REPO / "bench"))
    from startup import run_ray_train_empty, summarise

    startup = summarise({**seed["runs"], "ray_train_empty": [run_ray_train_empty(tmp_path / "empty")]})
    (rayft,), (trl,), (empty,) = (startup["runs"][k] for k in ("rayft", "baseline", "ray_train_empty"))
    cores = os.cpu_count()
    for run, parts in (
        (rayft, {"driver", "ray", "train_workers"}),
        (trl, {"launcher", "ranks"}),
        (empty, {"driver", "ray", "train_workers"}),
    ):
        cpu = run["cpu_s_to_first_step"]
        assert set(cpu) == parts | {"total"} and all(cpu[p] > 0 for p in parts), cpu
        assert cpu["total"] == pytest.approx(sum(cpu[p] for p in parts), abs=0.05)
        assert cpu["total"] <= cores * run["time_to_first_step_s"] + 0.5, (cpu, run["time_to_first_step_s"])
    assert 0 < empty["time_to_first_step_s"] <= empty["wall_s"]
    assert startup["rayft_floor_s"] == pytest.approx(rayft["cpu_s_to_first_step"]["total"] / cores, abs=0.01)
    assert startup["ratio_ray_train_empty_over_trl"] == pytest.approx(
        empty["time_to_first_step_s"] / trl["time_to_first_step_s"], rel=1e-2
    )
    assert 0 < rayft["time_to_first_step_s"] <= rayft["wall_s"] and 0 < trl["time_to_first_step_s"] <= trl["wall_s"]
    stages = rayft["profile"]
    for stage in (
        "launch",
        "preflight_tokenizer",
        "ray_start",
        "data_plan",
        "worker_group_start",
        "model_build_load",
        "first_batch",
        "first_step",
    ):
        assert stage in stages, stages
    parts = sum(v for k, v in stages.items() if k != "to_first_step_s")
    assert parts <= stages["to_first_step_s"] <= rayft["time_to_first_step_s"] + 1.0
    assert startup["ratio_rayft_over_trl"] == pytest.approx(
        rayft["time_to_first_step_s"] / trl["time_to_first_step_s"], rel=1e-2
    )
    assert startup["ratio_ok"] == (startup["ratio_rayft_over_trl"] <= 1.5)


GPU_CHECK_MAX_MIN = 9  # what one device loan leaves for the check's commands once the machine has started


def dry_run_budgets(out: str) -> dict[str, float]:
    """Each stage's budget in minutes, read from the dry run's `stage NAME (budget N s|min` lines."""
    found = re.findall(r"^stage (\S+) \(budget ([\d.]+) (s|min)\b", out, re.M)
    return {name: float(value) / (60 if unit == "s" else 1) for name, value, unit in found}


def test_gpu_check_dry_run_lists_every_stage_and_builds_the_bench_configs():
    """`make gpu-check GPU_CHECK_ARGS=--dry-run` (what runs without a GPU, through the Makefile target the device
    runs): the plan, each stage of `all` with its command and budget, the measuring process first, all of them
    together within the minutes a device loan leaves (summed here from the stage lines), and the stages run alone;
    the measuring process's configurations and both bench configs accepted by rayft's config and planned on the
    meta device; without --dry-run on a machine with no GPU it refuses with exit 2 instead of reporting empty
    results."""
    result = subprocess.run(
        ["make", "--no-print-directory", "gpu-check", "GPU_CHECK_ARGS=--dry-run", f"PY={sys.executable}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    budgets = dry_run_budgets(out)
    total = sum(budgets.values())
    assert budgets and total <= GPU_CHECK_MAX_MIN, f"the stages' budgets add up to {total:.1f} min: {budgets}"
    assert list(budgets) == ["mfu", "tests", "job"], out
    assert f"({round(total * 60)} s; at most {GPU_CHECK_MAX_MIN} min" in out, out
    assert "-m 'gpu and not ray'" in out and "-m 'gpu and ray'" in out and "--size gpu" in out
    assert "python bench/gpu_mfu.py --out" in out and "run alone" in out, out
    assert "RAYFT_BENCH_PARTS=moe" in out and "RAYFT_BENCH_PARTS=dense" in out
    for case in ("dense-12l-ac", "dense-12l-noac", "moe-2l-fp8", "moe-8l-fp8", "moe-2l-bf16", "moe-8l-bf16"):
        assert re.search(rf"^  {case} +budget +\d+ s  [\d.]+B params .*planned [\d.]+ GiB", out, re.M), out
    assert "bench config dense: MistralForCausalLM, 3.39B params" in out, out
    assert "bench config moe: Mistral4ForCausalLM, 7.62B params" in out and "gpu kit: {" in out, out

    import torch

    if not torch.cuda.is_available():
        refused = subprocess.run(
            [sys.executable, "bench/gpu_check.py", "--stage", "tests"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert refused.returncode == 2 and "no CUDA GPU here" in refused.stderr, refused.stderr


def test_gpu_check_cuts_a_stage_at_its_deadline(tmp_path, monkeypatch):
    """Each stage ends by the sum of the budgets up to its own. A command still running at its deadline is
    interrupted in time to write what it has (SIGINT, as pytest writes its JUnit report) and reported as cut; one
    that ignores the interrupt is killed at the deadline; one that ends in time is not cut."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check
    from gpu_check import STAGES, deadlines, run_until

    tests, job = STAGES["tests"].budget_s, STAGES["job"].budget_s
    assert deadlines(["tests", "job"], 100.0) == {"tests": 100.0 + tests, "job": 100.0 + tests + job}
    # The grace is the interrupted child's time to write and exit: on a loaded CI machine one second was not enough.
    monkeypatch.setattr(gpu_check, "CUT_GRACE_S", 4.0)
    wrote = tmp_path / "interrupted"
    interrupted = (
        "import sys, time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n"
        f"    open({str(wrote)!r}, 'w').write('partial result')\n    sys.exit(2)"
    )
    stubborn = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)"
    # The interrupt must find each child past its own set-up (the handler, or SIG_IGN): an interpreter starts in
    # well under a second, even beside two busy loops, and the deadline leaves it eight.
    deadline_s = 12
    started = time.monotonic()
    assert run_until([sys.executable, "-c", interrupted], started + deadline_s) == (2, True)
    assert wrote.read_text() == "partial result" and time.monotonic() - started < deadline_s
    started = time.monotonic()
    assert run_until([sys.executable, "-c", stubborn], started + deadline_s) == (-signal.SIGKILL, True)
    assert deadline_s <= time.monotonic() - started < deadline_s + 7
    assert run_until([sys.executable, "-c", "pass"], time.monotonic() + 30) == (0, False)


def test_gpu_check_counts_a_skipped_gpu_test_as_a_failure(tmp_path):
    """The JUnit summary a GPU stage reports (outcome and message per test, and what a test measured), and its
    verdict: a stage whose tests passed but one was skipped ("needs CUDA"), or that passed none, has not shown
    anything and fails."""
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_check import junit_summary, stage_outcome

    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" time="3.5">'
        '<testcase classname="tests.test_gpu" name="test_a" time="1.25"><properties>'
        '<property name="device_load_peak_mib" value="41.5"/></properties></testcase>'
        '<testcase classname="tests.test_gpu" name="test_b" time="0.1"><skipped message="needs CUDA"/></testcase>'
        '<testcase classname="tests.test_gpu" name="test_c" time="2"><failure message="boom"/></testcase>'
        "</testsuite></testsuites>"
    )
    summary = junit_summary(xml)
    assert (summary["passed"], summary["skipped"], summary["failed"], summary["error"]) == (1, 1, 1, 0)
    assert summary["tests"][1] == {
        "test": "tests.test_gpu::test_b",
        "outcome": "skipped",
        "seconds": 0.1,
        "message": "needs CUDA",
    }
    assert summary["tests"][0]["measured"] == {"device_load_peak_mib": 41.5} and "measured" not in summary["tests"][1]
    assert summary["seconds"] == 3.5 and "error" in junit_summary(tmp_path / "absent.xml")
    assert stage_outcome(0, {"passed": 3, "skipped": 1})[0] == 1
    assert stage_outcome(0, {"passed": 0, "skipped": 0})[0] == 1
    assert stage_outcome(0, {"passed": 3, "skipped": 0}) == (0, None)
    assert stage_outcome(1, {"passed": 2, "failed": 1})[0] == 1


def test_gpu_bench_arithmetic_from_rayft_rows_to_acceptance():
    """The GPU bench's numbers from rows as rayft writes them on a GPU (metrics.jsonl): steady-state tokens/s after
    the warm-up steps, rayft's FLOPs per token recovered from its MFU and applied to the baseline's tokens/s too,
    peak GPU memory, and the acceptance verdicts (none on a CPU run)."""
    sys.path.insert(0, str(REPO / "bench"))
    from train_vs_trl import acceptance, summarise_gpu, summarise_rayft

    peak, flops = 989.0, 40e9  # TFLOP/s, LoRA-aware FLOPs per token

    def row(step: int, tokens_per_s: float, allocated: float) -> dict:
        return {
            "step": step,
            "loss": 2.0,
            "time": 100.0 + step,
            "step_time_s": 2.0,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_worker": tokens_per_s,
            "host_rss_gib": 3.0,
            "peak_tflops": peak,
            "mfu_lora": tokens_per_s * flops / (peak * 1e12),
            "mfu_6n": tokens_per_s * 1.4 * flops / (peak * 1e12),
            "memory_allocated_gib": allocated,
            "memory_reserved_gib": allocated + 1,
        }

    rows = [row(1, 1000.0, 30.0), row(2, 9000.0, 31.0), row(3, 10000.0, 31.5), row(4, 12000.0, 31.0)]
    rayft = summarise_rayft(rows, started=100.0, skip=2)
    assert rayft["tokens_per_s"] == 11000.0 and rayft["time_to_first_step_s"] == 1.0
    assert rayft["flops_per_token_lora"] == pytest.approx(flops)
    assert rayft["flops_per_token_6n"] == pytest.approx(1.4 * flops)
    assert (rayft["peak_gpu_allocated_gib"], rayft["peak_gpu_reserved_gib"]) == (31.5, 32.5)
    per_token = {k: rayft[k] for k in ("flops_per_token_lora", "flops_per_token_6n", "peak_tflops")}
    summary = summarise_gpu({"rayft": [rayft], "baseline": [{**rayft, "tokens_per_s": 5500.0}]}, per_token)
    assert summary["rayft"]["mfu_lora"] == round(11000 * flops / 989e12, 4)
    assert summary["baseline"]["mfu_lora"] == round(5500 * flops / 989e12, 4)  # same yardstick for both
    report = {
        "gpu": {"name": "NVIDIA H100"},
        "dense": {**summary, "ratio_tokens_per_s": 2.0},
        "moe": {"rayft": {"mfu_lora": 0.15}},
    }
    verdicts = acceptance(report)
    assert verdicts["dense_ratio_tokens_per_s"]["ok"] is True and verdicts["moe_mfu_lora"]["ok"] is False
    assert verdicts["dense_mfu_lora"]["ok"] is (summary["rayft"]["mfu_lora"] >= 0.4)
    assert all(v["ok"] is None for v in acceptance({**report, "gpu": None}).values())
    assert "mfu_lora" not in summarise_rayft([{**r, "mfu_lora": None} for r in rows], 100.0)


def test_step_work_benchmark_counts_what_a_gpu_pays():
    """bench/step_work.py at toy size, this checkout's code only (bench/results/step_work_cpu.json holds the rows
    of the code before beside it): expert parallel FP8 with and without activation checkpointing meets the counts
    the step must keep to: at most one host sync per MoE layer per pass in the expert path, each layer's FP8
    weights read at most once per pass, and as many all-to-alls per step with activation checkpointing as
    without; both train."""
    sys.path.insert(0, str(REPO / "bench"))
    from step_work import run

    report = run("small", before=None, cases=[("fp8", 2, False), ("fp8", 2, True)])
    assert report["versions"]["torch"] and report["after"]["commit"] and "before" not in report
    rows = report["rows"]
    off, on = rows["fp8 base, EP 2, AC off"]["after"], rows["fp8 base, EP 2, AC on"]["after"]
    for row in (off, on):
        assert row["host_syncs_expert_path_per_moe_layer_per_pass"] <= 1, row["host_syncs_by_site_both_ranks"]
        assert 0 < row["dequant_per_pass_over_layer_fp8"] <= 1, row
        assert row["adapter_sq_norm"] > 0 and all(math.isfinite(x) for x in row["losses_rank0"]), row
    calls = [r["collective_calls_per_step"]["all_to_all"] for r in (off, on)]
    assert calls[0] == calls[1] > 0, calls
    # Dequantising one weight: eagerly, the E4M3 byte read and an fp32 written (5 B), that fp32 read and the product
    # written (8 B), the product read and bf16 written (6 B); compiled, one kernel that reads the byte and writes
    # bf16 (3 B). Both read each row's fp32 scale once: 4 B over the bench stack's 128 weights a row.
    traffic, per_row_scale = report["dequant_traffic"], 4 / 128
    assert traffic["eager_ops"] == ["_to_copy", "mul", "_to_copy"], traffic
    assert math.isclose(traffic["eager_bytes_per_weight"], 19 + per_row_scale, abs_tol=1e-3), traffic
    assert traffic["compiled_kernels"] == 1, traffic
    assert math.isclose(traffic["compiled_bytes_per_weight"], 3 + per_row_scale, abs_tol=1e-3), traffic


def test_gpu_check_times_the_fp8_expert_path_for_the_moe_run(tmp_path):
    """The bench stage's MoE config keeps the frozen base in FP8 (the seeds' default), so the GPU times
    `Fp8Experts`, not bf16 experts; the dense comparison with TRL stays bf16."""
    sys.path.insert(0, str(REPO / "bench"))
    from train_vs_trl import SIZES, gpu_settings

    from rayft.config import Config
    from rayft.model.build import frozen_fp8

    size = SIZES["gpu"]
    moe = Config.from_dict(gpu_settings(tmp_path, tmp_path / "m", tmp_path / "d", size, moe=True))
    dense = Config.from_dict(gpu_settings(tmp_path, tmp_path / "m", tmp_path / "d", size))
    assert frozen_fp8(moe.model, checkpoint_fp8=False)
    assert not frozen_fp8(dense.model, checkpoint_fp8=False)


def test_gpu_check_job_stage_saves_the_ray_paths_startup_profile(tmp_path, monkeypatch):
    """The job stage's pytest keeps its tmp_path folders in a known place, and the stage writes the job's start-up
    profile (the first metrics row's `startup`, and the job log's `start-up` line parsed) as a JSON that also lands
    in $OUT; with no run there, the JSON says so."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check

    from rayft.startup import Profile

    (command,) = gpu_check.commands("job")
    assert f"--basetemp={gpu_check.JOB_TMP}" in command and command[-1] == "tests"
    test_dir = tmp_path / "basetemp" / "test_gpu_job_checkpoints_and0"
    run = test_dir / "storage" / gpu_check.JOB_RUN
    run.mkdir(parents=True)
    stages = {"launch": 2.5, "preflight_tokenizer": 0.4, "ray_start": 6.25, "first_step": 3.0}
    rows = [{"step": 1, "loss": 2.0, "startup": {**stages, "to_first_step_s": 14.2}}, {"step": 2, "loss": 1.9}]
    run.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (test_dir / "out").mkdir()
    line = Profile(stages={**stages}).line(14.2)
    (test_dir / "out" / "job.log").write_text(f"noise\n(RayTrainWorker pid=1) INFO {line}\nJob 'x' succeeded\n")
    out = tmp_path / "OUT"
    monkeypatch.setenv("OUT", str(out))
    gpu_check.save(gpu_check.JOB_STARTUP, gpu_check.job_startup(tmp_path / "basetemp"), tmp_path / "results")
    saved = json.loads((out / gpu_check.JOB_STARTUP).read_text())
    (only,) = saved["runs"].values()
    assert only["profile"] == {**stages, "to_first_step_s": 14.2}, saved
    assert only["log_line"] == {"to_first_step_s": 14.2, "stages": {k: round(v, 1) for k, v in stages.items()}}
    assert "note" not in saved and saved["machine"]
    empty = gpu_check.job_startup(tmp_path / "nothing")
    assert empty["runs"] == {} and "did not reach its first step" in empty["note"]
