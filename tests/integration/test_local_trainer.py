"""rayft's Trainer driven by plain gloo ranks (tests/fixtures/local_run.py): the launcher-agnostic core the Ray
workers run. A run stopped dead while saving a checkpoint and continued from the one before ends exactly where
the uninterrupted run ends (what Ray's restarts rely on), on the checkpointing job the Ray recovery tests use."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from conftest import STEPS, CliResult, Fixtures, checkpointing_config, run_cli, write_yaml
from fixtures.chat import chatml_expected
from fixtures.ledger import assert_each_record_once, ledger_rows
from fixtures.local_run import LocalRun, train_locally
from fixtures.moe_families import make_tiny_moe
from fixtures.preference import write_preference_data
from fixtures.preflight import assert_refused
from fixtures.small_vocab import FIXTURE_VOCAB
from fixtures.trackers import wandb_records
from safetensors.torch import load_file
from test_chat_job import TRAIN, assert_adapter_saved, chat_config
from test_dpo_job import dpo_config
from test_fp8_job import FROZEN, assert_close_adapters, assert_close_losses, ep_config

from rayft.train.runtime import PreemptionNotice
from rayft.train.spool import SPOOL_ROOT

EXACT = ("loss", "eval_loss", "learning_rate", "grad_norm")  # what depends only on what was trained
TOLERANCE = 1e-6  # exact resume: the same sums in the same order
REORDERED = 1e-4  # the same sums in another order, fp32 (as test_fp8_job's EP against FSDP)
TOKENIZER_IDS = FIXTURE_VOCAB  # the fixture tokenizer's: the embedding must have a row for each
OFFLINE_WANDB = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


@pytest.fixture(scope="module")
def qwen3_moe(fixtures: Fixtures, tmp_path_factory) -> Path:
    """Tiny Qwen3-MoE, fused expert keys, fp32 weights (FP8 storage is `model.frozen_dtype`'s)."""
    directory = tmp_path_factory.mktemp("qwen3-moe") / "m"
    return make_tiny_moe("qwen3_moe", directory, vocab_size=TOKENIZER_IDS, tokenizer_from=fixtures.model)


def _assert_same_training(got: LocalRun, want: LocalRun, steps: range, tolerance: float = TOLERANCE) -> None:
    mine, theirs = {r["step"]: r for r in got.metrics()}, {r["step"]: r for r in want.metrics()}
    for step in steps:
        for key in EXACT:
            assert abs(mine[step][key] - theirs[step][key]) < tolerance, f"step {step} {key}"
    a = load_file(got.out / "final" / "adapter_model.safetensors")
    b = load_file(want.out / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and a
    gap = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"adapter gap {gap:.3g}")
    assert gap < tolerance, f"adapter gap {gap}"


@pytest.fixture(scope="module")
def uninterrupted(fixtures: Fixtures, tmp_path_factory) -> LocalRun:
    out = tmp_path_factory.mktemp("local-reference")
    run = train_locally(checkpointing_config(fixtures, out), 2)
    assert [r["step"] for r in run.metrics()] == list(range(1, STEPS + 1))
    return run


def test_a_run_stopped_after_a_checkpoint_continues_to_the_uninterrupted_result(
    fixtures: Fixtures, uninterrupted: LocalRun, tmp_path: Path
):
    cfg = checkpointing_config(fixtures, tmp_path, train__report_to=["wandb"])
    stopped = train_locally(cfg, 2, crash_saving=3, env=OFFLINE_WANDB)
    assert [r["step"] for r in stopped.metrics()] == [1, 2] and not (stopped.out / "final").exists()
    assert not stopped.checkpoint(3).exists()
    # The failure closed what the run held open: its W&B run ended, marked failed; the spool is gone, step 3's
    # half-saved shards with it.
    (wandb_file,) = (stopped.out / "wandb").glob("offline-run-*/run-*.wandb")
    last = wandb_records(wandb_file)[-1]
    assert last.WhichOneof("record_type") == "exit" and last.exit.exit_code == 1, last
    run_id = json.loads((stopped.run_dir / "rayft_run.json").read_text())["run_id"]
    assert not list((Path(tempfile.gettempdir()) / SPOOL_ROOT).glob(f"*-{run_id}"))
    resumed = train_locally(cfg, 2, resume=stopped.checkpoint(2), env=OFFLINE_WANDB)
    assert [r["step"] for r in resumed.metrics()] == list(range(1, STEPS + 1))
    (finished,) = set((resumed.out / "wandb").glob("offline-run-*/run-*.wandb")) - {wandb_file}
    assert wandb_records(finished)[-1].exit.exit_code == 0  # the run that finished is not marked failed
    _assert_same_training(resumed, uninterrupted, range(1, STEPS + 1))


@pytest.mark.torch_agnostic
def test_a_drain_notice_saves_a_checkpoint_at_once_and_the_run_continues_from_it_exactly(
    fixtures: Fixtures, uninterrupted: LocalRun, tmp_path: Path
):
    """Ray's drain notice for a node of the run (`ray.preemption: checkpoint`, the default), first seen after step 2
    of a run whose periodic checkpoints come only at its end: step 2's checkpoint is saved at once, once for the
    notice though it stays up, the job log says what happened, and training goes on to the end. Continued from that
    checkpoint, as Ray restarts a preempted run, it ends where the uninterrupted run ends."""
    cfg = checkpointing_config(fixtures, tmp_path, train__save_steps=100)
    notice = PreemptionNotice(("node-b",), (1,), deadline=time.time() + 120)
    run = train_locally(cfg, 2, notices=[None, notice, notice])
    saved = sorted(p.name for p in run.run_dir.glob("checkpoint-*"))
    assert saved == ["checkpoint-000002", f"checkpoint-{STEPS:06d}"], saved
    text = run.text()
    assert re.search(
        r"preemption notice at step 2: node\(s\) node-b \(ranks \[1\]\) draining, deadline in 1\d\d s; "
        r"checkpoint-000002 holds the run",
        text,
    ), text[-3000:]
    assert text.count("preemption notice") == 1
    assert [r["step"] for r in run.metrics()] == list(range(1, STEPS + 1))
    resumed = train_locally(cfg, 2, resume=run.checkpoint(2))
    assert resumed.resumes()[-1] == 2
    _assert_same_training(resumed, uninterrupted, range(1, STEPS + 1))


@pytest.mark.torch_agnostic
def test_a_drain_notice_without_a_deadline_saves_at_once_and_says_so(fixtures: Fixtures, tmp_path: Path):
    """A drain that gave no deadline (`ray drain-node` without one; Ray then stops the group after its own default):
    the checkpoint is saved at the first look all the same, and the job log says no deadline was given."""
    cfg = checkpointing_config(fixtures, tmp_path, train__save_steps=100, train__max_steps=3)
    run = train_locally(cfg, 2, notices=[PreemptionNotice(("node-c",), (0,), deadline=None)])
    assert sorted(p.name for p in run.run_dir.glob("checkpoint-*")) == ["checkpoint-000001", "checkpoint-000003"]
    assert (
        "preemption notice at step 1: node(s) node-c (ranks [0]) draining, no deadline given; checkpoint-000001 "
        "holds the run" in run.text()
    ), run.text()[-3000:]


@pytest.mark.torch_agnostic
@pytest.mark.parametrize(
    ("logging_steps", "save_steps"), [(1, 1), (100, 2)], ids=["seen in the logged window", "seen before a save"]
)
def test_a_diverging_run_stops_at_the_step_keeps_its_last_finite_checkpoint_and_writes_no_final_adapter(
    fixtures: Fixtures, tmp_path: Path, logging_steps: int, save_steps: int
):
    """A learning rate of 1e30 (finite: the config takes it) makes the weights overflow within a few steps. The run
    stops with one line naming the step where the loss or gradient norm stopped being finite, found with the window's
    metrics (logging every step) or in the reduction before a save (logging only at the end); it writes no
    checkpoint after that step and no final adapter. The expected step is read from the run's own record: the rows
    logged, and the saved weights, not from the loop's verdict."""
    cfg = checkpointing_config(
        fixtures,
        tmp_path,
        train__learning_rate=1e30,
        train__logging_steps=logging_steps,
        train__save_steps=save_steps,
        train__max_steps=10,
        train__load_best_model_at_end=False,
        train__eval_strategy="no",
    )
    with pytest.raises(Exception, match=r"training stopped at step \d+") as err:
        train_locally(cfg, 2)
    (reason,) = re.findall(r"NonFinite: (training stopped at step .*)", str(err.value))
    print(reason)
    out, run_dir = tmp_path, tmp_path / "ray_run"
    assert not (out / "final").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["stopped"] == reason and "\n" not in reason
    stopped_at = rows[-1]["step"]
    saved = sorted(int(p.name.removeprefix("checkpoint-")) for p in run_dir.glob("checkpoint-*"))
    for step in saved:  # every checkpoint kept holds finite weights, and all come before the stop
        adapter = load_file(run_dir / f"checkpoint-{step:06d}" / "adapter" / "adapter_model.safetensors")
        assert adapter and all(t.isfinite().all() for t in adapter.values()) and step < stopped_at, step
    if logging_steps == 1:  # every step logged: the rows before are finite, the last is not
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows[:-1]), rows
        assert not (math.isfinite(rows[-1]["loss"]) and math.isfinite(rows[-1]["grad_norm"])), rows[-1]
        assert f"not finite from step {stopped_at} " in reason
    assert f"at step {stopped_at}:" in reason and "train.learning_rate 1e+30" in reason
    if saved:
        assert f"the last checkpoint, saved before it: {run_dir}/checkpoint-{saved[-1]:06d};" in reason, reason
    else:
        assert "no checkpoint was saved before it" in reason
    first = int(re.search(r"not finite from step (\d+) ", reason)[1])
    assert (saved[-1] if saved else 0) < first <= stopped_at, reason
    assert f"{out / 'final'} not written" in reason
    # What the driver makes of the record the workers left (they end without an error, so Ray does not retry the
    # run into the same divergence): the reason, as the failed run's one line.
    from rayft.launch import TrainingStopped, _raise_if_stopped
    from rayft.train.rundir import RunDir

    with pytest.raises(TrainingStopped) as stopped:
        _raise_if_stopped(RunDir(str(run_dir)))
    assert str(stopped.value) == reason


