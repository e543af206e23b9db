"""Tokens/s, LoRA-aware MFU and peak memory of rayft's training step, one configuration after another, in one
process: no Ray, no checkpoint files (`make gpu-check`'s first stage, `mfu`).

Each configuration is built on the device from its transformers config, with random weights
(`rayft.model.build.random_model`), and made ready to train by rayft's own `build_model` (FP8 storage, activation
checkpointing, LoRA, FSDP2 on a one-rank NCCL group, or gloo on CPU); its steps are `rayft.train.step.train_step`
with the objective's loss, over synthetic packed rows: document lengths drawn from a fixed wikitext-like
distribution, position ids restarting at each document as rayft's packing makes them (`dense-12l-ac` also times
one document per row, attention over the whole row). One warm-up step, then timed steps (CUDA events on a GPU).
Throughput, MFU and peak memory are computed by rayft's own metrics (`rayft.train.metrics.hardware_metrics`, the
FLOPs of `rayft.model.flops`); beside them, what `rayft plan` predicts for the same configuration (memory and step
time), so every run also measures the planner. After a configuration with a TRL budget (the dense ones), TRL
`SFTTrainer` on the same work in a process of its own (`bench/gpu_mfu_trl.py`), under its own deadline: its line
beside rayft's, with rayft/TRL tokens/s, or the reason it has no figures ("trl not importable: ...").

Why one process and these rules: a GPU is lent for minutes. Every configuration appends its JSON line to
`<out>/gpu_mfu.jsonl` the moment it ends (flushed and fsynced); each has its own deadline (what the ones before it
left passes on); one that fails or runs out of time writes a line with its error and the next one starts; SIGINT or
SIGTERM writes the running configuration's line (or lets the line being written finish) and exits at once. The
compile caches (Inductor, Triton) live under `<out>/cache`, so a later loan can carry them and skip the cold
compile.

    python bench/gpu_mfu.py --out DIR [--toy] [--only NAME ...]

`--toy`: every configuration at toy size (tiny hidden sizes, 2 layers, short rows) on CPU, where the MFU divides by
the CPU's measured fp32 matmul rate (there is no table peak for a CPU).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

STARTED = time.monotonic()  # before torch's import: what start-up costs is part of the budget
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from train_vs_trl import DENSE_SCALED, TOY_DENSE, TOY_MOE, gpu_facts, gpu_settings, model_config  # noqa: E402

RESULT = "gpu_mfu.jsonl"
TIMED_STEPS = 3
STARTUP_S = 30  # imports, CUDA and the process group before the first configuration (docs/gpu-check.md)
TOY_BUDGET_S = 120  # each configuration at toy size on a CPU, and each TRL side of one
# TRL's side of a dense configuration on the GPU: its process's start-up (torch, transformers, TRL, CUDA), the
# random init on the device, the trainer's set-up and packing, 4 steps (docs/gpu-check.md)
TRL_BUDGET_S = 35
TRL_COMMAND = "bench/gpu_mfu_trl.py"
TOY_VOCAB = 2048  # the toy models' vocabulary: the full one's LM head would be nearly all of a toy step
PLAN_GPU = "h200"  # what the planner's step time is for where the device is no GPU of its table
FP8 = "float8_e4m3fn"
# Document lengths in tokens, like wikitext's records (one line each): a quarter headings of a few tokens, the
# rest paragraphs around a hundred tokens with a long tail. Fixed, so every run packs the same rows.
HEADING_SHARE, HEADING_TOKENS = 0.25, (4, 12)
PARAGRAPH_MEDIAN, PARAGRAPH_SIGMA = 110.0, 0.8
DOC_SEED = 1234
# The shapes each configuration runs at on a GPU and, with --toy, on CPU: rows of `max_length` tokens,
# `accumulation` micro-batches a step (gpu_settings' other keys: one GPU worker).
SIZES = {
    "gpu": {"device": "cuda", "max_length": 4096, "accumulation": 4, "steps": 1 + TIMED_STEPS,
            "moe_steps": 1 + TIMED_STEPS},
    "toy": {"device": "cpu", "max_length": 128, "accumulation": 1, "steps": 1 + TIMED_STEPS,
            "moe_steps": 1 + TIMED_STEPS},
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One configuration: a model (`kind` dense or moe, transformers config overrides on the GPU and at toy size),
    its frozen base's storage and activation checkpointing, the batches it is timed on; or a kernel (`kind`
    kernel). `budget_s`: what it may take on the GPU."""

    name: str
    kind: str
    shape: dict[str, Any]
    toy: dict[str, Any]
    budget_s: int
    ac: bool = True
    fp8: bool = False
    variants: tuple[str, ...] = ("packed",)
    trl_budget_s: int = 0  # TRL's side of the same work (bench/gpu_mfu_trl.py) after rayft's; 0: none
    default: bool = True  # in a run without --only


