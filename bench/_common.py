"""Helpers shared by the benchmarks: host memory high-water marks, free ports, machine facts."""

from __future__ import annotations

import os
import platform
import socket
import sys
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