def test_an_elastic_run_shrunk_and_grown_back_ends_at_the_uninterrupted_result(fixtures: Fixtures, tmp_path: Path):
    """`ray.num_workers: [2, 3]`: three workers, stopped dead while saving step 3's checkpoint; continued on two
    from step 2's (as Ray restarts a run that lost a node at the size the cluster has), stopped right after step
    4's registered; continued on three from it (a node came back). Every step trains on the same records as the
    uninterrupted three-worker run's (one global order, 3 micro-batches a worker on two, 2 on three), with the same
    dropout draws (seeded per micro-batch): the losses and the adapter are the uninterrupted run's, up to the order
    in which the workers' sums are added (a fixed-size run on other sizes trains on other records: see
    test_elastic_data.py)."""
    # Evaluated: the 12 of the 16 validation records that split evenly at every size, in batches of one. A gentler
    # learning rate than the recovery tests' 3e-2, at which Adam's first steps grow the reordered sums' 1e-7 gaps
    # to 1e-4 within a few steps.
    elastic = {
        "ray__num_workers": [2, 3],
        "train__per_device_eval_batch_size": 1,
        "train__learning_rate": 3e-3,
        "train__record_ledger": True,
        "data__packing": False,  # each sequence a record, counted in the ledger
    }
    cfg = checkpointing_config(fixtures, tmp_path / "elastic", **elastic)
    reference = train_locally(checkpointing_config(fixtures, tmp_path / "reference", **elastic), 3)
    first = train_locally(cfg, 3, crash_saving=3)
    assert [r["step"] for r in first.metrics()] == [1, 2]
    second = train_locally(cfg, 2, resume=first.checkpoint(2), crash_saved=4)
    run = train_locally(cfg, 3, resume=second.checkpoint(4))
    assert run.resumes() == [2, 4]
    text = run.text()
    assert "written by 3 workers" in text and "written by 2 workers" in text, text[-3000:]
    assert [r["step"] for r in run.metrics()] == list(range(1, STEPS + 1))
    _assert_same_training(run, reference, range(1, STEPS + 1), REORDERED)
    # Each step's sequences in the global batch's order; step 3, trained again after the first stop, once.
    ledger = ledger_rows(run.run_dir)
    assert ledger == ledger_rows(reference.run_dir)
    t = cfg["train"]
    assert_each_record_once(ledger, STEPS, t["per_device_train_batch_size"] * t["gradient_accumulation_steps"] * 3)


