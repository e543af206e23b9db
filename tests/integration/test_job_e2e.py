"""The product path for real: `ray job submit` → TorchTrainer (2 workers, gloo, FSDP2 + LoRA) → Ray Data → Ray
checkpoints, on a two-node local Ray cluster."""

from __future__ import annotations

import hashlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    CPU_PEAK_TFLOPS,
    REPO,
    SEED_CONFIG,
    STEPS,
    Fixtures,
    RayCluster,
    Run,
    submit_job,
)
from fixtures import hf_cache
from fixtures.cluster import dashboard_get
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM

from rayft.config import LoraConfig
from rayft.model.lora import peft_config

pytestmark = pytest.mark.ray

PROGRESS = re.compile(r"step (\d+)/(\d+) \| epoch [\d.]+ \| loss ([\d.]+)(?: \| eval_loss ([\d.]+))?")


def _progress(logs: str) -> list[tuple[int, float, float | None]]:
    """One (step, loss, eval_loss) per logged step: with two nodes on one machine Ray prints worker lines twice."""
    steps = {int(m[1]): (int(m[1]), float(m[3]), float(m[4]) if m[4] else None) for m in PROGRESS.finditer(logs)}
    return [steps[s] for s in sorted(steps)]


def _assert_succeeded(job) -> str:
    logs = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in logs, logs[-6000:]
    return logs


def test_tiny_job_trains_checkpoints_and_exports_a_correct_adapter(reference_run: Run, fixtures: Fixtures, tmp_path):
    """The tiny job (2 workers, a checkpoint every step) as `ray job submit` ran it for the recovery tests."""
    logs = reference_run.text()
    progress = _progress(logs)
    assert len(progress) >= STEPS, logs[-4000:]
    losses = [loss for _, loss, _ in progress]
    assert losses[-1] < losses[0] - 1.0, f"training loss did not go down: {losses}"
    assert any(ev is not None for _, _, ev in progress), "no eval_loss reported"
    assert "final adapter:" in logs

    final = reference_run.out / "final"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in final.iterdir()}
    last = reference_run.run_dir / f"checkpoint-{STEPS:06d}"
    cfg = yaml.safe_load((reference_run.out / "config.yaml").read_text())
    _assert_adapter_matches_training_state(fixtures.model, last / "adapter", last / "state", cfg, tmp_path)


TRAIN_FIELDS = {
    "step",
    "epoch",
    "loss",
    "learning_rate",
    "grad_norm",
    "tokens_per_s",
    "tokens_per_s_per_worker",
    "step_time_s",
    "data_wait_share",
    "mfu_6n",
    "mfu_lora",
    "flops_per_token_6n",
    "flops_per_token_lora",
    "peak_tflops",
    "memory_allocated_gib",
    "memory_reserved_gib",
    "host_rss_gib",
    "trainable_params",
    "total_params",
    "elapsed_s",
    "checkpoint_stall_s",
}


