"""Preference tuning (DPO and its relatives) with LoRA: the loss a step minimises, its metrics, evaluation.

The reference model is the policy with its adapter switched off (`adapter_off`, as PEFT's `disable_adapter()`),
run without gradients on the same FSDP2-sharded base: no second model in memory. With `precomputed` that pass runs
once over the training pairs before the first step (`rayft.train.reference`) and the batches carry its results.
A micro-batch holds B pairs as 2B rows (chosen first, then rejected: `rayft.data.preference.PreferenceCollate`), so
one forward scores both sides of every pair. Log-probabilities are summed over completion tokens only; the loss and
metrics follow TRL's `DPOTrainer` (same names), and every pair of a step weighs the same across micro-batches and
workers, as every token does in SFT (the step's pair count is all-reduced once per step).
"""

from __future__ import annotations

import logging
import math
import typing
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import AuxiliaryTrainingWrapper
from torch import nn
from torch.nn import functional as F

from rayft.config import DpoConfig
from rayft.model.loss import Batch, FrozenCast, Workspace, last_hidden_states, lm_head, sequence_logprobs, why_not_fused
from rayft.train.step import MicroBatchLoss, eval_pass

if TYPE_CHECKING:
    import peft
    from transformers import PreTrainedModel

    from rayft.train.runtime import Collate, Shard
    from rayft.train.step import Autocast

log = logging.getLogger("rayft")

# TRL's metric names, in the order they are shown.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")  # fmt: skip


