"""The logging window's figures from a real training step on one gloo rank: the FLOPs its MFU counts for a packed
batch (against a hand count from the model's config), and the time it measures."""

from __future__ import annotations

import os
import time
from contextlib import nullcontext

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.distributed as dist
from conftest import free_port
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard
from transformers import MistralConfig, MistralForCausalLM

from rayft.data.pipeline import PackedCollate, PadCollate, pack
from rayft.model.flops import flop_model
from rayft.model.loss import CausalLMLoss
from rayft.parallel.layout import ParallelDims
from rayft.parallel.topology import Topology
from rayft.train.metrics import LossWindow, attended_keys
from rayft.train.step import NextTokenLoss, train_step

PEAK = 1e12  # a stated peak (train.peak_tflops 1): MFU exists on CPU
MAX_LENGTH = 8
PLAIN = NextTokenLoss(CausalLMLoss(fused=False))  # transformers' own loss, as the tiny model gives it
ONE_RANK = ParallelDims(Topology(("local",)), shard=1, experts=1, device_type="cpu")  # fully_shard over the world


@pytest.fixture(scope="module")
def one_rank():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(one_rank):
    torch.manual_seed(0)
    config = MistralConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        tie_word_embeddings=False,
    )
    model = get_peft_model(MistralForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return model, config, optimizer, scheduler


def packed_batch(lengths: list[int]) -> dict[str, torch.Tensor]:
    """The real packing (blocks of MAX_LENGTH) and padding-free collate of documents of these lengths."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 1000, n).tolist() for n in lengths]
    blocks = pack(pa.table({"input_ids": docs}), MAX_LENGTH).to_pydict()
    return PackedCollate()({k: np.array([np.array(v) for v in vs], dtype=object) for k, vs in blocks.items()})


def step(tiny, window: LossWindow, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model, _, optimizer, scheduler = tiny
    return train_step(
        model,
        optimizer,
        scheduler,
        [batch],
        window,
        loss=PLAIN,
        layout=ONE_RANK,
        kept_layers=[],
        autocast=nullcontext,
        max_grad_norm=1.0,
    )


def test_mfu_counts_causal_attention_per_packed_document(tiny):
    """Documents of 5, 6 and 5 tokens packed into blocks of 8: [5 | 3 of 6] [3 of 6 | 5]. Attention never crosses
    a document or a block, and is causal: the documents attend 15 + 6 + 6 + 15 = 42 keys, not 16 × 8."""
    model, config, _, scheduler = tiny
    batch = packed_batch([5, 6, 5])
    assert batch["input_ids"].shape == (1, 16)
    window = LossWindow(torch.device("cpu"), 1, flop_model(model, config, MAX_LENGTH), PEAK)
    metrics = window.take(step(tiny, window, batch), scheduler, 0.0)

    # By hand, from the config: per layer q 64·64 + k 64·32 + v 64·32 + o 64·64 + gate/up/down 3·64·128, two
    # layers, lm_head 64·1000; LoRA r=4 on q (4·64 + 64·4) and v (4·64 + 32·4) per layer.
    base = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 64 * 1000
    lora = 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)
    # One query attending one key, forward: QKᵀ (2 · 16) + attention·V (2 · 16) FLOPs per head, 4 heads, 2 layers.
    per_key = 2 * 4 * (2 * 16 + 2 * 16)
    keys = (1 + 2 + 3 + 4 + 5) + (1 + 2 + 3) + (1 + 2 + 3) + (1 + 2 + 3 + 4 + 5)
    lora_aware = 16 * (4 * base + 6 * lora) + 3 * per_key * keys
    six_n = 16 * 6 * (base + lora) + 3 * per_key * keys
    per_worker = metrics["tokens_per_s_per_worker"]
    assert metrics["mfu_lora"] * PEAK / per_worker == pytest.approx(lora_aware / 16, rel=1e-9)
    assert metrics["mfu_6n"] * PEAK / per_worker == pytest.approx(six_n / 16, rel=1e-9)


def test_attended_keys_of_padded_and_unmarked_rows():
    """Padded rows (SFT without packing, DPO pairs) attend within their tokens; a row with neither mask nor
    positions is one document."""
    padded = PadCollate(pad_id=0, multiple=4)({"input_ids": np.array([np.arange(1, 4), np.arange(1, 6)], dtype=object)})
    assert padded["attention_mask"].shape == (2, 8)
    assert attended_keys(padded).item() == (1 + 2 + 3) + (1 + 2 + 3 + 4 + 5)
    assert attended_keys({"input_ids": torch.zeros(3, 4, dtype=torch.long)}).item() == 3 * (1 + 2 + 3 + 4)


def timed_steps(tiny, window: LossWindow, count: int) -> tuple[float, torch.Tensor]:
    """`count` training steps on one packed batch: their wall seconds and the last gradient norm."""
    batch = packed_batch([5, 6, 5])
    started = time.perf_counter()
    norms = [step(tiny, window, batch) for _ in range(count)]
    return time.perf_counter() - started, norms[-1]


SLOW = 2.0  # seconds of set-up, evaluation or saving
SLACK = 0.1  # seconds: a take's own bookkeeping before it reads the clock


def test_the_first_window_starts_with_the_first_step_not_at_set_up(tiny):
    """Model build, resume and the first batch's wait (here: SLOW seconds between the window's creation and the
    first step) are not training: the first window measures the steps alone."""
    model, config, _, scheduler = tiny
    window = LossWindow(torch.device("cpu"), 1, flop_model(model, config, MAX_LENGTH), PEAK)
    time.sleep(SLOW)
    started = time.perf_counter()
    _, norm = timed_steps(tiny, window, 2)
    metrics = window.take(norm, scheduler, 0.0)
    assert 2 * metrics["step_time_s"] <= time.perf_counter() - started, metrics
    assert metrics["tokens_per_s"] >= 2 * 16 / (time.perf_counter() - started)


def test_window_time_excludes_evaluation_and_checkpoints(tiny):
    """The loop evaluates and saves inside `window.paused()`: a slow evaluation between two steps of a window, and
    a slow save after the window was taken, count in neither window's time."""
    model, config, _, scheduler = tiny
    window = LossWindow(torch.device("cpu"), 1, flop_model(model, config, MAX_LENGTH), PEAK)
    before, _ = timed_steps(tiny, window, 1)
    with window.paused():
        time.sleep(SLOW)  # an evaluation
    after, norm = timed_steps(tiny, window, 1)
    first = window.take(norm, scheduler, 0.0)
    stepping = before + after
    with window.paused():
        time.sleep(SLOW)  # a checkpoint
    stepping_second, norm = timed_steps(tiny, window, 2)
    second = window.take(norm, scheduler, 0.0)
    assert 2 * first["step_time_s"] <= stepping + SLACK, first
    assert stepping_second <= 2 * second["step_time_s"] <= stepping_second + SLACK, second


