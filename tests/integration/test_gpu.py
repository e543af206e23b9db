"""What only a CUDA GPU can show, in-process on a one-rank NCCL group (`make gpu-check STAGE=tests`).

Each test builds the model exactly as a worker does (`build_model(cfg, on_gpu=True, device)`: meta init → LoRA →
FSDP2 → sharded loading onto the GPU) and checks it against a path that shares none of that: transformers'
own model classes on CPU in fp32 (experts through their eager loop, not `grouped_mm`), `from_pretrained`, the
FP8 files as stored or dequantised whole, or an uninterrupted run. Every test runs twice: on CUDA (marked `gpu`,
skipped with "needs CUDA" elsewhere) and on the CPU over a one-rank gloo group, where the same body checks the
device-independent part in CI.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import Fixtures, free_port, tiny_config
from fixtures.devices import DEVICES, LoadMemory, synchronize
from fixtures.ranks import whole

from rayft.config import Config
from rayft.model.fp8 import STORAGE, fp8_scale_params
from rayft.model.lora import AUTO_TARGETS, DENSE_TARGETS

# bf16 keeps 8 significant bits: each LoRA gradient within 5% of fp32 in norm (10% for the MoE model, where a bf16
# router may send the odd near-tied token to another expert than fp32 does). The random models' losses sit near
# ln(vocabulary) (7.6 for the fixture's 2,048 ids) with logits of order 0.1, so bf16 moves them by ~1e-3: 1e-2 is
# tight enough to show a wrong mask or a dropped loss term, and the gradients carry the finer check.
LOSS_ATOL = 1e-2
GRAD_RTOL = {"dense": 5e-2, "mistral4-hub": 1e-1}


def _raw_config(kind: str, fixtures: Fixtures, hub: Path, out: Path, frozen: str = "auto") -> dict:
    """The demo settings in bf16 on GPU, LoRA (dropout 0) on an explicit list so the reference can copy it; the hub
    model's base kept as `frozen` (auto: FP8, as its checkpoint)."""
    raw = tiny_config(fixtures, out)
    raw["train"]["bf16"] = True
    raw["lora"].update(lora_dropout=0.0, target_modules=list(DENSE_TARGETS))
    if kind == "mistral4-hub":
        raw["model"].update(model_name_or_path=str(hub), torch_dtype="bfloat16", frozen_dtype=frozen)
        raw["lora"]["target_modules"] = list(AUTO_TARGETS["mistral4"])
    return raw


def _model_dir(kind: str, fixtures: Fixtures, hub: Path) -> Path:
    return hub if kind == "mistral4-hub" else fixtures.model


def _batch(device: torch.device, packed: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two examples: packed into one padding-free row (position ids restart), or padded with an attention mask."""
    from rayft.data.pipeline import PackedCollate, PadCollate

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, 2000, (n,), generator=g) for n in (40, 24)]
    if packed:
        batch = PackedCollate()({"input_ids": seqs, "position_ids": [torch.arange(len(s)) for s in seqs]})
    else:
        batch = PadCollate(pad_id=11)({"input_ids": seqs})
    return {k: v.to(device) for k, v in batch.items()}


def _randomise_lora_b(model) -> None:
    """B = 0 at init leaves A's gradients zero: give both something to show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().float().cpu() for n, p in model.named_parameters() if p.requires_grad}


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _cpu_reference(gpu_model, raw: dict, model_dir: Path):
    """The same weights (base + LoRA, gathered from the GPU) in transformers' own class on CPU, fp32, no FSDP,
    experts through the eager per-expert loop: the independent path every bf16 number is held against."""
    import peft

    from rayft.model.build import causal_lm_class, text_config

    config = text_config(str(model_dir))
    config.use_cache = False  # as in training: with a cache transformers would not split packed rows by position ids
    experts = {"experts_implementation": "eager"} if getattr(config, "num_experts_per_tok", None) else {}
    base = causal_lm_class(config)._from_config(config, dtype=torch.float32, **experts)
    lora = raw["lora"]
    reference = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=lora["r"],
            lora_alpha=lora["lora_alpha"],
            lora_dropout=0.0,
            target_modules=lora["target_modules"],
            task_type=peft.TaskType.CAUSAL_LM,
        ),
    )
    missing, unexpected = reference.load_state_dict(_dense_weights(gpu_model), strict=False)
    assert not unexpected and not [k for k in missing if k in dict(reference.named_parameters())], missing
    return reference


