"""User errors end with exit code 2 and one short message naming the key or path, from both `rayft validate`
and the job entrypoint, before any cluster work starts; a good config validates with exit 0. The cases run `rayft`
in this process (the interpreter's imports are the cost of a subprocess, ~10 s here); each entrypoint also runs once
as the process a user starts, for its exit code and its output."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, CliResult, Fixtures, run_cli, tiny_config, write_yaml


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # never join a cluster by accident
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)


def _overrides(overrides: tuple[str, ...]) -> list[str]:
    return [a for o in overrides for a in ("--override", o)]


def _validate(capsys, config, *overrides: str) -> CliResult:
    return run_cli(capsys, "validate", "--config", str(config), *_overrides(overrides))


def _job(capsys, config, *overrides: str) -> CliResult:
    """What `jobs/mistral4.py ARGS` runs: `rayft train ARGS`."""
    return run_cli(capsys, "train", "--config", str(config), *_overrides(overrides))


CASES = {
    "unknown section": (["trainer.learning_rate=1e-4"], "unknown section 'trainer'"),
    "typo'd key": (["train.learnin_rate=1e-4"], "did you mean 'learning_rate'"),
    "wrong type": (["train.num_train_epochs=many"], "train.num_train_epochs must be an integer"),
    "negative learning rate": (["train.learning_rate=-0.001"], "train.learning_rate must be > 0"),
    "zero peak": (["train.peak_tflops=0"], "train.peak_tflops must be > 0"),
    "infinite learning rate": (["train.learning_rate=inf"], "train.learning_rate must be a finite number, got inf"),
    "negative seed": (["train.seed=-1"], "train.seed must be in [0, 4294967296), got -1"),
    "run name out of its folder": (["ray.name=.."], "ray.name must be one directory name inside the storage path"),
    "zero workers": (["ray.num_workers=0"], "ray.num_workers must be >= 1"),
    "unknown scheduler": (["train.lr_scheduler_type=cosine_annealing"], "train.lr_scheduler_type"),
    "missing model path": (["model.model_name_or_path=/nonexistent/model"], "/nonexistent/model does not exist"),
    "missing dataset path": (["data.dataset_name_or_path=/nonexistent/data"], "/nonexistent/data does not exist"),
    "LoRA targets match nothing": (["lora.target_modules=[q_a_proj]"], "its linear layers are"),
    "unknown tracker": (["train.report_to=comet"], "train.report_to: unknown value 'comet'"),
    "8-bit optimizer": (["train.optim=adamw_8bit"], "train.optim: adamw_8bit is a bitsandbytes optimizer"),
    # mlflow is not in the dev/CI environment (constraints.txt): the error a user without it would see
    "tracker library missing": (["train.report_to=mlflow"], "train.report_to: mlflow needs the mlflow package"),
    "resume from a missing checkpoint": (
        ["train.resume_from_checkpoint=/nonexistent/ckpt"],
        "train.resume_from_checkpoint: /nonexistent/ckpt does not exist",
    ),
}


@pytest.fixture(scope="module")
def good_config(fixtures: Fixtures, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    return write_yaml(tmp / "tiny.yaml", tiny_config(fixtures, tmp / "out"))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("command", [_validate, _job], ids=["rayft validate", "job"])
def test_user_errors_exit_2_with_a_short_message(command, case, good_config, capsys):
    import ray

    overrides, needle = CASES[case]
    result = command(capsys, good_config, *overrides)
    assert result.rc == 2, result.err[-3000:]
    assert needle in result.err
    assert "Traceback" not in result.err + result.out
    assert not ray.is_initialized(), "a Ray cluster was started before the error"


@pytest.mark.parametrize(
    "entrypoint", [["-m", "rayft.cli", "validate"], ["jobs/mistral4.py"]], ids=["rayft validate", "jobs/mistral4.py"]
)
def test_the_entrypoints_as_processes_exit_2_with_the_message_only(entrypoint, good_config):
    result = _run(*entrypoint, "--config", str(good_config), "--override", "train.learnin_rate=1e-4")
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith("rayft: config error: ") and "did you mean 'learning_rate'" in line, result.stderr


def test_a_good_config_validates(good_config, capsys):
    """The tiny config trains on CPU workers (ray.use_gpu: false): its memory plan is host memory, no GPU verdict."""
    result = _validate(capsys, good_config)
    assert result.rc == 0, result.err
    assert "config ok" in result.out and "LoRA modules: 15" in result.out
    assert re.search(
        r"trains on \(\S+train-00000-of-00001.parquet: record \d+; trained text in ⟦ ⟧\): ⟦<s> .+</s>⟧", result.out
    )
    assert re.search(r"memory plan: [\d.]+ GiB of host memory per CPU worker on 2 workers", result.out), result.out
    assert "fits" not in result.out and "GPU on" not in result.out
    result = _validate(capsys, good_config, "ray.use_gpu=true", "fsdp.param_dtype=auto")
    assert result.rc == 0, result.err
    assert re.search(r"memory plan: [\d.]+ GiB per GPU on 2 workers: fits h200", result.out), result.out
    # An elastic run is judged where each worker holds the most, at its fewest workers: as a run of one worker.
    on_gpu = ("ray.use_gpu=true", "fsdp.param_dtype=auto")
    alone = _validate(capsys, good_config, *on_gpu, "ray.num_workers=1").out
    one = re.search(r"memory plan: ([\d.]+) GiB per GPU on 1 workers: fits", alone)
    result = _validate(capsys, good_config, *on_gpu, "ray.num_workers=[1, 2]")
    assert result.rc == 0 and one, (result.err, alone)
    fewest = r"memory plan: ([\d.]+) GiB per GPU on 1 workers \(the fewest of ray.num_workers \[1, 2\]\): fits"
    assert re.search(fewest, result.out)[1] == one[1], result.out


def test_validate_says_what_activation_checkpointing_does_and_costs(good_config, capsys):
    """`fsdp.activation_checkpointing`: on CPU workers auto keeps no recompute (no GPU to fit); on a GPU auto finds
    the tiny model fits without recompute, and an explicit full says what it saves and costs against none."""
    result = _validate(capsys, good_config)
    assert "activation checkpointing auto → none (CPU workers: no GPU to fit)" in result.out, result.out
    on_gpu = ("ray.use_gpu=true", "fsdp.param_dtype=auto")
    result = _validate(capsys, good_config, *on_gpu)
    line = r"activation checkpointing auto → none \(FSDP, fp32 base, h200\): [\d.]+ GiB/GPU, step [\d.]+ s \(no layer"
    assert re.search(line, result.out), result.out
    result = _validate(capsys, good_config, *on_gpu, "fsdp.activation_checkpointing=full")
    found = re.search(
        r"activation checkpointing full \(FSDP, fp32 base, h200\): ([\d.]+) GiB/GPU, step ([\d.]+) s; without "
        r"recompute ([\d.]+) GiB/GPU \(fits\), step ([\d.]+) s: recompute saves ([\d.]+) GiB and costs ([\d.]+) s "
        r"a step",
        result.out,
    )
    assert found, result.out
    full_gib, full_s, none_gib, none_s, saved, cost = map(float, found.groups())
    assert full_gib <= none_gib and full_s >= none_s and saved >= 0 and cost >= 0, found.groups()


@pytest.mark.parametrize("command", [_validate, _job])
def test_a_torch_older_than_the_floor_is_refused_in_one_line(command, good_config, capsys, monkeypatch):
    """A cluster image's own torch below the oldest release rayft runs on (faked here): refused before anything is
    built, naming the version found and the install that fixes it."""
    import torch

    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    result = command(capsys, good_config)
    assert result.rc == 2 and result.err.strip().count("\n") == 0, result.err
    assert "torch 2.10.0+cu128 is older than 2.11" in result.err and "pip install 'torch>=2.11'" in result.err
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")  # the floor itself passes
    assert _validate(capsys, good_config).rc == 0


@pytest.mark.parametrize("flag", [["--num-nodes", "2", "0"], ["--gpus-per-node", "0"]], ids=["nodes", "gpus"])
def test_plan_refuses_zero_nodes_or_gpus(flag, capsys):
    result = run_cli(capsys, "plan", "--preset", "mistral-small-4", *flag)
    assert result.rc == 2, result.err[-3000:]
    assert f"{flag[0]} must be >= 1" in result.err and "Traceback" not in result.err


def test_seed_config_validates_only_where_its_paths_exist(fixtures: Fixtures, tmp_path, capsys):
    from conftest import SEED_CONFIG

    result = _validate(capsys, SEED_CONFIG)
    assert result.rc == 2 and "model.model_name_or_path" in result.err
    result = _validate(
        capsys,
        SEED_CONFIG,
        f"model.model_name_or_path={fixtures.model}",
        f"data.dataset_name_or_path={fixtures.dataset}",
        f"train.output_dir={tmp_path}",
    )
    assert result.rc == 0, result.err
    for line in ("config ok", "train data: split 'train'", "records: text", "LoRA modules:", "memory plan:"):
        assert line in result.out, result.out


def test_validate_names_where_the_run_writes_and_what_a_relative_path_resolves_against(
    good_config, tmp_path, monkeypatch, capsys
):
    """The final adapter and the run directory as the job will resolve them; a relative output_dir or storage_path
    is named as relative with the directory it resolves to (under `ray job submit --working-dir`, Ray's temporary
    copy). The expected paths are built here from the working directory the test sets."""
    result = _validate(capsys, good_config)
    out = yaml.safe_load(good_config.read_text())["train"]["output_dir"]
    assert f"  writes: final adapter {out}/final, run directory {out}/ray_run" in result.out, result.out
    assert "is relative" not in result.err
    monkeypatch.chdir(tmp_path)
    result = _validate(capsys, good_config, "train.output_dir=out", "ray.storage_path=runs", "ray.name=trial")
    assert result.rc == 0, result.err
    assert f"  writes: final adapter {tmp_path}/out/final, run directory {tmp_path}/runs/trial" in result.out
    for key, value in (("train.output_dir", "out"), ("ray.storage_path", "runs")):
        note = f"{key} '{value}' is relative: it resolves against the working directory, to {tmp_path}/{value};"
        assert f"rayft: warning: {note}" in result.err, result.err
    result = _validate(capsys, good_config, "train.warmup_steps=3")
    assert "train.warmup_steps 3: checked against the run's steps when the job counts its records" in result.out
    assert "train.warmup_steps" not in _validate(capsys, good_config, "train.max_steps=4", "train.warmup_steps=3").out


def test_strict_spread_on_a_one_node_local_cluster_is_refused_not_hung(good_config):
    """No cluster to join → a local one-node Ray starts (in a process of its own, as a job would); it can never
    place 2 workers on 2 nodes."""
    strict = ("--override", "ray.placement_strategy=STRICT_SPREAD")
    result = _run("jobs/mistral4.py", "--config", str(good_config), *strict)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "ray.placement_strategy: STRICT_SPREAD" in result.stderr and "PACK" in result.stderr


def test_eval_result_line_with_and_without_a_perplexity():
    """`rayft eval` on a split whose loss is not finite (perplexity null) prints its line instead of crashing."""
    import math

    from rayft.cli import eval_summary

    empty = {"split": "validation", "rows": 0, "eval_loss": math.nan, "eval_perplexity": None}
    line = eval_summary(empty, adapter=False)
    assert line.startswith("rayft: eval base model on 'validation' (0 rows): loss nan, perplexity n/a")
    scored = {"split": "test", "rows": 1234, "eval_loss": 2.5, "eval_perplexity": math.exp(2.5)}
    assert eval_summary(scored, adapter=True).endswith("(1,234 rows): loss 2.5000, perplexity 12.182")


@pytest.mark.parametrize(
    ("overrides", "extra", "needle"),
    [
        ([], [], "--with-base compares the base model with an adapter: add --adapter DIR"),
        (["train.objective=dpo", "data.packing=false"], ["--adapter", "out/final"], "train.objective dpo already"),
    ],
    ids=["without an adapter", "with dpo"],
)
def test_eval_with_base_refuses_what_it_cannot_compare(overrides, extra, needle, good_config, capsys):
    """`rayft eval --with-base` needs an adapter to compare the base with, and has nothing to add to DPO's eval
    (which scores against the base already): exit 2 before any cluster work."""
    result = run_cli(capsys, "eval", "--config", str(good_config), "--with-base", *extra, *_overrides(overrides))
    assert result.rc == 2, result.err[-3000:]
    assert needle in result.err and "Traceback" not in result.err


def test_plan_of_a_cpu_config_says_it_plans_gpus(capsys):
    """`rayft plan` sizes GPU clusters: for a config that trains on CPU workers it says so before its GPU verdicts."""
    result = run_cli(
        capsys,
        "plan",
        "--preset",
        "mistral-small-4",
        "--no-layouts",
        "--override",
        "ray.use_gpu=false",
        "--override",
        "fsdp.param_dtype=auto",
    )
    assert result.rc == 0, result.err[-3000:]
    assert result.out.startswith("rayft plan: the config trains on CPU workers (ray.use_gpu: false)"), result.out
    result = run_cli(capsys, "plan", "--preset", "mistral-small-4", "--no-layouts")
    assert result.rc == 0 and "CPU workers" not in result.out


def test_ctrl_c_during_training_exits_130_with_one_line(fixtures: Fixtures, tmp_path):
    """Ctrl-C on a job started from a terminal (its own local Ray): Ray Train aborts the run gracefully and ends
    fit() with SystemExit, which used to leave the process with exit 1 and no word; documented is 130 and a line.
    The signal goes to the process this test started (by PID), after its second step."""
    import signal

    config = write_yaml(tmp_path / "long.yaml", tiny_config(fixtures, tmp_path / "out", max_steps=500, logging_steps=1))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    job = subprocess.Popen(
        [sys.executable, "jobs/mistral4.py", "--config", str(config)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = []
        for line in job.stdout:
            seen.append(line)
            if re.search(r"step 2/500 ", line):
                job.send_signal(signal.SIGINT)
                break
        rest = job.communicate(timeout=300)[0]
    finally:
        if job.poll() is None:
            job.kill()
    text = "".join(seen) + rest
    assert job.returncode == 130, text[-4000:]
    said = [line for line in text.splitlines() if line.startswith("rayft: interrupted")]
    assert said == [
        f"rayft: interrupted: {tmp_path / 'out' / 'ray_run'} keeps its checkpoints; the same command continues the run"
    ], text[-4000:]
    assert "Traceback" not in text, text[-4000:]
