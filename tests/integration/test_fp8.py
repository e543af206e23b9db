"""The frozen base in FP8 (rayft.model.fp8): input gradients, saved tensors, LoRA on top, FSDP2 bytes and losses.

Every reference is the same model in fp32 with the dequantised weights (E4M3 value × scale, computed here with
plain torch), run through transformers' own layers: the FP8 path must give its losses and input gradients.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import peft
import pytest
import torch
import torch.distributed as dist
from conftest import Fixtures, free_port, tiny_config
from fixtures.devices import DEVICES
from fixtures.hub_layout import TINY_MISTRAL4
from fixtures.moe_families import tiny_moe_config
from fixtures.ranks import spawn_ranks, whole
from fixtures.work import WorkCounter
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import GptOssForCausalLM, Mistral4Config, Mistral4ForCausalLM, MistralConfig, MistralForCausalLM

from rayft.config import Config, ConfigError, LoraConfig
from rayft.model import fp8 as fp8_module
from rayft.model.fp8 import Fp8Experts, Fp8Linear, adopt_lora_, fused_dequantization, to_fp8_
from rayft.model.lora import wrap

STEPS = 5
E4M3_MAX = 448.0


def _tiny(arch: str, **overrides) -> nn.Module:
    """A 2-layer model of `arch` in fp32; `overrides`: config fields of an MoE one."""
    torch.manual_seed(0)
    if arch == "dense":
        config = MistralConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
        return MistralForCausalLM(config).float()
    if arch == "gpt_oss":  # transposed, biased experts, interleaved gate/up; a limit low enough that it clamps
        fields = {"hidden_size": 64, "intermediate_size": 32, "vocab_size": 512, "swiglu_limit": 0.05, **overrides}
        config = tiny_moe_config("gpt_oss", **fields)
        return GptOssForCausalLM._from_config(config, dtype=torch.float32, experts_implementation="grouped_mm")
    config = Mistral4Config(**{**TINY_MISTRAL4, "vocab_size": 512, **overrides})
    return Mistral4ForCausalLM._from_config(config, dtype=torch.float32, experts_implementation="grouped_mm")


def _fp8_and_reference(arch: str, **overrides) -> tuple[nn.Module, nn.Module]:
    """(the model with its decoder in FP8, the same model in fp32 holding the dequantised weights); `<arch>-block16`:
    scales per row and 16-wide column block (as a block-wise checkpoint's are kept); `overrides`: `_tiny`'s."""
    arch, _, blocks = arch.partition("-block")
    block = int(blocks) if blocks else None
    reference = _tiny(arch, **overrides)
    fp8 = copy.deepcopy(reference)
    assert to_fp8_(list(fp8.model.layers), torch.float32, block) > 0
    swapped = dict(fp8.named_modules())
    with torch.no_grad():
        for name, module in reference.named_modules():
            twin = swapped.get(name)
            if isinstance(twin, Fp8Linear):
                module.weight.copy_(_dequantised(twin.weight, twin.weight_scale))
            elif isinstance(twin, Fp8Experts):
                for w in ("gate_up_proj", "down_proj"):
                    getattr(module, w).copy_(_dequantised(getattr(twin, w), getattr(twin, f"{w}_scale")))
    return fp8, reference


def _dequantised(data: torch.Tensor, scale_bits: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes × their row scales, read from the int32 parameter that holds the scales' fp32 bit patterns; with
    a scale per column block (one more dim), each column takes its block's (`columns` blocks of equal width)."""
    assert data.dtype == torch.uint8 and scale_bits.dtype == torch.int32
    scale = scale_bits.view(torch.float32)
    if scale.ndim < data.ndim:
        return data.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1)
    columns, blocks = data.shape[-1], scale.shape[-1]
    width = -(-columns // blocks)  # the widths the tests use divide the columns
    assert width * blocks == columns and width < columns
    return data.view(torch.float8_e4m3fn).float() * scale[..., torch.arange(columns) // width]


def _quantised_by_hand(weight: torch.Tensor) -> torch.Tensor:
    """Independent per-row E4M3 round trip: scale = row amax / 448, cast with torch, multiply back."""
    scale = weight.float().abs().amax(dim=-1, keepdim=True) / E4M3_MAX
    return (weight.float() / scale).to(torch.float8_e4m3fn).float() * scale


FP8_TYPES = (Fp8Linear, Fp8Experts)


def _input_grads(model: nn.Module, names: set[str], ids: torch.Tensor) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Each named module's gradient w.r.t. its (first) input, through that module alone, the embeddings', and the
    logits."""
    grads, hooks = {}, []
    for name, module in model.named_modules():
        if name in names:
            hooks.append(module.register_full_backward_hook(lambda m, gin, gout, n=name: grads.__setitem__(n, gin[0])))
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()  # so even layer 0 needs its dgrad
    out = model(inputs_embeds=embeds, labels=ids)
    out.loss.backward()
    for hook in hooks:
        hook.remove()
    return grads, embeds.grad, out.logits.detach()


@pytest.mark.parametrize("arch", ["dense", "mistral4", "mistral4-block16", "gpt_oss"])
def test_every_frozen_fp8_layer_passes_the_input_gradient(arch):
    """Fails if any FP8 layer drops (or changes) its input gradient: each one's dgrad is compared with the fp32
    dequantised layer's, and no FP8 storage gets a weight gradient."""
    fp8, reference = _fp8_and_reference(arch)
    layers = {name for name, m in fp8.named_modules() if isinstance(m, FP8_TYPES)}
    assert len(layers) == {"dense": 14, "gpt_oss": 10}.get(arch, 18)  # 7 linears/layer; MLA 5 + shared 3 + experts
    if arch.endswith("-block16"):  # blocks where the rows are wider than 16 (kv_b_proj's 16 columns: one scale)
        assert sum(m.weight_scale.ndim == 2 for m in fp8.modules() if isinstance(m, Fp8Linear)) == 14
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    got, got_embeds, got_logits = _input_grads(fp8, layers, ids)
    want, want_embeds, want_logits = _input_grads(reference, layers, ids)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-6)
    assert set(got) == layers
    for name in sorted(layers):
        assert got[name] is not None and got[name].abs().sum() > 0, f"{name} dropped its input gradient"
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(got_embeds, want_embeds, rtol=1e-5, atol=1e-7)
    for name, param in fp8.named_parameters():
        if param.dtype == torch.uint8 or name.endswith("_scale"):
            assert not param.requires_grad and param.grad is None, name


class _Saved:
    """Records every tensor autograd saves for backward."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.tensors.append(t) or t, lambda t: t)

    def weight_sized(self, numel: int) -> list[tuple]:
        """Saved tensors of >= 2 bytes per element and at least `numel` elements: a dequantised weight."""
        return [(t.dtype, tuple(t.shape)) for t in self.tensors if t.element_size() >= 2 and t.numel() >= numel]


def test_nothing_weight_sized_in_the_compute_dtype_is_saved_for_backward():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=False)
    x = torch.randn(4, 64, requires_grad=True)
    plain = _Saved()
    with plain.hooks():
        linear(x).sum().backward()
    assert plain.weight_sized(linear.weight.numel()), "the check must see nn.Linear's saved fp32 weight"

    fp8_linear, saved = Fp8Linear.from_linear(linear, torch.float32), _Saved()
    with saved.hooks():
        fp8_linear(x).sum().backward()
    assert saved.weight_sized(fp8_linear.weight.numel()) == []
    assert any(t.dtype == torch.uint8 and t.shape == (96, 64) for t in saved.tensors)  # the 1-byte storage

    model = _tiny("mistral4")
    experts = Fp8Experts(model.model.layers[0].mlp.experts, torch.float32)
    hidden = torch.randn(6, 64, requires_grad=True)
    top_k = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [0, 7], [1, 6]])
    saved = _Saved()
    with saved.hooks():
        experts(hidden, top_k, torch.rand(6, 2)).sum().backward()
    assert saved.weight_sized(experts.down_proj.numel()) == []
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_under_cpu_bf16_autocast_the_fp8_linear_is_the_dequantised_linear():
    """`train.bf16` on CPU runs matmuls under autocast: output dtype, values and input gradient as nn.Linear's."""
    torch.manual_seed(0)
    fp8 = Fp8Linear.from_linear(nn.Linear(64, 96, bias=False), torch.bfloat16)
    reference = nn.Linear(64, 96, bias=False)
    reference.weight.data = _dequantised(fp8.weight, fp8.weight_scale)
    x = torch.randn(4, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = fp8(x), reference(x_ref)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    got.float().sum().backward()
    want.float().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, x_ref.grad)


def _lora(model: nn.Module, arch: str) -> peft.PeftModel:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    experts = None if arch == "dense" else ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    if arch.startswith("mistral4"):
        targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj"]
    elif arch == "gpt_oss":
        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets, target_parameters=experts)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("arch", ["dense", "mistral4", "mistral4-block16", "gpt_oss"])
