"""DCP training state across world sizes: written by 2 FSDP2 ranks (gloo), read back by 1, exactly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import Fixtures, free_port, tiny_config

PLAN = {
    "world_size": 2,
    "train_rows": 64,
    "validation_rows": 0,
    "micro_batches_per_epoch": 8,
    "steps_per_epoch": 4,
    "total_steps": 4,
    "warmup_steps": 1,
}


def _setup(rank: int, world: int, port: int, raw: dict):
    import torch.distributed as dist

    from rayft.config import Config
    from rayft.model.build import build_model
    from rayft.train.schedule import Plan, build_optimizer, build_scheduler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = Config.from_dict(raw)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, on_gpu=False)
    optimizer = build_optimizer(model, cfg.train, on_gpu=False)
    scheduler = build_scheduler(optimizer, cfg.train, Plan(**{**PLAN, "world_size": world}))
    return model, optimizer, scheduler


def _full_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, optimizer, options=full),
    }


def _train_and_save(rank: int, world: int, port: int, raw: dict, out: str) -> None:
    import torch.distributed as dist

    from rayft.train.checkpoint import Progress, save_checkpoint

    model, optimizer, scheduler = _setup(rank, world, port, raw)
    try:
        torch.manual_seed(rank)
        for _ in range(2):  # LoRA dropout draws from each rank's generator
            ids = torch.randint(3, 1000, (2, 16))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        rng = torch.get_rng_state()
        save_checkpoint(Path(out), model, optimizer, scheduler, Progress(2, 0, 4, world), {"loss": 1.0})
        state = _full_state(model, optimizer)
        if rank == 0:
            torch.save({**state, "rng": rng, "lr": scheduler.get_last_lr()}, Path(out) / "expected.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _load(rank: int, world: int, port: int, raw: dict, out: str) -> None:
    import torch.distributed as dist

    from rayft.train.checkpoint import Progress, load_checkpoint

    model, optimizer, scheduler = _setup(rank, world, port, raw)
    try:
        progress = load_checkpoint(Path(out), model, optimizer, scheduler)
        torch.save(
            {**_full_state(model, optimizer), "rng": torch.get_rng_state(), "lr": scheduler.get_last_lr(),
             "progress": progress == Progress(2, 0, 4, 2)},
            Path(out) / "loaded.pt",
        )  # fmt: skip
    finally:
        dist.destroy_process_group()


def _assert_equal(got, want, path: str = "") -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in want:
            _assert_equal(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), path
    else:
        assert got == want, path


def test_state_written_by_two_ranks_loads_exactly_on_one(fixtures: Fixtures, tmp_path):
    raw = tiny_config(fixtures, tmp_path / "out")
    raw["lora"]["lora_dropout"] = 0.1
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    mp.spawn(_train_and_save, args=(2, free_port(), raw, str(ckpt)), nprocs=2)
    mp.spawn(_load, args=(1, free_port(), raw, str(ckpt)), nprocs=1)

    expected, loaded = torch.load(ckpt / "expected.pt"), torch.load(ckpt / "loaded.pt")
    assert loaded["progress"], "step, epoch, data position and writer world size come back"
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in expected["model"].items()), "nothing was trained"
    _assert_equal(loaded["model"], expected["model"], "model")
    _assert_equal(loaded["optim"], expected["optim"], "optim")
    assert loaded["lr"] == expected["lr"]
    assert torch.equal(loaded["rng"], expected["rng"]), "rank 0's RNG state was not restored"


def test_resume_latest_needs_a_run_with_checkpoints(tmp_path):
    from rayft.config import Config, ConfigError
    from rayft.launch import _resume_source
    from rayft.train.rundir import RAY_SNAPSHOT, RunDir

    cfg = Config.from_dict({"train": {"output_dir": str(tmp_path), "resume_from_checkpoint": "latest"}})
    run = RunDir(cfg.run_uri)
    with pytest.raises(ConfigError, match=r"train\.resume_from_checkpoint: latest, but .* has no checkpoint"):
        _resume_source(cfg, run)
    Path(run.path).mkdir(parents=True)
    (Path(run.path) / RAY_SNAPSHOT).write_text("{}")
    assert _resume_source(cfg, run) is None  # Ray continues the run from its own registry
    cfg.train.resume_from_checkpoint = str(tmp_path / "elsewhere" / "checkpoint-000004")
    assert _resume_source(cfg, run) is None  # a run with checkpoints never jumps to another one


def test_unregistered_checkpoint_dirs_after_the_resume_point_are_removed(tmp_path):
    from rayft.train.rundir import RunDir

    run = RunDir(str(tmp_path / "run"))
    for step in (2, 3, 4, 5):
        (tmp_path / "run" / f"checkpoint-{step:06d}" / "state").mkdir(parents=True)
    assert run.remove_checkpoints_after(3) == ["checkpoint-000004", "checkpoint-000005"]
    assert sorted(run.checkpoints()) == [2, 3]
    assert run.remove_checkpoints_after(-1, keep=frozenset({"checkpoint-000002"})) == ["checkpoint-000003"]
