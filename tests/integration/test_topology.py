"""Several workers a node on a real local 2-node Ray cluster: 2 workers on each node (`ray.workers_per_node`),
expert parallelism 2 on the tiny hub-layout Mistral-Small-4. Each expert-parallel group and each FSDP shard group
lies within one node (by the Ray node id each worker reports), what crossed between nodes is what `rayft plan`
predicts for that layout, and the run ends where the same global batch on two workers ends (one worker a node's
layout: the same job on two gloo ranks, tests/fixtures/local_run.py; only the four-worker run needs the cluster)."""

from __future__ import annotations

import ast
import json
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import TEST_RAY_ENV, Fixtures, RayCluster, checkpointing_config, free_port
from fixtures.local_run import train_locally
from test_comm import PLANNER_TOLERANCE
from test_recovery import EXACT, assert_same_adapter, finish, start

from rayft.config import Config
from rayft.model.build import held_as
from rayft.plan import meta_structure
from rayft.plan.comm import Cluster, Layout, plan_comm

pytestmark = pytest.mark.ray

STEPS = 3
ROWS = 8  # the global batch: every training row in each step, so how rows are split over workers cannot matter
NODE_OF_RANK = re.compile(r"topology: .*node of each rank: (\[.*\])")
GROUPS = re.compile(r"layout: FSDP shard groups (\[.*\]), expert-parallel groups (\[.*\])")

ORDER_GAP = 1e-5  # the adapters of 4 workers against 2 at lr 1e-3: a few 1e-6 apart (the sums' order)


def _dataset(root: Path) -> Path:
    """8 short training records, 4 validation ones, each well under max_length: one row each, no packing."""
    root.mkdir()
    for split, n in (("train", ROWS), ("validation", 4)):
        lines = [json.dumps({"text": f"record {i} of the {split} split says {i * 7 % 5} things"}) for i in range(n)]
        (root / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _config(fixtures: Fixtures, hub: Path, data: Path, out: Path, nodes: int, per_node: int) -> dict:
    cfg = checkpointing_config(
        fixtures,
        out,
        ray__num_workers=nodes * per_node,
        ray__workers_per_node=per_node,
        ray__placement_strategy="STRICT_SPREAD",
        ray__resources_per_worker={"CPU": 1, "trainer": 1},
        ray__max_failures=0,
    )
    cfg["model"].update(model_name_or_path=str(hub), torch_dtype="float32")
    cfg["lora"].update(target_modules=["auto"], target_experts=True, lora_dropout=0.0)
    cfg["fsdp"] = {"activation_checkpointing": True}
    cfg["parallel"] = {"expert_parallel": 2}
    cfg["data"] = {"dataset_name_or_path": str(data), "max_length": 32, "packing": False, "shuffle_buffer_size": 0}
    # Adam's first steps move a weight by about the learning rate whatever its gradient's size, so a gradient that
    # nearly cancels shows the other summation order of 4 workers against 2 at full size: a small rate keeps that
    # within ORDER_GAP, while a wrong gradient would still move the adapter by ~lr
    cfg["train"].update(
        learning_rate=1e-3,
        warmup_ratio=0.0,
        max_steps=STEPS,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=ROWS // (nodes * per_node),
        eval_strategy="no",
        save_strategy="no",
        load_best_model_at_end=False,
    )
    return cfg


def test_two_workers_a_node_keep_expert_groups_and_shards_on_their_node(
    fixtures: Fixtures, mistral4_hub: Path, tmp_path: Path, monkeypatch
):
    from ray.cluster_utils import Cluster as RayTestCluster
    from ray.util import get_node_ip_address

    gcs_port = free_port()
    # The nodes' processes inherit this environment: their state API answers for this cluster (conftest.own_state_api)
    monkeypatch.setenv("RAY_ADDRESS", f"{get_node_ip_address()}:{gcs_port}")
    cluster = RayTestCluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "gcs_server_port": gcs_port,
            "dashboard_agent_listen_port": free_port(),
            "ray_client_server_port": free_port(),
        },
    )
    try:
        # Two trainer nodes whose resources hold exactly two workers each: driver, controller and data stay on the head
        trainers = [cluster.add_node(num_cpus=2, resources={"trainer": 2}) for _ in range(2)]
        cluster.wait_for_nodes()
        env = {**os.environ, **TEST_RAY_ENV}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        test_cluster = RayCluster(address=cluster.address, dashboard="", env=env)
        data = _dataset(tmp_path / "data")
        out = tmp_path / "2x2"
        run, driver = start(test_cluster, _config(fixtures, mistral4_hub, data, out, 2, 2), out)
        try:
            text = finish(run, driver)
        finally:
            if driver.proc.poll() is None:
                driver.kill()
    finally:
        cluster.shutdown()
    reference = train_locally(_config(fixtures, mistral4_hub, data, tmp_path / "2x1", 2, 1), 2)

    node_of_rank = ast.literal_eval(NODE_OF_RANK.search(text)[1])
    trainer_ids = {n.node_id for n in trainers}
    assert sorted(node_of_rank) == sorted([*trainer_ids, *trainer_ids]), (node_of_rank, trainer_ids)
    shard_groups, expert_groups = (ast.literal_eval(g) for g in GROUPS.search(text).groups())
    for groups in (shard_groups, expert_groups):
        assert sorted(r for g in groups for r in g) == [0, 1, 2, 3] and all(len(g) == 2 for g in groups), groups
        assert all(len({node_of_rank[r] for r in g}) == 1 for g in groups), (groups, node_of_rank)

    # Between the nodes: the gradient all-reduces of the replicas (non-expert shards, expert LoRA, target count)
    cfg = Config.from_dict(_config(fixtures, mistral4_hub, data, tmp_path / "plan", 2, 2))
    cluster_2x2 = Cluster(nodes=2, gpus_per_node=2)
    predicted = plan_comm(
        cfg, meta_structure(cfg), Layout.expert(2, cluster_2x2), cluster_2x2, False, held_as(cfg.model)
    )
    planned = predicted.per_step(inter_node=True)
    print("inter-node bytes per step", [r["comm_inter_node_bytes"] for r in run.metrics()], "planned", planned)
    for row in run.metrics():
        assert abs(row["comm_inter_node_bytes"] - planned) <= PLANNER_TOLERANCE * planned, (row, planned)
        assert row["comm_inter_node_bytes"] < row["comm_bytes"] / 4  # the all-to-all and the gathers stay inside

    got, want = run.metrics(), reference.metrics()
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    print("loss", [(g["loss"], w["loss"]) for g, w in zip(got, want, strict=True)])
    for g, w in zip(got, want, strict=True):
        for key in EXACT:
            if key != "eval_loss":  # no evaluation here
                assert abs(g[key] - w[key]) < 1e-6, f"step {g['step']} {key}: {g[key]} != {w[key]}"
    assert_same_adapter(run.out / "final", reference.out / "final", ORDER_GAP)