def test_peft_lora_on_the_fp8_base_trains_like_the_dequantised_reference(arch):
    fp8, reference = _fp8_and_reference(arch)
    fp8, reference = _lora(fp8, arch), _lora(reference, arch)
    adopt_lora_(fp8)
    lora = [(n, p) for n, p in fp8.named_parameters() if p.requires_grad]
    lora_ref = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    assert [n for n, _ in lora] == [n for n, _ in lora_ref] and lora
    assert not any(".base_layer.weight" in n or n.endswith("_scale") for n, _ in lora)
    with torch.no_grad():
        for (name, p), (_, q) in zip(lora, lora_ref, strict=True):
            q.normal_(std=0.05) if "lora_B" in name else None  # B = 0 would hide A's gradient
            p.copy_(q)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    runs = {}
    for label, model in (("fp8", fp8), ("reference", reference)):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for _ in range(STEPS):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if not losses:
                runs[f"{label}_grads"] = [p.grad.clone() for p in model.parameters() if p.requires_grad]
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs[label] = losses
    assert runs["reference"][-1] < runs["reference"][0]
    for got, want in zip(runs["fp8"], runs["reference"], strict=True):
        assert abs(got - want) <= 1e-3 * abs(want), (runs["fp8"], runs["reference"])
    for got, want in zip(runs["fp8_grads"], runs["reference_grads"], strict=True):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest deviation relative to the reference's largest magnitude: bf16's rounding shows as a few 1e-3."""
    return ((got.float() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["mistral4", "gpt_oss"])
@pytest.mark.parametrize("rank", [4, 6])
def test_expert_lora_of_any_rank_runs_in_bf16_like_the_fp32_per_expert_loop(rank, arch, device):
    """`lora.target_experts` with a rank whose bf16 rows are not 16 bytes wide (grouped_mm's stride alignment) on
    the FP8 experts in bf16: output and the expert LoRA factors' gradients are those of transformers' eager experts
    (one dense matmul per expert) in fp32 on the dequantised weights, PEFT adding the same factors to them. The
    dequantisation stays eager: compiling it is another test's subject."""
    # GPT-OSS's own clamp (7): the tests' 0.05 clamps most gate values, and a bf16 rounding across it flips whether
    # a gradient passes, which says nothing about the LoRA.
    fp8, reference = _fp8_and_reference(arch, **({"swiglu_limit": 7.0} if arch == "gpt_oss" else {}))
    reference.set_experts_implementation("eager")
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_experts=True)
    (fp8, _), (reference, _) = wrap(fp8, lora), wrap(reference, lora)
    adopt_lora_(fp8)
    experts, experts_ref = (m.base_model.model.model.layers[0].mlp.experts for m in (fp8, reference))
    factors = [(n, p) for n, p in experts.named_parameters() if p.requires_grad]
    factors_ref = [(n, p) for n, p in experts_ref.named_parameters() if p.requires_grad]
    assert [n for n, _ in factors] == [n for n, _ in factors_ref] and len(factors) == 4  # A and B of both weights
    with torch.no_grad():
        for (name, p), (_, q) in zip(factors, factors_ref, strict=True):
            q.normal_(std=0.5) if "lora_B" in name else None  # B = 0 would hide A's gradient and the update
            p.copy_(q)
    experts.to(device), experts_ref.to(device)
    generator = torch.Generator().manual_seed(0)
    top_k = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [0, 7], [1, 6], [3, 4], [1, 2], [5, 0]], device=device)
    weights = torch.rand(9, 2, generator=generator).to(device)
    hidden = torch.randn(9, 64, generator=generator).to(device, torch.bfloat16)
    probe = torch.randn(9, 64, generator=generator).to(device)
    with fused_dequantization(device, False):
        out = experts(hidden, top_k, weights.bfloat16())
        assert out.dtype == torch.bfloat16
        (out.float() * probe).sum().backward()
    want = experts_ref(hidden.float(), top_k, weights)
    (want * probe).sum().backward()
    assert _relative_error(out, want.detach()) < 2e-2
    for (name, p), (_, q) in zip(factors, factors_ref, strict=True):
        assert p.grad.shape == q.grad.shape and q.grad.abs().sum() > 0, name
        assert _relative_error(p.grad, q.grad) < 2e-2, name


