"""The test clusters' own machinery, without Ray: a node started for a test never outlives the test process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO

# A test process that starts a "node" (`sleep`, through the fixtures' own launcher), says its PID and waits.
OWNER = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from fixtures.cluster import start_node
node = start_node(["sleep", "120"], dict(os.environ), Path(sys.argv[2]))
print(node.pid, flush=True)
time.sleep(120)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (a reaped-late child still answers `kill(pid, 0)`)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_node_ends_when_the_test_process_that_started_it_is_killed(tmp_path):
    """An interrupted `pytest -n 2` kills its workers before their teardown runs: the nodes they started must end
    with them, not keep a cluster's daemons busy on the machine."""
    argv = [sys.executable, "-c", OWNER, str(REPO / "tests"), str(tmp_path / "node.log")]
    owner = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    node = int(owner.stdout.readline())
    try:
        assert running(node)
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while running(node) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(node), "the node outlived the process that started it"
    finally:
        if running(node):
            os.kill(node, signal.SIGKILL)
