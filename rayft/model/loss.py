"""The causal-LM loss taken straight from the last hidden states, without the (tokens × vocabulary) logits.

A 131k vocabulary makes the logits the largest tensor of a LoRA step (0.5 MB of fp32 per token), and the softmax
passes over them cost more than the LM head's matmul itself. With a frozen LM head the whole backward of the loss
is one matrix, d loss / d hidden, so it is computed chunk by chunk in the forward, while each chunk's logits are
still at hand: no logits kept for backward, no second matmul pass, two fewer sweeps over the vocabulary.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import PreTrainedModel


Batch = dict[str, torch.Tensor]  # a collated micro-batch: input_ids, labels, attention or position ids
IGNORE_INDEX = -100
# Batch columns that are no input of the model: the targets, and the precomputed DPO reference a pair batch carries.
NOT_MODEL_INPUTS = ("labels", "shift_labels", "reference_logps", "reference_missing")
ROW_MULTIPLE = 64
# Config fields that change the logits after the LM head's matmul, or add a loss term the fused path leaves out.
_LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


class Workspace:
    """The chunk buffers (logits in the compute dtype, fp32 logits, fp32 log-probs). On CPU they are kept from call
    to call: glibc maps and unmaps every allocation this large, and the page faults of fresh 50 MB tensors cost
    more than the softmax over them. On GPU the caching allocator already reuses memory."""

    def __init__(self) -> None:
        self.kept: tuple[torch.Tensor, ...] = ()

    def take(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
        if self.kept and self.kept[0].shape == (rows, vocab) and self.kept[0].dtype == dtype:
            return self.kept
        buffers = tuple(torch.empty(rows, vocab, dtype=d, device=device) for d in (dtype, torch.float32, torch.float32))
        if device.type == "cpu":
            self.kept = buffers
        return buffers


def chunk_rows(vocab: int, on_gpu: bool) -> int:
    """Tokens per chunk, a multiple of ROW_MULTIPLE: 64 MiB of fp32 logits on CPU (the kept buffers), 256 MiB on GPU."""
    rows = (256 if on_gpu else 64) * 2**20 // (4 * vocab)
    return max(ROW_MULTIPLE, rows - rows % ROW_MULTIPLE)


def _low_rank_buffers(
    ctx: Any, u: torch.Tensor | None, b: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """LoRA on the head: its factors in the compute dtype and the buffers of their gradients (`b`'s transposed, summed
    in fp32), None where there is no LoRA or no gradient is asked for."""
    if u is None:
        return None, None, None, None
    b = cast(torch.Tensor, b)  # LoRA on the head gives both factors
    u_low, b_low = u.to(dtype), b.to(dtype)
    grad_u = torch.empty_like(u_low) if ctx.needs_input_grad[6] else None
    grad_b_t = torch.zeros(b.shape[::-1], dtype=torch.float32, device=b.device) if ctx.needs_input_grad[7] else None
    return u_low, b_low, grad_u, grad_b_t


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean token cross-entropy of `hidden @ w.T` (plus `u @ b.T`: LoRA on the head, see `LoraHead`), the gradients
    of `hidden`, `u` and `b` computed in the forward (`w` is frozen)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        w: torch.Tensor,
        targets: torch.Tensor,
        num_items: torch.Tensor | None,
        scored_first: bool,
        workspace: Workspace,
        u: torch.Tensor | None = None,
        b: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`scored_first`: the scored rows come first and only padding follows them (their gradients are garbage
        for the caller to drop); otherwise unscored rows anywhere are masked out."""
        h = hidden.to(w.dtype)  # the weight's dtype is the compute dtype: the caller casts it
        lora = u is not None
        scored = targets != IGNORE_INDEX
        count = scored.sum()
        n_scored = int(count) if scored_first else 0
        safe = targets.clamp_min(0)[:, None]
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        u_low, b_low, grad_u, grad_b_t = _low_rank_buffers(ctx, u, b, w.dtype)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        rows = chunk_rows(w.shape[0], h.device.type != "cpu")
        low, logits, log_probs = workspace.take(rows, w.shape[0], w.dtype, h.device)
        fp32 = w.dtype == torch.float32  # the logits are fp32 already: no copies in and out of the compute dtype
        with torch.autocast(h.device.type, enabled=False):
            for start in range(0, h.shape[0], rows):
                part = slice(start, start + rows)
                n = len(safe[part])
                torch.mm(h[part], w.T, out=low[:n])
                if lora:
                    low[:n].addmm_(cast(torch.Tensor, u_low)[part], cast(torch.Tensor, b_low).T)
                z = low[:n] if fp32 else logits[:n].copy_(low[:n])
                lp = torch.log_softmax(z, dim=-1, out=log_probs[:n])
                nll = -lp.gather(1, safe[part])[:, 0]
                total += nll[: max(0, n_scored - start)].sum() if scored_first else (nll * scored[part]).sum()
                if grad is None and grad_u is None and grad_b_t is None:
                    continue
                probs = lp.exp_()  # d nll / d logits = softmax − one-hot(target)
                probs.scatter_add_(1, safe[part], torch.full_like(nll, -1.0)[:, None])
                if not scored_first:
                    probs.mul_(scored[part, None])
                if grad_b_t is not None:  # d / d b = probs.T @ u over the scored rows, summed in fp32 (as u.T @ probs)
                    valid = max(0, min(n, n_scored - start)) if scored_first else n
                    grad_b_t.addmm_(cast(torch.Tensor, u)[part][:valid].float().T, probs[:valid])
                g = probs if fp32 else low[:n].copy_(probs)
                if grad is not None:
                    torch.mm(g, w, out=grad[part])
                if grad_u is not None:
                    torch.mm(g, cast(torch.Tensor, b_low), out=grad_u[part])
        # As transformers: the sum over scored tokens divided by `num_items_in_batch` when given, else their mean.
        divisor = count if num_items is None else num_items.to(total.device, torch.float32)
        ctx.dtypes = (
            hidden.dtype,
            cast(torch.Tensor, u).dtype if lora else None,
            cast(torch.Tensor, b).dtype if lora else None,
        )
        ctx.save_for_backward(grad, grad_u, grad_b_t.T if grad_b_t is not None else None, divisor)
        return total / divisor

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        *grads, divisor = ctx.saved_tensors
        scale = grad_loss / divisor
        grad, grad_u, grad_b = (
            g.to(dtype) * scale if g is not None else None for g, dtype in zip(grads, ctx.dtypes, strict=True)
        )
        return grad, None, None, None, None, None, grad_u, grad_b