def test_frozen_dtype_is_checked_with_the_key_named():
    with pytest.raises(ConfigError, match=r"model\.frozen_dtype: unknown value 'float8_e5m2'"):
        Config.from_dict({"model": {"frozen_dtype": "float8_e5m2"}})
    with pytest.raises(ConfigError, match=r"model\.frozen_dtype float32 disagrees with model\.torch_dtype bfloat16"):
        Config.from_dict({"model": {"frozen_dtype": "float32", "torch_dtype": "bfloat16"}})


def test_the_plan_counts_exactly_the_bytes_fp8_storage_holds(mistral4_hub):
    """The planner's FP8 figures (from the unswapped meta model) against the swapped model's own parameters."""
    from rayft.model.build import decoder_layers, empty_model
    from rayft.plan import meta_structure, plan_memory

    cfg = Config.from_dict({"model": {"model_name_or_path": str(mistral4_hub)}, "lora": {"target_modules": ["auto"]}})
    s = meta_structure(cfg)
    model = empty_model(cfg.model)
    to_fp8_(decoder_layers(model), torch.bfloat16)
    storage = [p for n, p in model.named_parameters() if p.dtype == torch.uint8]
    scales = [p for n, p in model.named_parameters() if n.endswith("_scale")]
    assert s.fp8 == sum(p.numel() for p in storage) > 0
    assert s.fp8_rows == sum(p.numel() for p in scales)
    bf16 = dict(plan_memory(cfg, s, 2, on_gpu=True, held="dtype").rows)
    fp8 = dict(plan_memory(cfg, s, 2, on_gpu=True, held="fp8").rows)
    saved = (bf16["sharded weights (/2)"] - fp8["sharded weights (/2)"]) * 2**30 * 2
    assert saved == pytest.approx(s.fp8 * 2 - (s.fp8 + 4 * s.fp8_rows))


