"""What a run optimises (`train.objective`), as registered specs: each objective gives the batches' collate, the
loss a step minimises (computed outside the model's forward, from what the model's own call returns), its
evaluation and the metrics it adds to the logging window. The step itself is one for all
(`rayft.train.step.train_step`); a new objective is a class here and an entry in `OBJECTIVES`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

from rayft.config import Config
from rayft.model.build import fused_loss
from rayft.model.loss import CausalLMLoss
from rayft.train import dpo, sinks
from rayft.train.metrics import perplexity
from rayft.train.step import NextTokenLoss, StepLoss, mean_eval_loss

if TYPE_CHECKING:
    import peft
    from ray.data.collate_fn import NumpyBatchCollateFn

    from rayft.train.runtime import Collate, Shard
    from rayft.train.step import Autocast

log = logging.getLogger(__name__)


class Objective(Protocol):
    """A run's objective, built once per worker for its model."""

    loss: StepLoss  # what `train_step` minimises
    precomputed: bool  # its reference is scored once before the first step (`rayft.train.reference`)
    gauges: dict[str, str] | None  # the gauges it adds to the Ray dashboard, with their help (`rayft.train.sinks`)

    def collate(self, pad_id: int, **options: Any) -> NumpyBatchCollateFn:
        """The batches it trains and evaluates on, from the configured data settings."""
        ...

    def evaluate(
        self, shard: Shard, batch_size: int, collate: Collate, device: torch.device, autocast: Autocast
    ) -> dict[str, Any]:
        """Its eval metrics (`eval_loss` first) over every rank's validation shard."""
        ...

    def window_metrics(self) -> dict[str, Any]:
        """What it measured over the logging window beside the loss (the window itself gives the loss)."""
        ...


class NextTokenObjective:
    """Supervised fine-tuning (`sft`): the next-token loss over the target tokens, fused with the LM head where the
    model allows (`rayft.model.build.fused_loss`)."""

    precomputed: bool = False
    gauges: dict[str, str] | None = None

    def __init__(self, cfg: Config, model: nn.Module, device: torch.device) -> None:
        self.cfg, self.model = cfg, model
        not_fused = fused_loss(cast("peft.PeftModel", model), cfg)
        log.info("loss: %s", f"from full logits ({not_fused})" if not_fused else "fused with the LM head, chunked")
        self.causal_lm_loss = CausalLMLoss(fused=not_fused is None)
        self.loss: StepLoss = NextTokenLoss(self.causal_lm_loss)

    def collate(self, pad_id: int, **options: Any) -> NumpyBatchCollateFn:
        from rayft.data.pipeline import collate_fn  # here: Ray Data's, which a step timed without Ray never needs

        return collate_fn(self.cfg.data, pad_id, **options)

    def evaluate(
        self, shard: Shard, batch_size: int, collate: Collate, device: torch.device, autocast: Autocast
    ) -> dict[str, Any]:
        loss = mean_eval_loss(self.model, self.causal_lm_loss, shard, batch_size, collate, device, autocast)
        return {"eval_loss": loss, "eval_perplexity": perplexity(loss)}

    def window_metrics(self) -> dict[str, Any]:
        return {}


class PreferenceObjective:
    """Preference tuning (`dpo`, `rayft.train.dpo`): a preference loss on chosen/rejected pairs against the
    reference (the base model: the adapter off), scored live or precomputed once (`dpo.reference`), with TRL's
    reward metrics."""

    gauges: dict[str, str] | None = sinks.PREFERENCE_GAUGES

    def __init__(self, cfg: Config, model: nn.Module, device: torch.device) -> None:
        self.cfg, self.model = cfg, model
        self.precomputed = cfg.dpo.reference == "precomputed"
        self.logprobs = dpo.SequenceLogprobs(model)
        fused = "fused with the LM head, chunked" if self.logprobs.fused else "from full logits"
        log.info("loss: %s preference loss; sequence log-probs %s", cfg.dpo.loss_type, fused)
        self.sums = dpo.PreferenceSums(device)
        self.loss: StepLoss = dpo.PreferenceLoss(cfg.dpo, self.sums, self.logprobs)

    def collate(self, pad_id: int, **options: Any) -> NumpyBatchCollateFn:
        from rayft.data.pipeline import collate_fn  # here: Ray Data's, which a step timed without Ray never needs

        return collate_fn(self.cfg.data, pad_id, pairs=True, **options)

    def evaluate(
        self, shard: Shard, batch_size: int, collate: Collate, device: torch.device, autocast: Autocast
    ) -> dict[str, Any]:
        return dpo.preference_eval(
            self.model, shard, batch_size, collate, device, autocast, dpo=self.cfg.dpo, logprobs=self.logprobs
        )

    def window_metrics(self) -> dict[str, Any]:
        return {k: v for k, v in self.sums.take().items() if k != "loss"}


OBJECTIVES: dict[str, Callable[[Config, nn.Module, torch.device], Objective]] = {
    "sft": NextTokenObjective,
    "dpo": PreferenceObjective,
}


def build_objective(cfg: Config, model: nn.Module, device: torch.device) -> Objective:
    """The objective `train.objective` names, for this worker's model."""
    return OBJECTIVES[cfg.train.objective](cfg, model, device)
