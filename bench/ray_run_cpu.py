"""What one Ray Train run of the test suite costs, by process: the CPU seconds of every process of a two-node test
cluster while `ray job submit` runs the suite's checkpointing job (6 steps, a checkpoint and an eval each).

    python bench/ray_run_cpu.py --out bench/results/ray_run_cpu.json

On a small machine the suite is CPU-bound, and a test that submits a job pays for the driver, the Train controller,
each training worker, and Ray Train's and Ray Data's helper actors, each a Python process importing Ray: this is
the price list a check pays for running on Ray rather than on gloo ranks in the test process. Each process is
sampled from /proc every 0.3 s while the job runs (its own CPU seconds at its last sample before it exits count; a
process that lives less than that is missed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from _common import machine, versions

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
TICK = os.sysconf("SC_CLK_TCK")


def _sample(pid: int) -> tuple[int, int, float, str] | None:
    """(parent, session id, CPU seconds, a name) of a live process: its own CPU only, since its children are counted
    as processes of their own."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    command, fields = stat.split(" (", 1)[1].rsplit(")", 1)  # the command name may hold spaces and parentheses
    fields = fields.split()
    cpu = sum(int(x) for x in fields[11:13]) / TICK  # utime, stime
    name = _name([part.decode(errors="replace") for part in cmdline if part])
    # A process that retitled itself over its arguments (Ray's dashboard modules) leaves a garbled command line:
    # the kernel's short name says what it is.
    return int(fields[1]), int(fields[3]), cpu, name if "'" not in name else command


def _name(argv: list[str]) -> str:
    """`ray::TrainController`, `raylet`, `dashboard.py`, ...: what the process is, without its arguments."""
    if not argv:
        return "?"
    if argv[0].startswith("ray::"):
        return argv[0].split()[0]
    program = Path(argv[0]).name
    if program.startswith("python") and len(argv) > 1:
        if "-c" in argv:  # programs given inline: multiprocessing's fork servers and spawned children
            return "python -c"
        rest = [a for a in argv[1:] if not a.startswith("-")]
        return Path(rest[0]).name if rest else " ".join(argv[1:3])
    return program


class Sampler(threading.Thread):
    """The last sample of every process in `sessions` (the test cluster's nodes start one session each) or below
    one (a job's driver, which its supervisor starts in a session of its own)."""

    def __init__(self, sessions: set[int]):
        super().__init__(daemon=True)
        self.sessions, self.last = sessions, {}
        self.stop = threading.Event()

    def snapshot(self) -> dict[int, tuple[float, str]]:
        samples = {int(e.name): s for e in Path("/proc").iterdir() if e.name.isdigit() and (s := _sample(int(e.name)))}

        def tracked(pid: int) -> bool:
            while pid in samples:
                parent, session, _, _ = samples[pid]
                if session in self.sessions:
                    return True
                pid = parent
            return False

        return {pid: (cpu, name) for pid, (_, _, cpu, name) in samples.items() if tracked(pid)}

    def run(self) -> None:
        while not self.stop.wait(0.3):
            for pid, (cpu, name) in self.snapshot().items():
                # an exiting process's command line reads empty: it keeps the name it had
                self.last[pid] = (cpu, self.last[pid][1] if name == "?" and pid in self.last else name)


def measure(out: Path) -> dict:
    import conftest
    import fixtures.cluster as cluster
    from fixtures.cache import cached_dir

    root = cached_dir("demo-fixtures", conftest._fixture_key(), conftest._build_demo_fixtures)
    fx = conftest.Fixtures(model=root / "tiny-mistral", dataset=root / "wikitext")
    started: list[int] = []

    class Recorded(subprocess.Popen):  # the nodes' `ray start` processes: each leads a session of its own
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self.pid)

    cluster.subprocess.Popen = Recorded  # type: ignore[misc]
    with cluster.two_node_cluster() as test_cluster:
        time.sleep(5)  # the nodes settle
        sampler = Sampler(set(started))
        before = sampler.snapshot()
        sampler.start()
        config = conftest.write_yaml(out / "config.yaml", conftest.checkpointing_config(fx, out))
        wall = time.monotonic()
        job = cluster.submit_job(test_cluster, "--config", str(config))
        wall = time.monotonic() - wall
        time.sleep(1)
        sampler.stop.set()
        sampler.join()
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    by_name: dict[str, list[float]] = defaultdict(list)
    for pid, (cpu, name) in sampler.last.items():
        by_name[name].append(round(cpu - before.get(pid, (0.0, ""))[0], 1))
    processes = dict(sorted(by_name.items(), key=lambda kv: -sum(kv[1])))
    return {
        **machine(),
        "versions_more": versions("ray"),
        "measured": "one `ray job submit` of the suite's checkpointing job on a fresh two-node test cluster",
        "job_wall_s": round(wall, 1),
        "cpu_s_total": round(sum(sum(v) for v in processes.values()), 1),
        "cpu_s_by_process": {name: {"count": len(v), "cpu_s": round(sum(v), 1)} for name, v in processes.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ray_run_cpu.json")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / f"rayft-ray-run-cpu-{os.getpid()}")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    report = measure(args.work)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{report['cpu_s_total']} CPU-s in {report['job_wall_s']} s of job")
    for name, entry in report["cpu_s_by_process"].items():
        print(f"{entry['cpu_s']:7.1f} CPU-s  {entry['count']} x {name}")


if __name__ == "__main__":
    main()