# --- FSDP2 on two gloo ranks: the FP8 bytes are sharded and gathered, the losses are the fp32 path's ---------------


def _count_frozen_all_gathers(layer: nn.Module, box: list[int]) -> None:
    """Make `layer`'s FSDP all-gathers add the bytes they move, less its LoRA's (the same in every run), to box."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    lora = sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)

    class Counting(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            box[0] += output_tensor.numel() * output_tensor.element_size() - lora
            return super().__call__(output_tensor, input_tensor, group, async_op)

    layer.set_custom_all_gather(Counting())


def _frozen_layer_bytes(layers: list[nn.Module]) -> dict[str, int]:
    """This rank's bytes of the decoder layers' frozen parameters, by dtype."""
    from torch.distributed.tensor import DTensor

    out: dict[str, int] = {}
    for layer in layers:
        for p in layer.parameters():
            assert isinstance(p, DTensor)  # sharded by FSDP2, FP8 storage included
            if not p.requires_grad:
                dtype = str(p.dtype).removeprefix("torch.")
                out[dtype] = out.get(dtype, 0) + p.to_local().numel() * p.element_size()
    return out


def _assert_hub_bytes_loaded_as_they_are(model: nn.Module, model_dir: str, rank: int) -> None:
    """Every FP8 parameter holds the checkpoint's E4M3 bytes unchanged, its row scales the hub's static scale."""
    from rayft.model.weights import model_param_name

    hub = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        hub.update(load_file(file))
    storage = [(n, p) for n, p in model.named_parameters() if p.dtype == torch.uint8]
    assert len(storage) == 2 * (8 + 2)  # per layer: 8 linears, gate_up and down of the experts
    for name, param in storage:
        full = whole(param).cpu()  # collective: every rank; compared on the host, where the files are read
        scale_name = name.removesuffix(".weight") + ".weight_scale" if name.endswith(".weight") else f"{name}_scale"
        scale = whole(dict(model.named_parameters())[scale_name]).cpu().view(torch.float32)
        if rank:
            continue
        key = "language_model." + model_param_name(name)
        hub_scale = hub.get(f"{key}_scale_inv", hub.get(key.removesuffix(".weight") + ".weight_scale_inv"))
        assert torch.equal(full, hub[key].view(torch.uint8)), name
        assert torch.equal(scale, hub_scale.float().reshape(-1, *([1] * (scale.ndim - 1))).expand_as(scale)), name


def _fsdp_rank(rank: int, world: int, port: int, runs: dict, out: str) -> None:
    from rayft.model.build import decoder_layers
    from rayft.parallel.parallelize import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for label, raw in runs.items():
            torch.manual_seed(0)  # the LoRA A init draws from the global stream, as in the training loop
            model = build_model(Config.from_dict(raw), on_gpu=False)
            if label == "hub_fp8":
                _assert_hub_bytes_loaded_as_they_are(model, raw["model"]["model_name_or_path"], rank)
            gathered = [0]
            for layer in decoder_layers(model):
                _count_frozen_all_gathers(layer, gathered)
            ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(rank))
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            losses, per_step = [], []
            for _ in range(STEPS):
                before = gathered[0]
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
                per_step.append(gathered[0] - before)
            local = _frozen_layer_bytes(decoder_layers(model))
            results[label] = {"losses": losses, "frozen_gathered_per_step": per_step, "frozen_local": local}
            del model, optimizer
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _dequantised_copy(source: Path, target: Path) -> Path:
    """The fp32 checkpoint holding every decoder matrix after an E4M3 per-row round trip (done by hand here)."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(source / "model.safetensors")
    for key, tensor in tensors.items():
        if ".layers." in key and key.endswith("_proj.weight"):
            tensors[key] = _quantised_by_hand(tensor)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_fsdp2_gathers_fp8_bytes_and_trains_like_the_dequantised_fp32_path(fixtures: Fixtures, mistral4_hub, tmp_path):
    def config(model_dir: Path, frozen: str, hub: bool) -> dict:
        raw = tiny_config(fixtures, tmp_path)
        raw["model"].update(model_name_or_path=str(model_dir), torch_dtype="float32", frozen_dtype=frozen)
        raw["lora"].update(lora_dropout=0.0)
        if hub:
            raw["lora"].update(target_modules=["auto"], target_experts=True)
            raw["fsdp"] = {"activation_checkpointing": True}
        return raw

    dense_reference = _dequantised_copy(fixtures.model, tmp_path / "dense-dequantised")
    runs = {
        "hub_fp8": config(mistral4_hub, "auto", hub=True),  # auto: the FP8 checkpoint stays FP8
        "hub_fp32": config(mistral4_hub, "float32", hub=True),
        "dense_fp8": config(fixtures.model, "float8_e4m3fn", hub=False),  # quantised at load
        "dense_fp32": config(dense_reference, "float32", hub=False),
    }
    out = tmp_path / "results.json"
    spawn_ranks(_fsdp_rank, args=(2, free_port(), runs, str(out)), nprocs=2)
    results = json.loads(out.read_text())
    print(json.dumps(results, indent=1))
    for model in ("hub", "dense"):
        fp8, fp32 = results[f"{model}_fp8"], results[f"{model}_fp32"]
        assert fp8["losses"][-1] < fp8["losses"][0]
        for got, want in zip(fp8["losses"], fp32["losses"], strict=True):
            assert abs(got - want) <= 1e-3 * abs(want), (model, fp8["losses"], fp32["losses"])
        # FP8 storage: 1 byte per weight + 4 per row, no fp32/bf16 copy; against bf16 (half the fp32 run's bytes)
        local_fp8, local_fp32 = fp8["frozen_local"], fp32["frozen_local"]
        assert set(local_fp32) == {"float32"} and local_fp8["uint8"] > 0
        assert sum(local_fp8.values()) <= 0.6 * local_fp32["float32"] / 2, (model, local_fp8, local_fp32)
        for step_fp8, step_fp32 in zip(fp8["frozen_gathered_per_step"], fp32["frozen_gathered_per_step"], strict=True):
            assert 0 < step_fp8 <= 0.6 * step_fp32 / 2, (model, step_fp8, step_fp32)


