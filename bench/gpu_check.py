"""`make gpu-check STAGE=all`: what rayft must show on one CUDA GPU, as stages that together take at most 9 minutes
of device commands on one H100 or H200 (`all` runs them in order as one command). Never runs in CI; `--dry-run` is
the part that runs anywhere.

`all`, in this order:
  mfu          bench/gpu_mfu.py: one process, no Ray, no checkpoint files: each configuration (dense 8B shapes with
               and without activation checkpointing, Mistral-Small-4's shapes at 2 layers with FP8 and bf16
               experts, two kernels) built on the GPU and timed through rayft's own step: tokens/s, LoRA-aware MFU,
               peak memory and the planner's memory and step time, a line each as it ends; after each dense
               one, TRL SFTTrainer on the same work in a process of its own (bench/gpu_mfu_trl.py): its
               tokens/s, peak memory and rayft/TRL
                                                                  → gpu_mfu.jsonl (in $OUT as it is written)
  tests        `pytest -m "gpu and not ray"`: bf16 FSDP2 + LoRA steps against the fp32 CPU reference (dense Mistral
               and the hub-layout Mistral-Small-4 through grouped_mm), expert LoRA in bf16, the compiled FP8
               dequantisation, the fused loss's two branches, sharded loading onto the GPU (its peak device
               memory per load: bf16, FP8, NF4), checkpoint save + exact resume, MFU/memory metrics
                                                                  → bench/results/gpu_tests_gpu.json
  job          `pytest -m "gpu and ray"`: one real `ray job submit` on a local Ray head with one GPU, NCCL, a
               checkpoint and an eval every step, final/ present  → bench/results/gpu_job_gpu.json
               and the job's start-up profile (where the seconds before its first step go)
                                                                  → bench/results/gpu_job_startup.json
Alone (`--stage NAME`; no longer in `all`: `mfu` measures what they measured, without Ray and checkpoint files):
  bench-moe    bench/train_vs_trl.py --size gpu, MoE part: Mistral-Small-4's shapes (2 of its layers, FP8 base)
               through rayft                                      → bench/results/train_vs_trl_gpu.json
  bench-dense  the dense part: Ministral-8B's shapes (12 of its layers), rayft vs TRL SFTTrainer
                                                                  → bench/results/train_vs_trl_gpu.json (merged)
  plan         `rayft plan` for the bench's two configs against the peak GPU memory the bench measured (CPU only)
                                                                  → bench/results/plan_gpu.json

Each stage is cut at its deadline (with `all`: the sum of the budgets so far, so time one stage leaves is the next
one's) and writes its result file as it ends, cut or not; bench/results/gpu_check_gpu.json says after every stage
which stages finished, which was cut and which was running, so a device command cut short still reports what
finished. Every result file also lands in $OUT when that is set (the device tool brings back only what is under $OUT).

    python bench/gpu_check.py --stage mfu|tests|job|bench-moe|bench-dense|plan|all [--no-cut]
    python bench/gpu_check.py --dry-run [--toy] [--out DIR]   # anywhere: the plan (budgets, commands), configs,
                                                              # planner, kit; --toy also runs the measuring
                                                              # process, the bench and the plan at toy size on CPU,
                                                              # results into DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_mfu  # noqa: E402  (bench/ is no package)

RESULTS = REPO / "bench" / "results"
KIT = REPO / ".gpu-kit"
TOY_RESULTS = Path(os.environ.get("TMPDIR", "/tmp")) / "rayft-gpu-check-toy"
KIT_MAX_MIB = 50
PLAN_TOLERANCE = 0.10  # acceptance: the planner within 10% of the measured peak
# The device has no network: libraries that would ask the hub first must not wait for a timeout.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "RAY_USAGE_STATS_ENABLED": "0"}  # fmt: skip
TOTAL_BUDGET_S = 9 * 60  # the stages of `all`, so that one device loan (machine start included) holds the check
COMMAND_LIMIT_S = 10 * 60  # what the device allows one command
CUT_GRACE_S = 15  # between the interrupt at a deadline and the kill: pytest writes its report, fixtures stop Ray
SUMMARY = "gpu_check_gpu.json"
BENCH_RESULT = "train_vs_trl_gpu.json"  # both bench parts' numbers, merged
MFU_COMMAND = "bench/gpu_mfu.py"
JOB_TMP = Path(os.environ.get("TMPDIR", "/tmp")) / "rayft-gpu-job"  # the job stage's pytest tmp_path folders
JOB_STARTUP = "gpu_job_startup.json"  # where the Ray path's seconds before the first step go
JOB_RUN = "gpu_run"  # tests/integration/test_gpu_job.py's run name: its metrics are <storage>/gpu_run/metrics.jsonl
STARTUP_LINE = re.compile(r"start-up ([\d.]+) s to the first step: (.*?) \(s\)")


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: int  # what the stage may take on one H100; a stage on the GPU is cut there
    result: str
    what: str
    bench_part: str | None = None  # the bench stages: which part of bench/train_vs_trl.py --size gpu


STAGES = {
    s.name: s
    for s in (
        # its configurations' budgets, its start-up and the grace between the interrupt and the kill
        Stage("mfu", gpu_mfu.STAGE_BUDGET_S + 15, gpu_mfu.RESULT, "one process, no Ray: tokens/s, MFU, memory, plan"),
        # tests and job: what they took on an H200 (bench/results/gpu_tests_gpu.json, gpu_job_gpu.json), with margin
        Stage("tests", 100, "gpu_tests_gpu.json", "pytest -m 'gpu and not ray' (in-process, one-rank NCCL)"),
        Stage("job", 140, "gpu_job_gpu.json", "pytest -m 'gpu and ray' (one ray job submit, 1-GPU local Ray head)"),
        Stage("bench-moe", 100, BENCH_RESULT, "scaled Mistral-Small-4, FP8 base, through rayft", "moe"),
        Stage("bench-dense", 110, BENCH_RESULT, "dense Mistral, 8B shapes: rayft vs TRL", "dense"),
        Stage("plan", 30, "plan_gpu.json", "rayft plan for the bench configs vs the measured peak GPU memory"),
    )
}
ALL = ("mfu", "tests", "job")  # `--stage all`; the others run alone
assert sum(STAGES[s].budget_s for s in ALL) <= TOTAL_BUDGET_S
assert STAGES["mfu"].budget_s - CUT_GRACE_S >= gpu_mfu.STAGE_BUDGET_S  # its own deadlines come before the cut
assert all(s.budget_s <= COMMAND_LIMIT_S for s in STAGES.values())


def pytest_command(marker: str, junit: Path, basetemp: Path | None = None) -> list[str]:
    """pytest on the marked tests; `basetemp`: where their tmp_path folders stay after (the job's run dir)."""
    return [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        marker,
        "-p",
        "no:cacheprovider",
        "-q",
        "-rs",
        "--durations=20",
        f"--junitxml={junit}",
        *([f"--basetemp={basetemp}"] if basetemp else []),
        "tests",
    ]


def bench_command(size: str, out: Path) -> list[str]:
    return [sys.executable, "bench/train_vs_trl.py", "--size", size, "--out", str(out)]


def mfu_dir(toy_dir: Path | None = None) -> Path:
    """Where the measuring process writes its lines as it goes: the toy directory; on the device $OUT where set (what
    a device command leaves there comes back even when it is killed), else bench/results."""
    if toy_dir is not None:
        return toy_dir
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS


def commands(stage: str, toy: bool = False, toy_dir: Path = TOY_RESULTS) -> list[list[str]]:
    """The commands a stage runs (the dry run prints them)."""
    if stage == "mfu":
        where = mfu_dir(toy_dir if toy else None)
        return [[sys.executable, MFU_COMMAND, "--out", str(where), *(["--toy"] if toy else [])]]
    if stage == "tests":
        return [pytest_command("gpu and not ray", RESULTS / "gpu_tests_gpu.xml")]
    if stage == "job":
        return [pytest_command("gpu and ray", RESULTS / "gpu_job_gpu.xml", JOB_TMP)]
    if STAGES[stage].bench_part:
        directory = toy_dir if toy else RESULTS
        return [bench_command("gpu-toy" if toy else "gpu", part_file(directory, STAGES[stage].bench_part))]
    return [
        [
            sys.executable,
            "-m",
            "rayft.cli",
            "plan",
            "--config",
            "<bench config>",
            "--num-nodes",
            "1",
            "--gpu",
            "<h100|h200>",
        ]
    ]


def part_file(directory: Path, part: str) -> Path:
    """Where one bench part writes its numbers alone, before they are merged into `BENCH_RESULT`."""
    return directory / BENCH_RESULT.replace(".json", f"-{part}.json")


def deadlines(stages: list[str], start: float) -> dict[str, float]:
    """When each stage is cut (`time.monotonic()`): at the sum of the budgets up to and including its own, so a
    stage may use what the ones before it left, and the whole never runs past its total."""
    out, end = {}, start
    for name in stages:
        end += STAGES[name].budget_s
        out[name] = end
    return out


class Ended(NamedTuple):
    rc: int
    cut: bool  # it ran into its deadline


def run_until(command: list[str], deadline: float | None, env: dict | None = None, quiet: bool = False) -> Ended:
    """`command` in its own process group; if it runs into `deadline`, interrupted `CUT_GRACE_S` before it (SIGINT:
    pytest still writes its JUnit report, fixtures stop their Ray head, the bench's runs end) and killed at it. A
    Ctrl-C here is passed on to the group the same way."""
    proc = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL if quiet else None)  # fmt: skip
    try:
        if deadline is None:
            return Ended(proc.wait(), cut=False)
        try:
            return Ended(proc.wait(timeout=max(0.0, deadline - CUT_GRACE_S - time.monotonic())), cut=False)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGINT, command)
        try:
            return Ended(proc.wait(timeout=max(0.0, deadline - time.monotonic())), cut=True)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL, command)
        return Ended(proc.wait(), cut=True)
    except KeyboardInterrupt:
        _signal_group(proc, signal.SIGINT, command)
        try:
            proc.wait(timeout=CUT_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL, command)
        raise


