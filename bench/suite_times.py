"""Where the test suite's time goes: per-test wall and CPU seconds of one complete run, summed by file and by group.

    RAYFT_TEST_TIMES=times.jsonl make test          # tests/fixtures/timings.py writes a line per test
    python bench/suite_times.py times.jsonl --label after --total-s 1234 --out bench/results/suite_times_after_cpu.json

The machine's busy CPU seconds per test (not only pytest's own) are what a 2-core machine pays: Ray's daemons and
workers are not pytest's children, so a Ray test's own CPU figure is small while the machine's is large. With two
xdist workers each test's machine figure also holds what the other worker ran meanwhile; the sums per file are
therefore an upper bound, and the wall of each worker's tests is the measure of its critical path.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from _common import machine, versions


def _totals() -> dict[str, float]:
    return {"tests": 0, "wall_s": 0.0, "cpu_s": 0.0, "machine_busy_s": 0.0}


def _line(name: str, entry: dict[str, float]) -> str:
    return f"{entry['wall_s']:8.1f} s wall {entry['machine_busy_s']:8.1f} s busy {entry['tests']:4d} tests  {name}"


def summarise(rows: list[dict], label: str, total_s: float | None) -> dict:
    by_file: dict[str, dict[str, float]] = defaultdict(_totals)
    by_group: dict[str, dict[str, float]] = defaultdict(_totals)
    by_worker: dict[str, float] = defaultdict(float)
    for row in rows:
        # lines written before the group was recorded count as in-process
        for entry in (by_file[row["nodeid"].split("::", 1)[0]], by_group[row.get("group", "in-process")]):
            entry["tests"] += 1
            for key in ("wall_s", "cpu_s", "machine_busy_s"):
                entry[key] = round(entry[key] + row[key], 2)
        by_worker[row["worker"]] += row["wall_s"]
    tests = sorted(rows, key=lambda r: -r["wall_s"])
    return {
        **machine(),
        "versions_more": versions("ray", "pytest", "pytest-xdist"),
        "label": label,
        "measured": "one complete `make test` run (two xdist workers); per test: setup + call + teardown",
        "suite_wall_s": total_s,
        "tests": len(rows),
        "sum_wall_s": round(sum(r["wall_s"] for r in rows), 1),
        "sum_machine_busy_s": round(sum(r["machine_busy_s"] for r in rows), 1),
        "wall_s_by_worker": {w: round(s, 1) for w, s in sorted(by_worker.items())},
        "by_group": dict(sorted(by_group.items(), key=lambda kv: -kv[1]["wall_s"])),
        "by_file": dict(sorted(by_file.items(), key=lambda kv: -kv[1]["wall_s"])),
        "per_test": [{k: r[k] for k in ("nodeid", "worker", "wall_s", "cpu_s", "machine_busy_s")} for r in tests],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("times", type=Path, help="the JSON lines tests/fixtures/timings.py wrote")
    parser.add_argument("--label", default="run")
    parser.add_argument("--total-s", type=float, default=None, help="the whole run's wall seconds, if known")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.times.read_text().splitlines() if line.strip()]
    report = summarise(rows, args.label, args.total_s)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    top = list(report["by_file"].items())[:15]
    print(f"{report['tests']} tests, per worker wall {report['wall_s_by_worker']}")
    for name, entry in [*((f"[{g}]", e) for g, e in report["by_group"].items()), *top]:
        print(_line(name, entry))


if __name__ == "__main__":
    main()