@pytest.mark.torch_agnostic
def test_a_run_stopped_right_after_a_checkpoint_registered_keeps_that_steps_metrics(
    fixtures: Fixtures, uninterrupted: LocalRun, tmp_path: Path
):
    """Stopped between registering checkpoint 2 and writing step 2's row: the row the checkpoint was reported with
    is the history's, so the continued run's metrics.jsonl has every step."""
    cfg = checkpointing_config(fixtures, tmp_path)
    stopped = train_locally(cfg, 2, crash_saved=2)
    assert [r["step"] for r in stopped.metrics()] == [1] and stopped.checkpoint(2).exists()
    resumed = train_locally(cfg, 2, resume=stopped.checkpoint(2))
    assert [r["step"] for r in resumed.metrics()] == list(range(1, STEPS + 1))
    _assert_same_training(resumed, uninterrupted, range(1, STEPS + 1))


@pytest.mark.torch_agnostic
def test_the_losses_move_and_differ_between_seeds(fixtures: Fixtures, uninterrupted: LocalRun, tmp_path: Path):
    """The comparison above can fail: another seed (other dropout draws, another shuffle) trains otherwise."""
    losses = [r["loss"] for r in uninterrupted.metrics()]
    assert losses[-1] < losses[0], losses
    other = train_locally(checkpointing_config(fixtures, tmp_path, train__seed=7), 2)
    with pytest.raises(AssertionError):
        _assert_same_training(other, uninterrupted, range(1, STEPS + 1))


