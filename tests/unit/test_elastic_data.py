"""An elastic run (`ray.num_workers: [min, max]`) reads its records in one global order: at every group size a step
trains on the same records (the next global batch), so a run shrunk and grown back consumes each record once per
epoch, in the order an uninterrupted run uses. Checked on the loop's own feed (`rayft.train.step.step_groups`) over
record ids, rank by rank, with the data position carried across the resizes as a checkpoint carries it."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pyarrow as pa
import pytest
import torch

from rayft.config import Config, ConfigError
from rayft.train.checkpoint import remap_position
from rayft.train.checkpoint_dir import Progress
from rayft.train.runtime import RowShard
from rayft.train.step import DataWait, step_groups
from rayft.train.steps import StepPlan, plan_steps

RECORDS = 100
PER_DEVICE, ACCUMULATION, MOST = 2, 2, 3  # a step: 2 rows × 2 micro-batches × 3 workers = 12 records
STEP = PER_DEVICE * ACCUMULATION * MOST
TABLE = pa.table({"id": list(range(RECORDS))})


def config(shuffle: int = 0, **ray) -> Config:
    return Config.from_dict(
        {
            "model": {"model_name_or_path": "m"},
            "data": {"dataset_name_or_path": "d", "shuffle_buffer_size": shuffle},
            "ray": {"num_workers": [2, MOST], **ray},
            "train": {
                "per_device_train_batch_size": PER_DEVICE,
                "gradient_accumulation_steps": ACCUMULATION,
                "max_steps": 12,
            },
        }
    )


def collate(batch) -> dict[str, torch.Tensor]:
    return {"ids": torch.tensor([int(i) for i in batch["id"]])}


Trained = list[tuple[list[int], list[int]]]  # per step: the record ids, the seeds of its micro-batches


def train(cfg: Config, plan: StepPlan, start: Progress, world: int, steps: int) -> tuple[Trained, Progress]:
    """What each of `steps` steps of a `world`-worker group trains on from `start`, over all its ranks, and the
    position after them (as the checkpoint after the last one records it, then resumed from)."""
    ids: list[list[int]] = [[] for _ in range(steps)]
    seeds: list[list[int]] = [[] for _ in range(steps)]
    ends = []
    for rank in range(world):
        progress = replace(start)
        shard = RowShard(TABLE)  # an elastic run's workers each read the whole stream
        groups = step_groups(shard, cfg, plan, progress, collate, DataWait(), torch.device("cpu"), (rank, world))
        for i in range(steps):
            group = next(groups)
            assert len(group.batches) == plan.global_micro_per_step // world
            ids[i] += [int(x) for b in group.batches for x in b["ids"]]
            seeds[i] += group.seeds or []
            progress.step, progress.batches_in_epoch = progress.step + 1, group.last + 1
        ends.append(progress)
    assert all(end == ends[0] for end in ends), ends
    position = remap_position(replace(ends[0], world_size=world), plan, world, ACCUMULATION)
    return [(sorted(i), sorted(s)) for i, s in zip(ids, seeds, strict=True)], position


def test_the_plan_counts_whole_global_batches():
    plan = plan_steps(config(), RECORDS, 0, MOST)
    assert plan.global_micro_per_step == ACCUMULATION * MOST
    assert plan.steps_per_epoch == RECORDS // STEP  # 8; the last 4 records wait for the next epoch's order
    assert plan.micro_batches_per_epoch == 8 * ACCUMULATION * MOST
    assert [plan.accumulation(n, ACCUMULATION) for n in (2, 3)] == [3, 2]


def test_a_run_shrunk_and_grown_back_trains_each_step_on_the_uninterrupted_runs_records():
    """Three workers for 3 steps, two for 4, three for the rest (across the epoch's end): step s trains records
    [12 s, 12 s + 12) of the epoch (no shuffle: the file's order) with the same micro-batch seeds as the
    uninterrupted run, and each record of the epoch's whole batches is trained exactly once."""
    cfg = config()
    plan = plan_steps(cfg, RECORDS, 0, MOST)
    uninterrupted, _ = train(cfg, plan, Progress(world_size=MOST, global_order=True), MOST, 12)
    first, at = train(cfg, plan, Progress(world_size=MOST, global_order=True), MOST, 3)
    second, at = train(cfg, plan, at, 2, 4)
    third, end = train(cfg, plan, at, MOST, 5)
    resized = first + second + third
    expected = [list(range(STEP * s, STEP * (s + 1))) for s in range(8)] + [
        list(range(STEP * s, STEP * (s + 1))) for s in range(4)
    ]
    assert [ids for ids, _ in resized] == expected
    assert resized == uninterrupted  # the seeds too: dropout follows the micro-batch, not its rank
    epoch = Counter(i for ids, _ in resized[:8] for i in ids)
    assert set(epoch.values()) == {1} and len(epoch) == 8 * STEP
    assert (end.epoch, end.batches_in_epoch) == (1, 4 * ACCUMULATION * MOST)


def test_shuffled_records_keep_the_uninterrupted_order_across_resizes():
    cfg = config(shuffle=1000)
    plan = plan_steps(cfg, RECORDS, 0, MOST)
    uninterrupted, _ = train(cfg, plan, Progress(world_size=MOST, global_order=True), MOST, 12)
    first, at = train(cfg, plan, Progress(world_size=MOST, global_order=True), MOST, 5)
    rest, _ = train(cfg, plan, at, 2, 7)
    assert first + rest == uninterrupted
    assert [ids for ids, _ in uninterrupted[:2]] != [list(range(STEP)), list(range(STEP, 2 * STEP))]  # shuffled


@pytest.mark.parametrize(
    ("ray", "train", "said"),
    [
        ({"num_workers": [2, 4]}, {}, "at 3: the 8 micro-batches of a step do not split over 3 workers"),
        ({"num_workers": [2, 4]}, {}, "make train.gradient_accumulation_steps a multiple of 3"),
        ({"num_workers": [4, 3]}, {}, "the minimum exceeds the maximum"),
        ({"num_workers": [4, 16], "workers_per_node": 8}, {}, "the minimum must be whole nodes"),
        ({"num_workers": [1, 2, 3]}, {}, "a number of workers or [min, max]"),
        ({"num_workers": [2, 4], "min_workers": 2}, {}, "give num_workers as the maximum alone"),
    ],
)
def test_an_elastic_range_is_refused_where_a_size_cannot_keep_the_global_batch(ray, train, said):
    with pytest.raises(ConfigError) as refused:
        Config.from_dict({"ray": ray, "train": {"gradient_accumulation_steps": 2, **train}})
    assert said in str(refused.value) and "ray.num_workers" in str(refused.value)


def test_sizes_are_whole_nodes_and_expert_groups_must_divide_each():
    cfg = Config.from_dict({"ray": {"num_workers": [8, 16], "workers_per_node": 8}})
    assert cfg.ray.sizes() == [8, 16] and cfg.ray.elastic and cfg.ray.fewest_workers == 8
    with pytest.raises(ConfigError, match=r"at 2: parallel\.expert_parallel 4 does not divide 2 workers"):
        Config.from_dict(
            {
                "ray": {"num_workers": [2, 4]},
                "parallel": {"expert_parallel": 4},
                "model": {"load_mode": "sharded"},
                "train": {"gradient_accumulation_steps": 1},
            }
        )


def test_a_position_read_the_other_way_is_mapped_by_share_to_a_step_boundary(caplog):
    """Continuing a fixed-size run's checkpoint as an elastic run, or the reverse (`train.resume_from_checkpoint`):
    the micro-batches all ranks consumed, to the last whole step of the new run."""
    elastic = plan_steps(config(), RECORDS, 0, MOST)
    fixed_cfg = Config.from_dict(
        {
            "model": {"model_name_or_path": "m"},
            "data": {"dataset_name_or_path": "d"},
            "ray": {"num_workers": 2},
            "train": {"per_device_train_batch_size": PER_DEVICE},
        }
    )
    fixed = plan_steps(fixed_cfg, RECORDS, 0, 2)
    split = Progress(step=2, batches_in_epoch=4, world_size=2)  # 2 ranks x 4 micro-batches = 8 of the stream
    assert remap_position(split, elastic, 3, ACCUMULATION).batches_in_epoch == 6  # one global step of 6
    assert split.global_order and split.world_size == 3
    whole = Progress(step=2, batches_in_epoch=12, world_size=3, global_order=True)
    assert remap_position(whole, fixed, 2, 4).batches_in_epoch == 4  # 6 each, to the accumulation of 4
    assert not whole.global_order
    assert "not bit-identical" in caplog.text


def test_a_global_position_of_another_step_size_continues_from_the_step_before_it():
    """Written by a run whose steps were 8 global micro-batches (another maximum), read by one of 6: position 16 is
    no step boundary here; the run goes on from 12 rather than split a step unevenly between its workers."""
    plan = plan_steps(config(), RECORDS, 0, MOST)
    other = Progress(step=2, batches_in_epoch=16, world_size=4, global_order=True)
    assert remap_position(other, plan, 3, ACCUMULATION).batches_in_epoch == 12
