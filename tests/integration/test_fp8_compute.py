"""FP8 matmuls on the stored bytes of the frozen base (`model.fp8_compute`, rayft.model.fp8_matmul), on CPU through
`torch._scaled_mm` and the per-expert reference of `torch._scaled_grouped_mm`.

Two kinds of reference, both computed here with plain torch: the same product emulated by hand (the activation or
output gradient rounded to E4M3 per row with amax / 448, times the stored E4M3 bytes and scales in fp32), which the
FP8 path must give to fp32 accumulation order; and the dequantised path (`fp8_compute` off), which it must stay
within E4M3's rounding of: each quantised element is off by at most 2⁻⁴ of itself (3 mantissa bits, round to
nearest), or half E4M3's smallest subnormal step (2⁻¹⁰) times the row's scale, so an output element is off by at
most 2⁻⁴ · Σ|a_k||w_k| + 2⁻¹⁰ · s_row · Σ|w_k|.
"""

from __future__ import annotations

import copy

import pytest
import torch
from fixtures.devices import DEVICES
from fixtures.work import WorkCounter
from test_fp8 import _fp8_and_reference, _lora, _tiny
from torch import nn

from rayft.config import Config
from rayft.model import fp8 as fp8_module
from rayft.model import fp8_matmul
from rayft.model.fp8 import Fp8Experts, Fp8Linear, adopt_lora_, set_fp8_compute_
from rayft.plan.steptime import pass_bytes_per_weight

E4M3 = torch.float8_e4m3fn
REL, SUB = 2.0**-4, 2.0**-10  # E4M3's largest relative rounding error; half its subnormal step (× the scale)
STEPS = 4
# E4M3 rounds an element by at most 2⁻⁴ of itself, about 2.7 % r.m.s.: each FP8 matmul's product is off by about
# that much (relative L2), and a loss averages over every token, so it moves far less.
# torch 2.11's CPU `_scaled_mm` takes one scale per tensor (the torch-floor leg): the checks of the FP8 products on
# the CPU need row-wise scales, and what such a torch does instead is the fallback test below.
ROW_SCALES_ON_CPU = pytest.mark.skipif(
    not fp8_matmul.cpu_row_scales(), reason="this torch's CPU _scaled_mm takes no row-wise scales (CUDA's does)"
)
CPU_AND_CUDA = [pytest.param("cpu", marks=ROW_SCALES_ON_CPU), DEVICES[1]]
LOSS_TOLERANCE = 2.0**-6
GRAD_TOLERANCE = 2.0**-3  # forward and backward roundings of every layer compound into the gradient
ADAPTER_TOLERANCE = 2.0**-1  # AdamW turns small gradients' rounding noise into full-size steps