def _dense_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter gathered to the CPU in fp32, FP8 storage dequantised here by hand (E4M3 value × the row
    scale whose fp32 bits the int32 scale parameter holds), its scale parameters left out."""
    scale_of = fp8_scale_params(model)
    scale_ids = {id(p) for p in scale_of.values()}
    out = {}
    for name, p in model.named_parameters():
        if id(p) in scale_ids:
            continue
        full = whole(p).detach().cpu()
        if p.dtype == STORAGE:
            scale = whole(scale_of[name]).detach().cpu().view(torch.float32)
            full = full.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1)
        out[name] = full.float()
    return out


@pytest.mark.parametrize("kind", ["dense", "mistral4-hub"])
def test_bf16_fsdp2_lora_step_matches_the_fp32_cpu_reference(
    kind, fixtures: Fixtures, mistral4_hub: Path, tmp_path, device_group
):
    """One optimizer step of the worker's model (bf16 FSDP2 + LoRA, fused loss, MoE experts through grouped_mm):
    loss, every LoRA gradient and the loss after the AdamW step equal the fp32 CPU reference within bf16 error."""
    from rayft.model.build import fused_loss
    from rayft.model.loss import CausalLMLoss
    from rayft.parallel.parallelize import build_model

    raw = _raw_config(kind, fixtures, mistral4_hub, tmp_path)
    cfg = Config.from_dict(raw)
    torch.manual_seed(0)
    model = build_model(cfg, on_gpu=device_group.type == "cuda", device=device_group)
    if kind == "mistral4-hub":
        assert model.get_base_model().config._experts_implementation == "grouped_mm"
    _randomise_lora_b(model)
    reference = _cpu_reference(model, raw, _model_dir(kind, fixtures, mistral4_hub))
    assert fused_loss(model, cfg) is None
    batch = _batch(device_group)
    cpu_batch = {k: v.cpu() for k, v in batch.items()}

    def step(m, b, loss_of: CausalLMLoss):
        optimizer = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        loss = loss_of(m, b)
        loss.backward()
        grads = _lora_grads(m) if m is model else {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            after = loss_of(m, b).item()
        return loss.item(), grads, after

    loss, grads, after = step(model, batch, CausalLMLoss(fused=True))  # the worker's loss, fused with the head
    ref_loss, ref_grads, ref_after = step(reference, cpu_batch, CausalLMLoss(fused=False))
    assert loss == pytest.approx(ref_loss, abs=LOSS_ATOL)
    assert after == pytest.approx(ref_after, abs=LOSS_ATOL)
    assert after < loss  # the step did something, and the same thing on both sides
    assert set(grads) == set(ref_grads)
    errors = {n: _relative_error(grads[n], ref_grads[n]) for n in grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] < GRAD_RTOL[kind], f"{worst}: relative gradient error {errors[worst]:.3g}"


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_fused_loss_equals_full_logits_in_both_branches(packed, fixtures: Fixtures, tmp_path, device_group):
    """On the worker's model (bf16 on the GPU): transformers' loss over full logits, then rayft's fused loss
    through its GPU branch (masking) and its CPU branch (dropping rows): same loss and LoRA gradients within bf16
    error."""
    from rayft.model.loss import CausalLMLoss, why_not_fused
    from rayft.parallel.parallelize import build_model

    raw = _raw_config("dense", fixtures, fixtures.model, tmp_path)
    torch.manual_seed(0)
    model = build_model(Config.from_dict(raw), on_gpu=device_group.type == "cuda", device=device_group)
    _randomise_lora_b(model)
    batch = _batch(device_group, packed=packed)

    def loss_and_grads(loss_of: CausalLMLoss):
        loss = loss_of(model, batch)
        loss.backward()
        grads = _lora_grads(model)
        model.zero_grad(set_to_none=True)
        return loss.item(), grads

    full_loss, full_grads = loss_and_grads(CausalLMLoss(fused=False))
    assert why_not_fused(model.get_base_model()) is None
    for drop_unscored in (False, True):  # the GPU branch first: it is the one GPUs run
        loss, grads = loss_and_grads(CausalLMLoss(fused=True, drop_unscored=drop_unscored))
        assert loss == pytest.approx(full_loss, abs=LOSS_ATOL), drop_unscored
        for name, grad in full_grads.items():
            assert grad.abs().sum() > 0, name
            assert _relative_error(grads[name], grad) < GRAD_RTOL["dense"], (name, drop_unscored)


@pytest.mark.parametrize(
    "kind, frozen",
    [("dense", "auto"), ("mistral4-hub", "bfloat16"), ("mistral4-hub", "auto")],
    ids=["dense", "hub-bf16", "hub-fp8"],
)
def test_sharded_loading_onto_the_device_equals_the_files(
    kind, frozen, fixtures: Fixtures, mistral4_hub, tmp_path, device_group, record_property
):
    """Every base weight the rank reads from the files onto its device is the one `from_pretrained` gives (dense),
    the FP8 tensor × its scale (the hub layout in bf16), or the hub's E4M3 bytes and static scales as stored (the
    hub layout kept in FP8), bit for bit. The load's peak device memory is reported beside the NF4 load's
    (test_nf4_job.py)."""
    from test_fp8 import _assert_hub_bytes_loaded_as_they_are
    from test_weights import _dequantised_reference
    from transformers import AutoModelForCausalLM

    from rayft.model.weights import model_param_name
    from rayft.parallel.parallelize import build_model

    model_dir = _model_dir(kind, fixtures, mistral4_hub)
    cfg = Config.from_dict(_raw_config(kind, fixtures, mistral4_hub, tmp_path, frozen))
    with LoadMemory(device_group) as load:
        model = build_model(cfg, on_gpu=device_group.type == "cuda", device=device_group)
    load.report(record_property, model)
    for name, param in model.named_parameters():
        assert param.device.type == device_group.type, name  # on the device, not left on the host
    if kind == "mistral4-hub" and frozen == "auto":
        _assert_hub_bytes_loaded_as_they_are(model, str(model_dir), rank=0)
        return
    if kind == "dense":
        expected = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).state_dict()
    else:
        expected = {k.removeprefix("language_model."): v for k, v in _dequantised_reference(model_dir).items()}
    seen = set()
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        key = model_param_name(name)
        full = whole(param)
        assert torch.equal(full.cpu(), expected[key].to(full.dtype)), (kind, name)
        seen.add(key)
    assert seen == {k for k in expected if not k.endswith("rotary_emb.inv_freq")}, kind


def test_checkpoint_save_and_exact_resume_on_the_device(fixtures: Fixtures, tmp_path, device_group):
    """Save after 2 steps, train 2 more; a fresh model (other seed) that loads the checkpoint trains those 2 steps
    to the same losses and adapter: LoRA params, AdamW state, scheduler and the device's RNG (dropout) restored."""
    from rayft.parallel.layout import ParallelDims
    from rayft.parallel.parallelize import build_model
    from rayft.parallel.topology import Topology
    from rayft.train.checkpoint import load_checkpoint, save_checkpoint
    from rayft.train.checkpoint_dir import Progress
    from rayft.train.schedule import build_optimizer, build_scheduler
    from rayft.train.steps import plan_steps

    raw = _raw_config("dense", fixtures, fixtures.model, tmp_path)
    raw["lora"]["lora_dropout"] = 0.1  # draws from the device's generator every step
    raw["model"]["attn_implementation"] = "eager"  # deterministic kernels: the comparison can be exact
    raw["train"].update(max_steps=4, learning_rate=1e-2)
    cfg = Config.from_dict(raw)
    plan = plan_steps(cfg, train_rows=64, validation_rows=0, world_size=1)
    batches = [_batch(device_group, seed=s) for s in range(4)]
    one_rank = ParallelDims(Topology(("local",)), shard=1, experts=1, device_type=device_group.type)

    def trainer(seed: int):
        torch.manual_seed(seed)
        model = build_model(cfg, on_gpu=device_group.type == "cuda", device=device_group)
        optimizer = build_optimizer(model, cfg.train, on_gpu=device_group.type == "cuda")
        return model, optimizer, build_scheduler(optimizer, cfg.train, plan)

    def train(model, optimizer, scheduler, steps: range) -> list[float]:
        losses = []
        for i in steps:
            loss = model(**batches[i]).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    model, optimizer, scheduler = trainer(seed=0)
    train(model, optimizer, scheduler, range(2))
    save_checkpoint(tmp_path / "ckpt", model, optimizer, scheduler, Progress(step=2), {"step": 2}, one_rank)
    uninterrupted = train(model, optimizer, scheduler, range(2, 4))
    adapter = {n: p.full_tensor().cpu() for n, p in model.named_parameters() if p.requires_grad}

    model, optimizer, scheduler = trainer(seed=1)
    assert load_checkpoint(tmp_path / "ckpt", model, optimizer, scheduler, one_rank).step == 2
    resumed = train(model, optimizer, scheduler, range(2, 4))
    assert resumed == pytest.approx(uninterrupted, rel=1e-6, abs=1e-6)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p.full_tensor().cpu(), adapter[name], rtol=1e-6, atol=1e-7), name


