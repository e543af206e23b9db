"""LoRA + FSDP2 model assembly on a one-rank gloo process group (the two-rank path runs in the e2e tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import Fixtures, tiny_config

from rayft.config import Config
from rayft.model.build import decoder_layers
from rayft.model.lora import DENSE_TARGETS as DENSE
from rayft.parallel.parallelize import build_model, mixed_precision


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
    ids = torch.tensor([[1, 1784, 1937, 1278, 1812, 2]])
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


@pytest.mark.parametrize("batching, head", [("packed", "frozen"), ("padded", "lora")])
def test_fused_loss_matches_the_full_logits_loss_and_gradients(
    fixtures: Fixtures, tmp_path, process_group, batching, head
):
    """rayft.model.loss on FSDP2 + LoRA: the loss and LoRA gradients of transformers' loss over full logits, in
    fp32 and under CPU bf16 autocast, for padding-free and padded batches, with the LM head frozen or under LoRA
    (its low-rank term inside the chunks, A and B trained); eval (no grad) too."""
    from rayft.data.pipeline import PackedCollate, PadCollate
    from rayft.model.build import fused_loss
    from rayft.model.loss import CausalLMLoss

    raw = tiny_config(fixtures, tmp_path)
    targets = [*DENSE, "lm_head"] if head == "lora" else list(DENSE)
    raw["lora"].update(target_modules=targets, lora_dropout=0.0)
    torch.manual_seed(0)
    model = build_model(Config.from_dict(raw), on_gpu=False)
    with torch.no_grad():  # B = 0 at init would leave A's gradients zero: give both something to show
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    seqs = [torch.tensor([1, 1784, 1937, 1278, 2]), torch.tensor([1, 1812, 1321, 2])]
    if batching == "packed":
        batch = PackedCollate()({"input_ids": seqs, "position_ids": [torch.arange(5), torch.arange(4)]})
    else:
        batch = PadCollate(pad_id=11)({"input_ids": seqs})

    def loss_and_grads(loss_of: CausalLMLoss, bf16: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(model, batch)
        loss.backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            assert loss_of(model, batch).item() == pytest.approx(loss.item(), rel=1e-6)
        return loss.item(), grads

    def summed(loss_of: CausalLMLoss):  # the Trainer's token-weighted accumulation: the sum over targets / a count
        with torch.no_grad():
            return loss_of(model, batch, torch.tensor(3.0, dtype=torch.float64)).item()

    plain, chunked = CausalLMLoss(fused=False), CausalLMLoss(fused=True)
    full, full_summed = {bf16: loss_and_grads(plain, bf16) for bf16 in (False, True)}, summed(plain)
    assert plain.workspace.kept == ()  # transformers' own loss: no chunk ran
    assert fused_loss(model, Config.from_dict(raw)) is None
    fused = {bf16: loss_and_grads(chunked, bf16) for bf16 in (False, True)}
    assert chunked.workspace.kept  # the chunked path is the one that ran
    assert summed(chunked) == pytest.approx(full_summed, rel=1e-5)
    assert full_summed == pytest.approx(full[False][0] * 7 / 3, rel=1e-5)  # 7 targets in either batch
    for bf16, tolerance in ((False, 1e-4), (True, 2e-2)):
        (full_loss, full_grads), (fused_loss_, fused_grads) = full[bf16], fused[bf16]
        assert fused_loss_ == pytest.approx(full_loss, rel=tolerance)
        for name, grad in full_grads.items():
            assert grad.abs().sum() > 0, name
            assert torch.allclose(fused_grads[name], grad, rtol=tolerance, atol=tolerance * grad.abs().max()), name


def test_fused_loss_is_skipped_where_it_would_be_wrong(fixtures: Fixtures, tmp_path, process_group):
    import peft
    from transformers import AutoModelForCausalLM

    from rayft.model.build import fused_loss
    from rayft.model.loss import why_not_fused
    from rayft.train.objectives import build_objective

    dora = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(fixtures.model)),
        peft.LoraConfig(r=4, target_modules=["lm_head"], use_dora=True),
    )
    assert "DoRA" in why_not_fused(dora.get_base_model())
    raw = tiny_config(fixtures, tmp_path)
    raw["lora"]["target_modules"] = list(DENSE)
    raw["train"]["fused_loss"] = False
    model = build_model(Config.from_dict(raw), on_gpu=False)
    assert fused_loss(model, Config.from_dict(raw)) == "train.fused_loss is false"
    ids = torch.tensor([[1, 1784, 1937, 2]])
    sft = build_objective(Config.from_dict(raw), model, torch.device("cpu"))
    loss = sft.causal_lm_loss(model, {"input_ids": ids, "labels": ids})
    assert sft.causal_lm_loss.workspace.kept == ()  # no chunk ran: transformers' loss over the full logits
    assert loss.item() == model(input_ids=ids, labels=ids).loss.item()


def test_replicated_model_trains_like_the_sharded_one(fixtures: Fixtures, tmp_path):
    """fsdp.shard_size 1 on two gloo ranks: weights replicated (a 2-D mesh), the frozen root gathered once and kept,
    layers kept gathered across the micro-batches of a step; the same losses and adapter as full sharding."""
    from conftest import free_port
    from fixtures.ranks import spawn_ranks

    raw = tiny_config(fixtures, tmp_path)
    raw["lora"]["lora_dropout"] = 0.0
    spawn_ranks(_train_two_ways, args=(2, free_port(), raw, str(tmp_path)), nprocs=2)
    sharded, replicated = (torch.load(tmp_path / f"{name}.pt") for name in ("sharded", "replicated"))
    assert replicated["losses"] == pytest.approx(sharded["losses"], rel=1e-5)
    assert replicated["losses"][-1] < replicated["losses"][0]
    for name, weight in sharded["lora"].items():
        assert torch.allclose(replicated["lora"][name], weight, atol=1e-6), name


def _train_two_ways(rank: int, world: int, port: int, raw: dict, out: str) -> None:
    from torch.distributed.tensor import Replicate, Shard

    from rayft.parallel.parallelize import set_gradient_sync

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, shard_size in (("sharded", None), ("replicated", 1)):
            raw["fsdp"] = {"shard_size": shard_size}
            cfg = Config.from_dict(raw)
            torch.manual_seed(0)
            model = build_model(cfg, on_gpu=False)
            lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
            placements = next(iter(lora.values())).placements
            assert placements == ((Replicate(), Shard(0)) if shard_size == 1 else (Shard(0),))
            optimizer = torch.optim.AdamW(list(lora.values()), lr=1e-2)
            torch.manual_seed(rank)  # each rank its own data, as in training
            batches = [torch.randint(3, 1000, (2, 16))] * 6  # the same batch: the loss must fall
            losses = []
            for step in range(3):
                for micro in range(2):
                    kept = [] if cfg.fsdp.reshards() else decoder_layers(model)
                    set_gradient_sync(model, sync=micro == 1, kept_layers=kept)
                    ids = batches[2 * step + micro]
                    loss = model(input_ids=ids, labels=ids).loss
                    (loss / 2).backward()
                    losses.append(loss.item())
                optimizer.step()
                optimizer.zero_grad()
            full = {n: p.full_tensor() for n, p in lora.items()}
            if rank == 0:
                torch.save({"losses": losses, "lora": full}, Path(out) / f"{name}.pt")
    finally:
        dist.destroy_process_group()


def test_cpu_offload_materialises_the_shards_on_the_host(fixtures: Fixtures, tmp_path, process_group):
    """FSDP2 refuses offloaded parameters that are not on the CPU: with `fsdp.cpu_offload` the model is built on the
    host even when the worker's device is a GPU (here a CUDA device this machine has not: main created the shards
    there and failed), and it still loads and trains."""
    raw = tiny_config(fixtures, tmp_path)
    raw["fsdp"] = {"cpu_offload": True}
    cfg = Config.from_dict(raw)
    model = build_model(cfg, on_gpu=False, device=torch.device("cuda", 0))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    ids = torch.tensor([[1, 1784, 1937, 1278, 1812, 2]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in model.parameters() if p.requires_grad)

    from rayft.parallel.parallelize import materialization_device

    assert materialization_device(cfg.fsdp, torch.device("cuda", 0)) == torch.device("cpu")
    without = Config.from_dict(tiny_config(fixtures, tmp_path)).fsdp
    assert materialization_device(without, torch.device("cuda", 0)) == torch.device("cuda", 0)


@pytest.mark.parametrize("frozen", ["float8_e4m3fn", "bfloat16"], ids=["fp8-base", "bf16-base"])
def test_lora_master_weights_and_adamw_state_stay_fp32_over_a_low_precision_base(
    fixtures: Fixtures, tmp_path, process_group, frozen
):
    """Over a bf16 or FP8 frozen base the adapter (FSDP's sharded master copy) and its AdamW moments are fp32, so a
    learning-rate-sized first AdamW step lands as an fp32 AdamW step computed here by hand: lr · g / (|g| + eps).
    In bf16 most of these 1e-4 updates fall below the weight's ulp and vanish."""
    from rayft.train.schedule import build_optimizer

    lr, eps = 1e-4, 1e-8
    raw = tiny_config(fixtures, tmp_path)
    raw["model"].update(torch_dtype="bfloat16", frozen_dtype=frozen)
    raw["train"].update(learning_rate=lr, weight_decay=0.0)
    raw["lora"].update(lora_dropout=0.0)
    cfg = Config.from_dict(raw)
    model = build_model(cfg, on_gpu=False)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and {p.to_local().dtype for p in trainable.values()} == {torch.float32}
    with torch.no_grad():  # B = 0 at init leaves every A's gradient zero
        for name, p in trainable.items():
            if "lora_B" in name:
                p.normal_(std=0.05)
    before = {n: p.full_tensor().clone() for n, p in trainable.items()}
    optimizer = build_optimizer(model, cfg.train, on_gpu=False)
    ids = torch.tensor([[1, 1784, 1937, 1278, 1812, 2, 977, 41]])
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in trainable.items()}
    optimizer.step()
    moments = [t for state in optimizer.state.values() for k, t in state.items() if k.startswith("exp_avg")]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    for name, p in trainable.items():
        g = grads[name]
        assert g.abs().sum() > 0, name
        expected = before[name] - lr * g / (g.abs() + eps)  # Adam's first step: bias-corrected m / sqrt(v) = g / |g|
        torch.testing.assert_close(p.full_tensor(), expected, rtol=1e-6, atol=1e-9, msg=name)