def _bf16_gather_rank(rank: int, world: int, port: int, out: str) -> None:
    """Shard an FP8 linear and FP8 experts over the gloo ranks under a bf16 mixed-precision policy (the GPU's); in
    forward, where FSDP has gathered them, record their scales and bf16 weights against the unsharded originals."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from rayft.parallel.torch_compat import allow_integer_parameters

    allow_integer_parameters()  # as rayft's own wrapping does
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # the same modules on every rank
        linear = Fp8Linear.from_linear(nn.Linear(64, 48, bias=False), torch.bfloat16)
        experts, _ = _experts_and_reference()
        modules = {"linear": (linear, ("weight",)), "experts": (experts, ("gate_up_proj", "down_proj"))}
        originals, seen = {}, {}
        for label, (module, names) in modules.items():
            for name in names:
                scale = getattr(module, f"{name}_scale")
                originals[f"{label}.{name}"] = (scale.detach().clone(), _dequantised(getattr(module, name), scale))
            fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))

            def record(mod, args, label=label, names=names):
                for name in names:
                    seen[f"{label}.{name}"] = (
                        getattr(mod, f"{name}_scale").detach().clone(),
                        _dequantised(getattr(mod, name), getattr(mod, f"{name}_scale")),
                    )

            module.register_forward_pre_hook(record)
        linear(torch.randn(3, 64))
        experts(torch.randn(4, 64), torch.tensor([[0, 1]] * 4), torch.full((4, 2), 0.5))
        same = {
            key: [torch.equal(seen[key][0], scale), torch.equal(seen[key][1].bfloat16(), weight.bfloat16())]
            for key, (scale, weight) in originals.items()
        }
        if rank == 0:
            Path(out).write_text(json.dumps(same))
    finally:
        dist.destroy_process_group()


def test_fp8_scales_cross_a_bf16_fsdp_all_gather_bit_for_bit(tmp_path):
    """FSDP2's bf16 parameter policy casts every floating-point parameter it gathers; the row scales must come out of
    the all-gather as the checkpoint's fp32 values, bit for bit, and so must the bf16 weight they dequantise to."""
    out = tmp_path / "same.json"
    spawn_ranks(_bf16_gather_rank, args=(2, free_port(), str(out)), nprocs=2)
    same = json.loads(out.read_text())
    assert set(same) == {"linear.weight", "experts.gate_up_proj", "experts.down_proj"}
    assert all(scale and weight for scale, weight in same.values()), same