# Most valuable first: a loan cut short still returns the first ones.
CASES = [
    Case("dense-12l-ac", "dense", DENSE_SCALED, TOY_DENSE, 40, variants=("packed", "one_doc_per_row"),
         trl_budget_s=TRL_BUDGET_S + 5),
    Case("dense-12l-noac", "dense", DENSE_SCALED, TOY_DENSE, 25, ac=False, trl_budget_s=TRL_BUDGET_S),
    Case("moe-2l-fp8", "moe", {"num_hidden_layers": 2}, TOY_MOE, 70, fp8=True),
    Case("moe-2l-bf16", "moe", {"num_hidden_layers": 2}, TOY_MOE, 20),
    # the 8-layer MoE configurations run when named (--only): their minutes went to TRL's side of the dense ones
    Case("moe-8l-fp8", "moe", {"num_hidden_layers": 8}, TOY_MOE, 45, fp8=True, default=False),
    Case("moe-8l-bf16", "moe", {"num_hidden_layers": 8}, TOY_MOE, 30, default=False),
    # kernels: an expert stack of Mistral-Small-4's shapes (E, 2·2048, 4096) dequantised; grouped_mm over 128
    # experts of a micro-batch's routed tokens (4096 tokens x top-4)
    Case("kernel-fp8-dequant", "kernel", {"experts": 16, "rows": 4096, "columns": 4096},
         {"experts": 4, "rows": 64, "columns": 64}, 10),
    Case("kernel-grouped-mm", "kernel", {"experts": 128, "tokens": 16384, "k": 4096, "n": 4096},
         {"experts": 4, "tokens": 64, "k": 32, "n": 32}, 10),
]  # fmt: skip
STAGE_BUDGET_S = STARTUP_S + sum(c.budget_s + c.trl_budget_s for c in CASES if c.default)


# --------------------------------------------------------------------------------------------------------------------
# Lines that are never lost


class Stop(BaseException):
    """Raised in the main thread by a deadline (SIGALRM) or a SIGINT/SIGTERM: what runs is abandoned."""

    def __init__(self, reason: str, signum: int) -> None:
        super().__init__(reason)
        self.reason, self.signum = reason, signum


@dataclass
class Lines:
    """`<out>/gpu_mfu.jsonl`, appended line by line. A signal that arrives while a line is written waits for the
    line to be on disk; after it, an interrupt exits. A signal is also remembered (`check`): the `Stop` its handler
    raises can land where Python swallows exceptions (a weakref callback during garbage collection)."""

    path: Path
    common: dict[str, Any]
    writing: bool = False
    pending: int | None = None  # the signal that arrived while a line was written, or was swallowed
    written: list[dict[str, Any]] = field(default_factory=list)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps({**self.common, **record}, default=_jsonable)
        self.writing = True
        try:
            with open(self.path, "a") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        finally:
            self.writing = False
        self.written.append(record)
        print(f"gpu-mfu: {summary(record)}", flush=True)
        if self.pending is not None and self.pending != signal.SIGALRM:
            exit_now(self.pending)

    def on_signal(self, signum: int, _frame: object) -> None:
        if self.pending is None or signum != signal.SIGALRM:  # an interrupt outranks a deadline
            self.pending = signum
        if not self.writing:  # else the line first; `append` exits once it is on disk
            self.check()

    @contextmanager
    def deadline(self, seconds: float) -> Iterator[None]:
        """SIGALRM (a `Stop` in the main thread) once `seconds` have passed; none left pending after."""
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if self.pending == signal.SIGALRM:
                self.pending = None

    def check(self) -> None:
        """Raise the `Stop` of a signal that arrived and was not acted on."""
        signum, self.pending = self.pending, None
        if signum == signal.SIGALRM:
            raise Stop("deadline", signum)
        if signum is not None:
            self.pending = signum  # an interrupt stays pending until the process exits
            raise Stop(signal.Signals(signum).name, signum)