def test_run_is_visible_in_job_logs_run_files_prometheus_and_the_dashboard(reference_run: Run, ray_cluster):
    logs = reference_run.text()
    # start-up summary, once, before the workers start
    assert re.search(r"run ray_run: 2 workers \(CPU\) on a 2-node Ray cluster", logs), logs[:4000]
    assert re.search(r"LoRA r=\d+ on 15 modules \(.*q_proj.*\), [\d,]+ trainable", logs)
    batch = re.search(r"effective batch (\d+) = 2 per device × (\d+) accumulation × 2 workers; ([\d,]+) tokens", logs)
    assert batch and int(batch[1]) == 2 * int(batch[2]) * 2 and int(batch[3].replace(",", "")) == int(batch[1]) * 32
    assert re.search(rf"→ {STEPS} steps", logs)
    # one progress line per logging step (every step here), with throughput, MFU against the stated CPU peak
    # (train.peak_tflops), memory and ETA
    line = re.compile(
        r"step (\d+)/\d+ \| epoch [\d.]+ \| loss [\d.]+ .*\| tok/s [\d,]+ \| step [\d.]+s "
        r"\| MFU\(LoRA\) [\d.]+% \| MFU\(6N\) [\d.]+% .*\| rss [\d.]+ GiB \| ETA \d+m\d+s"
    )
    assert {int(m[1]) for m in line.finditer(logs)} == set(range(1, STEPS + 1)), logs[-4000:]
    assert f"peak {CPU_PEAK_TFLOPS:g} TFLOP/s per worker (train.peak_tflops)" in logs
    per_token = re.search(r"FLOPs/token: ([\d.]+) G \(6N\), ([\d.]+) G \(LoRA-aware\)", logs)
    assert per_token, logs[:4000]

    rows = reference_run.metrics()
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    for row in train_rows:
        assert set(row) >= TRAIN_FIELDS, TRAIN_FIELDS - set(row)
        # MFU = tokens/s per worker × the window's FLOPs per token / the stated peak; the window counts the keys its
        # documents attended, at most the logged figure's (full-length documents, 3 decimals of GFLOP)
        assert row["peak_tflops"] == CPU_PEAK_TFLOPS
        for kind, logged in (("6n", per_token[1]), ("lora", per_token[2])):
            flops = row[f"flops_per_token_{kind}"]
            assert 0 < flops <= float(logged) * 1e9 + 0.5e6, (kind, row)
            expected = row["tokens_per_s_per_worker"] * flops / (CPU_PEAK_TFLOPS * 1e12)
            assert row[f"mfu_{kind}"] == pytest.approx(expected, rel=0.01, abs=2e-6), (kind, row)
        assert row["memory_allocated_gib"] is None and row["memory_reserved_gib"] is None
        assert row["host_rss_gib"] > 0.1 and row["tokens_per_s"] > 0 and row["step_time_s"] > 0
        assert row["tokens_per_s_per_worker"] == pytest.approx(row["tokens_per_s"] / 2)
        assert 0 <= row["data_wait_share"] < 1 and 0 < row["trainable_params"] < row["total_params"]
    evals = [r for r in rows if "eval_loss" in r]
    assert evals and all(r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"])) for r in evals)

    png = (reference_run.run_dir / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    scraped = (reference_run.out / "scraped.prom").read_text()
    for gauge in ("ray_rayft_tokens_per_s", "ray_rayft_loss", "ray_rayft_step"):
        assert re.search(rf'^{gauge}\{{.*run="ray_run".*\}} [\d.e+-]+$', scraped, re.M), scraped[:2000]

    with dashboard_get(f"{ray_cluster.dashboard}/api/train/v2/runs/v1", timeout=30) as response:
        runs = json.loads(response.read())["train_runs"]
    assert any(run["name"] == "ray_run" for run in runs), [run["name"] for run in runs]


RAY_PREFIX = re.compile(r"^(?:\x1b\[[\d;]*m)*\((\w+) pid=(\d+)(?:, ip=[\d.]+)?\)(?:\x1b\[[\d;]*m)*\s?(.*)$")
RAY_TRAIN_DATA = ("TrainController", "RayTrainWorker", "SplitCoordinator", "DatasetManager", "MapWorker")
# rayft's own lines from rank 0 (Ray Train formats a worker's log records as the bare message)
RAYFT_WORKER_LINE = re.compile(
    r"^(step \d+/\d+ \||checkpoint-\d+: training paused|first batch after|start-up |final adapter written|resumed from"
    r"|removed |kept |FLOPs/token|loss: |compute: |frozen base: )"
)


def test_job_log_has_one_line_per_event_and_hides_no_trouble(reference_run: Run):
    """The reference run's job log at default verbosity (a log line, an evaluation and a save every step): Ray Train
    and Ray Data together print at most one line per such event, Ray's routine per-save and per-execution lines
    are gone, no rank-0 line appears twice and no line of one rank is repeated by another; the start-up profile
    is in the log and in metrics.jsonl's first row."""
    text = reference_run.text()
    lines = text.splitlines()
    messages = [m[3] if (m := RAY_PREFIX.match(line)) else line for line in lines]  # without the worker prefix
    first = next(i for i, message in enumerate(messages) if re.match(r"step 1/\d+ \|", message))
    last = next(i for i, line in enumerate(lines) if "final adapter written to" in line)
    ray_lines = []
    for line in lines[first : last + 1]:
        m = RAY_PREFIX.match(line)
        if m and m[1] in RAY_TRAIN_DATA and not RAYFT_WORKER_LINE.match(m[3]):
            ray_lines.append(line)
    events = 3 * STEPS  # logging, eval and save at every step
    assert len(ray_lines) <= events, "\n".join(ray_lines)
    for chatter in (
        "Checkpoint successfully created",
        "Reporting training result",
        "Execution plan of Dataset",
        "Starting execution of Dataset",
        "execution finished in",
    ):
        assert chatter not in text, chatter
    saves = [m for m in messages if re.match(r"checkpoint-\d+: training paused [\d.]+ s", m)]
    assert len(saves) == STEPS, saves  # one line per save, with its pause

    # each line once (continuation lines of a traceback or warning may repeat: `  warnings.warn(`)
    worker_lines = [m for m in map(RAY_PREFIX.match, lines) if m and m[1] == "RayTrainWorker" and m[3][:1].strip()]
    full = [m[0] for m in worker_lines]
    assert len(full) == len(set(full)), [x for x in full if full.count(x) > 1][:5]  # no line printed twice
    by_text: dict[str, set[str]] = {}
    for m in worker_lines:
        by_text.setdefault(m[3], set()).add(m[2])
    repeated = {text: pids for text, pids in by_text.items() if len(pids) > 1}
    assert not repeated, repeated  # no rank repeats another's line

    profile = next(filter(None, (re.match(r"start-up ([\d.]+) s to the first step: (.*) \(s\)", m) for m in messages)))
    stages = dict(part.rsplit(" ", 1) for part in profile[2].split(" | "))
    for stage in (
        "launch",
        "preflight_data",
        "ray_start",
        "data_plan",
        "worker_group_start",
        "model_build_load",
        "first_batch",
        "first_step",
    ):
        assert stage in stages, stages
    assert sum(map(float, stages.values())) <= float(profile[1]) + 0.5  # stages are parts of the whole
    first_row = reference_run.metrics()[0]
    assert set(first_row["startup"]) >= {*stages, "to_first_step_s"} and "startup" not in reference_run.metrics()[1]


EVAL_LINE = re.compile(
    r"eval (base model|base \+ adapter) on '\w+' \([\d,]+ rows\): loss ([\d.]+), perplexity ([\d.]+)"
)


def _eval(cluster, config: Path, *args: str) -> dict[str, float]:
    """`rayft eval` on the test cluster: the loss of each model its result lines name."""
    env = {**cluster.env, "RAY_ADDRESS": cluster.address}
    result = subprocess.run(
        [sys.executable, "-m", "rayft.cli", "eval", "--config", str(config), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    found = EVAL_LINE.findall(result.stdout)
    assert found, result.stdout + result.stderr[-3000:]
    for _, loss, perplexity in found:
        assert float(perplexity) == pytest.approx(math.exp(float(loss)), rel=1e-3)
    return {model: float(loss) for model, loss, _ in found}


def test_eval_scores_the_base_model_and_the_trained_adapter(reference_run: Run, ray_cluster):
    """`rayft eval --adapter output_dir/final --with-base` reproduces the eval loss training reported for that
    adapter (the best checkpoint's: load_best_model_at_end), and scores the untrained base, in the same job, worse."""
    config = reference_run.out / "config.yaml"
    losses = _eval(ray_cluster, config, "--adapter", str(reference_run.out / "final"), "--with-base")
    best = min(r["eval_loss"] for r in reference_run.metrics() if "eval_loss" in r)
    assert losses["base + adapter"] == pytest.approx(best, abs=2e-4)
    assert losses["base model"] > losses["base + adapter"] + 0.5


def _assert_adapter_matches_training_state(model_dir: Path, final: Path, dcp_dir: Path, cfg: dict, tmp: Path):
    """The gathered PEFT adapter reproduces the model rebuilt from the sharded DCP training state (written by
    each rank separately), and holds every shard of every LoRA tensor, trained."""
    adapter = load_file(final / "adapter_model.safetensors")
    modules = {k.rsplit(".lora_", 1)[0] for k in adapter}
    assert len(modules) == 2 * 7 + 1  # 2 layers x 7 projections + lm_head
    assert len(adapter) == 2 * len(modules)
    assert all(adapter[k].abs().sum() > 0 for k in adapter if ".lora_B." in k), "untrained (zero) lora_B tensors"
    assert "base_model.model.model.embed_tokens.weight" not in adapter, "frozen base weights in the adapter"

    dcp_to_torch_save(dcp_dir, tmp / "state.pt")
    trained = torch.load(tmp / "state.pt", weights_only=False)["model"]
    reference = get_peft_model(_base(model_dir), peft_config(LoraConfig(**cfg["lora"]), cfg["lora"]["target_modules"]))
    missing, unexpected = reference.load_state_dict(trained, strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    for key, tensor in trained.items():  # full, unsharded shapes in the export
        peft_key = key.replace(".default.", ".")
        assert adapter[peft_key].shape == tensor.shape, key

    exported = PeftModel.from_pretrained(_base(model_dir), str(final))
    probe = torch.tensor([[1, 1784, 1937, 1278, 1812, 1321, 1261, 2], [1, 1278, 1821, 1932, 1044, 2, 11, 11]])
    mask = (probe != 11).long()
    with torch.no_grad():
        want = reference.eval()(input_ids=probe, attention_mask=mask).logits
        got = exported.eval()(input_ids=probe, attention_mask=mask).logits
    assert (want - got).abs().max().item() < 1e-4


def _base(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


SEED_MODEL, SEED_DATASET = "rayft-test/tiny-mistral-small-4", "rayft-test/wikitext"  # hub ids in the seeded cache


def test_seed_yaml_fine_tunes_the_hub_layout_mistral_small4(
    ray_cluster: RayCluster, fixtures: Fixtures, mistral4_hub: Path, tmp_path
):
    """The seed recipe's YAML, unchanged, on a tiny Mistral-Small-4 in the hub's exact layout (FP8 Mistral3 wrapper →
    sharded per-rank loading), default STRICT_SPREAD placement (one worker per node), unpacked padded batches.
    Overridden: the model and dataset, named by hub id (and the model's revision) in a pre-seeded Hugging Face cache
    read offline, HF_HOME and HF_HUB_OFFLINE in the job's environment as a RayJob's pods have them; the output dir,
    LoRA targets `auto` (the seed's dense names miss the MLA projections), and a step cap, per-step logging and a
    learning rate that make 4 steps (16 micro-batches each) show a trend."""
    out, home = tmp_path / "seed-out", tmp_path / "hf-home"
    commit = hashlib.sha1(b"tiny-mistral-small-4").hexdigest()
    snapshot = hf_cache.seed(home / "hub", "model", SEED_MODEL, mistral4_hub, commit)
    hf_cache.seed(home / "hub", "dataset", SEED_DATASET, fixtures.dataset, hashlib.sha1(b"wikitext").hexdigest())
    job = submit_job(
        ray_cluster,
        "--config",
        str(SEED_CONFIG),
        "--override",
        f"model.model_name_or_path={SEED_MODEL}",
        "--override",
        f"model.revision={commit}",
        "--override",
        f"data.dataset_name_or_path={SEED_DATASET}",
        "--override",
        f"train.output_dir={out}",
        "--override",
        "lora.target_modules=[auto]",
        "--override",
        "train.max_steps=4",
        "--override",
        "train.logging_steps=1",
        "--override",
        "train.learning_rate=1e-2",
        env={"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"},
    )
    logs = _assert_succeeded(job)
    assert str(snapshot) in logs  # the hub id became the cached snapshot, which the workers were handed
    assert re.search(r"model Mistral4ForCausalLM \(.*\): [\d,]+ params, LoRA r=\d+ on 16 modules", logs), logs[:4000]
    # model.frozen_dtype auto: the FP8 checkpoint stays FP8 (8 linears + 1 expert stack per layer, 2 layers)
    assert "frozen base: 18 decoder matrices stored as FP8 E4M3" in logs, logs[:4000]
    progress = _progress(logs)
    losses = [loss for _, loss, _ in progress]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert progress[-1][2] is not None, "the final step reports an eval loss"
    assert len(list((out / "ray_run").glob("checkpoint-*"))) == 1  # save_steps 200 > steps: only the final one

    adapter = load_file(out / "final" / "adapter_model.safetensors")
    modules = {k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in adapter}
    assert modules == {
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert len(adapter) == 2 * 2 * 8  # A and B x 2 layers x 8 modules, nothing from the vision tower
    assert all(adapter[k].abs().sum() > 0 for k in adapter if ".lora_B." in k)
