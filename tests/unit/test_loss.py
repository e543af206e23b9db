"""The fused chunked loss (rayft.model.loss) against cross-entropy over full logits, for both of its branches.

The branch that drops unscored rows before the head is what CPUs run; the branch that masks them inside the chunks
is what GPUs run. `drop_unscored` forces either, so the GPU branch is checked on every CI run, not only on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from rayft.model.loss import IGNORE_INDEX, chunk_rows, linear_cross_entropy

VOCAB = 131072  # the tekken vocabulary: several chunks for a few hundred tokens
CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)


def _problem(device: str, dtype: torch.dtype, tokens: int = 300, hidden: int = 32):
    """Hidden states, a frozen head and labels with padding in the middle and at the end (as padded batches have)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, tokens // 2, hidden, generator=g)
    w = torch.randn(VOCAB, hidden, generator=g) / hidden**0.5
    labels = torch.randint(0, VOCAB, (2, tokens // 2), generator=g)
    labels[0, 40:60] = IGNORE_INDEX
    labels[1, -30:] = IGNORE_INDEX
    return h.to(device, dtype).requires_grad_(), w.to(device, dtype), labels.to(device)


def _reference(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, num_items: torch.Tensor | None):
    """transformers' causal-LM loss written out: full fp32 logits, shift by one, mean (or sum / num_items)."""
    h = h.detach().float().requires_grad_()
    logits = (h @ w.float().T)[:, :-1].reshape(-1, w.shape[0])
    targets = labels[:, 1:].reshape(-1)
    summed = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    loss = summed / (num_items if num_items is not None else (targets != IGNORE_INDEX).sum())
    loss.backward()
    return loss.detach(), h.grad


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("drop_unscored", [True, False], ids=["cpu-branch", "gpu-branch"])
def test_fused_loss_equals_full_logits_loss_and_input_gradient(device, drop_unscored):
    h, w, labels = _problem(device, torch.float32)
    if device == "cpu":
        assert h.numel() // h.shape[-1] > 2 * chunk_rows(VOCAB, on_gpu=False)  # several chunks
    loss = linear_cross_entropy(h, w, labels, drop_unscored=drop_unscored)
    loss.backward()
    ref_loss, ref_grad = _reference(h, w, labels, None)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert torch.allclose(h.grad.float(), ref_grad, rtol=1e-4, atol=1e-4 * ref_grad.abs().max().item())
    # unscored rows get no gradient in either branch (their rows of the input are exactly zero)
    assert h.grad[0, 39:59].abs().max() == 0 and h.grad[1, -31:].abs().max() == 0
    # the Trainer's token weighting: the sum over scored tokens / num_items_in_batch instead of their mean
    items = torch.tensor(200.0, dtype=torch.float64, device=device)
    with torch.no_grad():
        summed = linear_cross_entropy(h, w, labels, items, drop_unscored=drop_unscored)
    scored = (labels[:, 1:] != IGNORE_INDEX).sum().item()
    assert summed.item() == pytest.approx(ref_loss.item() * scored / 200.0, rel=1e-5)


@pytest.mark.parametrize("device", [CUDA])
def test_both_branches_agree_in_bf16(device):
    """In bf16 (the GPU compute dtype) both branches round the same way: equal to each other, and to fp32 logits
    within bf16 precision. GPU only: CPUs without bf16 instructions emulate it (tens of seconds for this)."""
    results = {}
    for drop in (True, False):
        h, w, labels = _problem(device, torch.bfloat16)
        loss = linear_cross_entropy(h, w, labels, drop_unscored=drop)
        loss.backward()
        results[drop] = (loss.item(), h.grad.float())
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-3)
    scale = results[False][1].abs().max().item()
    assert torch.allclose(results[True][1], results[False][1], rtol=2e-2, atol=2e-2 * scale)
    ref_loss, ref_grad = _reference(*_problem(device, torch.bfloat16), None)
    assert results[False][0] == pytest.approx(ref_loss.item(), rel=2e-2)
    error = (results[False][1] - ref_grad).norm() / ref_grad.norm()
    assert error < 2e-2, f"relative gradient error {error:.3g}"


@pytest.mark.parametrize("drop_unscored", [True, False], ids=["cpu-branch", "gpu-branch"])
def test_lora_on_the_head_inside_the_chunks_equals_the_peft_module(drop_unscored):
    """LoRA on the LM head through the fused loss (its low-rank term added chunk by chunk): the loss and the
    gradients of the input, A and B equal those of PEFT's own module over full logits, in both branches."""
    from peft import LoraConfig, inject_adapter_in_model

    from rayft.model.loss import lora_head

    h, w, labels = _problem("cpu", torch.float32)
    base = torch.nn.Linear(w.shape[1], VOCAB, bias=False)
    base.weight.data.copy_(w)
    base.weight.requires_grad_(False)
    torch.manual_seed(1)
    # PEFT's public entry point (its Linear's constructor changed between releases).
    wrapped = inject_adapter_in_model(
        LoraConfig(r=4, lora_alpha=8, target_modules=["head"]), nn.ModuleDict({"head": base})
    )
    layer = wrapped["head"]
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.02)  # B = 0 at init would leave A's gradient zero
    trained = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]

    def grads(loss: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
        return [g.clone() for g in torch.autograd.grad(loss, [x, *trained])]

    x = h.detach().clone().requires_grad_()
    logits = layer(x)[:, :-1].reshape(-1, VOCAB)
    want = F.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)
    want_grads = grads(want, x)
    x = h.detach().clone().requires_grad_()
    got = linear_cross_entropy(x, w, labels, drop_unscored=drop_unscored, lora=lora_head(layer))
    got_grads = grads(got, x)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    for name, g, ref in zip(("input", "A", "B"), got_grads, want_grads, strict=True):
        assert ref.abs().sum() > 0, name
        assert torch.allclose(g, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()), name
    layer.enable_adapters(False)  # the DPO reference pass: the head without its adapter
    assert lora_head(layer) is None