@dataclass
class PairScores:
    """Per pair: the DPO loss, and what the metrics need (detached)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


class SequenceLogprobs:
    """(sum of completion log-probs per row, scored tokens per row) of a pair batch, from the model's last hidden
    states (`last_hidden_states`: its own call, no logits): a plain frozen LM head chunk by chunk without keeping
    logits; a trained one (LoRA on `lm_head`) through its module."""

    def __init__(self, model: nn.Module) -> None:
        """`model`: the PEFT model."""
        base = typing.cast("PreTrainedModel", typing.cast("peft.PeftModel", model).get_base_model())
        self.fused = why_not_fused(base) is None and type(lm_head(base)) is nn.Linear  # LoRA on it: its module
        self.cast, self.workspace = FrozenCast(), Workspace()

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = last_hidden_states(model, {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})
        head = lm_head(model)
        if self.fused:
            return sequence_logprobs(
                hidden, batch["labels"], weight=self.cast(typing.cast(nn.Linear, head).weight), workspace=self.workspace
            )
        return sequence_logprobs(hidden, batch["labels"], head=head)


def reference_logprobs(model: torch.nn.Module, logprobs: SequenceLogprobs, batch: Batch) -> torch.Tensor:
    """The same rows under the base model: the adapter switched off, no gradients."""
    with torch.no_grad(), adapter_off(model):
        return logprobs(model, batch)[0]


@contextmanager
def adapter_off(model: torch.nn.Module) -> Iterator[None]:
    """PEFT's `disable_adapter()` without its `requires_grad` toggling: re-enabling sets it on whichever LoRA
    parameters FSDP2 has registered at that moment (the gathered ones of a unit kept unsharded), so the sharded
    parameters came back frozen — left out of gradient clipping and of checkpoints (a resume then failed on a
    missing key). The reference pass runs without gradients, so only each LoRA layer's switch is flipped, and each
    `modules_to_save` wrapper's (an `AuxiliaryTrainingWrapper`, not a tuner layer): the reference is the base model's
    own module, not the trained copy."""
    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
    before = [m._disable_adapters for m in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, state in zip(layers, before, strict=True):
            layer._disable_adapters = state


def pair_scores(policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor, dpo: DpoConfig) -> PairScores:
    """TRL's formulas: Δ = (log π(c) − log π_ref(c)) − (log π(r) − log π_ref(r));
    sigmoid (DPO; conservative with label smoothing ε): −(1−ε)·logσ(βΔ) − ε·logσ(−βΔ);
    robust: (−(1−ε)·logσ(βΔ) + ε·logσ(−βΔ)) / (1 − 2ε);
    ipo: (Δ' − 1/(2β))², Δ' from log-ratios averaged over each completion's tokens.
    Rewards are β · log-ratio (summed, for every loss type)."""
    chosen, rejected = policy.chunk(2)
    ratios = policy - reference
    chosen_ratio, rejected_ratio = ratios.chunk(2)
    beta, eps = dpo.beta, dpo.label_smoothing
    delta = chosen_ratio - rejected_ratio
    if dpo.loss_type == "ipo":
        chosen_count, rejected_count = counts.clamp_min(1).to(ratios.dtype).chunk(2)
        losses = (chosen_ratio / chosen_count - rejected_ratio / rejected_count - 1 / (2 * beta)) ** 2
    elif dpo.loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    else:
        losses = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    return PairScores(
        losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), chosen.detach(), rejected.detach()
    )


def score(
    model: torch.nn.Module, logprobs: SequenceLogprobs, batch: Batch, dpo: DpoConfig, live: bool = True
) -> PairScores:
    """The pairs' scores; the reference scored now (`live`) or carried by the batch (`dpo.reference: precomputed`)."""
    reference = reference_logprobs(model, logprobs, batch) if live else None
    policy, counts = logprobs(model, batch)
    if reference is None:
        reference = batch["reference_logps"].to(policy.dtype)
    return pair_scores(policy, reference, counts, dpo)


class PreferenceSums:
    """Sums of the metrics over pairs, on the device (no host sync per micro-batch), all-reduced on `take`."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(2 + len(METRICS), dtype=torch.float64, device=device)

    def add(self, s: PairScores) -> None:
        margins = s.chosen_rewards - s.rejected_rewards
        parts = (
            s.losses.detach(),
            s.chosen_rewards,
            s.rejected_rewards,
            (margins > 0).to(margins.dtype),
            margins,
            s.chosen_logps,
            s.rejected_logps,
        )
        # the pair count filled on the device: a tensor built from a host number would be a copy the host waits for
        pairs = torch.full((), len(s.losses), dtype=torch.float64, device=self.sums.device)
        self.sums += torch.stack([pairs, *(p.double().sum() for p in parts)])

    def take(self, prefix: str = "") -> dict[str, float]:
        """Means over every pair of every rank since the last take: `loss` and TRL's metrics (with `prefix`)."""
        totals = self.sums.clone()
        dist.all_reduce(totals)
        self.sums.zero_()
        pairs = totals[0].item()
        means = [(v / pairs if pairs else math.nan) for v in totals[1:].tolist()]
        return {f"{prefix}{name}": value for name, value in zip(("loss", *METRICS), means, strict=True)}


def step_pairs(group: list[Batch], world_size: int) -> tuple[torch.Tensor, bool]:
    """Pairs in this step over all ranks, divided by the ranks (FSDP averages gradients over them); and whether the
    step can take its reference log-probs from the batches: only when every rank's batches carry all of them (one
    all-reduce for both; reading the second is the step's one host sync, and only with a precomputed reference)."""
    precomputed = "reference_logps" in group[0]
    device = group[0]["input_ids"].device
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    counts[0] = sum(len(b["input_ids"]) // 2 for b in group)
    if precomputed:
        counts[1] = sum(b["reference_missing"] for b in group)
    dist.all_reduce(counts)
    missing = int(counts[1].item()) if precomputed else 0
    if missing:
        log.warning("%d pairs of this step lack a precomputed reference: the step scores the reference live", missing)
    return (counts[0] / world_size).clamp_min(1.0), precomputed and not missing


class PreferenceLoss:
    """A step's loss on pairs (`rayft.train.step.StepLoss`): per micro-batch the reference pass (adapter off, no
    grad; skipped where the batches carry precomputed reference log-probs) and the policy pass over chosen +
    rejected, the loss summed over pairs and divided by the step's pairs per rank; TRL's metrics go to `sums`."""

    def __init__(self, dpo: DpoConfig, sums: PreferenceSums, logprobs: SequenceLogprobs):
        self.dpo, self.sums, self.logprobs = dpo, sums, logprobs

    def for_step(self, group: list[Batch], world_size: int) -> MicroBatchLoss:
        per_rank, carried = step_pairs(group, world_size)

        def micro_batch_loss(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
            scores = score(model, self.logprobs, batch, self.dpo, live=not carried)
            self.sums.add(scores)
            return scores.losses.sum() / per_rank, batch["attention_mask"].sum()

        return micro_batch_loss


def preference_eval(
    model: torch.nn.Module,
    shard: Shard,
    batch_size: int,
    collate: Collate,
    device: torch.device,
    autocast: Autocast = nullcontext,
    *,
    dpo: DpoConfig,
    logprobs: SequenceLogprobs,
) -> dict[str, float]:
    """`eval_loss` and TRL's `eval_rewards/*`, `eval_logps/*`: means over every pair of every rank's shard. For the
    base model alone (no adapter trained yet) policy and reference are the same: rewards 0, loss ln 2 (sigmoid)."""
    sums = PreferenceSums(device)

    def score_pairs(batch: Batch) -> None:
        sums.add(score(model, logprobs, batch, dpo))

    eval_pass(model, shard, batch_size, collate, device, autocast, score_pairs)
    return sums.take(prefix="eval_")
