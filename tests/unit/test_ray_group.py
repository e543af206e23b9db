"""The suite's own scheduling (tests/fixtures/ray_group.py), checked on this session's collected tests: a worker
stops its test cluster at its first test outside the cluster groups, which is safe only if no cluster test can come
after it; Prometheus stops after its last reader, which must run where Prometheus was started."""

from __future__ import annotations

import os

from fixtures import ray_group


def _grouped_run() -> bool:
    return bool(os.environ.get(ray_group.DIR_ENV) and os.environ.get("PYTEST_XDIST_WORKER"))


def test_no_cluster_test_comes_after_the_point_where_a_worker_stops_its_cluster(request):
    items = request.session.items
    on_cluster = [ray_group.group_of(item) in ray_group.CLUSTER_GROUPS for item in items]
    if _grouped_run():  # the worker's order is the scheduler's queue order: the Ray groups first, in GROUPS order
        ranks = [ray_group.GROUPS.index(g) for g in map(ray_group.group_of, items) if g in ray_group.GROUPS]
        assert ranks == sorted(ranks), "the Ray groups are not first and in GROUPS order"
        assert on_cluster == sorted(on_cluster, reverse=True), "a cluster test after a test outside the groups"
    for index, item in enumerate(items):  # past exactly where no cluster test follows
        assert ray_group.past_cluster_tests(item) == (not any(on_cluster[index:])), item.nodeid


def test_prometheus_readers_are_one_groups_so_its_last_reader_runs_where_it_started(request):
    readers = [item for item in request.session.items if "prometheus" in item.fixturenames]
    assert {ray_group.group_of(item) for item in readers} <= {"reference"}