def _hand_quantised(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `a` rounded to E4M3 by torch's cast after dividing by amax / 448: (values × scale, scale [M, 1])."""
    scale = a.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 448.0
    return (a / scale).clamp(-448, 448).to(E4M3).float() * scale, scale


def _stored(data: torch.Tensor, scale_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return data.view(E4M3).float(), scale_bits.view(torch.float32)


def _bound(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3's worst error of `a`'s per-row rounding in a · w (module docstring)."""
    return REL * (a.abs() @ w.abs()) + SUB * scale * w.abs().sum(dim=0)


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_the_fp8_linear_on_its_bytes_is_the_hand_quantised_product_within_e4m3_of_the_dequantised(device):
    """Forward x · Wᵀ (x per token row, W's row scales as `scale_b`) and input gradient g · W (W's row scales folded
    into g before it is quantised) equal the hand emulation, and stay within E4M3's bound of the dequantised
    layer's; nothing is dequantised and each pass reads W's bytes once. On CUDA (bf16, as its row-wise kernel
    returns) the same within bf16's rounding."""
    torch.manual_seed(0)
    dtype, tol = (torch.float32, 1e-5) if device == "cpu" else (torch.bfloat16, 1e-2)
    layer = Fp8Linear.from_linear(nn.Linear(96, 48), dtype).to(device)
    q, s = _stored(layer.weight.cpu(), layer.weight_scale.cpu())
    w = q * s.unsqueeze(-1)  # the dequantised weight [out, in]
    x = torch.randn(3, 7, 96) * torch.logspace(-3, 1, 96)  # columns of very different sizes: subnormals too
    probe = torch.randn(3, 7, 48)
    runs = {}
    for on in (False, True):
        layer.fp8_compute = on
        xi = x.to(device, dtype).clone().requires_grad_()
        with WorkCounter() as work:
            out = layer(xi)
            (out * probe.to(device, dtype)).sum().backward()
        runs[on] = out.detach().float().cpu(), xi.grad.float().cpu(), work
    (out, grad, work), (out_ref, grad_ref, _) = runs[True], runs[False]
    assert not work.dequantised and work.fp8_matmul_weights == [w.numel(), w.numel()], work.fp8_matmul_weights
    x, probe = x.to(dtype).float(), probe.to(dtype).float()

    rows, g = x.reshape(-1, 96), probe.reshape(-1, 48)
    xq, x_scale = _hand_quantised(rows)
    want = xq @ w.T + layer.bias.detach().float().cpu()
    torch.testing.assert_close(out.reshape(-1, 48), want, rtol=tol, atol=tol * want.abs().max().item())
    gq, g_scale = _hand_quantised(g * s)
    want_grad = gq @ q
    torch.testing.assert_close(grad.reshape(-1, 96), want_grad, rtol=tol, atol=tol * want_grad.abs().max().item())
    if device != "cpu":
        return  # the dequantised reference is bf16 on CUDA: the bound below is fp32's
    assert ((out - out_ref).reshape(-1, 48).abs() <= _bound(rows, w.T, x_scale) + 1e-6).all()
    assert ((grad - grad_ref).reshape(-1, 96).abs() <= _bound(g * s, q, g_scale) + 1e-6).all()
    assert not torch.equal(out, out_ref)  # the activations were quantised: not the dequantised product


@pytest.mark.parametrize("device", CPU_AND_CUDA)
@pytest.mark.parametrize("arch", ["mistral4", "gpt_oss"])  # [E, out, in] with row scales on out; transposed
def test_an_expert_stack_on_its_bytes_is_the_per_expert_hand_product(arch, device):
    """Each expert group's rows times its expert's stored bytes, forward and input gradient, through the grouped
    path (on the CPU its per-expert reference, on CUDA `torch._scaled_grouped_mm` in bf16); the expected values come
    from a host loop over the groups, each row quantised by hand (the weight's scales folded into the rows where
    they lie on the contraction dimension)."""
    dtype, tol = (torch.float32, 1e-5) if device == "cpu" else (torch.bfloat16, 1e-2)
    experts = _tiny(arch).model.layers[0].mlp.experts
    fp8 = Fp8Experts(experts, dtype).to(device)
    q, s = _stored(fp8.gate_up_proj.cpu(), fp8.gate_up_proj_scale.cpu())  # [E, out, in] / [E, out], or transposed
    counts = [3, 0, 2, 5, 0, 1, 0, 4]
    ids = torch.repeat_interleave(torch.arange(8), torch.tensor(counts))
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    x = torch.randn(len(ids), 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    probe = torch.randn(len(ids), 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    xi = x.to(device).clone().requires_grad_()
    storage = (fp8.gate_up_proj, fp8.scale("gate_up_proj"))
    args = (dtype, fp8.is_transposed, ids.to(device), offs.to(device), fp8_module.quantize_activation, *storage)
    out = fp8_matmul.ScaledFrozenGrouped.apply(xi, *args)
    (out * probe.to(device)).sum().backward()
    out, grad, x, probe = out.detach().float().cpu(), xi.grad.float().cpu(), x.float(), probe.float()

    want, want_grad, start = torch.zeros_like(out), torch.zeros_like(x), 0
    for e, n in enumerate(counts):
        rows, g = x[start : start + n], probe[start : start + n]
        if fp8.is_transposed:  # W_e [in, out], scales on its rows (in): forward folds them into x
            want[start : start + n] = _hand_quantised(rows * s[e])[0] @ q[e]
            want_grad[start : start + n] = _hand_quantised(g)[0] @ (q[e] * s[e].unsqueeze(-1)).T
        else:
            want[start : start + n] = _hand_quantised(rows)[0] @ (q[e] * s[e].unsqueeze(-1)).T
            want_grad[start : start + n] = _hand_quantised(g * s[e])[0] @ q[e]
        start += n
    torch.testing.assert_close(out, want, rtol=tol, atol=tol * want.abs().max().item())
    torch.testing.assert_close(grad, want_grad, rtol=tol, atol=tol * want_grad.abs().max().item())


@ROW_SCALES_ON_CPU
def test_the_expert_path_on_its_bytes_never_syncs_and_reads_each_weight_once_a_pass(monkeypatch):
    """A layer larger than one dequantisation chunk (budget: 2 of its 8 experts), which the dequantised path serves
    with one host sync (the routed counts, to chunk the experts with rows): on its bytes, no host sync and no
    host-to-device copy, nothing dequantised, and forward and input gradient each read every expert weight's
    bytes once: 1 byte per weight per pass, within the plan's 3 (CUDA adds the input gradient's transposed copy,
    which the CPU reference does not make), where the plan's dequantised path moves 1 + 2c."""
    experts = _tiny("mistral4").model.layers[0].mlp.experts
    fp8 = Fp8Experts(experts, torch.float32)
    monkeypatch.setattr(fp8_module, "EXPERT_DEQUANT_BUDGET", 2 * fp8.gate_up_proj[0].numel())
    top_k = torch.tensor([[1, 2], [5, 1], [2, 5], [1, 5], [2, 1]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    set_fp8_compute_(fp8, True)
    with WorkCounter() as work:
        fp8(hidden, top_k, weights).square().sum().backward()
    assert work.total_syncs() == work.total_host_copies() == 0, (work.syncs, work.host_copies)
    assert not work.dequantised and not work.fp8_copied
    stacks = fp8.gate_up_proj.numel() + fp8.down_proj.numel()
    per_weight_per_pass = (sum(work.fp8_matmul_weights) + 2 * sum(work.fp8_copied)) / (2 * stacks)
    assert per_weight_per_pass == 1.0, work.fp8_matmul_weights
    cfg = Config.from_dict({})
    assert per_weight_per_pass <= pass_bytes_per_weight(cfg, on_bytes=True) < pass_bytes_per_weight(cfg, False)


def _trained(model: nn.Module, ids: torch.Tensor) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """`STEPS` AdamW steps of the LoRA weights of `model`: the losses, the first step's gradient and the adapter's
    change over the steps (each flattened into one vector)."""
    params = [p for p in model.parameters() if p.requires_grad]
    start = torch.cat([p.detach().flatten() for p in params])
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    losses, first = [], torch.empty(0)
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if not losses:
            first = torch.cat([p.grad.flatten() for p in params])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, first, torch.cat([p.detach().flatten() for p in params]) - start


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@ROW_SCALES_ON_CPU
@pytest.mark.parametrize("arch", ["dense", "mistral4"])
def test_lora_on_fp8_matmuls_trains_within_the_stated_tolerance_of_the_dequantised_path(arch):
    """fp32 LoRA on a tiny FP8 model, `STEPS` AdamW steps with the frozen matmuls on their bytes against the same
    model dequantised (the setting off): every loss within `LOSS_TOLERANCE` of the dequantised one, relative; the
    first gradient and the adapter's change over the steps within `GRAD_TOLERANCE` and `ADAPTER_TOLERANCE` of
    theirs (relative L2). docs/configuration.md states the measured figures these bound with a margin."""
    fp8, _ = _fp8_and_reference(arch)
    fp8 = _lora(fp8, arch)
    adopt_lora_(fp8)
    with torch.no_grad():
        for name, p in fp8.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(3))  # B = 0 would hide A's gradient
    dequantised = copy.deepcopy(fp8)
    assert set_fp8_compute_(fp8, True) > 0
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with WorkCounter() as work:
        losses, grad, change = _trained(fp8, ids)
    assert not work.dequantised and work.fp8_matmul_weights
    losses_ref, grad_ref, change_ref = _trained(dequantised, ids)
    assert losses_ref[-1] < losses_ref[0] and losses[-1] < losses[0], (losses, losses_ref)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, losses_ref, strict=True))
    errors = (loss_error, _relative(grad, grad_ref), _relative(change, change_ref))
    print(f"{arch}: loss {errors[0]:.2e}, first gradient {errors[1]:.2e}, adapter change {errors[2]:.2e}")
    assert all(e <= t for e, t in zip(errors, (LOSS_TOLERANCE, GRAD_TOLERANCE, ADAPTER_TOLERANCE), strict=True)), errors


@pytest.mark.skipif(fp8_matmul.cpu_row_scales(), reason="this torch's CPU takes row-wise scales: nothing falls back")
def test_a_torch_whose_cpu_takes_no_row_scales_runs_the_setting_dequantised_and_says_why(caplog):
    """`model.fp8_compute: true` on CPU workers of a torch whose `_scaled_mm` takes one scale per tensor there: every
    layer runs the dequantised path (the same logits and input gradients as with the setting off, to the bit),
    with one warning naming the reason, rather than torch's internal assert in the first forward."""
    fp8, _ = _fp8_and_reference("mistral4")
    dequantised = copy.deepcopy(fp8)
    assert set_fp8_compute_(fp8, True) > 0
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    fp8_matmul._warned.clear()
    with caplog.at_level("WARNING", logger=fp8_matmul.log.name), WorkCounter() as work:
        embeds = fp8.get_input_embeddings()(ids).detach().requires_grad_()
        logits = fp8(inputs_embeds=embeds).logits
        logits.square().sum().backward()
    assert not work.fp8_matmul_weights and work.dequantised
    want_embeds = dequantised.get_input_embeddings()(ids).detach().requires_grad_()
    want = dequantised(inputs_embeds=want_embeds).logits
    want.square().sum().backward()
    assert torch.equal(logits, want) and torch.equal(embeds.grad, want_embeds.grad)
    said = [r.getMessage() for r in caplog.records if "fp8_compute" in r.getMessage()]
    assert len(said) == 1 and "CPU _scaled_mm takes no row-wise scales" in said[0], said


def test_the_setting_reaches_every_fp8_layer_and_auto_keeps_cpu_workers_dequantised():
    """`model.fp8_compute` as the model is built: `auto` on a CPU worker leaves every FP8 layer dequantising (CPU
    losses stay what they were), `true` turns each of them to FP8 matmuls."""
    from rayft.parallel.parallelize import quantize_frozen_base_

    for setting, want in (("auto", False), (True, True), (False, False)):
        model = _tiny("mistral4")
        cfg = Config.from_dict({"model": {"frozen_dtype": "float8_e4m3fn", "fp8_compute": setting}})
        quantize_frozen_base_(cfg, model, True, torch.device("cpu"))
        layers = [m for m in model.modules() if isinstance(m, (Fp8Linear, Fp8Experts))]
        assert layers and all(m.fp8_compute is want for m in layers), setting


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_activation_quantisation_gives_the_eager_bytes(dtype, caplog):
    """Where the dequantisation is compiled (CUDA; here forced on the CPU), rounding activations to E4M3 is one
    compiled kernel: the same bytes and scales as the storage's blockwise quantisation, a zero row included."""
    from rayft.model.fp8 import fused_dequantization

    a = (torch.randn(37, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 96)).to(dtype)
    a[3] = 0
    eager_bytes, eager_scale = fp8_module.quantize_activation(a)
    with fused_dequantization("cpu", True):
        fused_bytes, fused_scale = fp8_module.quantize_activation(a)
    assert "stays eager" not in caplog.text, caplog.text
    assert torch.equal(fused_bytes.view(torch.uint8), eager_bytes.view(torch.uint8))
    assert torch.equal(fused_scale, eager_scale) and fused_scale.shape == (37, 1)