def exit_now(signum: int) -> None:
    """Out at once after an interrupt: the lines are on disk, and the CUDA and process-group teardown of a normal
    exit could take longer than the caller's grace."""
    print(f"gpu-mfu: {signal.Signals(signum).name}: exiting", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def summary(record: dict[str, Any]) -> str:
    name = f"{record.get('config')}{'/' + record['variant'] if record.get('variant') else ''}"
    if record.get("error"):
        return f"{name}: {record['error'][:200]}"
    if record.get("system") == "trl" and "tokens_per_s" in record:
        peak = record.get("peak_allocated_gib") or record.get("peak_rss_delta_gib")
        ratio = record.get("ratio_tokens_per_s")
        return f"{name} TRL: {record['tokens_per_s']:,.0f} tok/s, peak {peak} GiB, rayft/TRL {ratio}"
    if "tokens_per_s" in record:
        mfu = record.get("mfu_lora")
        peak = record.get("peak_allocated_gib") or record.get("peak_rss_delta_gib")
        return (
            f"{name}: {record['tokens_per_s']:,.0f} tok/s, MFU(LoRA) {'n/a' if mfu is None else f'{mfu:.1%}'}, "
            f"peak {peak} GiB, planned {record.get('planned_memory_gib')} GiB"
        )
    return f"{name}: " + ", ".join(f"{k} {v}" for k, v in record.items() if k.endswith(("_gb_per_s", "_tflops")))


# --------------------------------------------------------------------------------------------------------------------
# Synthetic packed rows


def document_lengths(count: int, seed: int = DOC_SEED) -> list[int]:
    """`count` document lengths from the fixed wikitext-like distribution (module constants)."""
    import random

    rng = random.Random(seed)
    lengths = []
    for _ in range(count):
        if rng.random() < HEADING_SHARE:
            lengths.append(rng.randint(*HEADING_TOKENS))
        else:
            lengths.append(max(8, round(rng.lognormvariate(math.log(PARAGRAPH_MEDIAN), PARAGRAPH_SIGMA))))
    return lengths


def packed_documents(row_tokens: int, lengths: Iterator[int]) -> list[int]:
    """Documents filling one row of `row_tokens` as rayft's packing fills a block: whole documents, the last one cut
    at the row's end (the rest of it starts the next row)."""
    out, left = [], row_tokens
    while left:
        n = min(next(lengths), left)
        out.append(n)
        left -= n
    return out


def make_batch(docs: list[int], vocab: int, seed: int) -> dict[str, Any]:
    """One padding-free micro-batch as `rayft.data.pipeline.PackedCollate` makes it: one row, position ids
    restarting at each document, no target across a document's start."""
    import torch

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (sum(docs),), generator=g)
    positions = torch.cat([torch.arange(n) for n in docs])
    labels = input_ids.clone()
    labels[positions == 0] = -100
    return {"input_ids": input_ids[None], "position_ids": positions[None], "labels": labels[None]}


def step_batches(variant: str, row_tokens: int, micro_batches: int, vocab: int) -> tuple[list[dict[str, Any]], int]:
    """A step's micro-batches (`packed`: wikitext-like documents; `one_doc_per_row`: each row one document), and the
    number of documents in them."""

    def lengths() -> Iterator[int]:
        yield from document_lengths(100_000)

    stream = lengths()
    group, documents = [], 0
    for i in range(micro_batches):
        docs = packed_documents(row_tokens, stream) if variant == "packed" else [row_tokens]
        documents += len(docs)
        group.append(make_batch(docs, vocab, seed=i))
    return group, documents