def test_mfu_and_memory_metrics_are_reported_and_sane(fixtures: Fixtures, tmp_path, device_group):
    """The loop's hardware metrics on a real step: a peak (the GPU's from the table; on CPU a stated one), both MFUs
    in (0, 1) with 6N above LoRA-aware; on the GPU peak allocated ≤ reserved ≤ the GPU's memory, on the CPU no
    device memory (null) but the host's RSS."""
    from rayft.model.flops import flop_model, peak_flops
    from rayft.parallel.parallelize import build_model
    from rayft.train.metrics import hardware_metrics

    cuda = device_group.type == "cuda"
    raw = _raw_config("dense", fixtures, fixtures.model, tmp_path)
    model = build_model(Config.from_dict(raw), on_gpu=cuda, device=device_group)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch = _batch(device_group)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device_group)
    for i in range(4):
        if i == 1:  # the first step compiles and allocates: time the others
            synchronize(device_group)
            started = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    synchronize(device_group)
    tokens_per_s = 3 * batch["input_ids"].numel() / (time.perf_counter() - started)
    flops = flop_model(model, model.config, batch["input_ids"].shape[-1])
    peak = peak_flops(device_group, stated_tflops=None if cuda else 1000.0)
    assert peak is not None, f"no bf16 peak known for {torch.cuda.get_device_name(device_group)}"
    metrics = hardware_metrics(tokens_per_s, 1, flops, peak, device_group)
    assert 0 < metrics["mfu_lora"] < metrics["mfu_6n"] < 1, metrics
    assert metrics["host_rss_gib"] > 0.1 and metrics["peak_tflops"] == peak / 1e12
    if not cuda:
        assert metrics["memory_allocated_gib"] is None and metrics["memory_reserved_gib"] is None, metrics
        return
    assert all(metrics[k] is not None for k in metrics), metrics
    total_gib = torch.cuda.get_device_properties(device_group).total_memory / 2**30
    assert 0 < metrics["memory_allocated_gib"] <= metrics["memory_reserved_gib"] <= total_gib, metrics