@pytest.mark.torch_agnostic
def test_another_runs_checkpoint_of_another_adapter_shape_is_refused_before_anything_starts(
    fixtures: Fixtures, uninterrupted: LocalRun, tmp_path: Path, capsys
):
    """`train.resume_from_checkpoint` naming a checkpoint of a run with another LoRA rank or target list: refused by
    validate (and the job's preflight), naming each setting with both values, where the job once loaded the model on
    every worker and failed with a size mismatch. Another learning rate or dataset is a new run's business: fine."""
    source = sorted(uninterrupted.run_dir.glob("checkpoint-*"))[0]
    changes = {"lora__r": 16, "lora__target_modules": ["q_proj"]}
    recorded = json.loads((uninterrupted.run_dir / "rayft_run.json").read_text())["settings"]

    def validate(name: str, **change) -> CliResult:
        (tmp_path / name).mkdir()
        raw = checkpointing_config(fixtures, tmp_path / name, train__resume_from_checkpoint=str(source), **change)
        return run_cli(capsys, "validate", "--config", str(write_yaml(tmp_path / name / "config.yaml", raw)))

    for key, value in changes.items():
        name = key.replace("__", ".")
        said = rf"{re.escape(name)} {re.escape(repr(recorded[name]))} → {re.escape(repr(value))}"
        pattern = rf"{re.escape(str(source))} holds the state of another model or adapter \({said}\)"
        assert_refused(validate(key, **{key: value}), rf"train\.resume_from_checkpoint: {pattern}")
    result = validate("lr", train__learning_rate=1e-3)
    assert result.rc == 0, result.err