# --------------------------------------------------------------------------------------------------------------------
# One model configuration


def settings(case: Case, size: dict[str, Any], out: Path) -> dict[str, Any]:
    """The settings of `case`, for rayft and TRL's side alike: the bench's (`bench/train_vs_trl.gpu_settings`:
    LoRA, packed rows, bf16, fused AdamW, one worker) with the case's activation checkpointing and frozen storage;
    the model path names nothing (no file is read)."""
    root = out / "unused" / case.name
    raw = gpu_settings(root, root / "model", root / "data", size, moe=case.kind == "moe")
    raw["train"]["gradient_checkpointing"] = case.ac
    raw["fsdp"]["activation_checkpointing"] = case.ac
    raw["model"]["frozen_dtype"] = FP8 if case.fp8 else raw["model"]["torch_dtype"]
    return raw


def rayft_config(case: Case, size: dict[str, Any], out: Path) -> Any:
    """The rayft config of `case` (`settings`)."""
    from rayft.config import Config

    return Config.from_dict(settings(case, size, out))


def plan_gpu(device: Any) -> str:
    """The planner's GPU for this device: the table's entry in its name, else `PLAN_GPU`."""
    import torch

    from rayft.gpus import GPUS

    if device.type != "cuda":
        return PLAN_GPU
    name = torch.cuda.get_device_name(device).upper()
    return next((gpu for gpu in GPUS if gpu.upper() in name), PLAN_GPU)


def planned(cfg: Any, config: Any, on_gpu: bool, gpu: str) -> dict[str, Any]:
    """What `rayft plan` says of this configuration on one worker: memory (per GPU, or host memory on CPU) and the
    predicted step time on `gpu` at the planner's assumed MFU."""
    from rayft.model.build import held_as
    from rayft.plan import meta_structure, plan_memory
    from rayft.plan.comm import Cluster, Layout
    from rayft.plan.steptime import Hardware, plan_layouts

    s = meta_structure(cfg, copy.deepcopy(config))
    held = held_as(cfg.model)
    hw = Hardware(gpu)
    (layout,) = plan_layouts(cfg, s, Cluster(1, 1), hw, held, [Layout(shard=1)])
    # on a GPU the layout's own memory (its recompute and FP8 matmuls as planned); on CPU the host memory
    memory = layout.memory if on_gpu else plan_memory(cfg, s, 1, False, held=held)
    overhead = sum(gib for name, gib in memory.rows if name.startswith("CUDA"))
    return {
        "planned_memory_gib": round(memory.total_gib, 3),
        "planned_memory_less_overhead_gib": round(memory.total_gib - overhead, 3),
        "planned_memory_rows": {name: round(gib, 4) for name, gib in memory.rows},
        "planned_step_s": layout.time.predicted_s,
        "planned_mfu": round(layout.mfu, 4),
        "planned_recompute": layout.recompute.describe(),
        "planned_for": {"gpu": gpu, "mfu_assumed": hw.mfu, "params": s.total, "lora_params": s.lora, "held": held},
    }


def device_plan(out: Path, gpu: str = PLAN_GPU) -> list[dict[str, Any]]:
    """Each configuration at its GPU size as the planner sees it on `gpu` (no GPU needed: the model on the meta
    device), beside its budget and its TRL side's, and whether a run without --only has it: what `--dry-run`
    prints. Checks every configuration's rayft config too."""
    rows = []
    for case in CASES:
        row: dict[str, Any] = {"config": case.name, "budget_s": case.budget_s, "trl_budget_s": case.trl_budget_s,
                               "default": case.default}  # fmt: skip
        if case.kind != "kernel":
            plan = planned(rayft_config(case, SIZES["gpu"], out), model_config(case.kind, case.shape), True, gpu)
            row.update(plan["planned_for"], memory_gib=plan["planned_memory_gib"], step_s=plan["planned_step_s"],
                       steps=(1 + TIMED_STEPS) * len(case.variants))  # fmt: skip
        rows.append(row)
    return rows


