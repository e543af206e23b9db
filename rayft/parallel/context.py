"""Context parallelism, Ulysses-style: one sequence split over the N ranks of a group, attention run on the whole
sequence for H/N of the heads.

Each rank holds a contiguous 1/N of every row (its tokens, their position ids, their targets). Everything but
attention is per token, so it runs on the shard unchanged: the projections, the MLP and the experts, the norms, and
RoPE (YaRN too), which reads each token's own position id. Around attention, one all-to-all turns q, k and v from
(b, H, s/N, d) into (b, H/N, s, d), the chosen kernel runs on the whole sequence with the whole sequence's mask, and
a second all-to-all turns the output back. Why heads rather than a ring over the sequence: the kernel sees the full
sequence, so any kernel transformers has (SDPA, eager) serves, with the document mask of packed rows as transformers
builds it at N = 1, and MLA's different q/k and v head sizes need nothing of their own; a ring needs a kernel that
returns its log-sum-exp and load-balanced causal chunks.

GQA: when the kv heads do not divide N, k and v are repeated by the least factor that makes them divide it (the
query heads always divide N: `check_heads` refuses the rest, in preflight), so each rank's query heads find their
own kv heads.

A single packed row (what padding-free collation makes) runs SDPA causally on each document in turn, with no mask
at all, as a varlen kernel would: the whole row's dense s × s document mask would otherwise be the same on every
rank, the one activation N does not divide. Several rows, and eager, take transformers' mask of the whole rows.

The shard travels with the micro-batch as the model call's `context_parallel` keyword, which transformers hands down
to every attention call (and again in the recompute of a checkpointed layer): no global state.
"""

from __future__ import annotations

import copy
import itertools
import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rayft.config import ConfigError
from rayft.model.loss import IGNORE_INDEX, next_token_targets
from rayft.parallel.alltoall import exchange

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedConfig, PreTrainedModel

NAME = "rayft_ulysses"  # the attention implementation a context-parallel model is set to
KERNELS = ("sdpa", "eager")  # inner kernels this has been checked with
SHARDED = ("input_ids", "labels", "position_ids")  # per-token columns of a micro-batch that each rank slices