def test_selective_and_full_recompute_give_the_gradients_of_no_recompute(fixtures: Fixtures, tmp_path, process_group):
    """`fsdp.activation_checkpointing`: selective (every 2nd of the 2 layers: layer 0 recomputed, layer 1 keeping
    its activations) and full recompute change what is kept, not what is computed: the LoRA gradients of one
    step are those of the run without recompute."""
    ids = torch.tensor([[1, 1784, 1937, 1278, 1812, 2, 1784, 1937]])
    grads, recomputed = {}, {}
    for setting in ("none", "selective", "full"):
        raw = tiny_config(fixtures, tmp_path)
        raw["lora"]["lora_dropout"] = 0.0
        raw["fsdp"] = {"activation_checkpointing": setting}
        if setting == "selective":
            raw["fsdp"]["checkpoint_every_n_layers"] = 2
        torch.manual_seed(0)  # the same LoRA initialisation each time
        model = build_model(Config.from_dict(raw), on_gpu=False)
        recomputed[setting] = [layer.gradient_checkpointing for layer in decoder_layers(model)]
        model(input_ids=ids, labels=ids).loss.backward()
        grads[setting] = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert recomputed == {"none": [False, False], "selective": [True, False], "full": [True, True]}
    assert any(g.abs().sum() > 0 for g in grads["none"].values())
    for setting in ("selective", "full"):
        assert grads[setting].keys() == grads["none"].keys()
        for name, grad in grads[setting].items():
            torch.testing.assert_close(grad, grads["none"][name], rtol=1e-6, atol=0, msg=f"{setting}: {name}")