@dataclass(frozen=True)
class LoraHead:
    """PEFT LoRA on the LM head, as the fused loss takes it: logits = h W.T + u B.T with u = scale · A(dropout(h)),
    so the vocabulary-wide product stays inside the chunks and only A's small output is left to autograd."""

    layer: LoraLinear
    adapter: str

    def low_rank(self, hidden: torch.Tensor) -> torch.Tensor:
        a, dropout = cast(nn.Linear, self.layer.lora_A[self.adapter]), self.layer.lora_dropout[self.adapter]
        return cast(torch.Tensor, a(dropout(hidden.to(a.weight.dtype))) * self.layer.scaling[self.adapter])

    @property
    def b(self) -> torch.Tensor:
        return cast(nn.Linear, self.layer.lora_B[self.adapter]).weight


def lora_head(head: nn.Module) -> LoraHead | None:
    """The head's one active plain LoRA adapter (no DoRA or other variant, no bias, not merged), or None: for a
    plain Linear, and while the adapter is switched off (the DPO reference pass)."""
    if type(head) is nn.Linear or head.disable_adapters or head.merged:
        return None
    lora = cast("LoraLinear", head)  # `why_not_fused` lets only plain LoRA on a Linear through
    (adapter,) = (a for a in lora.active_adapters if a in lora.lora_A)
    return LoraHead(lora, adapter)


def _why_not_lora(head: nn.Module) -> str | None:
    """Why a wrapped LM head cannot go through the fused loss; None for plain LoRA on it."""
    from peft.tuners.lora import Linear as LoraLinear

    if not isinstance(head, LoraLinear) or type(head.base_layer) is not nn.Linear:
        return f"the LM head is a {type(head).__name__}, not a plain frozen Linear or LoRA on one"
    adapters = [a for a in head.active_adapters if a in head.lora_A]
    if len(adapters) != 1 or adapters[0] in head.lora_variant or head.lora_bias.get(adapters[0]):
        return "the LM head's LoRA is not one plain adapter (several adapters, DoRA or a LoRA bias)"
    return None