def _signal_group(proc: subprocess.Popen, sig: signal.Signals, command: list[str]) -> None:
    print(f"gpu-check: {sig.name} to `{shlex.join(command[1:4])} …`", file=sys.stderr)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


# --------------------------------------------------------------------------------------------------------------------
# Facts and results


def facts() -> dict:
    """Machine, versions and GPU of this run, for every result file. Ray's and TRL's versions are read, not
    imported: a device without them still runs the measuring stage (null there)."""
    from importlib.metadata import PackageNotFoundError, version

    from _common import machine
    from train_vs_trl import gpu_facts

    info = {**machine(), **gpu_facts()}
    for name in ("ray", "trl"):
        try:
            info["versions"][name] = version(name)
        except PackageNotFoundError:
            info["versions"][name] = None
    return info


def job_startup(basetemp: Path) -> dict:
    """The start-up profile of each job the job stage ran (under pytest's `basetemp`): rayft's own JSON, the
    `startup` field of the run's first metrics row (each stage's seconds and `to_first_step_s`), beside the
    `start-up N s to the first step: ...` line of the job's log, parsed; so a GPU loan returns where the Ray path's
    seconds before the first step go, not only that the job passed."""
    runs = {}
    for metrics in sorted(basetemp.glob(f"*/storage/{JOB_RUN}/metrics.jsonl")):
        test_dir = metrics.parents[2]
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        profile = next((row["startup"] for row in rows if row.get("startup")), None)
        logs = sorted(test_dir.glob("out/*.log"))
        runs[test_dir.name] = {"profile": profile, "metrics": str(metrics),
                               "log_line": startup_line(logs[0].read_text()) if logs else None}  # fmt: skip
    note = None if runs else f"no {JOB_RUN}/metrics.jsonl under {basetemp}: the job did not reach its first step"
    return {**facts(), "runs": runs, **({"note": note} if note else {})}