def test_each_window_reports_its_own_memory_peak(tiny):
    """A peak before training (the model load) and one inside a window show only in that window's figure. On CPU
    the figure is the host RSS peak; on CUDA the same resets restart the allocator's peaks."""
    model, config, _, scheduler = tiny
    window = LossWindow(torch.device("cpu"), 1, flop_model(model, config, MAX_LENGTH), PEAK)
    burst = 512 * 2**20  # bytes, touched: resident
    loading = torch.ones(burst // 4)
    del loading
    quiet = window.take(timed_steps(tiny, window, 1)[1], scheduler, 0.0)["host_rss_gib"]
    _, norm = timed_steps(tiny, window, 1)
    inside = torch.ones(burst // 4)
    del inside
    busy = window.take(norm, scheduler, 0.0)["host_rss_gib"]
    after = window.take(timed_steps(tiny, window, 1)[1], scheduler, 0.0)["host_rss_gib"]
    assert busy - quiet > 0.8 * burst / 2**30 and busy - after > 0.8 * burst / 2**30, (quiet, busy, after)


def test_a_non_finite_step_is_found_with_the_window_and_named_by_its_step(one_rank):
    """Steps 1-2 finite, step 3's loss infinite, step 4's gradient norm NaN: the window's reduction names step 3 and
    what was not finite then; the weights' check before a save names its own step."""
    import math

    from rayft.model.flops import FlopModel

    window = LossWindow(torch.device("cpu"), 1, FlopModel(0, 0, 0.0), None)
    one = torch.tensor(1)
    for step, (loss, norm) in enumerate([(2.0, 1.0), (1.5, 0.5), (math.inf, 0.5), (1.0, math.nan)], start=1):
        window.add(torch.tensor(loss), True, one, one)
        window.note_step(step, torch.tensor(norm))
        if step == 2:
            window.take(torch.tensor(norm), _Scheduler(), 0.0)
            assert window.non_finite is None
    window.take(torch.tensor(math.nan), _Scheduler(), 0.0)
    assert window.non_finite == (3, "the loss")
    assert window.finite.checked() == (3, "the loss")
    fresh = LossWindow(torch.device("cpu"), 1, FlopModel(0, 0, 0.0), None)
    fresh.finite.note_weights(7, [torch.ones(2), torch.tensor([0.0, math.nan])])
    assert fresh.finite.checked() == (7, "the adapter's weights")


class _Scheduler:
    def get_last_lr(self) -> list[float]:
        return [1e-4]
