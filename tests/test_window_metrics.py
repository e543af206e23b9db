"""The logging window's figures from a real training step on one gloo rank: the FLOPs its MFU counts for a packed
batch (against a hand count from the model's config), and the time it measures."""

from __future__ import annotations

import os
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

from rayft.data.pipeline import PackedCollate, pack
from rayft.train.metrics import LossWindow, flop_model
from rayft.train.step import train_step

PEAK = 1e12  # a stated peak (train.peak_tflops 1): MFU exists on CPU
MAX_LENGTH = 8


@pytest.fixture(scope="module")
def one_rank():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(one_rank):
    torch.manual_seed(0)
    config = MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=1000, tie_word_embeddings=False)  # fmt: skip
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
    return train_step(model, optimizer, scheduler, [batch], window, world_size=1, kept_layers=[],
                      autocast=nullcontext, max_grad_norm=1.0)  # fmt: skip


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