# --- Only the experts a micro-batch routes to are dequantised, a bounded chunk at a time ----------------------------


class _Dequantised(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every float8 → wider conversion the ops run (a dequantisation), by its element count."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        source = args[0] if args else None
        if (
            isinstance(source, torch.Tensor)
            and source.dtype == torch.float8_e4m3fn
            and func
            in (
                torch.ops.aten._to_copy.default,
                torch.ops.aten.to.dtype,
                torch.ops.aten.copy_.default,
            )
        ):
            self.sizes.append(source.numel())
        return func(*args, **(kwargs or {}))


def _experts_and_reference() -> tuple[Fp8Experts, nn.Module]:
    model = _tiny("mistral4")
    experts = model.model.layers[0].mlp.experts
    fp8 = Fp8Experts(experts, torch.float32)
    with torch.no_grad():
        for w in ("gate_up_proj", "down_proj"):
            getattr(experts, w).copy_(_dequantised(getattr(fp8, w), getattr(fp8, f"{w}_scale")))
    return fp8, experts


def _three_experts_routed(fp8: Fp8Experts, reference: nn.Module) -> tuple[torch.Tensor, torch.Tensor, WorkCounter]:
    """Tokens routed to experts {1, 2, 5} of 8 through `fp8`, forward and backward: output, input gradient, counts."""
    top_k = torch.tensor([[1, 2], [5, 1], [2, 5], [1, 5], [2, 1]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    probe = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    counter = WorkCounter()
    with counter:
        out = fp8(hidden, top_k, weights)
        (out * probe).sum().backward()
    hidden_ref = hidden.detach().clone().requires_grad_()
    want = reference(hidden_ref, top_k, weights)
    (want * probe).sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, hidden_ref.grad, rtol=1e-5, atol=1e-6)
    return out.detach(), hidden.grad, counter


def test_an_expert_without_tokens_is_never_dequantised_when_the_layer_is_chunked(monkeypatch):
    """A layer larger than one dequantisation chunk (budget: 7 of its 8 experts): forward and backward dequantise
    exactly the three routed experts' weights (each twice: forward, then the input gradient), never the others;
    output and input gradient are transformers' grouped_mm experts on the dequantised fp32 weights."""
    from rayft.model import fp8 as fp8_module

    fp8, reference = _experts_and_reference()
    monkeypatch.setattr(fp8_module, "EXPERT_DEQUANT_BUDGET", 7 * fp8.gate_up_proj[0].numel())
    _, _, counter = _three_experts_routed(fp8, reference)
    per_expert = fp8.gate_up_proj[0].numel() + fp8.down_proj[0].numel()
    assert sum(counter.dequantised) == 2 * 3 * per_expert, (counter.dequantised, per_expert)
    assert counter.total_syncs("fp8.py") == 1  # counts.tolist(): which experts to dequantise


def test_a_layer_within_one_chunk_runs_its_experts_without_a_host_sync(monkeypatch):
    """The whole layer fits one dequantisation chunk: no host sync in forward or backward (the group ends stay
    on the device), every expert dequantised once per pass, and output and input gradient equal, bit for bit,
    the host-chunked path's (and transformers' grouped_mm experts on the dequantised weights)."""
    from rayft.model import fp8 as fp8_module

    fp8, reference = _experts_and_reference()
    out, grad, counter = _three_experts_routed(fp8, reference)
    assert counter.total_syncs() == 0, counter.syncs
    per_expert = fp8.gate_up_proj[0].numel() + fp8.down_proj[0].numel()
    assert sum(counter.dequantised) == 2 * 8 * per_expert
    monkeypatch.setattr(fp8_module, "EXPERT_DEQUANT_BUDGET", 7 * fp8.gate_up_proj[0].numel())
    chunked_out, chunked_grad, _ = _three_experts_routed(fp8, reference)
    assert torch.equal(out, chunked_out) and torch.equal(grad, chunked_grad)


def test_active_experts_are_dequantised_a_bounded_chunk_at_a_time(monkeypatch):
    """With a budget of two experts' weights, no single dequantisation is larger than that, and the result (output
    and input gradient) is the one-chunk result, bit for bit. The four chunks of each weight cost one host sync for
    the layer (which experts have rows) and one host-to-device copy a weight (every chunk's ids and group ends)."""
    from rayft.model import fp8 as fp8_module

    fp8, _ = _experts_and_reference()
    top_k = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [0, 7], [1, 6], [3, 4]])
    weights = torch.rand(7, 2, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))

    def run() -> tuple[torch.Tensor, torch.Tensor, WorkCounter]:
        x = hidden.clone().requires_grad_()
        with WorkCounter() as work:
            out = fp8(x, top_k, weights)
            out.square().sum().backward()
        return out.detach(), x.grad, work

    whole_out, whole_grad, whole = run()
    assert max(whole.dequantised) == 8 * fp8.gate_up_proj[0].numel()  # default budget: all 8 experts at once
    assert whole.total_syncs() == whole.total_host_copies() == 0, (whole.syncs, whole.host_copies)
    monkeypatch.setattr(fp8_module, "EXPERT_DEQUANT_BUDGET", 2 * fp8.gate_up_proj[0].numel())
    out, grad, chunked = run()
    sizes = chunked.dequantised
    assert max(sizes) <= 2 * fp8.gate_up_proj[0].numel() and len(sizes) > len(whole.dequantised)
    assert sum(sizes) == sum(whole.dequantised)
    assert chunked.total_syncs() == 1 and chunked.total_host_copies() == 2, (chunked.syncs, chunked.host_copies)
    assert torch.equal(out, whole_out) and torch.equal(grad, whole_grad)