def test_qwen3_moe_expert_parallel_resumes_exactly_and_continues_with_another_k(
    fixtures: Fixtures, qwen3_moe: Path, tmp_path: Path
):
    """A tiny Qwen3-MoE (fused expert keys, stored as FP8 by `model.frozen_dtype`, LoRA on attention and the routed
    experts) with `parallel.expert_parallel: 2`, stopped while saving its second checkpoint and continued from the
    first, ends where its uninterrupted FSDP-only run (k = 1) ends; a k = 1 run from the k = 2 run's checkpoint
    does too. (The same on the Ray cluster, with a killed worker: test_fp8_job.py, Mistral-Small-4.)"""
    frozen = FROZEN["qwen3_moe"]
    reference = train_locally(ep_config(fixtures, qwen3_moe, tmp_path / "fsdp", 1, frozen), 2)
    cfg = ep_config(fixtures, qwen3_moe, tmp_path / "ep", 2, frozen)
    stopped = train_locally(cfg, 2, crash_saving=2)
    assert [r["step"] for r in stopped.metrics()] == [1]
    run = train_locally(cfg, 2, resume=stopped.checkpoint(1))
    text = run.text()
    assert run.resumes() == [1] and "expert parallel: 2 MoE layers, 4 of 8 experts" in text, text[-6000:]
    assert "stored as FP8 E4M3" in text, text[-6000:]
    assert [r["step"] for r in run.metrics()] == list(range(1, STEPS + 1))
    assert_close_losses(run, reference, range(1, STEPS + 1))
    assert_close_adapters(run.out / "final", reference.out / "final")

    source = run.checkpoint(STEPS - 2)
    again = train_locally(
        ep_config(fixtures, qwen3_moe, tmp_path / "k1-from-k2", 1, frozen, train__resume_from_checkpoint=str(source)),
        2,
    )
    assert again.resumes() == [STEPS - 2], again.text()[-6000:]
    assert [r["step"] for r in again.metrics()] == [STEPS - 1, STEPS]
    assert_close_losses(again, reference, range(STEPS - 1, STEPS + 1))
    assert_close_adapters(again.out / "final", reference.out / "final")


