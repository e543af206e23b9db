"""Helpers shared by the benchmarks: host memory high-water marks, free ports, machine facts, CPU per process."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

MIB = 2**20
# The tiny hub-layout checkpoint builder lives with the test fixtures (tests/fixtures), not in the package.
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))


def rss_kib(field: str = "VmRSS") -> int:
    """VmRSS (now) or VmHWM (peak since the last reset_peak_rss) of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset the kernel's RSS high-water mark to the current RSS; returns that RSS in KiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_kib("VmRSS")


def run_ranks(fn: Callable[..., None], args: tuple, nprocs: int = 2) -> None:
    """`fn(rank, *args)` on `nprocs` processes forked from a server that imported torch, transformers, PEFT and
    rayft once (the tests' `fixtures.ranks`): a fresh interpreter per rank, as `mp.spawn` starts, would import
    them again, seconds each. Raises when any rank fails."""
    from fixtures.ranks import spawn_ranks

    spawn_ranks(fn, args, nprocs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> dict:
    import peft
    import torch
    import transformers

    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
    }


def versions(*packages: str) -> dict[str, str]:
    """Installed versions of more packages than `machine()` names (the baselines' libraries)."""
    from importlib.metadata import version

    return {name: version(name) for name in packages}


def cli(doc: str, sizes: dict, run, result_name: str) -> None:
    """`--size` / `--out` for a benchmark: run it, write its JSON to bench/results/<result_name>, print it."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--size", choices=sizes, default="default")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / result_name)
    args = parser.parse_args()
    report = run(args.size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


class TreeCPU:
    """CPU seconds (user + system) of a launched process and of every process under it (a local Ray's daemons,
    actors and workers; torchrun's ranks), sampled from /proc while it runs. Start-up on a small machine is
    CPU-bound: how many CPU-seconds a system burns before its first step, and in which processes, bounds its wall
    time from below (CPU-seconds / cores) whatever the scheduling. Read afterwards at any moment of the run (`at`)."""

    def __init__(self, every_s: float = 0.25):
        self.every_s = every_s
        self.root = -1
        self.samples: list[tuple[float, dict[int, float]]] = []  # (wall time, {pid: CPU-s so far})
        self.labels: dict[int, str] = {}  # pid → every command line it showed, " | "-joined (Ray renames workers)

    def run(self, cmd: list[str], timeout: float, **popen) -> subprocess.CompletedProcess:
        """`subprocess.run(cmd, capture_output=True, text=True, timeout=...)`, sampling the tree meanwhile."""
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
        self.root = proc.pid
        deadline = time.monotonic() + timeout
        while True:
            self._sample()
            try:  # communicate() may be retried after a timeout without losing output
                out, err = proc.communicate(timeout=self.every_s)
                return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.communicate()  # reaped, as subprocess.run does
                    raise

    def _sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.root)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        cpu: dict[int, float] = {}
        for p in procs:
            try:
                times, label = p.cpu_times(), " ".join(p.cmdline())[:120] or p.name()
            except psutil.Error:
                continue
            cpu[p.pid] = times.user + times.system
            seen = self.labels.get(p.pid)
            if seen is None or label not in seen.split(" | "):
                self.labels[p.pid] = label if seen is None else f"{seen} | {label}"
        self.samples.append((time.time(), cpu))

    def at(self, when: float, role: Callable[[int, str], str]) -> dict[str, float]:
        """CPU-seconds spent until wall time `when`, summed per `role(pid, command line)`, plus their total. A
        process that ended before `when` counts with its last sample (up to `every_s` of its CPU is missed)."""
        seen: dict[int, float] = {}
        for sampled, cpu in self.samples:
            if sampled > when:
                break
            seen.update(cpu)
        totals: dict[str, float] = {}
        for pid, seconds in seen.items():
            name = role(pid, self.labels.get(pid, ""))
            totals[name] = totals.get(name, 0.0) + seconds
        return {**{k: round(v, 2) for k, v in sorted(totals.items())}, "total": round(sum(seen.values()), 2)}