def _logits_and_input_grad(model: nn.Module, ids: torch.Tensor, fused: bool, dtype: torch.dtype):
    device = ids.device
    with fused_dequantization(device.type, fused), torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()  # layer 0 needs its dgrad too
        out = model(inputs_embeds=embeds, labels=ids)
        out.loss.backward()
        assert fp8_module.fuses(device) is fused, "the compiled kernel failed and the eager ops ran"
    return out.logits.detach(), embeds.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["mistral4", "mistral4-block16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_dequantisation_gives_the_eager_ops_values_bit_for_bit(dtype, arch, device):
    """On CUDA the FP8 weights are dequantised by one compiled kernel (`rayft.model.fp8.fuses`); on either device
    the same FP8 model (linears and routed experts, forward and input gradient) gives exactly the eager ops' logits
    and input gradients, the CPU compiling its own kernel here."""
    model, _ = _fp8_and_reference(arch)
    model.to(device)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    eager = _logits_and_input_grad(model, ids, fused=False, dtype=dtype)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fp8_module.compiled.cache_clear()
    fused = _logits_and_input_grad(model, ids, fused=True, dtype=dtype)
    # One kernel for every weight shape (the linears' 2-D, the expert stacks' 3-D): far below dynamo's recompile
    # limit, past which the model would fall back to the eager ops.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3, torch._dynamo.utils.counters["stats"]
    assert eager[0].dtype == dtype and eager[1].abs().sum() > 0
    for got, want in zip(fused, eager, strict=True):
        assert torch.equal(got, want)


def test_fused_dequantisation_under_selective_checkpointing_runs_eager_blocks_and_stays_on(monkeypatch, caplog):
    """Expert parallelism's selective activation checkpointing runs each layer's forward and recompute under torch
    dispatch modes, where dynamo compiles nothing. There the eager ops run a block of rows at a time (never the whole
    stack at once in fp32), with the compiled kernel's values, and the kernel stays on for the calls outside."""
    from rayft.parallel.alltoall import checkpoint_context

    model, _ = _fp8_and_reference("mistral4")
    model.gradient_checkpointing_enable({"use_reentrant": False, "context_fn": checkpoint_context})
    model.train()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    eager = _logits_and_input_grad(model, ids, fused=False, dtype=torch.bfloat16)
    one_expert = model.model.layers[0].mlp.experts.gate_up_proj[0].numel()
    monkeypatch.setattr(fp8_module, "DEQUANT_BLOCK", one_expert)
    torch._dynamo.reset()
    fp8_module.compiled.cache_clear()
    seen = _Dequantised()
    with seen:
        fused = _logits_and_input_grad(model, ids, fused=True, dtype=torch.bfloat16)
    assert seen.sizes and max(seen.sizes) <= one_expert, sorted(set(seen.sizes))
    for got, want in zip(fused, eager, strict=True):
        assert torch.equal(got, want)
    assert "stays eager" not in caplog.text, caplog.text
    data, scale = fp8_module.quantize_rows(torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(2)))
    with fused_dequantization("cpu", True):  # outside the modes: one compiled kernel a block
        got = fp8_module.dequantize_rows(data, scale, torch.bfloat16)
        assert fp8_module.fuses(torch.device("cpu")) and torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert torch.equal(got, fp8_module.dequantize_rows(data, scale, torch.bfloat16))
    torch._dynamo.reset()
    fp8_module.compiled.cache_clear()