def test_dpo_with_a_precomputed_reference_stopped_and_continued_ends_at_the_live_reference_run(
    fixtures: Fixtures, tmp_path: Path
):
    """`dpo.reference: precomputed` scores the reference log-probs in one pass and keeps them in the run; stopped dead
    while saving its step-4 checkpoint and continued from step 2, the run reads that table back instead of scoring
    again, and still lands on the run that scored the reference live (adapter off) every step: equal within float
    rounding of the two passes. (That Ray restarts a killed group from its checkpoint: test_recovery.py.)"""
    data = write_preference_data(tmp_path / "pairs", train=96, validation=16)
    live = train_locally(dpo_config(fixtures, data, tmp_path / "live"), 2)
    cfg = dpo_config(fixtures, data, tmp_path / "precomputed")
    cfg["dpo"]["reference"] = "precomputed"
    stopped = train_locally(cfg, 2, crash_saving=4)
    assert [r["step"] for r in stopped.metrics() if "loss" in r] == [1, 2, 3] and not stopped.checkpoint(4).exists()
    run = train_locally(cfg, 2, resume=stopped.checkpoint(2))
    text = run.text()
    assert run.resumes() == [2], text[-6000:]
    assert re.search(r"reference log-probs of 96 pairs scored in [\d.]+ s", text), text[-6000:]
    assert "reference log-probs of 96 pairs read from reference_logps.npz" in text, text[-6000:]
    assert "scores the reference live" not in text and "reference log-probs of" not in live.text()
    got, want = run.metrics(), live.metrics()
    assert [r["step"] for r in got] == [r["step"] for r in want] and [r["step"] for r in got][-1] == 6
    gaps = {
        f"{g['step']} {key}": abs(g[key] - w[key])
        for g, w in zip(got, want, strict=True)
        for key in ("loss", "rewards/margins", "eval_loss")
        if key in w
    }
    print("largest gap to the live reference's run:", max(gaps.items(), key=lambda kv: kv[1]))
    assert gaps and max(gaps.values()) < 1e-5, gaps
    a = load_file(run.out / "final" / "adapter_model.safetensors")
    b = load_file(live.out / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


@pytest.mark.torch_agnostic
def test_chat_template_job_uses_every_record_and_saves_the_adapter(fixtures: Fixtures, smollm2: Path, tmp_path: Path):
    """SmolLM2's `tokenizer.json` + chat template: the job's record pipeline (here in this process, as the driver runs
    it) keeps every conversation with the ids an independent encoding gives, and the two ranks train and save the
    adapter. (The tekken chat job: test_chat_job.py.)"""
    run = train_locally(chat_config(fixtures, smollm2, tmp_path, torch_dtype="float32"), 2)
    ids, _ = chatml_expected(smollm2)
    logs = run.text()
    assert f"{TRAIN} records, {TRAIN} examples, {TRAIN * len(ids):,} tokens" in logs, logs[-6000:]
    assert [r["step"] for r in run.metrics() if "loss" in r] == [1, 2], run.metrics()
    assert_adapter_saved(run.out, logs)


def _ray_checkpoint_config(raw: dict):
    """The retention the job hands Ray for `raw` (`launch._run_config`): save_total_limit, ranked by eval_loss."""
    from ray.train import CheckpointConfig

    return CheckpointConfig(
        num_to_keep=raw["train"]["save_total_limit"],
        checkpoint_score_attribute="eval_loss",
        checkpoint_score_order="min",
    )


@pytest.fixture(scope="module")
def stopped_at_3(fixtures: Fixtures, tmp_path_factory) -> LocalRun:
    """The checkpointing job stopped right after checkpoint 3 registered, with the registry Ray would have left
    (Ray's own checkpoint manager registering 1, 2, 3 with their metrics, its retention included)."""
    from fixtures.ray_registry import register

    cfg = checkpointing_config(fixtures, tmp_path_factory.mktemp("stopped-at-3"))
    stopped = train_locally(cfg, 2, crash_saved=3)
    names = [f"checkpoint-{step:06d}" for step in (1, 2, 3)]
    register(stopped.run_dir, names, _ray_checkpoint_config(cfg))
    return stopped


def _copy_of(run: LocalRun, fixtures: Fixtures, tmp_path: Path) -> tuple[dict, LocalRun]:
    """The config and a copy of `run`'s output dir under `tmp_path` (its run dir, registry and log with it)."""
    shutil.copytree(run.out, tmp_path / "out")
    copy = LocalRun(tmp_path / "out", tmp_path / "out" / run.run_dir.relative_to(run.out))
    return checkpointing_config(fixtures, copy.out), copy


def _delete_a_shard(checkpoint: Path) -> str:
    """Delete one DCP shard file its .metadata lists (as a copy cut short leaves it); its name."""
    shard = sorted((checkpoint / "state").glob("*.distcp"))[-1]
    shard.unlink()
    return shard.name


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.torch_agnostic
def test_a_damaged_newest_checkpoint_is_set_aside_and_out_of_rays_registry_before_the_run_continues(
    fixtures: Fixtures, stopped_at_3: LocalRun, tmp_path: Path, caplog
):
    """Checkpoint 3 lost a shard: before any worker, the driver renames it (not a byte deleted), drops it from Ray's
    registry, so Ray's own manager now hands the workers checkpoint 2, and says so in one warning line."""
    from fixtures.ray_registry import registered

    from rayft.train.checkpoint_dir import set_aside_damaged
    from rayft.train.rundir import RunDir

    raw, run = _copy_of(stopped_at_3, fixtures, tmp_path)
    config = _ray_checkpoint_config(raw)
    names, latest = registered(run.run_dir, config)
    assert latest == "checkpoint-000003" and "checkpoint-000002" in names, names
    shard = _delete_a_shard(run.checkpoint(3))
    before = _tree(run.run_dir)
    with caplog.at_level(logging.WARNING, logger="rayft"):
        set_aside_damaged(RunDir(str(run.run_dir)))
    assert not run.checkpoint(3).exists()
    aside = run.run_dir / "checkpoint-000003.damaged"
    renamed = {k.replace("checkpoint-000003.damaged/", "checkpoint-000003/"): v for k, v in _tree(run.run_dir).items()}
    snapshot = "checkpoint_manager_snapshot.json"
    assert {k: v for k, v in renamed.items() if k != snapshot} == {k: v for k, v in before.items() if k != snapshot}
    assert (
        aside.is_dir() and 3 not in RunDir(str(run.run_dir)).checkpoints()
    )  # out of rayft's own listing and housekeeping
    names_after, latest_after = registered(run.run_dir, config)
    assert latest_after == "checkpoint-000002" and names_after == [n for n in names if n != "checkpoint-000003"]
    (line,) = [r.getMessage() for r in caplog.records if "checkpoint-000003" in r.getMessage()]
    assert re.fullmatch(
        rf"{re.escape(str(run.run_dir))}/checkpoint-000003 is incomplete: \S+/checkpoint-000003/state/"
        rf"{re.escape(shard)} \(missing\), which its \.metadata references: set aside as checkpoint-000003\.damaged "
        r"\(nothing deleted\); the run continues from checkpoint-000002",
        line,
    ), line


@pytest.mark.torch_agnostic
def test_a_run_whose_newest_checkpoint_is_damaged_continues_from_the_intact_one_to_the_uninterrupted_result(
    fixtures: Fixtures, stopped_at_3: LocalRun, uninterrupted: LocalRun, tmp_path: Path
):
    """After the driver set checkpoint 3 aside, the workers get what Ray's manager then hands them (checkpoint 2)
    and train on to the uninterrupted run's losses and adapter; the set-aside directory survives the run."""
    from fixtures.ray_registry import registered

    from rayft.train.checkpoint_dir import set_aside_damaged
    from rayft.train.rundir import RunDir

    raw, run = _copy_of(stopped_at_3, fixtures, tmp_path)
    _delete_a_shard(run.checkpoint(3))
    set_aside_damaged(RunDir(str(run.run_dir)))
    _, latest = registered(run.run_dir, _ray_checkpoint_config(raw))
    assert latest == "checkpoint-000002"
    resumed = train_locally(raw, 2, resume=run.run_dir / latest)
    assert resumed.resumes()[-1] == 2
    assert [r["step"] for r in resumed.metrics()] == list(range(1, STEPS + 1))
    _assert_same_training(resumed, uninterrupted, range(1, STEPS + 1))
    assert (run.run_dir / "checkpoint-000003.damaged" / "state" / ".metadata").is_file()


def test_validate_says_what_the_job_will_do_with_a_damaged_newest_checkpoint_and_changes_nothing(
    fixtures: Fixtures, stopped_at_3: LocalRun, tmp_path: Path, capsys
):
    """`rayft validate` over a run whose checkpoint 3 lost a shard: it passes, with one warning naming the file and
    what the job will do (set it aside, continue from checkpoint 2); it renames and rewrites nothing itself. Every
    registered checkpoint damaged: refused (exit 2)."""
    raw, run = _copy_of(stopped_at_3, fixtures, tmp_path)
    shard = _delete_a_shard(run.checkpoint(3))
    before = _tree(run.run_dir)
    result = run_cli(capsys, "validate", "--config", str(write_yaml(tmp_path / "config.yaml", raw)))
    assert result.rc == 0, result.err
    warned = [line for line in result.err.splitlines() if "checkpoint-000003 is incomplete" in line]
    assert len(warned) == 1 and f"checkpoint-000003/state/{shard} (missing)" in warned[0], result.err
    will = "the job will set it aside (renamed .damaged, nothing deleted) and continue from checkpoint-000002"
    assert will in warned[0], warned
    assert _tree(run.run_dir) == before
    for name in ("checkpoint-000001", "checkpoint-000002"):  # then none intact: refused, as the job refuses it
        if (run.run_dir / name).is_dir():
            _delete_a_shard(run.run_dir / name)
    refused = run_cli(capsys, "validate", "--config", str(tmp_path / "config.yaml"))
    assert refused.rc == 2 and "no checkpoint Ray registered is intact" in refused.err, refused.err


@pytest.mark.torch_agnostic
def test_a_run_whose_registered_checkpoints_are_all_damaged_is_refused_and_nothing_is_touched(
    fixtures: Fixtures, stopped_at_3: LocalRun, tmp_path: Path, capsys
):
    """Every registered checkpoint lost a shard: `rayft train` refuses (exit 2, before Ray starts) in one line
    naming each and the ways on; nothing renamed, deleted or rewritten."""
    from fixtures.ray_registry import registered

    raw, run = _copy_of(stopped_at_3, fixtures, tmp_path)
    names, _ = registered(run.run_dir, _ray_checkpoint_config(raw))
    for name in names:
        _delete_a_shard(run.run_dir / name)
    before = _tree(run.run_dir)
    result = run_cli(capsys, "train", "--config", str(write_yaml(tmp_path / "config.yaml", raw)))
    said = "; ".join(
        rf"{name} is incomplete: \S+/{name}/state/\S+ \(missing\), which its \.metadata references"
        for name in sorted(names, reverse=True)
    )
    assert_refused(
        result,
        rf"no checkpoint Ray registered is intact \({said}\); nothing was renamed or deleted: "
        r"start a new run \(another train\.output_dir or ray\.name\)",
    )
    assert _tree(run.run_dir) == before