@pytest.mark.parametrize("device_type", DEVICES)
def test_cpu_offload_takes_a_clipped_step_on_the_workers_process_group(device_type, fixtures: Fixtures, tmp_path):
    """`fsdp.cpu_offload`: shards and their gradients live on the host, so clipping all-reduces CPU tensors. On
    the group a worker joins (`cpu:gloo,cuda:nccl` on a GPU, where NCCL alone has no CPU backend) the clipped AdamW
    step runs and changes the adapter; the frozen base stays on the host too."""
    from rayft.parallel.backend import process_group_backend
    from rayft.parallel.layout import ParallelDims
    from rayft.parallel.parallelize import build_model
    from rayft.parallel.topology import Topology
    from rayft.train.schedule import build_optimizer
    from rayft.train.step import clip_gradients_

    cuda = device_type == "cuda"
    raw = _raw_config("dense", fixtures, fixtures.model, tmp_path)
    raw["fsdp"] = {"cpu_offload": True}
    cfg = Config.from_dict(raw)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group(process_group_backend(cfg, cuda), rank=0, world_size=1, device_id=device if cuda else None)
    try:
        model = build_model(cfg, on_gpu=cuda, device=device)
        assert {p.to_local().device.type for p in model.parameters()} == {"cpu"}
        optimizer = build_optimizer(model, cfg.train, on_gpu=cuda)
        _randomise_lora_b(model)
        before = {n: p.full_tensor().clone() for n, p in model.named_parameters() if p.requires_grad}
        model(**_batch(device)).loss.backward()
        one_rank = ParallelDims(Topology(("local",)), shard=1, experts=1, device_type=device.type)
        norm = clip_gradients_(model, 1e-3, one_rank)  # far below the norm: clipping really scales
        optimizer.step()
        assert torch.isfinite(norm) and norm.item() > 1e-3
        changed = [
            n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p.full_tensor(), before[n])
        ]
        assert changed == list(before), set(before) - set(changed)
    finally:
        dist.destroy_process_group()
