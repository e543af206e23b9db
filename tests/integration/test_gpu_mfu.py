"""bench/gpu_mfu.py, the measuring process of `make gpu-check`, at toy size on CPU: a line per configuration with
its figures, written as each ends, kept when the process is interrupted, and no Ray in the process."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO

# Four configurations (five lines: dense-12l-ac times two kinds of row), the cheapest that cover every path:
# dense with and without activation checkpointing, MoE with FP8 and with full-precision experts.
FOUR = ["dense-12l-ac", "dense-12l-noac", "moe-2l-fp8", "moe-2l-bf16"]
COMMAND = [sys.executable, "bench/gpu_mfu.py", "--toy"]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_toy_run_writes_every_configurations_figures_and_plan(tmp_path: Path):
    result = subprocess.run(
        [*COMMAND, "--out", str(tmp_path), "--only", *FOUR], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-4000:]
    written = _lines(tmp_path / "gpu_mfu.jsonl")
    trl = [r for r in written if r.get("system") == "trl"]
    lines = [r for r in written if r.get("system") != "trl"]
    _check_trl_lines(written, trl)
    assert [(r["config"], r["variant"]) for r in lines] == [
        ("dense-12l-ac", "packed"),
        ("dense-12l-ac", "one_doc_per_row"),
        ("dense-12l-noac", "packed"),
        ("moe-2l-fp8", "packed"),
        ("moe-2l-bf16", "packed"),
    ], lines
    for r in lines:
        assert "error" not in r and r["tokens_per_s"] > 0 and r["peak_tflops"] > 0, r
        assert 0 < r["mfu_lora"] < r["mfu_6n"], r  # a frozen base has no weight gradients to count
        assert r["peak_rss_delta_gib"] >= 0 and r["peak_allocated_gib"] is None  # CPU: host memory only
        assert r["planned_memory_gib"] > 0 and r["planned_step_s"] > 0 and r["planned_for"]["params"] > 0, r
        assert len(r["step_s"]) == 3 and r["warmup_s"] > 0 and r["loss"] > 0 and 0 < r["lm_head_flops_share"] < 1
        assert r["device"] == "cpu" and r["device_name"] and r["versions"]["torch"] and r["machine"]["cpus"]
        assert r["ray_imported"] is False  # the device has no Ray: the process must not need it
    packed, one_doc = lines[0], lines[1]
    assert packed["documents_per_row"] > 1 and one_doc["documents_per_row"] == 1
    assert packed["keys_per_token"] < one_doc["keys_per_token"]  # attention restarts at each packed document
    assert lines[0]["activation_checkpointing"] and not lines[2]["activation_checkpointing"]
    assert lines[3]["frozen_dtype"] == "float8_e4m3fn" and lines[4]["frozen_dtype"] == "float32"
    assert len({r["run"] for r in lines}) == 1 and (tmp_path / "cache").is_dir()


def _check_trl_lines(written: list[dict], trl: list[dict]) -> None:
    """TRL's side of each dense configuration, right after rayft's lines of it: TRL's tokens/s on the same packed
    documents, its options (padding-free, the same attention and gradient checkpointing) and rayft/TRL."""
    assert [r["config"] for r in trl] == ["dense-12l-ac", "dense-12l-noac"], trl
    for r in trl:
        assert "error" not in r and r["tokens_per_s"] > 0 and r["variant"] == "packed", r
        ours = next(x for x in written if x.get("system") == "rayft" and x["config"] == r["config"])
        assert written.index(r) > written.index(ours)
        assert r["ratio_tokens_per_s"] == round(ours["tokens_per_s"] / r["tokens_per_s"], 3), r
        assert r["tokens_per_step"] == ours["tokens_per_step"], r  # the same documents, packed by TRL
        assert len(r["step_s"]) == 3 and r["warmup_s"] > 0 and r["peak_rss_delta_gib"] >= 0, r
        assert r["options"]["padding_free"] and r["options"]["attn_implementation"] == "sdpa", r
        assert r["options"]["gradient_checkpointing"] is ours["activation_checkpointing"], r
        assert r["trl_versions"]["trl"] and r["ray_imported"] is False, r


def test_without_trl_the_trl_side_says_so_and_fails_nothing(tmp_path: Path):
    """Where TRL cannot be imported (the device without a kit that carries it), its line says why and the stage
    still succeeds: here a `trl` package on the child's path whose import fails."""
    shadow = tmp_path / "shadow" / "trl"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("no trl on this device")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(REPO)])}
    result = subprocess.run(
        [*COMMAND, "--out", str(tmp_path), "--only", "dense-12l-noac"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    ours, theirs = _lines(tmp_path / "gpu_mfu.jsonl")
    assert ours["system"] == "rayft" and ours["tokens_per_s"] > 0, ours
    assert theirs["system"] == "trl" and theirs["error"] == "trl not importable: no trl on this device", theirs
    assert "ratio_tokens_per_s" not in theirs


def test_an_interrupt_keeps_the_lines_written_and_ends_the_process_at_once(tmp_path: Path):
    """SIGINT after the first configuration's line: that line stays whole, the configuration running then gets a
    line saying it was interrupted (or none, if it was caught between two), and the process exits within seconds."""
    out = tmp_path / "gpu_mfu.jsonl"
    proc = subprocess.Popen(
        [*COMMAND, "--out", str(tmp_path), "--only", "dense-12l-noac", "moe-2l-bf16", "moe-2l-fp8"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        waited = time.monotonic()
        while not out.exists() or not out.read_text().endswith("\n"):
            assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
            assert time.monotonic() - waited < 240, "no configuration line in 240 s"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGINT)
        interrupted = time.monotonic()
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert time.monotonic() - interrupted < 20
    assert rc == 128 + signal.SIGINT, proc.stderr.read()[-3000:] if proc.stderr else rc
    lines = _lines(out)  # every line parses
    assert lines[0]["config"] == "dense-12l-noac" and lines[0]["tokens_per_s"] > 0
    assert len(lines) <= 2 and all("SIGINT" in r["error"] for r in lines[1:]), lines


def test_a_synthetic_packed_batch_is_what_rayfts_packing_makes(tmp_path: Path):
    """The measuring process builds its rows itself (rayft's collate lives with Ray Data, which the device lacks):
    the same tensors `PackedCollate` makes of the same documents."""
    import numpy as np

    sys.path.insert(0, str(REPO / "bench"))
    from gpu_mfu import document_lengths, make_batch, packed_documents

    from rayft.data.pipeline import PackedCollate

    docs = packed_documents(256, iter(document_lengths(1000)))
    assert sum(docs) == 256 and len(docs) > 1
    ours = make_batch(docs, vocab=1000, seed=0)
    ids = ours["input_ids"][0].numpy()
    starts = np.cumsum([0, *docs])
    blocks = {
        "input_ids": [ids[a:b] for a, b in itertools.pairwise(starts)],
        "position_ids": [np.arange(n) for n in docs],
    }
    theirs = PackedCollate()(blocks)
    assert set(ours) == set(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and (ours[key] == theirs[key]).all(), key