class _LinearTokenLogProbs(torch.autograd.Function):
    """log p(target) of each row of `hidden @ w.T`, its input gradient computed in the forward (`w` is frozen):
    d log p / d hidden = (one-hot(target) − softmax) @ w, kept per row and scaled by the caller's gradient."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, workspace: Workspace
    ) -> torch.Tensor:
        h = hidden.to(w.dtype)
        out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        rows = chunk_rows(w.shape[0], h.device.type != "cpu")
        low, logits, log_probs = workspace.take(rows, w.shape[0], w.dtype, h.device)
        with torch.autocast(h.device.type, enabled=False):
            for start in range(0, h.shape[0], rows):
                part = slice(start, start + rows)
                n = len(targets[part])
                torch.mm(h[part], w.T, out=low[:n])
                logits[:n].copy_(low[:n])
                lp = torch.log_softmax(logits[:n], dim=-1, out=log_probs[:n])
                out[part] = lp.gather(1, targets[part, None])[:, 0]
                if grad is None:
                    continue
                probs = lp.exp_().neg_()
                probs.scatter_add_(1, targets[part, None], torch.ones_like(out[part])[:, None])
                low[:n].copy_(probs)
                torch.mm(low[:n], w, out=grad[part])
        ctx.hidden_dtype = hidden.dtype
        ctx.save_for_backward(grad)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (grad,) = ctx.saved_tensors
        return (grad * grad_out[:, None].to(grad.dtype)).to(ctx.hidden_dtype), None, None, None


def sequence_logprobs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor | None = None,
    head: nn.Module | None = None,
    workspace: Workspace | None = None,
    drop_unscored: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log p over each row's scored tokens, their count) for a causal LM: labels shifted by one, -100 not
    scored. With a frozen `weight` the log-probs come chunk by chunk without the logits being kept
    (`_LinearTokenLogProbs`); otherwise `head` (a module: LoRA on the LM head) gives the logits, as autograd sees
    them. `drop_unscored` as for `linear_cross_entropy`: True sends only the scored positions to the head (their
    count reaches the host: free on CPU, a sync on GPU), False every position, the unscored ones' log-probs masked
    to 0 (no sync); None picks by device. Both give the same sums."""
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    scored = targets != IGNORE_INDEX
    hidden = hidden.reshape(-1, hidden.shape[-1])
    rows = torch.arange(len(targets), device=hidden.device) // labels.shape[-1]
    drop = hidden.device.type == "cpu" if drop_unscored is None else drop_unscored
    if drop:
        where = scored.nonzero()[:, 0]
        hidden, targets, rows = hidden[where], targets[where], rows[where]
    wanted = targets.clamp(min=0)  # an unscored position (masked below) looks up any valid id
    if weight is not None:
        # torch leaves autograd.Function.apply unannotated
        token_logps = _LinearTokenLogProbs.apply(hidden, weight, wanted, workspace or Workspace())  # type: ignore[no-untyped-call]
    else:  # without `weight` the caller gives `head`
        token_logps = torch.log_softmax(cast(nn.Module, head)(hidden).float(), dim=-1).gather(1, wanted[:, None])[:, 0]
    token_logps = torch.where(targets != IGNORE_INDEX, token_logps, 0.0)
    sums = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device).index_add(0, rows, token_logps)
    return sums, scored.reshape(labels.shape).sum(-1)


def next_token_targets(labels: torch.Tensor, shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """Each position's target: the next label (-100 after the last), or `shift_labels` where the caller shifted
    them already (as transformers' loss takes them)."""
    return shift_labels if shift_labels is not None else F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    drop_unscored: bool | None = None,
    lora: LoraHead | None = None,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' causal-LM loss for `hidden @ weight.T` (labels shifted by one, the mean over labels != -100,
    or their sum / `num_items_in_batch`), computed in `weight`'s dtype. The weight must be frozen: its gradient is
    never computed; with `lora` (LoRA on the head) the logits gain its low-rank term, and A and B their gradients.

    `drop_unscored` picks one of two ways to leave out unscored rows (padding, prompts): True drops them before the
    head (the CPU way: less work, but their count must reach the host), False masks them inside the chunks (the GPU
    way: no host sync). None picks by device. Both give the same loss on any device, so either runs on CPU tests.
    `shift_labels`: the targets already shifted (a context-parallel shard's, taken on the whole row), used as given."""
    targets = next_token_targets(labels, shift_labels).reshape(-1)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    scored_first = hidden.device.type == "cpu" if drop_unscored is None else drop_unscored
    if scored_first:  # dropping unscored rows needs their count on the host: free on CPU, a sync on GPU
        keep = (targets != IGNORE_INDEX).nonzero()[:, 0]
        # ... and padding to a multiple of 64 rows, since CPU bf16 matmuls compile a kernel for every new shape
        pad = -len(keep) % ROW_MULTIPLE
        hidden = F.pad(hidden[keep], (0, 0, 0, pad))
        targets = F.pad(targets[keep], (0, pad), value=IGNORE_INDEX)
    low_rank = (lora.low_rank(hidden), lora.b) if lora is not None else (None, None)
    loss: torch.Tensor = _LinearCrossEntropy.apply(  # type: ignore[no-untyped-call]  # torch: unannotated
        hidden, weight, targets, num_items_in_batch, scored_first, workspace or Workspace(), *low_rank
    )
    return loss


class FrozenCast:
    """A frozen weight in the autocast dtype (if autocast is on), cast once while its storage and version stay the
    same: autocast itself would cast it again on every call, as it caches casts of trainable leaves only."""

    def __init__(self) -> None:
        self.key: tuple[int, int, torch.dtype] | None = None
        self.cast: torch.Tensor | None = None

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        device = weight.device.type
        if not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) == weight.dtype:
            return weight
        key = (weight.data_ptr(), weight._version, torch.get_autocast_dtype(device))
        if key != self.key:
            self.key, self.cast = key, weight.detach().to(key[2])
        return cast(torch.Tensor, self.cast)  # set by the first call: its key differs from None


