"""The work one optimizer step of the tiny hub-layout Mistral-Small-4 does, counted as a GPU would pay for it.

Two gloo ranks train the same model (FP8 or dense frozen base, FSDP only or expert parallel 2, activation
checkpointing on or off); per step each rank counts
- host syncs (tests/fixtures/work.py's `WorkCounter`: `.item()`, `tolist`, the ops whose output size depends on
  the data), by the code location that asked;
- bytes of frozen FP8 weights read by dequantisation: the elements of every float8 → wider conversion (1 byte
  each), and the same per pass (forward, the checkpoint recompute, the input-gradient pass) and layer, against
  one layer's FP8 weights + scales;
- collective calls and bytes by kind, from `rayft.parallel.tally` (calls counted at its `add`);
- tokens/s of steps run without the counters, and the loss, so rows can be compared for equality.

Two more rows show the one host sync the FP8 expert path keeps: a layer whose experts do not fit one
dequantisation chunk (Mistral-Small-4's 128) reads the routed row counts on the host to skip experts without rows
and to dequantise a chunk of experts at a time. Here the chunk is made 2 experts (of the model's 4 or 8), and the
row's `trade` says what the sync buys against the same case dequantised whole: FP8 bytes not read per sync, and the
largest dequantised weight alive at once.

`dequant_traffic` says what dequantising one FP8 weight moves through memory on this checkout: the eager ops
(bytes of every op's inputs and outputs, counted as they dispatch: each writes an fp32 temporary the next reads)
against the compiled kernel CUDA runs (`rayft.model.fp8.fuses`), compiled here for the CPU: the kernels inductor
generated, and the bytes of that one kernel's inputs and outputs (a pointwise kernel reads and writes each once).

The "before" rows run the code of another commit (default: the branch point with `main`), unpacked with
`git archive` into a temporary directory and imported from there in the same invocation; the "after" rows run
this checkout. On CPU the times say little; the counts are what a GPU pays.

    python bench/step_work.py [--size small|default] [--out bench/results/step_work_cpu.json]
"""

from __future__ import annotations

import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = {
    "default": {"model": {"hidden_size": 128, "n_routed_experts": 8, "num_hidden_layers": 2}, "tokens": 256},
    "small": {"model": {"hidden_size": 64, "n_routed_experts": 4, "num_hidden_layers": 2}, "tokens": 32},
}
TIMED_STEPS = 2
CASES = [
    *((base, k, ac) for base in ("fp8", "dense") for k in (1, 2) for ac in (False, True)),
    ("fp8", 1, False, 2),  # experts dequantised 2 at a time: the chunked path and its sync
    ("fp8", 1, True, 2),
]  # fmt: skip


def _count_calls(calls: Counter) -> None:
    from rayft.parallel.tally import TALLY

    add = TALLY.add

    def counted(kind: str, nbytes: int, *where, **counted_over) -> None:  # the tally's own (group, inter_node)
        calls[kind] += 1
        add(kind, nbytes, *where, **counted_over)

    TALLY.add = counted


def _dequantise_in_chunks_of(model, experts: int) -> None:
    """Shrink the FP8 expert path's dequantisation budget to `experts` experts' gate_up weights (down_proj, half
    their size, goes twice as many at a time), as a layer with more experts than one chunk holds would run."""
    from rayft.model import fp8

    stacks = [m for m in model.modules() if isinstance(m, fp8.Fp8Experts)]
    fp8.EXPERT_DEQUANT_BUDGET = experts * math.prod(stacks[0].gate_up_proj.shape[1:])  # global shape if sharded


