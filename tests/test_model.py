"""LoRA + FSDP2 model assembly on a one-rank gloo process group (the two-rank path runs in the e2e tests)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from conftest import Fixtures, tiny_config

from rayft.config import Config
from rayft.model import build_model, decoder_layers, mixed_precision


@pytest.fixture
def process_group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_mixed_precision_defaults_follow_the_device():
    cfg = Config.from_dict({"train": {"bf16": True}})
    assert mixed_precision(cfg, on_gpu=True).param_dtype == torch.bfloat16
    assert mixed_precision(cfg, on_gpu=False).param_dtype == torch.float32
    assert mixed_precision(cfg, on_gpu=True).reduce_dtype == torch.float32


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_sharded_lora_model_trains_only_the_adapter(fixtures: Fixtures, tmp_path, process_group, checkpointing):
    raw = tiny_config(fixtures, tmp_path)
    raw["fsdp"] = {"activation_checkpointing": checkpointing}
    model = build_model(Config.from_dict(raw), on_gpu=False)
    assert all(hasattr(layer, "unshard") for layer in decoder_layers(model))  # each layer is an FSDP unit
    assert model.get_base_model().is_activation_checkpointing is checkpointing
    frozen = {n: p.full_tensor().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ids = torch.tensor([[1, 1784, 3937, 1278, 8312, 2]])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(p.full_tensor(), frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_chunked_loss_matches_the_full_logits_loss_and_gradients(fixtures: Fixtures, tmp_path, process_group):
    """TRL's fused LM head on the FSDP2 + LoRA model: same loss and LoRA gradients as HF's loss over full logits,
    padding-free packed batches included; not used when the LM head itself carries LoRA."""
    from rayft.data import PackedCollate
    from rayft.model import chunked_loss

    raw = tiny_config(fixtures, tmp_path)
    raw["lora"]["target_modules"] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = build_model(Config.from_dict(raw), on_gpu=False)
    assert chunked_loss(model, on_gpu=False) == {}  # its CPU path is slower than the full logits
    kwargs = chunked_loss(model, on_gpu=True)  # what a GPU run uses, checked here on CPU
    assert kwargs == {"fused_lm_head": True}
    batch = PackedCollate()({"input_ids": [torch.tensor([1, 1784, 3937, 1278, 2]), torch.tensor([1, 8312, 1321, 2])],
                             "position_ids": [torch.arange(5), torch.arange(4)]})  # fmt: skip

    def loss_and_grads(**extra):
        loss = model(**batch, **extra).loss
        loss.backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return loss.item(), grads

    full, full_grads = loss_and_grads()
    chunked, chunked_grads = loss_and_grads(**kwargs)
    assert chunked == pytest.approx(full, rel=1e-5)
    assert all(torch.allclose(chunked_grads[n], g, rtol=1e-4, atol=1e-6) for n, g in full_grads.items())

    raw["lora"]["target_modules"] = [*raw["lora"]["target_modules"], "lm_head"]
    assert chunked_loss(build_model(Config.from_dict(raw), on_gpu=False), on_gpu=True) == {}
