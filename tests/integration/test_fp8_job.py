"""The frozen base in FP8 (`model.frozen_dtype: auto` on the hub-layout Mistral-Small-4) and expert parallelism
through real `ray job submit` runs, and two jobs of the same default `ray.name` on one cluster at once.

One pair of concurrent submissions on the two-node test cluster serves every test here: both train the tiny FP8
Mistral-Small-4 (fp32 compute, LoRA on the MLA set, the shared expert and the routed experts), checkpointing and
evaluating every step, with the default `ray.name` and different output directories. The `reference` job runs
FSDP alone, uninterrupted; the `killed` one runs `parallel.expert_parallel: 2` and loses a worker (SIGKILL by PID
from Ray's state API) after its first checkpoint: Ray restarts the expert-parallel group, which resumes, and it must
end where the reference ends (the same sums in another order); a k = 1 run continuing from its checkpoint on gloo
ranks must too, and `rayft eval` of the reference's adapter (its workers on gloo ranks) must score the FP8 base as
the dequantised one. Every expected value comes from outside the code under test: the uninterrupted run, PEFT on a
model holding weights decoded from the checkpoint's raw E4M3 bytes with numpy (`test_weights._dequantised_reference`),
transformers loading the merged export. That a killed FP8 run resumes *exactly* is checked on gloo ranks
(test_local_trainer.py, Qwen3-MoE stored in FP8), a killed run on Ray exactly in test_recovery.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    STEPS,
    Fixtures,
    RayCluster,
    Run,
    Submitted,
    checkpointing_config,
    submit_no_wait,
    wait_for_jobs,
    working_dir,
    write_yaml,
)
from fixtures.local_run import eval_locally, train_locally
from peft import PeftModel
from safetensors.torch import load_file
from test_recovery import resumes, wait_until
from test_weights import _dequantised_reference
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import Mistral4Config, Mistral4ForCausalLM

from rayft.cli import eval_summary
from rayft.config import load_config

pytestmark = pytest.mark.ray

PROBE = torch.tensor([[1, 1784, 1937, 1278, 1812, 1321, 1261, 2], [1, 1278, 1821, 1932, 1044, 2, 11, 11]])


TOLERANCE = 1e-4  # EP and FSDP sum the same numbers in another order (fp32)
FROZEN = {"mistral4_hub": "auto", "qwen3_moe": "float8_e4m3fn"}  # FP8 either way: the checkpoint's, or stored so


def ep_config(fixtures: Fixtures, hub: Path, out: Path, k: int, frozen: str = "auto", **overrides) -> dict:
    """The checkpointing job on the MoE model at `hub` with LoRA on its experts, `k`-way expert parallel, the base
    stored as `frozen`; every checkpoint kept and the final adapter the last step's, so runs of other k compare."""
    cfg = checkpointing_config(fixtures, out, **overrides)
    cfg["model"].update(model_name_or_path=str(hub), torch_dtype="float32", frozen_dtype=frozen)
    cfg["lora"].update(target_modules=["auto"], target_experts=True, lora_dropout=0.0)
    cfg["fsdp"] = {"activation_checkpointing": True}
    cfg["train"].update(load_best_model_at_end=False, save_total_limit=None)  # final = the last step, all kept
    cfg["parallel"] = {"expert_parallel": k}
    return cfg