def _rank(rank: int, world: int, port: int, raw: dict, tokens: int, out: str, chunk: int | None = None) -> None:
    import torch
    import torch.distributed as dist
    from fixtures.work import WorkCounter

    from rayft.model.fp8 import frozen_storage_bytes
    from rayft.parallel.fsdp_tally import count_fsdp_collectives

    try:
        from rayft.parallel.parallelize import build_model
    except ImportError:  # a "before" commit whose rayft built the model in rayft.model.build
        from rayft.model.build import build_model
    from rayft.parallel.layout import parallel_dims
    from rayft.parallel.tally import TALLY
    from rayft.train.step import clip_gradients_

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    try:
        cfg = _config(raw)
        layout = parallel_dims(cfg, "cpu")
        model = build_model(cfg, on_gpu=False, dims=layout)
        if chunk:
            _dequantise_in_chunks_of(model, chunk)
        count_fsdp_collectives(model, *_layout_for(count_fsdp_collectives, layout))
        calls: Counter = Counter()
        _count_calls(calls)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        ids = torch.randint(3, 1000, (1, tokens), generator=torch.Generator().manual_seed(rank))

        def step() -> float:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            clip_gradients_(model, 1.0, *_layout_for(clip_gradients_, layout))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        losses = [step()]  # warm-up
        TALLY.take(), calls.clear()
        counter = WorkCounter()
        with counter:
            losses.append(step())
        moved, counted_calls = TALLY.take(), dict(calls)
        times = []
        for _ in range(TIMED_STEPS):
            dist.barrier()
            started = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - started)
        adapter = sum(p.detach().double().pow(2).sum().item() for p in model.parameters() if p.requires_grad)
        result = {
            "syncs": dict(counter.syncs),
            "dequant_calls": counter.dequantised,
            "collective_bytes": moved,
            "collective_calls": counted_calls,
            "step_s": statistics.median(times),
            "losses": losses,
            "adapter_sq_norm_local": adapter,
            "frozen_storage_bytes": frozen_storage_bytes(model),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _layout_for(function, layout) -> tuple:
    """(layout,) where this checkout's `function` takes the run's layout; () for a "before" commit's, which found
    the expert parallelism and the replicas in the model."""
    return (layout,) if "layout" in inspect.signature(function).parameters else ()


def _config(raw: dict):
    from rayft.config import Config

    return Config.from_dict(raw)


def _case_raw(model_dir: Path, base: str, k: int, ac: bool) -> dict:
    return {
        "model": {
            "model_name_or_path": str(model_dir),
            "torch_dtype": "float32",
            "frozen_dtype": "float8_e4m3fn" if base == "fp8" else "float32",
        },
        # LoRA on the routed experts too where rayft allows it: it needs activation checkpointing.
        "lora": {"target_modules": ["auto"], "target_experts": ac, "lora_dropout": 0.0},
        "ray": {"num_workers": 2, "use_gpu": False},
        "parallel": {"expert_parallel": k},
        "fsdp": {"activation_checkpointing": ac},
    }


def _worker_main(args: list[str]) -> None:
    """Child process entry: `--case JSON`; its rayft is whatever PYTHONPATH names."""
    from _common import free_port, run_ranks

    spec = json.loads(args[args.index("--case") + 1])
    run_ranks(_rank, (2, free_port(), spec["raw"], spec["tokens"], spec["out"], spec["chunk"]), 2)


def _summarise(per_rank: list[dict], raw: dict, shape: dict, tokens: int) -> dict:
    """One row: per-rank means of the counts, per-pass dequantised bytes against one layer's FP8 storage."""
    layers = shape["num_hidden_layers"]
    passes = 3 if raw["fsdp"]["activation_checkpointing"] else 2
    syncs = Counter()
    for r in per_rank:
        syncs.update(r["syncs"])
    dequant = statistics.mean(sum(r["dequant_calls"]) for r in per_rank)
    storage = per_rank[0]["frozen_storage_bytes"]
    layer_fp8 = (storage["fp8"] + storage["scales"]) / layers  # per rank (sharded or its experts)
    expert_syncs = sum(n for site, n in syncs.items() if "fp8.py" in site or "expert.py" in site)
    moe_passes = layers * passes
    return {
        "lora_on_routed_experts": raw["lora"]["target_experts"],
        "host_syncs_per_step": sum(syncs.values()) / len(per_rank),
        "host_syncs_expert_path_per_step": expert_syncs / len(per_rank),
        "host_syncs_expert_path_per_moe_layer_per_pass": expert_syncs / len(per_rank) / moe_passes,
        "host_syncs_by_site_both_ranks": dict(sorted(syncs.items())),
        "dequant_bytes_per_step": dequant,
        "dequant_bytes_per_layer_per_pass": dequant / moe_passes,
        "largest_dequant_elements": max(max(r["dequant_calls"], default=0) for r in per_rank),
        "layer_fp8_weights_plus_scales_bytes": layer_fp8,
        "dequant_per_pass_over_layer_fp8": round(dequant / moe_passes / layer_fp8, 4) if layer_fp8 else None,
        "collective_calls_per_step": _mean_dicts([r["collective_calls"] for r in per_rank]),
        "collective_bytes_per_step": _mean_dicts([r["collective_bytes"] for r in per_rank]),
        "tokens_per_s": round(2 * tokens / statistics.mean(r["step_s"] for r in per_rank), 1),
        "losses_rank0": per_rank[0]["losses"],
        "adapter_sq_norm": sum(r["adapter_sq_norm_local"] for r in per_rank),
    }


def _mean_dicts(rows: list[dict]) -> dict:
    keys = sorted({k for r in rows for k in r})
    return {k: statistics.mean(r.get(k, 0) for r in rows) for k in keys}


def _unpack(rev: str, into: Path) -> str:
    """The `rayft` package of commit `rev`, unpacked under `into`; returns the commit's full hash."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True, check=True)
    full = commit.stdout.strip()
    archive = subprocess.run(["git", "archive", full, "rayft"], cwd=REPO, capture_output=True, check=True)
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return full


def _run_case(code_root: Path, raw: dict, tokens: int, out: Path, shape: dict, chunk: int | None = None) -> dict:
    out.mkdir(parents=True)
    spec = json.dumps({"raw": raw, "tokens": tokens, "out": str(out), "chunk": chunk})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code_root), str(REPO / "bench"), str(REPO / "tests")])}
    result = subprocess.run(
        [sys.executable, __file__, "--worker", "--case", spec], env=env, capture_output=True, text=True, timeout=1800
    )
    if result.returncode:
        raise RuntimeError(f"case failed ({code_root}):\n{result.stderr[-4000:]}")
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return _summarise(per_rank, raw, shape, tokens)


def run(size: str, before: str | None = "main", cases: list | None = None) -> dict:
    """Every case on this checkout ("after"), and on commit `before` beside it ($STEP_WORK_BEFORE overrides; None:
    this checkout's rows alone)."""
    from _common import machine
    from fixtures.hub_layout import make_tiny_mistral_small4

    before = os.environ.get("STEP_WORK_BEFORE", before)
    shape, tokens = SIZES[size]["model"], SIZES[size]["tokens"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    report = {**machine(), "size": size, "model": shape, "tokens_per_rank_per_step": tokens, "ranks": 2, "rows": {}}
    report["dequant_traffic"] = dequant_traffic()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_mistral_small4(Path(tmp) / "model", **shape)
        roots = {"after": REPO}
        report["after"] = {"commit": head, "how": "this checkout (uncommitted changes included)"}
        if before:
            before_hash = _unpack(before, Path(tmp) / "before")
            report["before"] = {"commit": before_hash, "how": f"git archive of {before} imported in a child process"}
            roots = {"before": Path(tmp) / "before", **roots}
        for base, k, ac, *chunk in cases or CASES:
            whole = f"{base} base, {'EP 2' if k == 2 else 'FSDP only'}, AC {'on' if ac else 'off'}"
            name = f"{whole}, experts dequantised {chunk[0]} at a time" if chunk else whole
            raw = _case_raw(model_dir, base, k, ac)
            row = {label: _run_case(root, raw, tokens, Path(tmp) / "runs" / name / label, shape, *chunk)
                   for label, root in roots.items()}  # fmt: skip
            if before:
                pairs = zip(row["before"]["losses_rank0"], row["after"]["losses_rank0"], strict=True)
                row["loss_max_abs_diff"] = max(abs(a - b) for a, b in pairs)
            if chunk and whole in report["rows"]:
                row["trade"] = _trade(row["after"], report["rows"][whole]["after"])
            report["rows"][name] = row
    return report


def dequant_traffic(experts: int = 8, rows: int = 256, cols: int = 128) -> dict:
    """Memory traffic per FP8 weight of the eager and the compiled dequantisation of an expert stack (docstring)."""
    import torch
    import torch._inductor.config as inductor
    from torch._inductor import metrics
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from rayft.model import fp8

    class OpBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            if not func.is_view:  # a view moves nothing
                self.ops.append((func.overloadpacket.__name__, sum(t.numel() * t.element_size() for t in tensors)))
            return out

    data, scale = fp8.quantize_rows(torch.randn(experts, rows, cols, generator=torch.Generator().manual_seed(0)))
    weights = data.numel()
    with OpBytes() as eager:
        want = fp8._dequantize(data, scale, torch.bfloat16, None)  # per-row scales
    metrics.reset()
    with inductor.patch({"force_disable_caches": True}):  # a cached kernel is not generated, so not counted
        got = torch.compile(fp8._dequantize, fullgraph=True)(data, scale, torch.bfloat16, None)
    assert torch.equal(got, want)
    moved = sum(t.numel() * t.element_size() for t in (data, scale, got))
    return {
        "weights": weights,
        "eager_ops": [name for name, _ in eager.ops],
        "eager_bytes_per_weight": round(sum(b for _, b in eager.ops) / weights, 3),
        "compiled_kernels": metrics.generated_kernel_count,
        "compiled_bytes_per_weight": round(moved / weights, 3) if metrics.generated_kernel_count == 1 else None,
    }


def _trade(chunked: dict, whole: dict) -> dict:
    """What the chunked path's host syncs buy against the same case dequantised whole (both this checkout)."""
    syncs = chunked["host_syncs_expert_path_per_step"] - whole["host_syncs_expert_path_per_step"]
    saved = whole["dequant_bytes_per_step"] - chunked["dequant_bytes_per_step"]
    return {
        "host_syncs_added_per_step": syncs,
        "fp8_bytes_not_read_per_step": saved,
        "fp8_bytes_not_read_per_sync": saved / syncs if syncs else None,
        "largest_dequant_elements_whole_layer": whole["largest_dequant_elements"],
        "largest_dequant_elements_chunked": chunked["largest_dequant_elements"],
        "loss_max_abs_diff_vs_whole": max(
            abs(x - y) for x, y in zip(chunked["losses_rank0"], whole["losses_rank0"], strict=True)
        ),
    }


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker_main(sys.argv)
    else:
        sys.path.insert(0, str(REPO / "bench"))
        from _common import cli

        cli(__doc__, SIZES, run, "step_work_cpu.json")
