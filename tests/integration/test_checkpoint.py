"""DCP training state across world sizes: written by 2 FSDP2 ranks (gloo), read back by 1, exactly."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import Fixtures, free_port, tiny_config
from fixtures.ranks import spawn_ranks

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
    from rayft.parallel.layout import parallel_dims
    from rayft.parallel.parallelize import build_model
    from rayft.train.schedule import build_optimizer, build_scheduler
    from rayft.train.steps import StepPlan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = Config.from_dict(raw)
    torch.manual_seed(cfg.train.seed)
    layout = parallel_dims(cfg, "cpu")
    model = build_model(cfg, on_gpu=False, dims=layout)
    optimizer = build_optimizer(model, cfg.train, on_gpu=False)
    scheduler = build_scheduler(optimizer, cfg.train, StepPlan(**{**PLAN, "world_size": world}))
    return model, optimizer, scheduler, layout


def _full_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, optimizer, options=full),
    }


def _train_and_save(rank: int, world: int, port: int, raw: dict, out: str) -> None:
    import torch.distributed as dist

    from rayft.train.checkpoint import save_checkpoint
    from rayft.train.checkpoint_dir import Progress

    model, optimizer, scheduler, layout = _setup(rank, world, port, raw)
    try:
        torch.manual_seed(rank)
        random.seed(100 + rank)
        np.random.seed(100 + rank)
        for _ in range(2):  # LoRA dropout draws from each rank's generator
            ids = torch.randint(3, 1000, (2, 16))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        rng = torch.get_rng_state()
        progress = Progress(2, 0, 4, world)
        save_checkpoint(Path(out), model, optimizer, scheduler, progress, {"loss": 1.0}, layout, "run-a")
        state = _full_state(model, optimizer)
        if rank == 0:  # the next draws of Python's and NumPy's generators: a restored state makes the same ones
            draws = {"python": random.random(), "numpy": float(np.random.rand())}
            torch.save({**state, "rng": rng, "lr": scheduler.get_last_lr(), "draws": draws}, Path(out) / "expected.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _load(rank: int, world: int, port: int, raw: dict, out: str) -> None:
    import torch.distributed as dist

    from rayft.train.checkpoint import load_checkpoint
    from rayft.train.checkpoint_dir import Progress

    model, optimizer, scheduler, layout = _setup(rank, world, port, raw)
    try:
        random.seed(7)  # not the writer's seeds: only a restored state gives the writer's next draws
        np.random.seed(7)
        progress = load_checkpoint(Path(out), model, optimizer, scheduler, layout)
        draws = {"python": random.random(), "numpy": float(np.random.rand())}
        torch.save(
            {
                **_full_state(model, optimizer),
                "rng": torch.get_rng_state(),
                "lr": scheduler.get_last_lr(),
                "progress": progress == Progress(2, 0, 4, 2),
                "draws": draws,
            },
            Path(out) / "loaded.pt",
        )
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
    spawn_ranks(_train_and_save, args=(2, free_port(), raw, str(ckpt)), nprocs=2)
    spawn_ranks(_load, args=(1, free_port(), raw, str(ckpt)), nprocs=1)

    expected, loaded = torch.load(ckpt / "expected.pt"), torch.load(ckpt / "loaded.pt")
    assert loaded["progress"], "step, epoch, data position and writer world size come back"
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in expected["model"].items()), "nothing was trained"
    _assert_equal(loaded["model"], expected["model"], "model")
    _assert_equal(loaded["optim"], expected["optim"], "optim")
    assert loaded["lr"] == expected["lr"]
    assert torch.equal(loaded["rng"], expected["rng"]), "rank 0's RNG state was not restored"
    assert loaded["draws"] == expected["draws"], "Python/NumPy RNG states were not restored"
    assert json.loads((ckpt / "trainer_state.json").read_text())["run_id"] == "run-a"
    assert not any(ckpt.glob(".trainer_state.json*")), "a temporary file of the atomic write was left behind"


def _run_dir_with(tmp_path: Path, checkpoints: dict[str, str | None]) -> Path:
    """A run dir holding checkpoint dirs; each maps to the run id its trainer_state.json records (None: no file)."""
    run = tmp_path / "ray_run"
    for name, run_id in checkpoints.items():
        (run / name / "state").mkdir(parents=True)
        (run / name / "state" / "__0_0.distcp").write_bytes(b"shard")
        if run_id is not None:
            (run / name / "trainer_state.json").write_text(json.dumps({"step": int(name[-6:]), "run_id": run_id}))
    return run


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


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
    source, run_id = _resume_source(cfg, run)
    assert source is None  # Ray continues the run from its own registry
    cfg.train.resume_from_checkpoint = str(tmp_path / "elsewhere" / "checkpoint-000004")
    assert _resume_source(cfg, run) == (None, run_id)  # never jumps to another run; keeps the run's identity


def test_checkpoints_without_rays_registry_are_never_deleted_the_run_refuses(tmp_path):
    """Ray's registry gone (renamed by an upgrade, lost): a rerun is no fresh start over the run's checkpoints."""
    from rayft.config import Config, ConfigError
    from rayft.launch import _resume_source
    from rayft.train.rundir import RunDir

    run_path = _run_dir_with(tmp_path, {"checkpoint-000002": "run-a", "checkpoint-000004": "run-a"})
    before = _tree(run_path)
    cfg = Config.from_dict({"train": {"output_dir": str(tmp_path)}})
    with pytest.raises(ConfigError) as refused:
        _resume_source(cfg, RunDir(cfg.run_uri))
    message = str(refused.value)
    assert "checkpoint-000002, checkpoint-000004" in message and "checkpoint_manager_snapshot.json" in message
    assert f"train.resume_from_checkpoint: {run_path}/checkpoint-000004" in message and "\n" not in message
    assert _tree(run_path) == before


def test_housekeeping_deletes_only_this_runs_checkpoints_newer_than_the_registered_one(tmp_path):
    from rayft.train.checkpoint_dir import remove_unregistered
    from rayft.train.rundir import RunDir

    run_path = _run_dir_with(
        tmp_path,
        {
            "checkpoint-000001": "run-a",
            "checkpoint-000002": "run-a",
            "checkpoint-000003": "run-a",
            "checkpoint-000004": "run-b",
            "checkpoint-000005": None,
        },
    )
    run = RunDir(str(run_path))
    assert remove_unregistered(run, None, 2) == []  # a run without an identity proves nothing
    assert remove_unregistered(run, "run-a", 2) == ["checkpoint-000003"]
    # another run's, and one whose writer cannot be told (no trainer_state.json: an upload cut short, or by hand)
    assert sorted(run.checkpoints()) == [1, 2, 4, 5]


def test_metrics_history_survives_a_torn_last_line_and_the_plot_never_raises(tmp_path, caplog):
    from rayft.launch import _plot_losses
    from rayft.train.rundir import LOSS_PLOT, METRICS, RunDir

    run = RunDir(str(tmp_path / "run"))
    rows = [{"step": s, "loss": 3.0 - s / 10} for s in (1, 2, 3)]
    run.write_metrics(rows)
    assert [p.name for p in (tmp_path / "run").iterdir()] == [METRICS]  # no temporary file left
    path = tmp_path / "run" / METRICS
    path.write_bytes(path.read_bytes() + b'{"step": 4, "lo')  # a kill in the middle of a write
    assert run.read_metrics() == rows
    assert "line 4 is not a JSON record" in caplog.text
    _plot_losses(run)
    assert (tmp_path / "run" / LOSS_PLOT).read_bytes()[:4] == b"\x89PNG"
    path.write_bytes(b"\x00\xff garbage")
    _plot_losses(run)  # in the driver's `finally`: must not replace the run's own error


_STAGE = """
import sys, time
from rayft.train.spool import checkpoint_spool
spool = checkpoint_spool("ray_run", sys.argv[1])
(spool / "checkpoint-000003").mkdir()
(spool / "checkpoint-000003" / "__0_0.distcp").write_bytes(b"shard")
print(spool, flush=True)
time.sleep(600)
"""


def test_spool_is_per_job_and_attempt_other_jobs_shards_survive(tmp_path, monkeypatch):
    """Two jobs with the default ray.name on one node, and a second worker of the same run, each staging shards:
    starting another worker removes none of theirs; only a dead worker's leftovers of the same run go."""
    import tempfile

    from rayft.train.spool import checkpoint_spool

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    stagers = [
        subprocess.Popen([sys.executable, "-c", _STAGE, run_id], env=env, stdout=subprocess.PIPE, text=True)
        for run_id in ("job-a", "job-b")
    ]
    try:
        staged = [Path(p.stdout.readline().strip()) / "checkpoint-000003" / "__0_0.distcp" for p in stagers]
        assert all(path.is_file() for path in staged), staged
        dead = subprocess.Popen(["true"])
        dead.wait()
        leftover = staged[1].parents[2] / f"pid{dead.pid}" / "checkpoint-000002"
        leftover.mkdir(parents=True)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        mine = checkpoint_spool("ray_run", "job-b")  # a restarted worker of job b
        assert mine not in {path.parents[1] for path in staged} and mine.is_dir()
        assert all(path.read_bytes() == b"shard" for path in staged)
        assert not leftover.parent.exists(), "a dead worker's staged shards of this run stay behind"
    finally:
        for p in stagers:
            p.kill()
            p.wait()