def test_a_dequantisation_that_cannot_compile_runs_the_eager_ops_from_then_on(caplog):
    """Where compiling fails (here: the C++ compiler inductor calls does not exist; on a GPU: no Triton), the
    weight still comes out right, a warning says why, and no later call tries again."""
    import torch._inductor.config as inductor

    data, scale = fp8_module.quantize_rows(torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(1)))
    torch._dynamo.reset()
    fp8_module.compiled.cache_clear()
    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",)}), fused_dequantization("cpu", True):
        got = fp8_module.dequantize_rows(data, scale, torch.bfloat16)
        assert not fp8_module.fuses(torch.device("cpu"))
    want = (data.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1)).to(torch.bfloat16)
    assert torch.equal(got, want)
    assert "FP8 dequantisation stays eager: compiling it failed" in caplog.text
    torch._dynamo.reset()
    fp8_module.compiled.cache_clear()


def test_only_cuda_compiles_the_dequantisation_and_the_environment_can_say_no(monkeypatch):
    monkeypatch.setattr(fp8_module, "_fusing", {})
    assert fp8_module.fuses(torch.device("cuda")) and not fp8_module.fuses(torch.device("cpu"))
    monkeypatch.setattr(fp8_module, "_fusing", {})
    monkeypatch.setenv("RAYFT_FP8_FUSED", "0")
    assert not fp8_module.fuses(torch.device("cuda"))


class _StorageCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of every copy made of an integer tensor (the FP8 bytes and their int32-held scales) by the ops run."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        source = args[1] if func is torch.ops.aten.copy_.default else args[0] if args else None
        copies = (torch.ops.aten.copy_.default, torch.ops.aten.clone.default, torch.ops.aten._to_copy.default)
        if func in copies and isinstance(source, torch.Tensor) and source.dtype in (torch.uint8, torch.int32):
            self.bytes += source.numel() * source.element_size()
        return func(*args, **(kwargs or {}))


def _replicated_rank(rank: int, world: int, port: int, runs: dict, out: str) -> None:
    from rayft.parallel.parallelize import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for label, raw in runs.items():
            torch.manual_seed(0)
            model = build_model(Config.from_dict(raw), on_gpu=False)
            ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(rank))
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            losses, copied = [], []
            for _ in range(2):
                with _StorageCopies() as copies:
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
                copied.append(copies.bytes)
            results[label] = {"losses": losses, "storage_copied": copied}
            del model, optimizer
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_a_one_rank_shard_group_copies_no_fp8_storage(fixtures: Fixtures, mistral4_hub, tmp_path):
    """One worker (FSDP over a one-rank group): FSDP2 would "gather" each layer by copying every parameter, the FP8
    bytes and int32-held scales included, at every forward and backward (the recompute's too); the storage is left
    to the layers instead, so a step copies none of it, and training is the fp32 dequantised model's, as over FSDP."""
    runs = {}
    for label, frozen in (("fp8", "auto"), ("fp32", "float32")):
        raw = tiny_config(fixtures, tmp_path)
        raw["model"].update(model_name_or_path=str(mistral4_hub), torch_dtype="float32", frozen_dtype=frozen)
        raw["lora"].update(lora_dropout=0.0, target_modules=["auto"], target_experts=True)
        raw["fsdp"] = {"activation_checkpointing": True}
        raw["ray"] = {"num_workers": 1}
        runs[label] = raw
    out = tmp_path / "results.json"
    spawn_ranks(_replicated_rank, args=(1, free_port(), runs, str(out)), nprocs=1)
    results = json.loads(out.read_text())
    print(json.dumps(results, indent=1))
    assert results["fp8"]["storage_copied"] == [0, 0], results
    for got, want in zip(results["fp8"]["losses"], results["fp32"]["losses"], strict=True):
        assert abs(got - want) <= 1e-3 * abs(want), results
