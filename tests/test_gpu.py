"""What only a CUDA GPU can show, in-process on a one-rank NCCL group (`make gpu-check STAGE=tests`).

Each test builds the model exactly as a worker does (`build_model(cfg, on_gpu=True, device)`: meta init → LoRA →
FSDP2 → sharded loading onto the GPU) and checks it against a path that shares none of that: transformers'
own model classes on CPU in fp32 (experts through their eager loop, not `grouped_mm`), `from_pretrained`, the
FP8 files dequantised whole, or an uninterrupted run. Elsewhere every test here is skipped with "needs CUDA".
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import Fixtures, free_port, tiny_config

from rayft.config import Config
from rayft.model.lora import AUTO_TARGETS, DENSE_TARGETS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# bf16 keeps 8 significant bits: each LoRA gradient within 5% of fp32 in norm (10% for the MoE model, where a bf16
# router may send the odd near-tied token to another expert than fp32 does). The random models' losses sit near
# ln(131072) = 11.8 with logits of order 0.1, so bf16 moves them by ~1e-3: 1e-2 is tight enough to show a wrong
# mask or a dropped loss term, and the gradients carry the finer check.
LOSS_ATOL = 1e-2
GRAD_RTOL = {"dense": 5e-2, "mistral4-hub": 1e-1}


@pytest.fixture
def cuda_group():
    """A one-rank NCCL process group on GPU 0, as a Ray Train worker with one GPU has."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    yield device
    dist.destroy_process_group()


def _raw_config(kind: str, fixtures: Fixtures, hub: Path, out: Path) -> dict:
    """The demo settings in bf16 on GPU, LoRA (dropout 0) on an explicit list so the reference can copy it."""
    raw = tiny_config(fixtures, out)
    raw["train"]["bf16"] = True
    raw["lora"].update(lora_dropout=0.0, target_modules=list(DENSE_TARGETS))
    if kind == "mistral4-hub":
        raw["model"].update(model_name_or_path=str(hub), torch_dtype="bfloat16")
        raw["lora"]["target_modules"] = list(AUTO_TARGETS["mistral4"])
    return raw


def _model_dir(kind: str, fixtures: Fixtures, hub: Path) -> Path:
    return hub if kind == "mistral4-hub" else fixtures.model


