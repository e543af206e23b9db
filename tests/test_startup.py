"""The start-up profile's bookkeeping (the stages of a real job are checked on the reference run, test_job_e2e)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from rayft.startup import DRIVER_STAGES, WORKER_STAGES, Profile, process_start_time


def test_process_start_time_is_this_process_launch():
    """From /proc: a child started now reports a launch time between before and after its start."""
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "from rayft.startup import process_start_time as p; print(p())"],
                         capture_output=True, text=True, check=True)  # fmt: skip
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