def why_not_fused(model: PreTrainedModel) -> str | None:
    """Why this causal LM's loss cannot come from `linear_cross_entropy`; None when it can."""
    head: Any = lm_head(model)  # a LoRA or modules_to_save wrapper: its `base_layer` is read below
    if type(head) is not nn.Linear:  # LoRA (fused too, `LoraHead`) or modules_to_save on the head wraps it
        reason = _why_not_lora(head)
        if reason is not None:
            return reason
        head = head.base_layer
    if head.weight.requires_grad or head.bias is not None:
        return "the LM head is trained or has a bias"
    forward = why_not_fused_forward(model)
    if forward is not None:
        return forward
    config = model.config.get_text_config()
    changed = [k for k in _LOGIT_CHANGES if getattr(config, k, None) not in (None, 1.0)]
    if changed:
        return f"the model rescales its logits ({', '.join(changed)})"
    if getattr(config, "output_router_logits", False):
        return "the model adds a router auxiliary loss"
    return None


def why_not_fused_forward(model: PreTrainedModel) -> str | None:
    """Why the fused loss cannot take this causal LM's last hidden states from its own call without logits
    (`last_hidden_states`); None when it can."""
    if "logits_to_keep" not in inspect.signature(type(model).forward).parameters:
        return f"{type(model).__name__}'s forward has no logits_to_keep"
    return None


def model_inputs(batch: Batch) -> Batch:
    """What of a collated batch the model's forward takes: all but the targets and what objectives carry along."""
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}


def last_hidden_states(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The decoder's last hidden states (after its final norm) for `batch`, from the model's own call, so that
    FSDP's root hooks gather what the root holds, and without logits: transformers' `logits_to_keep` keeps no
    position and `output_hidden_states=-1` records the last states only. The root's weights (the LM head's among
    them) stay gathered after the call, for the loss to use: FSDP does not reshard the root after its forward."""
    none = torch.empty(0, dtype=torch.long, device=batch["input_ids"].device)
    # A vision-language wrapper hands a selection on to its vision tower, which then records that state, not the one
    # its projector reads (`vision_feature_layer`, whatever it is): there every state is recorded (the tensors
    # backward keeps anyway).
    selected = True if getattr(getattr(model, "config", None), "vision_config", None) is not None else -1
    out = model(**model_inputs(batch), logits_to_keep=none, output_hidden_states=selected, use_cache=False)
    return cast(torch.Tensor, out.hidden_states[-1])


def lm_head(model: nn.Module) -> nn.Module:
    """The LM head of a causal LM, or of the one a PEFT model wraps (its LoRA wrapper where it has one)."""
    head: nn.Module = cast(Any, model).get_output_embeddings()  # transformers leaves it unannotated
    return head


class CausalLMLoss:
    """The next-token loss of a batch (summed over its target tokens, divided by `num_items` when given, else their
    mean, as transformers does): fused with the LM head (`linear_cross_entropy` from the last hidden states, no
    logits kept) where `why_not_fused` allows, else the model's own loss from its logits."""

    def __init__(self, fused: bool, drop_unscored: bool | None = None) -> None:
        """`drop_unscored`: as in `linear_cross_entropy` (None: by device; tests force either branch)."""
        self.fused, self.drop_unscored = fused, drop_unscored
        self.head, self.workspace = FrozenCast(), Workspace()

    def __call__(self, model: nn.Module, batch: Batch, num_items: torch.Tensor | None = None) -> torch.Tensor:
        if not self.fused:
            return cast(torch.Tensor, model(**batch, num_items_in_batch=num_items).loss)
        hidden = last_hidden_states(model, batch)
        output = lm_head(model)
        weight = self.head(cast(nn.Linear, getattr(output, "base_layer", output)).weight)
        lora = lora_head(output)
        shifted = batch.get("shift_labels")  # a context-parallel shard's targets, taken on the whole row
        return linear_cross_entropy(
            hidden, weight, batch["labels"], num_items, self.workspace, self.drop_unscored, lora, shifted
        )