def assert_close_adapters(got: Path, want: Path) -> None:
    a, b = load_file(str(got / "adapter_model.safetensors")), load_file(str(want / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(".experts." in k for k in a)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=TOLERANCE, rtol=1e-3, msg=f"{got}: {key}")


def assert_close_losses(got, want, steps: range) -> None:
    """`got` and `want`: runs with `metrics()` (a Ray `Run`, or a gloo-rank `LocalRun`)."""
    mine = {r["step"]: r["loss"] for r in got.metrics()}
    theirs = {r["step"]: r["loss"] for r in want.metrics()}
    for step in steps:
        assert abs(mine[step] - theirs[step]) <= TOLERANCE, f"step {step}: {mine[step]} vs {theirs[step]}"


def _fp8_config(fx: Fixtures, hub: Path, out: Path) -> dict:
    cfg = checkpointing_config(fx, out, lora__lora_dropout=0.0, lora__target_experts=True, train__bf16=False)
    cfg["model"].update(model_name_or_path=str(hub), torch_dtype="float32")  # frozen_dtype auto: stays FP8
    cfg["lora"]["target_modules"] = ["auto"]
    cfg["fsdp"] = {"activation_checkpointing": True}  # target_experts needs it
    assert cfg["ray"].get("name") in (None, "ray_run")  # both jobs keep the default name
    return cfg


def _job_workers(address: str, submission_id: str) -> list[int]:
    """PIDs of the live training workers of this submission, from Ray's state API on the test's own cluster."""
    from ray.util.state import list_actors, list_jobs

    jobs = [j.job_id for j in list_jobs(address=address) if j.submission_id == submission_id and j.job_id]
    if not jobs:
        return []
    filters = [("job_id", "=", jobs[0]), ("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")]
    return [a.pid for a in list_actors(address=address, filters=filters) if a.pid]


@pytest.fixture(scope="module")
def fp8_jobs(ray_cluster: RayCluster, fixtures: Fixtures, mistral4_hub: Path, tmp_path_factory) -> dict[str, Run]:
    """`reference`: the FP8 job uninterrupted; `killed`: the same job expert parallel (k = 2), submitted at the
    same time with the same default `ray.name` into another output dir, whose worker is SIGKILLed after its first
    registered checkpoint (`ray.max_failures` 2: Ray restarts the group, which resumes from the latest checkpoint)."""
    root = tmp_path_factory.mktemp("fp8-jobs")
    jobs = {}
    for label in ("reference", "killed"):
        out = root / label
        out.mkdir()
        cfg = _fp8_config(fixtures, mistral4_hub, out)
        if label == "killed":
            cfg = ep_config(fixtures, mistral4_hub, out, 2, FROZEN["mistral4_hub"], train__bf16=False)
        config = write_yaml(out / "config.yaml", cfg)
        jobs[label] = Submitted(submit_no_wait(ray_cluster, config, working_dir(out)), Run(out, out / "job.log"))
    killed = jobs["killed"]
    wait_until(
        lambda: "checkpoint-000001" in killed.run.registered(),
        "the first checkpoint",
        killed.run,
        timeout=600,
        every=0.5,
    )
    group = wait_until(
        lambda: len(w := _job_workers(ray_cluster.address, killed.submission_id)) == 2 and w,
        "the two training workers",
        killed.run,
        timeout=600,
        every=0.5,
    )
    steps_before_kill = max((r["step"] for r in killed.run.metrics()), default=0)
    os.kill(max(group), signal.SIGKILL)
    wait_for_jobs(ray_cluster, list(jobs.values()))
    assert steps_before_kill < STEPS, "the job finished before its worker was killed"
    return {label: job.run for label, job in jobs.items()}


def test_fp8_job_trains_in_fp8_and_a_killed_expert_parallel_worker_resumes_to_the_uninterrupted_adapter(
    fp8_jobs: dict[str, Run],
):
    reference, killed = fp8_jobs["reference"], fp8_jobs["killed"]
    for run in (reference, killed):
        # 8 linears + 1 routed-expert stack per layer, 2 layers: the FP8 checkpoint stayed FP8 in memory
        assert "frozen base: 18 decoder matrices stored as FP8 E4M3" in run.text(), run.text()[:4000]
    losses = [r["loss"] for r in reference.metrics()]
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    text = killed.text()
    resumed = resumes(text)
    assert len(resumed) == 1 and resumed[0] >= 1, text[-6000:]
    assert "expert parallel: 2 MoE layers, 4 of 8 experts" in text, text[-6000:]
    assert [r["step"] for r in killed.metrics()] == list(range(1, STEPS + 1))
    assert_close_losses(killed, reference, range(1, STEPS + 1))
    assert_close_adapters(killed.out / "final", _last_adapter(reference))


def _last_adapter(run: Run) -> Path:
    """The adapter of the run's last step (its `final` is its best step's)."""
    return run.run_dir / f"checkpoint-{STEPS:06d}" / "adapter"


def test_the_expert_parallel_checkpoint_continues_with_one_rank_per_expert_to_the_uninterrupted_result(
    fp8_jobs: dict[str, Run], fixtures: Fixtures, mistral4_hub: Path, tmp_path: Path
):
    """The Ray run's k = 2 checkpoint continued with k = 1 on gloo ranks ends where the uninterrupted run ends."""
    reference, source = fp8_jobs["reference"], fp8_jobs["killed"].run_dir / f"checkpoint-{STEPS - 2:06d}"
    cfg = ep_config(
        fixtures,
        mistral4_hub,
        tmp_path / "k1-from-k2",
        1,
        FROZEN["mistral4_hub"],
        train__bf16=False,
        train__resume_from_checkpoint=str(source),
    )
    again = train_locally(cfg, 2)
    assert again.resumes() == [STEPS - 2], again.text()[-6000:]
    assert [r["step"] for r in again.metrics()] == [STEPS - 1, STEPS]
    assert_close_losses(again, reference, range(STEPS - 1, STEPS + 1))
    assert_close_adapters(again.out / "final", _last_adapter(reference))


def _checkpoint_files_present_and_loading(run: Run, tmp: Path) -> int:
    """Every registered checkpoint of `run`: each DCP file its metadata names is there and long enough, the state
    converts to one torch file holding the LoRA tensors, and the adapter loads. Returns the count."""
    registered = run.registered()
    assert registered, f"{run.run_dir}: nothing registered"
    for name in sorted(registered):
        state = run.run_dir / name / "state"
        metadata = FileSystemReader(str(state)).read_metadata()
        needed: dict[str, int] = {}
        for item in metadata.storage_data.values():
            needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
        assert len(needed) == 2, f"{state}: {sorted(needed)} (one file per rank expected)"
        for file, size in needed.items():
            assert (state / file).is_file() and (state / file).stat().st_size >= size, f"{state / file} lost"
        dcp_to_torch_save(state, tmp / f"{run.out.name}-{name}.pt")
        model = torch.load(tmp / f"{run.out.name}-{name}.pt", weights_only=False)["model"]
        assert model and all(".lora_" in k for k in model), f"{state}: {list(model)[:5]}"
        adapter = load_file(run.run_dir / name / "adapter" / "adapter_model.safetensors")
        assert set(adapter) == {k.replace(".default", "") for k in model}, name
    return len(registered)


def test_two_concurrent_jobs_with_the_default_name_keep_every_checkpoint_shard(fp8_jobs: dict[str, Run], tmp_path):
    """Issue 16: two jobs with the default `ray.name` and different output dirs, on one node pair at the same
    time (their workers share the nodes' spool directory): both finished, and every checkpoint each registered has
    all its shards and loads."""
    spans = {}
    for label, run in fp8_jobs.items():
        assert run.run_dir.name == "ray_run" and "rayft: final adapter:" in run.text()
        assert _checkpoint_files_present_and_loading(run, tmp_path) >= 2
        # from the run's identity (written as it starts training) to its final adapter
        spans[label] = ((run.run_dir / "rayft_run.json").stat().st_mtime, (run.out / "final").stat().st_mtime)
    (a_start, a_end), (b_start, b_end) = spans.values()
    assert a_start < b_end and b_start < a_end, f"the two jobs did not train at the same time: {spans}"


def _numpy_dequantised_text_model(hub: Path) -> Mistral4ForCausalLM:
    """The text model in fp32 holding the hub checkpoint decoded from its raw bytes with numpy (not rayft)."""
    text = json.loads((hub / "config.json").read_text())["text_config"]
    model = Mistral4ForCausalLM(Mistral4Config(**text)).float()
    tensors = {
        key.removeprefix("language_model."): tensor
        for key, tensor in _dequantised_reference(str(hub)).items()
        if key.startswith("language_model.")
    }
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    return model.eval()


def test_fp8_adapter_loads_with_peft_on_the_dequantised_base_and_the_merged_export_matches(
    fp8_jobs: dict[str, Run], mistral4_hub: Path, tmp_path
):
    final = fp8_jobs["reference"].out / "final"
    tuned = PeftModel.from_pretrained(_numpy_dequantised_text_model(mistral4_hub), str(final)).eval()
    with torch.no_grad():
        want = tuned(input_ids=PROBE).logits
        with tuned.disable_adapter():
            untuned = tuned(input_ids=PROBE).logits
    assert (want - untuned).abs().max() > 1e-3, "the adapter changes nothing"

    out = tmp_path / "merged"
    merged_run = subprocess.run(
        [
            sys.executable,
            "-m",
            "rayft.cli",
            "export",
            "--adapter",
            str(final),
            "--base",
            str(mistral4_hub),
            "--out",
            str(out),
            "--merge",
            "--dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert merged_run.returncode == 0, merged_run.stderr[-3000:]
    merged = Mistral4ForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    reference = tuned.merge_and_unload()  # PEFT folds the adapter (routed experts included) into the numpy base
    ours, theirs = merged.state_dict(), reference.state_dict()
    assert set(ours) == set(theirs)
    for key, tensor in theirs.items():
        torch.testing.assert_close(ours[key], tensor, rtol=1e-6, atol=1e-6, msg=key)
    with torch.no_grad():
        got = merged(input_ids=PROBE).logits
    assert (got - want).abs().max().item() < 1e-4


def _eval(config: Path, *overrides: str, adapter: Path) -> tuple[float, str]:
    """`rayft eval --config CONFIG --adapter ADAPTER --override ...` on gloo ranks (`eval_locally`: the command's
    driver part and workers, the config read as the command reads it): the loss its result line prints, and the
    eval's log."""
    scored = eval_locally(load_config(config, overrides), adapter)
    line = eval_summary(scored.result, adapter=True)
    found = re.search(r"eval .* on 'validation' \([\d,]+ rows\): loss ([\d.]+), perplexity ([\d.]+)", line)
    assert found, line + scored.text()[-3000:]
    assert float(found[2]) == pytest.approx(math.exp(float(found[1])), rel=1e-3)
    return float(found[1]), scored.text()


def test_eval_on_the_fp8_base_scores_as_the_dequantised_fp32_base(
    fp8_jobs: dict[str, Run], fixtures: Fixtures, mistral4_hub: Path, tmp_path: Path
):
    """`rayft eval --adapter final` with the base kept in FP8 (`auto`) and dequantised at load (`float32`): the
    same loss, and the one training reported for that (best) checkpoint. (The second eval runs from a copy of the
    job's config with another output dir: each eval has its own run dir.) `rayft eval` through Ray Train is
    test_job_e2e.py's."""
    run = fp8_jobs["reference"]
    copy = write_yaml(tmp_path / "config.yaml", _fp8_config(fixtures, mistral4_hub, tmp_path))
    fp8, fp8_log = _eval(run.out / "config.yaml", adapter=run.out / "final")
    fp32, fp32_log = _eval(copy, "model.frozen_dtype=float32", adapter=run.out / "final")
    assert "stored as FP8 E4M3" in fp8_log and "stored as FP8 E4M3" not in fp32_log, fp8_log[-3000:]
    assert fp8 == pytest.approx(fp32, rel=1e-4)
    best = min(r["eval_loss"] for r in run.metrics() if "eval_loss" in r)
    assert fp8 == pytest.approx(best, abs=2e-4)