def startup_line(text: str) -> dict | None:
    """The last `start-up N s to the first step: a 1.0 | b 2.0 (s)` line of a job log: its total and stages."""
    found = STARTUP_LINE.findall(text)
    if not found:
        return None
    total, parts = found[-1]
    stages = {name: float(value) for name, value in (part.rsplit(" ", 1) for part in parts.split(" | "))}
    return {"to_first_step_s": float(total), "stages": stages}


def save(name: str, report: dict, directory: Path = RESULTS) -> Path:
    """bench/results/<name>, and a copy in $OUT for the device tool to bring back."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(report, indent=2))
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, Path(out) / name)
    return path


def junit_summary(xml: Path) -> dict:
    """Counts and every test's outcome, duration and message from pytest's JUnit XML, with what it measured (its
    `record_property` figures: the device memory of each sharded load)."""
    if not xml.exists():
        return {"error": f"pytest wrote no {xml.name}"}
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    tests = []
    for case in suite.iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = (
                    {"failure": "failed", "error": "error", "skipped": "skipped"}[tag],
                    node.get("message"),
                )
        measured = {prop.get("name"): float(prop.get("value", "nan")) for prop in case.iter("property")}
        tests.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": round(float(case.get("time", 0)), 2),
                "message": (message or "")[:500] or None,
                **({"measured": measured} if measured else {}),
            }
        )
    counts = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
    return {**counts, "seconds": round(float(suite.get("time", 0)), 1), "tests": tests}


def stage_outcome(rc: int, summary: dict) -> tuple[int, str | None]:
    """A GPU stage that ran nothing, or skipped a test (for want of CUDA), proves nothing: a failure here."""
    if rc == 0 and (summary.get("passed", 0) == 0 or summary.get("skipped", 0)):
        return 1, "no GPU test passed, or some were skipped: this stage must run on a CUDA machine"
    return rc, None


def run_pytest_stage(stage: str, deadline: float | None = None) -> Ended:
    (command,) = commands(stage)
    junit = Path(command[-2].removeprefix("--junitxml="))
    junit.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    ended = run_until(command, deadline)
    summary = junit_summary(junit)
    report = {
        **facts(),
        "stage": stage,
        "command": " ".join(command),
        "budget_s": STAGES[stage].budget_s,
        "cut_at_deadline": ended.cut,
        "wall_s": round(time.time() - started, 1),
        **summary,
    }
    rc, note = stage_outcome(ended.rc, summary)
    report["exit_code"] = rc
    if note or ended.cut:
        report["note"] = "cut at its deadline: the tests after the last one reported did not run" if ended.cut else note
    junit.unlink(missing_ok=True)
    if stage == "job":
        save(JOB_STARTUP, job_startup(JOB_TMP))
    path = save(STAGES[stage].result, report)
    print(
        f"gpu-check {stage}: {summary.get('passed', 0)} passed, {summary.get('failed', 0)} failed, "
        f"{summary.get('error', 0)} errors, {summary.get('skipped', 0)} skipped in {report['wall_s']} s"
        f"{' (cut at its deadline)' if ended.cut else ''} → {path}"
    )
    return Ended(rc, ended.cut)


def run_bench_part(stage: str, deadline: float | None = None, toy_dir: Path | None = None) -> Ended:
    """One part of the bench in its own process, merged into the bench's report beside the other part's numbers
    (`toy_dir`: at toy size on CPU, results there, never to bench/results)."""
    part = STAGES[stage].bench_part
    toy = toy_dir is not None
    report_file = (toy_dir or RESULTS) / BENCH_RESULT
    fresh = part_file(report_file.parent, part)
    fresh.parent.mkdir(parents=True, exist_ok=True)
    fresh.unlink(missing_ok=True)
    (command,) = commands(stage, toy, report_file.parent)
    ended = run_until(command, deadline, {**os.environ, "RAYFT_BENCH_PARTS": part}, quiet=toy)
    if fresh.exists():
        earlier = json.loads(report_file.read_text()) if report_file.exists() else {}
        report = merge_parts(json.loads(fresh.read_text()), earlier)
        report.setdefault("versions", {}).update(facts()["versions"])
        save(report_file.name, report, report_file.parent)
        fresh.unlink()
        print_bench(report)
    return ended


def run_mfu(deadline: float | None = None, toy_dir: Path | None = None) -> Ended:
    """The measuring process (bench/gpu_mfu.py), cut at its deadline like any stage; its lines are written as each
    configuration ends, so a cut stage keeps every configuration that finished. On the device, where they went to
    $OUT, a copy lands in bench/results too."""
    (command,) = commands("mfu", toy_dir is not None, toy_dir or TOY_RESULTS)
    written = Path(command[command.index("--out") + 1]) / gpu_mfu.RESULT
    ended = run_until(command, deadline)
    if toy_dir is None and written.exists() and written.parent.resolve() != RESULTS.resolve():
        RESULTS.mkdir(parents=True, exist_ok=True)
        shutil.copy2(written, RESULTS / gpu_mfu.RESULT)
    lines = [json.loads(line) for line in written.read_text().splitlines()] if written.exists() else []
    print(f"gpu-check mfu: {len(lines)} line(s) in {written}{' (cut at its deadline)' if ended.cut else ''}")
    return ended


def merge_parts(report: dict, earlier: dict) -> dict:
    """The bench's parts run as stages of their own: one report with both (the other part's numbers taken from
    the report so far, when they were measured on the same GPU)."""
    from train_vs_trl import acceptance

    same_gpu = (earlier.get("gpu") or {}).get("name") == (report.get("gpu") or {}).get("name")
    for part in ("dense", "moe"):
        if part not in report and part in earlier and same_gpu:
            report[part] = earlier[part]
            report.setdefault("merged_from_earlier_run", []).append(part)
    report["acceptance"] = acceptance(report)
    return report


def print_bench(report: dict) -> None:
    """The numbers the acceptance is about, one line each."""
    lines = [f"gpu-check bench on {(report.get('gpu') or {}).get('name', 'CPU (toy)')}:"]
    dense, moe = report.get("dense"), report.get("moe")
    if dense:
        for system in ("rayft", "baseline"):
            d = dense[system]
            lines.append(
                f"  dense {system:8s} {d['tokens_per_s']:>10,.0f} tok/s  MFU(LoRA) {_pct(d['mfu_lora'])}  "
                f"MFU(6N) {_pct(d['mfu_6n'])}  peak GPU {d.get('peak_gpu_reserved_gib', '-')} GiB reserved"
            )
        lines.append(f"  dense rayft / TRL tokens/s: {dense['ratio_tokens_per_s']:.2f}x")
    if moe:
        m = moe["rayft"]
        lines.append(
            f"  scaled Mistral-Small-4 rayft {m['tokens_per_s']:>10,.0f} tok/s  MFU(LoRA) {_pct(m['mfu_lora'])}  "
            f"peak GPU {m.get('peak_gpu_reserved_gib', '-')} GiB reserved"
        )
    for key, verdict in (report.get("acceptance") or {}).items():
        ok = {True: "PASS", False: "FAIL", None: "n/a"}[verdict["ok"]]
        lines.append(f"  acceptance {key}: {verdict['value']} (bar {verdict['bar']}) {ok}")
    if not report.get("gpu"):
        lines.append("  (toy run on CPU: checks the code path, measures nothing)")
    print("\n".join(lines))


def _pct(value: float | None) -> str:
    return "  n/a" if value is None else f"{value:5.1%}"


# --------------------------------------------------------------------------------------------------------------------
# plan: the planner against the measured peak


def plan_configs(bench: dict, root: Path) -> dict[str, dict]:
    """The bench's two configs, each pointed at a config-only copy of its model (the planner needs no weights)."""
    sys.path.insert(0, str(REPO / "bench"))
    from train_vs_trl import model_config

    configs = {}
    for kind, overrides in (("dense", bench["settings"]["dense_model"]), ("moe", bench["settings"]["moe_model"])):
        if kind not in bench or "settings" not in bench[kind]:
            continue
        directory = root / kind
        model_config(kind, overrides.get("overrides", overrides)).save_pretrained(str(directory))
        raw = json.loads(json.dumps(bench[kind]["settings"]))
        raw["model"]["model_name_or_path"] = str(directory)
        configs[kind] = raw
    return configs