def rss_gib() -> float:
    from rayft.train.metrics import GIB

    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / GIB
    return math.nan


class Timer:
    """Seconds of one step: CUDA events on a GPU (the step's kernels, not the host's queueing), else wall time."""

    def __init__(self, device: Any) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch

    def time(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            started = time.perf_counter()
            fn()
            return time.perf_counter() - started
        start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000


def cpu_peak_flops() -> float:
    """The CPU's fp32 matmul rate, measured: what an MFU on CPU divides by (no table peak for a CPU)."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    started = time.perf_counter()
    for _ in range(4):
        a @ b
    return 4 * 2 * 1024**3 / (time.perf_counter() - started)


def measure_model(case: Case, size: dict[str, Any], env: Env, lines: Lines, progress: dict[str, Any]) -> None:
    """Build `case` through rayft and time each of its batch variants, one line each."""
    import torch

    from rayft.model.build import decoder_layers, forward_context, random_model
    from rayft.model.flops import flop_model
    from rayft.model.loss import lm_head
    from rayft.parallel.fsdp_tally import count_fsdp_collectives
    from rayft.parallel.layout import parallel_dims
    from rayft.parallel.parallelize import build_model
    from rayft.parallel.topology import Topology
    from rayft.train.metrics import LossWindow, attended_keys, hardware_metrics, peak_rss_gib, reset_peaks
    from rayft.train.objectives import build_objective
    from rayft.train.schedule import build_optimizer, build_scheduler
    from rayft.train.step import train_step
    from rayft.train.steps import plan_steps

    began = time.perf_counter()
    device, on_gpu = env.device, env.device.type == "cuda"
    cfg = rayft_config(case, size, env.out)
    config = model_config(case.kind, case.toy if env.toy else case.shape)
    if env.toy:
        config.vocab_size = TOY_VOCAB
    progress.update(phase="plan")
    plan = planned(cfg, config, on_gpu, env.plan_gpu)
    progress.update(plan, phase="build")
    lines.check()
    started = time.perf_counter()
    torch.manual_seed(0)
    dims = parallel_dims(cfg, device.type, Topology(("local",)))
    model = build_model(cfg, on_gpu, device, dims, base=random_model(cfg.model, config, device))
    count_fsdp_collectives(model, dims)  # as a run's set-up does: its Python cost is part of every step
    model.train()
    optimizer = build_optimizer(model, cfg.train, on_gpu)
    scheduler = build_scheduler(optimizer, cfg.train, plan_steps(cfg, size["steps"], 0, 1))
    objective = build_objective(cfg, model, device)
    flops = flop_model(model, model.config, cfg.data.max_length)
    window = LossWindow(device, 1, flops, env.peak)
    autocast = forward_context(cfg, device)
    kept = [] if cfg.fsdp.reshards() else decoder_layers(model)
    head = lm_head(model.get_base_model())
    head_params = getattr(head, "base_layer", head).weight.numel()
    if on_gpu:
        torch.cuda.synchronize()
    progress.update(phase="steps", build_s=round(time.perf_counter() - started, 2))
    lines.check()
    timer = Timer(device)
    for variant in case.variants:
        progress["variant"] = variant
        group, documents = step_batches(
            variant, cfg.data.max_length, cfg.train.gradient_accumulation_steps, config.vocab_size
        )
        group = [{k: v.to(device) for k, v in batch.items()} for batch in group]
        tokens = sum(batch["input_ids"].numel() for batch in group)
        keys = sum(int(attended_keys(batch)) for batch in group)

        step = partial(train_step, model, optimizer, scheduler, group, window, loss=objective.loss, layout=dims,
                       kept_layers=kept, autocast=autocast, max_grad_norm=cfg.train.max_grad_norm)  # fmt: skip
        reset_peaks(device)
        rss_before = rss_gib()
        warmup_s = timer.time(step)
        seconds = []
        for _ in range(TIMED_STEPS):
            lines.check()
            seconds.append(timer.time(step))
        tokens_per_s = tokens * len(seconds) / sum(seconds)
        hw = hardware_metrics(tokens_per_s, 1, flops, env.peak, device, keys / tokens)  # before `take` resets peaks
        rss_added = peak_rss_gib() - rss_before  # unrounded: the metrics' 3 places could fall below rss_before
        loss = window.take(torch.zeros((), device=device), scheduler, 0.0)["loss"]
        per_token = hw["flops_per_token_lora"]
        lines.append(
            {
                **progress,
                "phase": "done",
                "config": case.name,
                "variant": variant,
                "system": "rayft",
                "shape": _shape(config),
                "frozen_dtype": cfg.model.frozen_dtype,
                "activation_checkpointing": case.ac,
                "max_length": cfg.data.max_length,
                "accumulation": cfg.train.gradient_accumulation_steps,
                "tokens_per_step": tokens,
                "documents_per_row": round(documents / len(group), 2),
                "keys_per_token": round(keys / tokens, 1),
                "warmup_s": round(warmup_s, 4),
                "step_s": [round(s, 4) for s in seconds],
                "tokens_per_s": tokens_per_s,
                "mfu_lora": hw["mfu_lora"],
                "mfu_6n": hw["mfu_6n"],
                "flops_per_token_lora": per_token,
                "lm_head_flops_share": round(4 * head_params / per_token, 4),  # frozen: forward + input gradient
                "peak_tflops": hw["peak_tflops"],
                "peak_source": env.peak_source,
                "peak_allocated_gib": hw["memory_allocated_gib"],
                "peak_reserved_gib": hw["memory_reserved_gib"],
                "peak_rss_delta_gib": round(rss_added, 4) if not on_gpu else None,
                **_plan_ratios(plan, hw["memory_reserved_gib"]),
                "planned_step_ratio": round(plan["planned_step_s"] / (sum(seconds) / len(seconds)), 3),
                "loss": loss,
                "case_s": round(time.perf_counter() - began, 2),
                "ray_imported": "ray" in sys.modules,
            }
        )


def _plan_ratios(plan: dict[str, Any], reserved_gib: float | None) -> dict[str, float | None]:
    """Planned over measured peak GPU memory (reserved), with and without the plan's CUDA/NCCL overhead row, which
    torch's counters never see. None on CPU: the plan of a CPU worker is its whole host memory, which the RSS the
    steps added does not measure."""
    if not reserved_gib:
        return {"planned_memory_ratio": None, "planned_memory_less_overhead_ratio": None}
    return {
        "planned_memory_ratio": round(plan["planned_memory_gib"] / reserved_gib, 3),
        "planned_memory_less_overhead_ratio": round(plan["planned_memory_less_overhead_gib"] / reserved_gib, 3),
    }


def _shape(config: Any) -> dict[str, Any]:
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
            "num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "vocab_size")  # fmt: skip
    return {k: getattr(config, k) for k in keys if getattr(config, k, None) is not None}


# --------------------------------------------------------------------------------------------------------------------
# TRL's side


def measure_trl(case: Case, env: Env, lines: Lines, progress: dict[str, Any]) -> None:
    """TRL `SFTTrainer` on `case`'s work in a process of its own (`bench/gpu_mfu_trl.py`: TRL patches
    transformers, so it never runs in this one); its line, with rayft's tokens/s over TRL's. The child is killed
    when this one is stopped (deadline or interrupt); its output goes to `<out>/trl/<config>.log`."""
    import subprocess

    result = env.out / "trl" / f"{case.name}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    command = [sys.executable, str(REPO / TRL_COMMAND), "--case", case.name, "--result", str(result)]
    progress.update(phase="trl")
    began = time.perf_counter()
    with open(result.with_suffix(".log"), "w") as log:
        child = subprocess.Popen([*command, *(["--toy"] if env.toy else [])], stdout=log, stderr=subprocess.STDOUT)
        try:
            while child.poll() is None:
                lines.check()
                time.sleep(0.1)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    if not result.exists():
        tail = result.with_suffix(".log").read_text()[-1500:]
        raise RuntimeError(f"{TRL_COMMAND} exited {child.returncode} with no result: {tail}")
    record = {
        **progress,
        "phase": "done",
        **json.loads(result.read_text()),
        "case_s": round(time.perf_counter() - began, 2),
    }
    ours = next((r for r in reversed(lines.written) if r.get("system") == "rayft" and r.get("config") == case.name
                 and r.get("variant") == "packed" and "tokens_per_s" in r), None)  # fmt: skip
    if ours and record.get("tokens_per_s"):
        record.update(rayft_tokens_per_s=ours["tokens_per_s"],
                      ratio_tokens_per_s=round(ours["tokens_per_s"] / record["tokens_per_s"], 3))  # fmt: skip
    lines.append({**record, "ray_imported": "ray" in sys.modules})


# --------------------------------------------------------------------------------------------------------------------
# Kernels


def measure_kernel(case: Case, env: Env, lines: Lines, progress: dict[str, Any]) -> None:
    """The FP8 dequantisation rayft runs before each frozen matmul (GB/s of bytes read and written), or bf16
    grouped_mm over experts (TFLOP/s), where the torch has it."""
    import torch
    import torch.nn.functional as F

    shape = case.toy if env.toy else case.shape
    device, timer = env.device, Timer(env.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    record: dict[str, Any] = {**progress, "config": case.name, "shape": shape, "dtype": str(dtype)}
    if case.name == "kernel-fp8-dequant":
        from rayft.model.fp8 import dequantize_rows, fuses, quantize_rows

        data, scale = quantize_rows(torch.randn(shape["experts"], shape["rows"], shape["columns"], device=device))
        dequantize_rows(data, scale, dtype)  # warm-up: the compile, on a GPU
        seconds = min(timer.time(lambda: dequantize_rows(data, scale, dtype)) for _ in range(5))
        moved = data.numel() * (1 + torch.finfo(dtype).bits // 8) + scale.numel() * 4
        record.update(fp8_dequant_gb_per_s=round(moved / seconds / 1e9, 2), seconds=seconds, compiled=fuses(device))
    else:
        grouped_mm = getattr(F, "grouped_mm", None)
        if grouped_mm is None:
            record["error"] = f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
        else:
            e, t = shape["experts"], shape["tokens"]
            x = torch.randn(t, shape["k"], device=device, dtype=torch.bfloat16)
            w = torch.randn(e, shape["k"], shape["n"], device=device, dtype=torch.bfloat16)
            offs = torch.arange(1, e + 1, device=device, dtype=torch.int32) * (t // e)
            grouped_mm(x, w, offs=offs)
            seconds = min(timer.time(lambda: grouped_mm(x, w, offs=offs)) for _ in range(5))
            flops = 2 * t * shape["k"] * shape["n"]
            record.update(grouped_mm_tflops=round(flops / seconds / 1e12, 3), seconds=seconds,
                          share_of_peak=round(flops / seconds / env.peak, 4) if env.peak else None)  # fmt: skip
    lines.append({**record, "phase": "done", "ray_imported": "ray" in sys.modules})


# --------------------------------------------------------------------------------------------------------------------
# The run


@dataclass
class Env:
    device: Any
    toy: bool
    out: Path
    peak: float | None
    peak_source: str
    plan_gpu: str


def start(out: Path, toy: bool) -> Env:
    """The device, a one-rank process group on it (NCCL on a GPU, gloo on CPU) and the peak MFU divides by."""
    import torch
    import torch.distributed as dist
    from _common import free_port

    from rayft.model.flops import peak_flops

    on_gpu = not toy and torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)  # fmt: skip
    peak = peak_flops(device)
    source = "rayft.gpus bf16 table" if peak else "measured fp32 matmul (CPU)"
    if peak is None and not on_gpu:
        peak = cpu_peak_flops()
    return Env(device, toy, out, peak, source, plan_gpu(device))


def facts(env: Env, run_id: str) -> dict[str, Any]:
    """What every line carries: the run, the machine, the device and the versions."""
    import torch
    from _common import machine

    info = machine()
    info["versions"].update(cuda=torch.version.cuda)
    name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    return {"run": run_id, "toy": env.toy, "device": env.device.type, "device_name": name, **info, **gpu_facts()}


def cache_dirs(out: Path) -> None:
    """Inductor's and Triton's caches under `out` (set before torch is imported): a later loan carries them."""
    for variable, name in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        os.environ.setdefault(variable, str(out / "cache" / name))
        Path(os.environ[variable]).mkdir(parents=True, exist_ok=True)  # there from the start, whatever compiles


def run(out: Path, toy: bool, only: list[str] | None = None) -> int:
    """Every configuration (or `only` those), each under its deadline, a line each; 0 when every one measured."""
    out.mkdir(parents=True, exist_ok=True)
    cache_dirs(out)
    lines = Lines(out / RESULT, {"run": time.strftime("%Y%m%dT%H%M%S"), "config": None})
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
        signal.signal(signum, lines.on_signal)
    try:
        env = start(out, toy)
        lines.common = {**facts(env, lines.common["run"]), "startup_s": round(time.monotonic() - STARTED, 2)}
        lines.check()
    except Stop as stop:
        exit_now(stop.signum)
    size = SIZES["toy" if toy else "gpu"]
    failed, due = 0, STARTED + STARTUP_S
    try:
        for case in [c for c in CASES if c.name in only] if only else [c for c in CASES if c.default]:
            due += TOY_BUDGET_S if toy else case.budget_s  # what the ones before left passes on
            failed += not measure_case(case, size, env, lines, due)
            release(env)
            lines.check()
            if case.trl_budget_s:  # TRL's line says what went wrong there; it fails no stage
                due += TOY_BUDGET_S if toy else case.trl_budget_s
                measure_case(case, size, env, lines, due, trl=True)
                lines.check()
    except Stop as stop:  # between two configurations: every line so far is on disk
        exit_now(stop.signum)
    return int(failed > 0)


def measure_case(case: Case, size: dict[str, Any], env: Env, lines: Lines, due: float, trl: bool = False) -> bool:
    """One configuration (or with `trl` TRL's side of it) by `due` (`time.monotonic()`); False when it wrote a
    line with an error instead of its figures. An interrupt writes that line and exits."""
    progress: dict[str, Any] = {"config": case.name, "budget_s": round(due - time.monotonic(), 1)}
    if trl:
        progress.update(variant="packed", system="trl")
    began = time.perf_counter()
    before = len(lines.written)
    try:
        if due - time.monotonic() <= 0:
            raise TimeoutError("not started: the configurations before it used its time")
        with lines.deadline(due - time.monotonic()):
            if trl:
                measure_trl(case, env, lines, progress)
            elif case.kind == "kernel":
                measure_kernel(case, env, lines, progress)
            else:
                measure_model(case, size, env, lines, progress)
            lines.check()
    except BaseException as error:  # every failure is a line; a signal also ends the run
        stop = error if isinstance(error, Stop) else None
        reason = f"{stop.reason} in phase {progress.get('phase')}" if stop else f"{type(error).__name__}: {error}"
        lines.append({**progress, "config": case.name, "error": reason[:2000],
                      "wall_s": round(time.perf_counter() - began, 2)})  # fmt: skip
        if stop is not None and stop.signum != signal.SIGALRM:
            exit_now(stop.signum)
        return False
    return len(lines.written) > before


def release(env: Env) -> None:
    """What a configuration left (its model, optimizer, compiled graphs' memory) freed before the next one."""
    gc.collect()
    if env.device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help=f"directory of {RESULT} and the compile caches")
    parser.add_argument("--toy", action="store_true", help="toy sizes on CPU")
    parser.add_argument("--only", nargs="+", choices=[c.name for c in CASES], help="these configurations alone")
    args = parser.parse_args(argv)
    return run(args.out.resolve(), args.toy, args.only)


if __name__ == "__main__":
    sys.exit(main())
