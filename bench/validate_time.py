"""Seconds `rayft validate` takes on the seeds' YAML: this checkout against another commit, side by side.

The seed YAML (`../shared/seeds/configs/mistral4small_fsdp_2xH200.yaml`) on the tiny hub-layout Mistral-Small-4 and
the demo's wikitext, each checkout run as a user runs it (`python -m rayft.cli validate --config ... --override ...`,
a fresh interpreter each time), alternating, `repeats` times; the median of each and their ratio. The other commit
is checked out into a temporary git worktree and run with this checkout's interpreter.

    python bench/validate_time.py [--before REV] [--target-ratio R] [--out bench/results/validate_time_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, versions

REPO = Path(__file__).resolve().parents[1]
SEED_YAML = REPO.parent / "shared" / "seeds" / "configs" / "mistral4small_fsdp_2xH200.yaml"
TARGET_RATIO = 1.5  # validate may take at most this much longer than before the record-pipeline check


def make_inputs(root: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(REPO / "tests"))
    from fixtures import hub_layout

    from rayft import demo

    demo.make_tokenizer(root / "tokenizer")
    hub = hub_layout.make_tiny_mistral_small4(root / "mistral-small-4", tokenizer_from=root / "tokenizer")
    return hub, demo.make_wikitext(root / "wikitext")


def validate_seconds(checkout: Path, hub: Path, data: Path, out: Path) -> float:
    command = [sys.executable, "-m", "rayft.cli", "validate", "--config", str(SEED_YAML),
               "--override", f"model.model_name_or_path={hub}", "--override", f"data.dataset_name_or_path={data}",
               "--override", f"train.output_dir={out}"]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, cwd=checkout, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"validate failed in {checkout}:\n{done.stderr[-3000:]}")
    return seconds


def run(before: str, repeats: int, target_ratio: float = TARGET_RATIO) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hub, data = make_inputs(root / "inputs")
        old = root / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), before], cwd=REPO, check=True,
                       capture_output=True)  # fmt: skip
        try:
            times: dict[str, list[float]] = {"before": [], "after": []}
            for _ in range(repeats):
                times["before"].append(validate_seconds(old, hub, data, root / "out"))
                times["after"].append(validate_seconds(REPO, hub, data, root / "out"))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO, capture_output=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    median = {k: statistics.median(v) for k, v in times.items()}
    return {
        "benchmark": "validate_time",
        "what": "wall seconds of `rayft validate` on the seed YAML (tiny hub-layout Mistral-Small-4, demo wikitext)",
        **machine(),
        "versions": versions("torch", "transformers", "ray"),
        "before": {"commit": before, "seconds": times["before"], "median_s": round(median["before"], 3)},
        "after": {"commit": commit, "seconds": times["after"], "median_s": round(median["after"], 3)},
        "ratio_after_over_before": round(median["after"] / median["before"], 3),
        "target_ratio": target_ratio,
        "ok": median["after"] <= target_ratio * median["before"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="126b7e1", help="the commit to compare with (default: before the check)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target-ratio", type=float, default=TARGET_RATIO, help="after/before may be at most this")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "validate_time_cpu.json")
    args = parser.parse_args()
    report = run(args.before, args.repeats, args.target_ratio)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