def _write_checkpoint_state(directory: Path, state: dict) -> None:
    """A checkpoint's state/ as DCP writes it in one process (no process group needed)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(directory / "state"))


def test_an_older_format_checkpoint_is_refused_in_one_clear_line(tmp_path):
    from rayft.config import ConfigError
    from rayft.launch import _check_checkpoint

    lora = {"base_model.model.lm_head.lora_A.default.weight": torch.zeros(2, 4)}
    layouts = {
        "older": {"model": lora, "progress": {"step": 3, "epoch": 0, "world_size": 2}},  # no batches_in_epoch
        "pickled": {"model": lora, "progress": {"step": 3, "epoch": 0, "batches_in_epoch": 6, "world_size": 2}},
    }
    for name, state in layouts.items():
        ckpt = tmp_path / name / "checkpoint-000003"
        _write_checkpoint_state(ckpt, state)
        with pytest.raises(ConfigError) as refused:
            _check_checkpoint(str(ckpt))
        message = str(refused.value)
        assert message.startswith(f"train.resume_from_checkpoint: {ckpt}: a checkpoint of an older rayft format")
        assert "\n" not in message and "start without train.resume_from_checkpoint" in message


class _Payload:
    """What a hostile checkpoint could carry: unpickling it writes a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def test_loading_a_checkpoint_never_unpickles_its_contents(tmp_path):
    from rayft.train.checkpoint import load_checkpoint

    marker = tmp_path / "executed"
    bytes_entry = tmp_path / "bytes-entry" / "checkpoint-000001"  # DCP pickles non-tensor values
    _write_checkpoint_state(bytes_entry, {"progress": _Payload(marker)})
    metadata_entry = tmp_path / "metadata" / "checkpoint-000001"  # DCP unpickles .metadata with pickle.load
    shutil.copytree(bytes_entry, metadata_entry)
    (metadata_entry / "state" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    for ckpt in (bytes_entry, metadata_entry):
        with pytest.raises(Exception, match=r"older rayft format|has no place in a DCP checkpoint") as refused:
            load_checkpoint(ckpt, None, None, None, None)
        assert not marker.exists(), f"loading {ckpt} ran code from it"
        assert str(ckpt) in str(refused.value)


def test_final_adapter_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """A crash while the final adapter is written leaves the previous complete one, never a mix."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from rayft.parallel.layout import ParallelDims
    from rayft.parallel.topology import Topology
    from rayft.train.checkpoint import publish_adapter

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = get_peft_model(Tiny(), LoraConfig(r=2, target_modules=["proj"]))
        layout = ParallelDims(Topology(("local",)), shard=1, experts=1, device_type="cpu")
        final = tmp_path / "final"
        publish_adapter(model, final, layout)
        before = _tree(final)
        assert "adapter_model.safetensors" in before
        saver = type(model).save_pretrained

        def crash_midway(self, directory, **kwargs):
            (Path(directory) / "adapter_config.json").write_text("{}")  # one file written, then the node dies
            raise OSError("disk gone")

        monkeypatch.setattr(type(model), "save_pretrained", crash_midway)
        with pytest.raises(OSError, match="disk gone"):
            publish_adapter(model, final, layout)
        assert _tree(final) == before
        monkeypatch.setattr(type(model), "save_pretrained", saver)
        with torch.no_grad():
            model.base_model.model.proj.lora_B.default.weight.fill_(1.0)
        publish_adapter(model, final, layout)
        assert _tree(final)["adapter_model.safetensors"] != before["adapter_model.safetensors"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["final"], "staging dirs left behind"
    finally:
        dist.destroy_process_group()


# --- `rayft eval --adapter` loads every kind of LoRA tensor PEFT saves -------------------------------------------


def _load_adapter_rank(rank: int, world: int, port: int, raw: dict, adapter_dir: str) -> None:
    """Two FSDP2 ranks build the LoRA model from the config and load the adapter file; every LoRA tensor, gathered
    from the shards, must be the file's."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from rayft.config import Config
    from rayft.parallel.layout import parallel_dims
    from rayft.parallel.parallelize import build_model
    from rayft.train.checkpoint import load_adapter_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = Config.from_dict(raw)
        layout = parallel_dims(cfg, "cpu")
        model = build_model(cfg, on_gpu=False, dims=layout)
        load_adapter_weights(model, Path(adapter_dir), layout)
        want = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
        got = {n.replace(".default", ""): p.full_tensor() for n, p in model.named_parameters() if ".lora_" in n}
        assert set(got) == set(want), set(got) ^ set(want)
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor.to(got[key].dtype)), key
    finally:
        dist.destroy_process_group()


def test_an_adapter_with_embedding_lora_loads_into_the_sharded_model(fixtures: Fixtures, tmp_path):
    """PEFT saves embedding LoRA as `lora_embedding_A/B` (no `.weight`): `load_adapter_weights` (what `rayft eval
    --adapter` uses) must place those as well as `lora_A/B`. The adapter is PEFT's own, every tensor random."""
    import peft
    from transformers import AutoModelForCausalLM

    targets = ["embed_tokens", "q_proj"]
    model = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(fixtures.model), dtype=torch.float32),
        peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets),
    )
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.normal_()
    adapter_dir = tmp_path / "adapter"
    model.save_pretrained(str(adapter_dir), save_embedding_layers=False)
    keys = load_file_keys(adapter_dir / "adapter_model.safetensors")
    assert any(".lora_embedding_A" in k for k in keys) and any(".lora_A." in k for k in keys), keys

    raw = tiny_config(fixtures, tmp_path / "out")
    raw["lora"].update(target_modules=targets, r=4, lora_alpha=8, lora_dropout=0.0)
    spawn_ranks(_load_adapter_rank, args=(2, free_port(), raw, str(adapter_dir)), nprocs=2)


def load_file_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())