def run_plan(bench_file: Path) -> int:
    """`rayft plan` (printed as users see it) and the same numbers in-process, divided by the measured peaks."""
    import tempfile

    import yaml

    from rayft.config import Config
    from rayft.plan import meta_structure, plan_memory

    if not bench_file.exists():
        print(f"gpu-check plan: no {bench_file}: run the bench stages first (or carry its result)", file=sys.stderr)
        return 2
    bench = json.loads(bench_file.read_text())
    gpu_name = (bench.get("gpu") or {}).get("name", "")
    from rayft.gpus import GPUS

    gpu = next((name for name in GPUS if name.upper() in gpu_name), "h200")  # the GPU table's order: GH200 first
    root = Path(tempfile.mkdtemp(prefix="rayft-plan-"))
    cases = {}
    for kind, raw in plan_configs(bench, root).items():
        config = root / f"{kind}.yaml"
        config.write_text(yaml.safe_dump(raw))
        shown = subprocess.run(
            [sys.executable, "-m", "rayft.cli", "plan", "--config", str(config), "--num-nodes", "1", "--gpu", gpu],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        print(shown.stdout or shown.stderr)
        cfg = Config.from_dict(raw)
        estimate = plan_memory(cfg, meta_structure(cfg), 1, on_gpu=True, gpu=gpu)
        measured = bench[kind]["rayft"]
        overhead = sum(gib for name, gib in estimate.rows if name.startswith("CUDA"))
        reserved, allocated = measured.get("peak_gpu_reserved_gib"), measured.get("peak_gpu_allocated_gib")
        ratio = round(estimate.total_gib / reserved, 3) if reserved else None
        cases[kind] = {
            "estimate_gib": round(estimate.total_gib, 2),
            "rows": {name: round(gib, 3) for name, gib in estimate.rows},
            "measured_peak_reserved_gib": reserved,
            "measured_peak_allocated_gib": allocated,
            "ratio_estimate_to_reserved": ratio,
            "ratio_estimate_to_allocated": round(estimate.total_gib / allocated, 3) if allocated else None,
            # torch's peaks leave out the CUDA context and NCCL buffers the estimate's overhead row stands for
            "ratio_estimate_less_overhead_to_reserved": round((estimate.total_gib - overhead) / reserved, 3)
            if reserved
            else None,
            "within_10_percent": None if ratio is None else abs(ratio - 1) <= PLAN_TOLERANCE,
            "rayft_plan_exit_code": shown.returncode,
        }
        verdict = {True: "PASS", False: "FAIL", None: "n/a (no GPU measurement)"}[cases[kind]["within_10_percent"]]
        print(
            f"gpu-check plan {kind}: estimate {estimate.total_gib:.1f} GiB vs measured peak {reserved} GiB "
            f"reserved / {allocated} GiB allocated: ratio {ratio} → {verdict}"
        )
    shutil.rmtree(root, ignore_errors=True)
    report = {
        **facts(),
        "bench_file": bench_file.name,
        "gpu_plan_for": gpu,
        "cases": cases,
        "note": "the estimate includes 2 GiB CUDA/NCCL overhead that torch's reserved peak does not count",
    }
    save(STAGES["plan"].result, report, bench_file.parent)
    return 0 if all(c["rayft_plan_exit_code"] == 0 for c in cases.values()) else 1


# --------------------------------------------------------------------------------------------------------------------
# dry run: everything but the GPU


def kit_status() -> dict:
    """Is the device kit built here (it travels with `carry: [".gpu-kit"]`), and how big is it."""
    if not (KIT / "activate.sh").is_file():
        return {"present": False, "hint": "build it: ../shared/gpu/make_kit.sh (about 5 minutes)"}
    size = sum(f.stat().st_size for f in KIT.rglob("*") if f.is_file()) / 2**20
    manifest = KIT / "MANIFEST.txt"
    lines = manifest.read_text().splitlines() if manifest.exists() else []
    counts = {kind: sum(line.startswith(f"{tag} ") for line in lines)
              for kind, tag in (("shipped", "ship"), ("conditional", "cond"), ("left_to_device", "skip"))}  # fmt: skip
    built_from = next((line.split("project: ", 1)[1] for line in lines if line.startswith("# project: ")), None)
    return {"present": True, "mib": round(size, 1), "within_limit": size <= KIT_MAX_MIB, "manifest": bool(lines),
            **counts, "built_from": built_from}  # fmt: skip


def dry_run(toy: bool, toy_dir: Path = TOY_RESULTS) -> int:
    """The plan (the budget, deadline and commands of each stage of `all`, in minutes, and the total; the stages
    run alone); the measuring process's configurations planned at their GPU size; the bench configs built and
    validated, planned on H100 and H200; the kit. With --toy, the measuring process, the bench and the plan at toy
    size on CPU, their results in `toy_dir`."""
    import torch
    from train_vs_trl import GPU_SIZES, gpu_settings, model_config

    from rayft.config import Config
    from rayft.plan import meta_structure, plan_memory

    print(f"gpu-check dry run: torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    print("plan on one GPU (`--stage all`: one command, these stages in this order; a stage on the GPU still")
    print("running when its time is up is cut, and every stage writes its result as it ends):")
    for stage, deadline in deadlines(list(ALL), 0.0).items():
        budget = STAGES[stage].budget_s
        print(f"stage {stage} (budget {budget} s = {budget / 60:.1f} min, done by {deadline / 60:.1f} min): "
              f"{STAGES[stage].what}")  # fmt: skip
        _print_commands(stage)
    total = sum(STAGES[s].budget_s for s in ALL)
    print(
        f"total budget {total / 60:.1f} min ({total} s; at most {TOTAL_BUDGET_S / 60:.0f} min; the device: "
        f"{COMMAND_LIMIT_S / 60:.0f} min per command); progress after every stage → bench/results/{SUMMARY}"
    )
    print("run alone (`--stage NAME`, not in `all`):")
    for stage in (s for s in STAGES if s not in ALL):
        print(f"  {stage} (budget {STAGES[stage].budget_s / 60:.1f} min): {STAGES[stage].what}")
        _print_commands(stage)
    print(
        f"measuring process: start-up {gpu_mfu.STARTUP_S} s, then each configuration by its deadline (the time one"
        " leaves passes on); planned on H200 at the planner's MFU:"
    )
    for row in gpu_mfu.device_plan(toy_dir):
        planned = (
            f"{row['params'] / 1e9:.2f}B params ({row['held']}), planned {row['memory_gib']:.1f} GiB, "
            f"{row['steps']} steps x {row['step_s']:.2f} s"
            if "params" in row
            else "kernel"
        )
        trl = f"; then TRL's side, budget {row['trl_budget_s']} s" if row["trl_budget_s"] else ""
        alone = "" if row["default"] else "; alone (--only NAME), not in the stage"
        print(f"  {row['config']:<20} budget {row['budget_s']:>3} s  {planned}{trl}{alone}")
    s = GPU_SIZES["gpu"]
    root = Path("/tmp/rayft-gpu-bench")
    for kind in ("dense", "moe"):
        raw = gpu_settings(root, root / kind, root / "wikitext", s, moe=kind == "moe")
        cfg = Config.from_dict(raw)  # every key checked as a real run would
        structure = meta_structure(cfg, model_config(kind, s[kind]))
        estimates = {
            gpu: round(plan_memory(cfg, structure, 1, on_gpu=True, gpu=gpu).total_gib, 1) for gpu in ("h100", "h200")
        }
        print(
            f"bench config {kind}: {structure.architecture}, {structure.total / 1e9:.2f}B params, LoRA "
            f"{structure.lora / 1e6:.1f}M, {cfg.data.max_length} tokens/row x {cfg.train.gradient_accumulation_steps} "
            f"accumulation, AC {cfg.fsdp.activation_checkpointing}, {cfg.train.max_steps} steps; "
            f"planned GiB/GPU {estimates}"
        )
    kit = kit_status()
    print(f"gpu kit: {json.dumps(kit)}")
    if not toy:
        return 0
    print(f"toy measuring process on CPU ({MFU_COMMAND} --toy) → {toy_dir / gpu_mfu.RESULT}")
    measured = run_mfu(toy_dir=toy_dir)
    print("toy bench on CPU (bench/train_vs_trl.py --size gpu-toy) ...")
    ended = [run_bench_part(stage, toy_dir=toy_dir) for stage in STAGES if STAGES[stage].bench_part]
    if measured.rc or any(e.rc for e in ended):
        return 1
    return run_plan(toy_dir / BENCH_RESULT)


def _print_commands(stage: str) -> None:
    for command in commands(stage):
        env = f"RAYFT_BENCH_PARTS={STAGES[stage].bench_part} " if STAGES[stage].bench_part else ""
        print("   $ " + env + shlex.join(command).replace(sys.executable, "python").replace(str(REPO) + "/", ""))
    print(f"   → {STAGES[stage].result}")


def run_stage(stage: str, deadline: float | None) -> Ended:
    if stage == "mfu":
        return run_mfu(deadline)
    if stage in ("tests", "job"):
        return run_pytest_stage(stage, deadline)
    if STAGES[stage].bench_part:
        return run_bench_part(stage, deadline)
    return Ended(run_plan(RESULTS / BENCH_RESULT), cut=False)  # on the CPU, in seconds: never cut


def run_stages(stages: list[str], cut: bool) -> int:
    """The stages in turn, each cut at its deadline unless `cut` is off. bench/results/gpu_check_gpu.json is
    rewritten as each stage starts and ends (which finished, cut or not, and which is running), so a device command
    cut short still says how far it got."""
    started = time.monotonic()
    until = deadlines(stages, started) if cut else dict.fromkeys(stages)
    progress = {**facts(), "stages": {s: {"budget_s": STAGES[s].budget_s} for s in stages},
                "total_budget_s": sum(STAGES[s].budget_s for s in stages), "running": None}  # fmt: skip
    failed = False
    for stage in stages:
        progress["running"] = stage
        save(SUMMARY, progress)
        began = time.monotonic()
        ended = run_stage(stage, until[stage])
        progress["stages"][stage].update(exit_code=ended.rc, cut_at_deadline=ended.cut,
                                         wall_s=round(time.monotonic() - began, 1))  # fmt: skip
        failed = failed or ended.rc != 0 or ended.cut
    progress.update(running=None, wall_s=round(time.monotonic() - started, 1))
    save(SUMMARY, progress)
    return int(failed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=[*STAGES, "all"], default="tests")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: print and check what the stages would run")
    parser.add_argument("--toy", action="store_true", help="with --dry-run: run the bench and plan at toy size on CPU")
    parser.add_argument("--no-cut", action="store_true", help="let each stage run past its budget (one stage alone)")
    parser.add_argument("--out", type=Path, default=TOY_RESULTS, help="with --dry-run --toy: where the results go")
    args = parser.parse_args(argv)
    os.environ.update(OFFLINE)  # inherited by every stage's processes
    if args.dry_run:
        return dry_run(args.toy, args.out.resolve())
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU here; run it on the device (README: GPU check) or use --dry-run", file=sys.stderr)
        return 2
    return run_stages(list(ALL) if args.stage == "all" else [args.stage], cut=not args.no_cut)


if __name__ == "__main__":
    sys.exit(main())