@dataclass(eq=False)
class SequenceShard:
    """What attention needs beyond its rank's tokens: the group, the whole rows' position ids (the document mask
    comes from them) and the inner kernel; the whole sequence's mask is built once, at the first layer."""

    group: dist.ProcessGroup
    ranks: int  # N: the group's ranks
    position_ids: torch.Tensor  # (b, s): the whole rows'
    kernel: str
    masks: dict[int | str, Any] = field(default_factory=dict)  # built on first use, kept for the other layers

    def documents(self) -> list[tuple[int, int]] | None:
        """[start, end) of each document of a single packed row (a position id 0 starts one); None for several rows,
        whose documents need not line up."""
        if self.position_ids.shape[0] != 1:
            return None
        if "documents" not in self.masks:
            starts = [*(self.position_ids[0] == 0).nonzero()[:, 0].tolist(), self.position_ids.shape[-1]]
            starts = starts if starts[0] == 0 else [0, *starts]
            self.masks["documents"] = list(itertools.pairwise(starts))
        return cast("list[tuple[int, int]]", self.masks["documents"])

    def mask(self, module: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> Any:
        """The whole sequence's mask as transformers builds it for `kernel` at N = 1 (None: plainly causal)."""
        from transformers.masking_utils import create_causal_mask

        own = cast("PreTrainedConfig", module.config)
        if id(own) not in self.masks:
            config = copy.copy(own)
            config._attn_implementation_internal = self.kernel  # a copy: the model keeps its own setting
            positions = self.position_ids.to(device)  # collated on the host; a mask per micro-batch, not per layer
            shape_only = torch.empty(*positions.shape, 0, dtype=dtype, device=device)
            self.masks[id(own)] = create_causal_mask(config, shape_only, None, None, positions)
        return self.masks[id(own)]


def _padded(batch: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """Rows lengthened to a multiple of N by a padding document: positions from 0 (so no real token attends to it
    and it to none of them, as a document of its own), no targets, token id 0."""
    pad = -batch["input_ids"].shape[-1] % n
    if not pad:
        return batch
    tail = torch.arange(pad, device=batch["position_ids"].device).expand(*batch["position_ids"].shape[:-1], pad)
    fill = {"input_ids": 0, "labels": IGNORE_INDEX}
    out = {k: F.pad(v, (0, pad), value=fill[k]) if k in fill else v for k, v in batch.items()}
    out["position_ids"] = torch.cat([batch["position_ids"], tail], dim=-1)
    return out


def shard_batch(batch: dict[str, torch.Tensor], group: dist.ProcessGroup, n: int, kernel: str) -> dict[str, Any]:
    """This rank's contiguous 1/N of every row of a padding-free micro-batch (`group`: the N ranks of the
    sequence), with `shift_labels` (the next-token targets taken on the whole row, so the target of a shard's last
    token, the next shard's first label, is not lost) and the `SequenceShard` for attention."""
    if "position_ids" not in batch:
        raise ValueError("parallel.context_parallel > 1 needs padding-free rows (position_ids); this batch has none")
    rank = dist.get_rank(group)
    batch = _padded(batch, n)
    length = batch["input_ids"].shape[-1]
    part = slice(rank * length // n, (rank + 1) * length // n)
    shifted = next_token_targets(batch["labels"])
    out: dict[str, Any] = {k: v[..., part].contiguous() if k in SHARDED else v for k, v in batch.items()}
    out["shift_labels"] = shifted[..., part].contiguous()
    out["context_parallel"] = SequenceShard(group, n, batch["position_ids"], kernel)
    return out


def _to_heads(x: torch.Tensor, n: int, group: dist.ProcessGroup) -> torch.Tensor:
    """(b, h, s/N, d), this rank's tokens of every head → (b, h/N, s, d), every token of this rank's heads."""
    b, h, s_local, d = x.shape
    chunks = x.reshape(b, n, h // n, s_local, d).transpose(0, 1).contiguous()
    got = exchange(chunks, [1] * n, [1] * n, group)  # chunk r: rank r's tokens of this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s_local, d)


def _to_tokens(x: torch.Tensor, n: int, group: dist.ProcessGroup) -> torch.Tensor:
    """(b, s, h/N, d), the kernel's output layout → (b, s/N, h, d): this rank's tokens of every head."""
    b, s, h_local, d = x.shape
    chunks = x.reshape(b, n, s // n, h_local, d).transpose(0, 1).contiguous()
    got = exchange(chunks, [1] * n, [1] * n, group)  # chunk r: this rank's tokens of rank r's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h_local, d)


def _kv_repeat(kv_heads: int, n: int) -> int:
    """The least factor by which to repeat the kv heads so that N divides them (1 when it already does)."""
    return n // math.gcd(kv_heads, n)


class _Groups:
    """The attention module as the kernel sees it, with the kv grouping left after k and v were repeated."""

    def __init__(self, module: torch.nn.Module, groups: int) -> None:
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _eager(module: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The eager attention of the module's own family (its modeling file's, with whatever that adds: soft-capping,
    sinks), as transformers calls it for `eager`."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    family = sys.modules[type(module).__module__]
    return cast(
        "Callable[..., tuple[torch.Tensor, Any]]", getattr(family, "eager_attention_forward", eager_attention_forward)
    )


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An attention function for transformers' `AttentionInterface`: heads exchanged for tokens, the inner kernel
    on the whole sequence, tokens exchanged back. The model's own (shard-sized) `attention_mask` is not used."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    shard = cast(SequenceShard, kwargs.pop("context_parallel"))
    kwargs.pop("position_ids", None)  # the shard's: no inner kernel here reads them (a flash kernel would)
    n, group = shard.ranks, shard.group
    repeat = _kv_repeat(key.shape[1], n)
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    groups = query.shape[1] // key.shape[1]
    q, k, v = (_to_heads(t, n, group) for t in (query, key, value))
    view = cast(torch.nn.Module, _Groups(module, groups))
    documents = shard.documents() if shard.kernel == "sdpa" else None
    if documents is not None:  # SDPA causal on each document: no s × s mask, as a varlen kernel
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        parts = [sdpa(view, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None, **kwargs)[0] for a, b in documents]
        return _to_tokens(torch.cat(parts, dim=1), n, group), None
    inner = _eager(module) if shard.kernel == "eager" else ALL_ATTENTION_FUNCTIONS[shard.kernel]
    out, _ = inner(view, q, k, v, shard.mask(module, query.dtype, query.device), **kwargs)
    return _to_tokens(out, n, group), None


@dataclass(frozen=True)
class ContextParallel:
    """A worker's context-parallel setting: its group of N ranks, the kernel run inside, and its data-parallel place
    (the group's index among the groups, and their count): every rank of a group reads the same rows."""

    group: dist.ProcessGroup
    ranks: int
    kernel: str
    data_rank: int
    data_ranks: int

    def collate(self, collate: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`collate`, then this rank's shard of the micro-batch."""
        return lambda rows: shard_batch(collate(rows), self.group, self.ranks, self.kernel)


def enable_context_parallel(
    model: PreTrainedModel, n: int, group: dist.ProcessGroup, place: tuple[int, int]
) -> ContextParallel:
    """The model's attention switched to `NAME` around the kernel it was built with (sdpa when that one reads
    the shard's position ids itself: a flash kernel), over this worker's `group` of `n` ranks, whose data-parallel
    `place` is (the group's index, the groups) (`rayft.parallel.layout` holds what this returns)."""
    check_heads(model.config, n)
    built = model.config._attn_implementation
    context = ContextParallel(group, n, built if built in KERNELS else "sdpa", *place)
    register()
    model.set_attn_implementation(NAME)
    return context


def register() -> None:
    """Make `NAME` an attention implementation transformers accepts (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, ulysses_attention)


def check_heads(config: PreTrainedConfig, n: int) -> None:
    """ConfigError when N ranks cannot split the model's query heads (each attends with H/N of them), naming the
    valid N; the kv heads are repeated where they do not divide N (`_kv_repeat`)."""
    heads = config.get_text_config().num_attention_heads
    if n > 1 and heads % n:
        valid = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ConfigError(
            f"parallel.context_parallel {n} must divide the model's {heads} attention heads (each rank attends "
            f"with heads/N of them); valid: {valid}"
        )
