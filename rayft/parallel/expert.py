"""Expert parallelism: every worker keeps E/k routed experts of each MoE layer resident, tokens travel to them.

A frozen MoE under FSDP alone re-gathers every expert's weights in every forward and backward although each token
uses top_k of E of them. Here the world is a (dp, ep) device mesh of W/k × k workers built from where Ray placed
them (`rayft.parallel.layout`): each ep-group is k workers of one node (whole nodes when k exceeds a node's
workers), so the all-to-all stays on the node's links:
- the routed experts (frozen base, FP8 or not, and their LoRA) are split over `ep`: worker i of a group holds
  experts [i·E/k, (i+1)·E/k) whole and never gathers them; the W/k groups along `dp` hold the same experts;
- everything else (attention, shared expert, router, norms, embeddings, head) is FSDP2 as HSDP within a node:
  sharded over each node's workers, replicated across nodes (whole on each worker with one worker a node);
  FSDP averages its LoRA gradients;
- each MoE layer sends every (token, expert) pair's hidden state to the worker holding the expert (all-to-all with
  the per-expert counts exchanged first, dropless), runs the local experts through their usual grouped-GEMM path
  and sends the outputs back, where the router's weights combine them.

Why the rest is sharded within the node, not over this mesh: FSDP gathers it layer by layer in every forward and
backward, while its gradients cross the replicas once per step, so its shard group belongs where the fast links
are, whatever k is. Sharding over `dp` (the layout of strided ep-groups) would put every gather on the network, as
`dp` takes one worker of every ep-group; sharding over the ep-group would shard it only k ways when k is below a
node's workers, and over the network when k is above. The price: with one worker a node, the rest is whole on each.

The expert LoRA's gradients arrive through the all-to-all's backward already summed over the ep-group's tokens;
`clip_gradients_` averages them as FSDP averages the rest (sum over `dp`, divide by W) and takes the global norm.
Checkpoints and the published adapter hold the expert LoRA in PEFT's own layout and shape (as with k = 1), so a
run resumes with another k and the adapter file is the same either way.

With context parallelism (`rayft.parallel.context`) a rank holds a contiguous slice of each row; the experts act per
token, so the all-to-all sends that slice's tokens as it would whole rows, and no group needs to know the other:
the ep-groups and the context groups are each consecutive node-ordered ranks (the same ranks when k = N). The sums
above stay exact: the step's loss divides each rank's token sum by the whole step's count, so summing the expert
gradients over every rank's tokens (ep-group by the all-to-all, then `dp`) gives the unsplit gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from rayft.config import Config, ConfigError
from rayft.model.families import MOE_BLOCKS, MoeBlock, block_of, moe_blocks, num_routed_experts, unsupported_moe
from rayft.model.fp8 import expert_counts
from rayft.parallel.alltoall import exchange, exchange_counts
from rayft.parallel.tally import TALLY

SUPPORTED_MOE = tuple(MOE_BLOCKS)  # the MoE blocks of `rayft.model.families`: how each is laid out is read there


@dataclass
class ExpertParallel:
    """The layout of one run: k workers share each MoE layer's experts; this worker's place in it."""

    k: int
    num_experts: int
    mesh: DeviceMesh  # (dp, ep): the expert LoRA's in checkpoints
    group: dist.ProcessGroup  # this worker's ep-group (all-to-all)
    dp_group: dist.ProcessGroup | None  # workers holding the same experts; None when W = k
    world: int  # W: every worker of the run

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def local(self) -> int:
        return self.num_experts // self.k

    @property
    def first(self) -> int:
        """Global index of this worker's first expert."""
        return self.rank * self.local

    def route(
        self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, experts: nn.Module
    ) -> torch.Tensor:
        """The routed experts' output for `hidden` [T, H] with the router's top-k `index`/`weights` [T, K]."""
        tokens, top_k = index.shape
        pairs = index.reshape(-1)
        order = torch.argsort(pairs, stable=True)  # by expert, so by owner: each owner's rows are one block
        counts = expert_counts(pairs, self.num_experts)
        received = exchange_counts(counts, self.group)  # [k, E/k]: each source's pairs for each local expert
        per_rank = torch.stack([counts.view(self.k, self.local).sum(1), received.view(self.k, self.local).sum(1)])
        sent, arriving = per_rank.tolist()  # the one host sync: the split sizes of both exchanges
        rows = exchange(hidden[order // top_k], arriving, sent, self.group)
        out = self._local_experts(rows, received, experts)
        back = exchange(out, sent, arriving, self.group)
        per_pair = back[torch.argsort(order)].view(tokens, top_k, -1)
        return (per_pair * weights.unsqueeze(-1).to(per_pair.dtype)).sum(dim=1).to(hidden.dtype)

    def _local_experts(self, rows: torch.Tensor, received: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """Rows (by source worker, then local expert) through the local experts' own forward, weight 1 each.
        A worker no token was routed to runs one zero row: grouped_mm's backward refuses zero rows, and its
        all-to-all backward must run like everyone else's."""
        n = rows.shape[0]
        ids = torch.arange(self.local, device=rows.device).repeat(self.k)
        ids = ids.repeat_interleave(received.reshape(-1), output_size=n)  # n known: no host sync
        if n == 0:
            rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
            ids = ids.new_full((1,), self.local - 1)
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        return cast(torch.Tensor, experts(rows, ids.unsqueeze(-1), ones))[:n]

    # -- gradients -------------------------------------------------------------------------------------------

    def clip_gradients_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Average the expert LoRA gradients as FSDP averages the others, clip all by the global norm; returns
        the norm before clipping (what `clip_grad_norm_` returns for k = 1)."""
        experts = [p for p in expert_params(model) if p.requires_grad]
        ids = {id(p) for p in experts}
        for p in experts:  # an expert no token reached still takes its (zero) gradient, as with k = 1
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = cast(list[torch.Tensor], [p.grad for p in experts])  # each one set above
        if grads:
            torch._foreach_div_(grads, self.world)
            if self.dp_group is not None:
                self._sum_over_dp(grads)
        others = [p.grad for p in model.parameters() if p.requires_grad and id(p) not in ids and p.grad is not None]
        other_sq = _norm(others).to(torch.float64).cpu() ** 2 if others else torch.zeros((), dtype=torch.float64)
        expert_sq = torch.zeros((), dtype=torch.float64)
        if grads:  # the same on every worker: expert LoRA is on or off for all
            expert_sq = _norm(grads).to(torch.float64) ** 2
            dist.all_reduce(expert_sq, group=self.group)  # every worker of the group holds other experts
        total = torch.sqrt(other_sq + expert_sq.cpu())
        coef = min(1.0, max_norm / (total.item() + 1e-6))
        if coef < 1.0:
            for g in [*others, *grads]:
                g.mul_(coef)
        return total.to(torch.float32)

    def _sum_over_dp(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        w = self.world // self.k  # the dp group: one worker of each ep-group
        TALLY.add("all_reduce", flat.numel() * flat.element_size() * 2 * (w - 1) // w, self.dp_group)
        # torch leaves Tensor.split unannotated
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):  # type: ignore[no-untyped-call]
            g.copy_(part.view_as(g))

    # -- the expert LoRA in PEFT's layout: checkpoints and the adapter -----------------------------------------

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Collective over the ep-group: the whole tensor, as PEFT lays it out for E experts, from every worker's
        part. lora_A is [E·r, in] expert-major (a worker's rows are contiguous); lora_B is [out, r·E] with the
        expert as the fastest index, so the parts interleave."""
        parts = [torch.empty_like(local) for _ in range(self.k)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        if ".lora_B." not in name:
            return torch.cat(parts)
        out = local.shape[0]
        return torch.cat([p.view(out, -1, self.local) for p in parts], dim=2).reshape(out, -1)

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This worker's experts' part of a whole PEFT-layout expert LoRA tensor (the inverse of `full`)."""
        if ".lora_B." not in name:
            rank = full.shape[0] // self.num_experts
            return full[self.first * rank : (self.first + self.local) * rank].contiguous()
        out = full.shape[0]
        view = full.reshape(out, -1, self.num_experts)[:, :, self.first : self.first + self.local]
        return view.reshape(out, -1).contiguous()

    def sharded(self, name: str, local: torch.Tensor) -> DTensor:
        """The whole tensor as a DTensor sharded by rows over `ep` (replicated over `dp`): the same key, shape and
        layout a k = 1 (FSDP) checkpoint stores, so DCP reshards between the two."""
        whole = self.full(name, local)
        chunks = whole.chunk(self.k)  # DTensor's Shard(0) split: ceil-sized chunks, the last ones short or empty
        rows = chunks[self.rank] if self.rank < len(chunks) else whole[:0]
        placements = (Replicate(), Shard(0))
        return DTensor.from_local(rows.contiguous(), self.mesh, placements, shape=whole.shape, stride=whole.stride())

    def to_checkpoint(self, state: dict[str, Any]) -> None:
        """Replace, in a `_training_state` dict, the local expert LoRA tensors (and their optimizer moments) with
        their `sharded` form."""
        for name, tensor, put in self._expert_entries(state):
            put(self.sharded(name, tensor))

    def from_checkpoint(self, state: dict[str, Any]) -> None:
        """The inverse of `to_checkpoint` after DCP has filled the sharded tensors."""
        for name, tensor, put in self._expert_entries(state):
            put(self.local_part(name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor))

    def _expert_entries(self, state: dict[str, Any]) -> list[tuple[str, torch.Tensor, Callable[[torch.Tensor], None]]]:
        """(name, tensor, setter) for every expert LoRA tensor of the model and optimizer state."""
        entries = []
        model, optim = state.get("model", {}), state.get("optim", {}).get("state", {})
        for name in sorted(model):
            if is_expert_lora(name):
                entries.append((name, model[name], _setter(model, name)))
        for name in sorted(optim):
            if is_expert_lora(name):
                optim[name] = dict(optim[name])  # it may be the optimizer's own: replace entries in a copy
                for key in sorted(optim[name]):
                    if torch.is_tensor(optim[name][key]) and optim[name][key].ndim:
                        entries.append((name, optim[name][key], _setter(optim[name], key)))
        return entries

    def gather_adapter(self, model: nn.Module, full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Collective: the gathered adapter state dict (rank 0's; the others' are empty under `cpu_offload`) with
        the expert LoRA made whole from every worker's parameters."""
        whole = {}
        for name, param in model.named_parameters():
            if param.requires_grad and is_expert_lora(name):
                whole[name] = self.full(name, param.detach()).cpu()
        if full_state and not whole.keys() <= full_state.keys():
            raise RuntimeError(f"expert LoRA {sorted(whole.keys() - full_state.keys())[:1]} not in the adapter state")
        return {**full_state, **whole} if full_state else {}


def _setter(mapping: dict[str, Any], key: str) -> Callable[[torch.Tensor], None]:
    def put(value: torch.Tensor) -> None:
        mapping[key] = value

    return put


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(tensors)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def is_expert_lora(name: str) -> bool:
    return ".experts." in name and ".lora_" in name


def moe_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in moe_blocks(model) if block_of(m) is not None]


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter (frozen and LoRA) of the routed experts: each worker's own, never FSDP's."""
    return [p for moe in moe_layers(model) for p in cast(nn.Module, moe.experts).parameters()]


def check_experts(k: int, num_experts: int, world: int) -> None:
    """A ConfigError naming the valid k when the experts or the workers do not split into k groups."""
    if num_experts % k == 0 and world % k == 0:
        return
    valid = [d for d in range(1, math.gcd(num_experts, world) + 1) if num_experts % d == 0 and world % d == 0]
    what = f"{num_experts} routed experts" if num_experts % k else f"{world} workers"
    raise ConfigError(f"parallel.expert_parallel {k} does not divide the model's {what}; valid: {valid}")


def check_expert_parallel(cfg: Config, config: Any, k: int | None = None) -> None:
    """`parallel.expert_parallel` k > 1 against the model: routed experts that split into k groups (ConfigError
    naming the valid k), before any worker starts. `k`: the degree decided for `auto` (else the config's)."""
    k = cfg.parallel.expert_groups() if k is None else k
    if k == 1:
        return
    experts = num_routed_experts(config)
    if not experts:
        raise ConfigError(f"parallel.expert_parallel {k}: the model ({config.model_type}) has no routed experts; use 1")
    check_experts(k, experts, cfg.ray.num_workers)


def routed_experts(k: int, world: int, config: Any) -> int:
    """The model's routed experts per MoE layer, checked to split over k of `world` workers (ConfigError)."""
    experts = num_routed_experts(config)
    if not experts:
        raise ConfigError(f"parallel.expert_parallel {k}: the model ({config.model_type}) has no routed experts")
    check_experts(k, experts, world)
    return experts


class ExpertParallelMoE(nn.Module):
    """Mixin put in front of a supported MoE block's class: the same computation with the routed experts
    (E/k of them here) reached through `ExpertParallel.route`; `family` says where the block keeps its router,
    shared expert and jitter, and what it returns."""

    ep: ExpertParallel
    family: MoeBlock
    experts: nn.Module  # the block's own routed experts

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        family, shape = self.family, hidden_states.shape
        residuals = hidden_states
        jitter = getattr(self, family.jitter, 0.0) if family.jitter else 0.0
        if self.training and jitter > 0:  # the block's own draw, from the same generator
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)
        flat = hidden_states.view(-1, shape[-1])
        _, weights, index = getattr(self, family.router)(flat)
        out = self.ep.route(flat, index, weights, self.experts).view(*shape)
        if family.shared is not None:
            out = out + getattr(self, family.shared)(residuals)
        return (out, weights) if family.returns_router_weights else out


def split_experts_(model: nn.Module, ep: ExpertParallel) -> int:
    """On the weightless (meta) model, after FP8 and LoRA, before FSDP: every supported MoE block keeps E/k experts
    (frozen storage, FP8 scales, expert LoRA factors) and routes through `ep`. Cutting after PEFT has wrapped the
    experts makes PEFT create (and draw the random numbers for) the same adapters as with k = 1, so the adapter
    starts the same. Returns the blocks changed; ConfigError when the model has MoE blocks of another kind."""
    others = unsupported_moe(model)
    if others:
        raise ConfigError(
            f"parallel.expert_parallel: {', '.join(others)} blocks are not supported (only {', '.join(SUPPORTED_MOE)})"
        )
    blocks = moe_layers(model)
    for moe in blocks:
        _cut_experts_(cast(nn.Module, moe.experts), ep)
        cls = type(moe)
        moe.__class__ = type(f"ExpertParallel{cls.__name__}", (ExpertParallelMoE, cls), {"family": block_of(moe)})
        cast(ExpertParallelMoE, moe).ep = ep
    return len(blocks)


def _cut_experts_(experts: nn.Module, ep: ExpertParallel) -> None:
    """Keep E/k experts: every [E, ...] parameter of the base experts module, and each PEFT expert-LoRA wrapper's
    factors ([E·r, in] and [out, E·r]) and expert count. Meta tensors: nothing is allocated or drawn."""
    wrappers: list[Any] = []  # PEFT's ParamWrappers: their factors sit in ModuleDicts, typed as plain modules
    base = experts
    while hasattr(base, "base_layer"):
        wrappers.append(base)
        base = cast(nn.Module, base.base_layer)
    for name, param in list(base.named_parameters(recurse=False)):
        if param.shape and param.shape[0] == ep.num_experts:
            local = torch.empty((ep.local, *param.shape[1:]), dtype=param.dtype, device="meta")
            setattr(base, name, nn.Parameter(local, requires_grad=param.requires_grad))
    # Plain attributes: the ignores because nn.Module.__setattr__'s hint names only tensors and modules.
    base.num_experts = ep.local  # type: ignore[assignment]
    # the rows of the checkpoint's [E, ...] tensors it reads
    base.ep_rows = (ep.first, ep.local, ep.num_experts)  # type: ignore[assignment]
    for wrapper in wrappers:
        wrapper.num_experts = ep.local
        for adapter in list(wrapper.lora_A):
            a, b = wrapper.lora_A[adapter], wrapper.lora_B[adapter]
            rank = a.out_features // ep.num_experts
            wrapper.lora_A[adapter] = _linear(a.in_features, rank * ep.local, a)
            wrapper.lora_B[adapter] = _linear(rank * ep.local, b.out_features, b)


def _linear(in_features: int, out_features: int, like: nn.Linear) -> nn.Linear:
    return nn.Linear(
        in_features, out_features, bias=like.bias is not None, device="meta", dtype=like.weight.dtype
    ).requires_grad_(like.weight.requires_grad)