def _batch(device: torch.device, packed: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two examples: packed into one padding-free row (position ids restart), or padded with an attention mask."""
    from rayft.data.pipeline import PackedCollate, PadCollate

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, 4000, (n,), generator=g) for n in (40, 24)]
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
        peft.LoraConfig(r=lora["r"], lora_alpha=lora["lora_alpha"], lora_dropout=0.0,
                        target_modules=lora["target_modules"], task_type=peft.TaskType.CAUSAL_LM),
    )  # fmt: skip
    weights = {n: p.full_tensor().detach().float().cpu() for n, p in gpu_model.named_parameters()}
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    assert not unexpected and not [k for k in missing if k in dict(reference.named_parameters())], missing
    return reference


@pytest.mark.parametrize("kind", ["dense", "mistral4-hub"])
def test_bf16_fsdp2_lora_step_matches_the_fp32_cpu_reference(
    kind, fixtures: Fixtures, mistral4_hub: Path, tmp_path, cuda_group
):
    """One optimizer step of the worker's model (bf16 FSDP2 + LoRA, fused loss, MoE experts through grouped_mm):
    loss, every LoRA gradient and the loss after the AdamW step equal the fp32 CPU reference within bf16 error."""
    from rayft.model.build import build_model, fused_loss

    raw = _raw_config(kind, fixtures, mistral4_hub, tmp_path)
    cfg = Config.from_dict(raw)
    torch.manual_seed(0)
    model = build_model(cfg, on_gpu=cuda_group.type == "cuda", device=cuda_group)
    if kind == "mistral4-hub":
        assert model.get_base_model().config._experts_implementation == "grouped_mm"
    _randomise_lora_b(model)
    reference = _cpu_reference(model, raw, _model_dir(kind, fixtures, mistral4_hub))
    assert fused_loss(model, cfg) is None
    batch = _batch(cuda_group)
    cpu_batch = {k: v.cpu() for k, v in batch.items()}

    def step(m, b):
        optimizer = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        loss = m(**b).loss
        loss.backward()
        grads = _lora_grads(m) if m is model else {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            after = m(**b).loss.item()
        return loss.item(), grads, after

    loss, grads, after = step(model, batch)
    ref_loss, ref_grads, ref_after = step(reference, cpu_batch)
    assert loss == pytest.approx(ref_loss, abs=LOSS_ATOL)
    assert after == pytest.approx(ref_after, abs=LOSS_ATOL)
    assert after < loss  # the step did something, and the same thing on both sides
    assert set(grads) == set(ref_grads)
    errors = {n: _relative_error(grads[n], ref_grads[n]) for n in grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] < GRAD_RTOL[kind], f"{worst}: relative gradient error {errors[worst]:.3g}"


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_fused_loss_equals_full_logits_on_cuda_in_both_branches(packed, fixtures: Fixtures, tmp_path, cuda_group):
    """On the GPU model in bf16: transformers' loss over full logits, then rayft's fused loss through its GPU
    branch (masking) and its CPU branch (dropping rows): same loss and LoRA gradients within bf16 error."""
    from rayft.model.build import build_model
    from rayft.model.loss import fuse_loss

    raw = _raw_config("dense", fixtures, fixtures.model, tmp_path)
    torch.manual_seed(0)
    model = build_model(Config.from_dict(raw), on_gpu=cuda_group.type == "cuda", device=cuda_group)
    _randomise_lora_b(model)
    batch = _batch(cuda_group, packed=packed)

    def loss_and_grads():
        loss = model(**batch).loss
        loss.backward()
        grads = _lora_grads(model)
        model.zero_grad(set_to_none=True)
        return loss.item(), grads

    full_loss, full_grads = loss_and_grads()
    assert model(**batch).logits is not None
    for drop_unscored in (False, True):  # the GPU branch first: it is the one GPUs run
        assert fuse_loss(model.get_base_model(), drop_unscored=drop_unscored) is None
        loss, grads = loss_and_grads()
        assert model(**batch).logits is None  # the fused path ran
        assert loss == pytest.approx(full_loss, abs=LOSS_ATOL), drop_unscored
        for name, grad in full_grads.items():
            assert grad.abs().sum() > 0, name
            assert _relative_error(grads[name], grad) < GRAD_RTOL["dense"], (name, drop_unscored)


def test_sharded_loading_onto_the_gpu_equals_from_pretrained(fixtures: Fixtures, mistral4_hub, tmp_path, cuda_group):
    """Every base weight the rank reads from the files onto the GPU is the one `from_pretrained` gives (dense), or
    the FP8 tensor × its scale (the hub layout), bit for bit."""
    from test_weights import _dequantised_reference
    from transformers import AutoModelForCausalLM

    from rayft.model.build import build_model
    from rayft.model.weights import model_param_name

    for kind in ("dense", "mistral4-hub"):
        model_dir = _model_dir(kind, fixtures, mistral4_hub)
        cfg = Config.from_dict(_raw_config(kind, fixtures, mistral4_hub, tmp_path))
        model = build_model(cfg, on_gpu=cuda_group.type == "cuda", device=cuda_group)
        if kind == "dense":
            expected = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).state_dict()
        else:
            expected = {k.removeprefix("language_model."): v for k, v in _dequantised_reference(model_dir).items()}
        seen = set()
        for name, param in model.named_parameters():
            assert param.device.type == cuda_group.type, name  # on the GPU, not left on the host
            if ".lora_" in name:
                continue
            key = model_param_name(name)
            full = param.full_tensor()
            assert torch.equal(full.cpu(), expected[key].to(full.dtype)), (kind, name)
            seen.add(key)
        assert seen == {k for k in expected if not k.endswith("rotary_emb.inv_freq")}, kind


def test_checkpoint_save_and_exact_resume_on_cuda(fixtures: Fixtures, tmp_path, cuda_group):
    """Save after 2 steps, train 2 more; a fresh model (other seed) that loads the checkpoint trains those 2 steps
    to the same losses and adapter: LoRA params, AdamW state, scheduler and the CUDA RNG (dropout) all restored."""
    from rayft.model.build import build_model
    from rayft.train.checkpoint import Progress, load_checkpoint, save_checkpoint
    from rayft.train.schedule import build_optimizer, build_scheduler, make_plan

    raw = _raw_config("dense", fixtures, fixtures.model, tmp_path)
    raw["lora"]["lora_dropout"] = 0.1  # draws from the CUDA generator every step
    raw["model"]["attn_implementation"] = "eager"  # deterministic kernels: the comparison can be exact
    raw["train"].update(max_steps=4, learning_rate=1e-2)
    cfg = Config.from_dict(raw)
    plan = make_plan(cfg, train_rows=64, validation_rows=0, world_size=1)
    batches = [_batch(cuda_group, seed=s) for s in range(4)]

    def trainer(seed: int):
        torch.manual_seed(seed)
        model = build_model(cfg, on_gpu=cuda_group.type == "cuda", device=cuda_group)
        optimizer = build_optimizer(model, cfg.train, on_gpu=cuda_group.type == "cuda")
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
    save_checkpoint(tmp_path / "ckpt", model, optimizer, scheduler, Progress(step=2), {"step": 2})
    uninterrupted = train(model, optimizer, scheduler, range(2, 4))
    adapter = {n: p.full_tensor().cpu() for n, p in model.named_parameters() if p.requires_grad}

    model, optimizer, scheduler = trainer(seed=1)
    assert load_checkpoint(tmp_path / "ckpt", model, optimizer, scheduler).step == 2
    resumed = train(model, optimizer, scheduler, range(2, 4))
    assert resumed == pytest.approx(uninterrupted, rel=1e-6, abs=1e-6)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p.full_tensor().cpu(), adapter[name], rtol=1e-6, atol=1e-7), name


def test_mfu_and_gpu_memory_metrics_are_reported_and_sane(fixtures: Fixtures, tmp_path, cuda_group):
    """The loop's hardware metrics on a real GPU step: a known peak, both MFUs in (0, 1) with 6N above LoRA-aware,
    peak allocated ≤ reserved ≤ the GPU's memory, all non-null."""
    from rayft.model.build import build_model
    from rayft.train.loop import _hardware_metrics
    from rayft.train.metrics import flop_model, peak_flops

    raw = _raw_config("dense", fixtures, fixtures.model, tmp_path)
    model = build_model(Config.from_dict(raw), on_gpu=cuda_group.type == "cuda", device=cuda_group)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch = _batch(cuda_group)
    torch.cuda.reset_peak_memory_stats(cuda_group)
    for i in range(4):
        if i == 1:  # the first step compiles and allocates: time the others
            torch.cuda.synchronize()
            started = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    tokens_per_s = 3 * batch["input_ids"].numel() / (time.perf_counter() - started)
    flops, peak = flop_model(model, model.config, batch["input_ids"].shape[-1]), peak_flops(cuda_group)
    assert peak is not None, f"no bf16 peak known for {torch.cuda.get_device_name(cuda_group)}"
    metrics = _hardware_metrics(tokens_per_s, 1, flops, peak, cuda_group)
    assert all(metrics[k] is not None for k in metrics), metrics
    assert 0 < metrics["mfu_lora"] < metrics["mfu_6n"] < 1, metrics
    total_gib = torch.cuda.get_device_properties(cuda_group).total_memory / 2**30
    assert 0 < metrics["memory_allocated_gib"] <= metrics["memory_reserved_gib"] <= total_gib, metrics
    assert metrics["host_rss_gib"] > 0.1 and metrics["peak_tflops"] == peak / 1e12
