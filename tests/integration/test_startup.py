"""The start-up profile's bookkeeping (the stages of a real job are checked on the reference run, test_job_e2e), and
what a private local Ray starts with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from rayft.startup import DRIVER_STAGES, WORKER_STAGES, Profile, process_start_time


def test_process_start_time_is_this_process_launch():
    """From /proc: a child started now reports a launch time between before and after its start."""
    before = time.time()
    out = subprocess.run(
        [sys.executable, "-c", "from rayft.startup import process_start_time as p; print(p())"],
        capture_output=True,
        text=True,
        check=True,
    )
    after = time.time()
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert before - 1.0 - tick <= float(out.stdout) <= after  # the boot time in /proc/stat is whole seconds
    assert process_start_time() < before


def test_stages_add_up_and_print_in_run_order():
    profile = Profile(origin=time.time() - 5.0)
    with profile.stage("data_plan"):
        time.sleep(0.05)
    profile.add("first_step", 1.25)
    profile.add("launch", 2.0)
    profile.add("launch", 0.5)  # a stage timed in two parts
    assert profile.stages["launch"] == 2.5 and 0.05 <= profile.stages["data_plan"] < 1.0
    assert 5.0 <= profile.since_origin() < 6.0
    line = profile.line(total=9.0)
    assert line.startswith("start-up 9.0 s to the first step: launch 2.5 | data_plan 0.")
    assert line.index("data_plan") < line.index("first_step") and line.endswith("first_step 1.2 (s)")
    again = Profile.from_dict(profile.to_dict())  # as the workers receive it
    assert again.stages == profile.stages and again.origin == profile.origin
    assert set(DRIVER_STAGES).isdisjoint(WORKER_STAGES)


LOCAL_RAY_PROBE = """
import json, os, time
import ray
from rayft.config import RayConfig
from rayft.launch import connect

assert connect(RayConfig(local_num_cpus=2)) is True  # no address: a private local Ray
deadline, named = time.monotonic() + 60, []
while time.monotonic() < deadline and len(named) < 2:  # from this Ray's GCS: other Rays on the machine do not count
    named = ray.util.list_named_actors(all_namespaces=True)
    time.sleep(0.5)
poll = ray.get(ray.remote(lambda: os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")).remote())  # as actors see it
print(json.dumps({"named": named, "state_tracking": os.environ.get("RAY_TRAIN_ENABLE_STATE_TRACKING"), "poll": poll}))
ray.shutdown()
"""
# Ray's names for its cluster-wide actors (ray.data._internal: the autoscaling coordinator and STATS_ACTOR_NAME;
# ray.train.v2._internal.state: TRAIN_STATE_ACTOR_NAME).
RAY_DATA_ACTORS = {
    ("AutoscalingCoordinator", "AutoscalingCoordinator"),
    ("datasets_stats_actor", "_dataset_stats_actor"),
}
TRAIN_STATE_ACTOR = ("train_v2_state_actor", "_train_state_actor")


def test_a_private_local_ray_starts_ray_datas_cluster_actors_at_once_and_no_train_state_api():
    """`connect()` without an address, in a process of its own as a job's: Ray Data's two cluster-wide actors are
    asked for before any dataset runs (Ray Train's controller and the first batch would each wait on one starting),
    the Train state API is left off (its actor sits on the worker group's start path), and the job's processes see
    a 0.5 s worker poll (Ray Train's controller reads it from its environment). The names are Ray's; were the
    functions that create them moved, the actors would not be there."""
    import json

    unset = ("RAY_ADDRESS", "RAY_TRAIN_ENABLE_STATE_TRACKING", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    out = subprocess.run([sys.executable, "-c", LOCAL_RAY_PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    named = {(a["name"], a["namespace"]) for a in seen["named"]}
    assert named >= RAY_DATA_ACTORS, seen
    assert TRAIN_STATE_ACTOR not in named and seen["state_tracking"] is None, seen
    assert seen["poll"] == "0.5", seen


OTHER_RAY_PROBE = """
import json, os, socket
import ray
from ray.cluster_utils import Cluster
from rayft.config import RayConfig
from rayft.launch import connect

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

@ray.remote(num_cpus=0)
class Probe:
    def finds_itself(self) -> str:
        from ray.util.state import get_actor
        from ray.util.state.exception import RayStateApiException
        try:  # what Ray Train's placement-group cleaner asks of its controller, with no address
            return "found" if get_actor(ray.get_runtime_context().get_actor_id(), timeout=60) else "not found"
        except RayStateApiException:  # the cleaner asks again
            return "no answer"

# Another Ray on the machine, started as `ray start` would be: Ray's address auto-detection now names it.
other = Cluster(initialize_head=True, head_node_args={
    "num_cpus": 0, "dashboard_agent_listen_port": free_port(), "ray_client_server_port": free_port()})
answers = {}
try:
    for dashboard in ("1", "0"):  # rayft's local Ray with its dashboard, then without
        os.environ["RAYFT_LOCAL_DASHBOARD"] = dashboard
        assert connect(RayConfig(local_num_cpus=1)) is True
        answers[dashboard] = ray.get(Probe.remote().finds_itself.remote())
        ray.shutdown()
finally:
    other.shutdown()
print(json.dumps(answers))
"""


def test_a_private_local_rays_processes_never_ask_another_rays_state_api():
    """Ray Train's placement-group cleaner asks the state API, with no address, whether its controller lives; asked
    of another Ray on the machine, the answer is "not found" and it removes the run's placement group. A private
    local Ray's processes get their own Ray's answer, or, without a dashboard (no state API of its own), none."""
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    out = subprocess.run([sys.executable, "-c", OTHER_RAY_PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"1": "found", "0": "no answer"}, out.stderr[-3000:]


PORT_RACE = """
import json, logging, socket
import ray
from rayft import launch

logging.basicConfig(level=logging.INFO)  # as the CLI logs

held = socket.socket()  # the port another Ray takes between rayft's choice and Ray's bind
held.bind(("127.0.0.1", 0))
held.listen()
chosen = []
real = launch.local_port
launch.local_port = lambda preferred: chosen.append(real(preferred) if chosen else held.getsockname()[1]) or chosen[-1]
launch.start_local_ray(2)
print(json.dumps({"chosen": chosen, "taken": held.getsockname()[1], "up": ray.is_initialized()}))
ray.shutdown()
"""


def test_a_dashboard_port_taken_before_ray_init_binds_it_is_replaced():
    """A rerun of the demo died with a traceback when another local Ray took the dashboard port between rayft's
    check and Ray's bind. The race is made certain here: the first port rayft picks is already held."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", PORT_RACE], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    taken, chosen = found["taken"], found["chosen"]
    assert found["up"] and chosen[0] == taken and len(chosen) == 2 and chosen[1] != taken, found
    assert f"dashboard port {taken} was taken meanwhile" in done.stderr, done.stderr[-3000:]
