"""The order a model is made ready to train, in one place: weightless (or loaded) base → FP8 storage of the frozen
matrices → activation checkpointing → LoRA → expert parallelism → FSDP2 → each rank's own shards read from disk.

Each step needs the one before: PEFT wraps the FP8 layers, so they are swapped in first; checkpointing is set on the
base model so adapter keys stay PEFT's; expert parallelism cuts the experts once LoRA is on them; FSDP shards what
is left; the weights are read last, into the sharded parameters. The pieces live with what they act on
(`rayft.model`, `rayft.parallel.expert`); the FSDP2 wrapping and its per-step switches live here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, cast

import peft
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from rayft.config import Config, FsdpConfig
from rayft.decisions import Decisions
from rayft.model.build import (
    attention_model_config,
    check_quantised_storage,
    decoder_layers,
    empty_model,
    frozen_fp8,
    load_base_model,
)
from rayft.model.fp8 import adopt_lora_, set_fp8_compute_, to_fp8_
from rayft.model.fp8_format import weight_block
from rayft.model.fp8_matmul import fp8_compute_on
from rayft.model.lora import apply_lora
from rayft.model.nf4 import to_nf4_
from rayft.model.vision import vision_blocks
from rayft.model.weights import buffers_kept, load_sharded_
from rayft.parallel.alltoall import checkpoint_context
from rayft.parallel.expert import ExpertParallel, expert_params, split_experts_
from rayft.parallel.layout import ParallelDims, parallel_dims
from rayft.parallel.torch_compat import allow_integer_parameters, check_torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("rayft")


def build_model(
    cfg: Config,
    on_gpu: bool,
    device: torch.device | None = None,
    dims: ParallelDims | None = None,
    base: PreTrainedModel | None = None,
    decisions: Decisions | None = None,
) -> peft.PeftModel:
    """`sharded`: weightless init → LoRA → fully_shard → each rank reads its own shards from disk.
    `full`: every rank loads the whole model with `from_pretrained` first (reference path, needs RAM for it all).
    `dims`: the run's layout on its workers, made at set-up; without it, made here from `cfg` (a collective); it
    keeps the expert and context parallelism made here. `decisions`: what the driver decided for the config's
    `auto` settings (the layout's k, the recompute); without them, the config's own.
    `base`: a base model already holding its weights where it trains (`rayft.model.build.random_model`, for timing
    steps without checkpoint files): it goes through the same steps, and nothing is read from disk."""
    check_torch()  # a worker's torch is its node image's, which the driver's validation never saw
    sharded = base is None and cfg.model.load_mode == "sharded"
    decisions = decisions or Decisions.of(cfg)
    dims = dims or parallel_dims(cfg, "cuda" if on_gpu else "cpu", decisions=decisions)
    model: PreTrainedModel | peft.PeftModel  # the base model, then PEFT's around it
    if base is None:
        model_cfg, attention = attention_model_config(cfg, on_gpu)
        (log.warning if attention.loud else log.info)("attention: %s", attention.line())
        base = empty_model(model_cfg) if sharded else load_base_model(model_cfg)
    model = base
    if dims.context > 1:  # before activation checkpointing and LoRA wrap the attention modules
        dims.split_sequences(model)
    # k > 1: the layout's meshes and groups; k = 1: FSDP over every expert, as without the setting.
    # `split_experts_` cuts the model to this worker's experts once LoRA is on.
    ep = dims.split_experts(model.config) if dims.experts > 1 else None
    fp8 = frozen_fp8(cfg.model)
    check_quantised_storage(cfg, model, fp8)
    # before LoRA and FSDP: PEFT wraps these layers, FSDP shards their bytes
    quantize_frozen_base_(cfg, model, fp8, device or torch.device("cuda" if on_gpu else "cpu"))
    enable_recompute(decisions.recompute_every, model, ep)
    model = apply_lora(model, cfg.lora)
    if fp8 or cfg.model.frozen_dtype == "nf4":
        adopt_lora_(model)
    if ep is None:
        apply_fsdp(model, cfg.fsdp, mixed_precision(cfg, on_gpu), dims, unsharded_storage(model, cfg.fsdp, dims))
    else:
        blocks = split_experts_(model, ep)
        log.info(
            "expert parallel: %d MoE layers, %d of %d experts each on this worker (experts %d-%d), %d-way",
            blocks,
            ep.local,
            ep.num_experts,
            ep.first,
            ep.first + ep.local - 1,
            ep.k,
        )
        # The rest: HSDP within each node (`rayft.parallel.expert` says why), whatever k is.
        ignored = set(expert_params(model)) | unsharded_storage(model, cfg.fsdp, dims)
        apply_fsdp(model, cfg.fsdp, mixed_precision(cfg, on_gpu), dims, ignored)
    log.info("layout: %s", layout_line(dims))
    if sharded:
        with buffers_kept(model):
            model.to_empty(device=materialization_device(cfg.fsdp, device))
        load_sharded_(model, Path(cfg.model.model_name_or_path))
    return model


def enable_recompute(every: int | None, model: PreTrainedModel, ep: ExpertParallel | None) -> None:
    """Activation checkpointing as decided (`Decisions.recompute_every`): every n-th decoder layer (selective) or
    all of them, or none. HF's per-layer checkpointing keeps module names intact, so adapter keys stay
    PEFT-standard. With expert parallelism the recompute reuses the saved all-to-all outputs instead of exchanging
    again."""
    if every is None:
        return
    kwargs = {"use_reentrant": False} if ep is None else {"use_reentrant": False, "context_fn": checkpoint_context}
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every)


def quantize_frozen_base_(cfg: Config, model: PreTrainedModel, fp8: bool, device: torch.device) -> None:
    """The decoder's frozen matrices in the storage `model.frozen_dtype` asks for: FP8 (a block-wise checkpoint's
    scales kept as they are; multiplied on their bytes on `device` as `model.fp8_compute` says) or NF4; otherwise
    left as loaded."""
    if fp8:
        block = weight_block(Path(cfg.model.model_name_or_path))  # block-wise scales are kept as they are
        swapped = to_fp8_(decoder_layers(model), model.dtype, block[1] if block else None)
        compute = fp8_compute_on(cfg.model.fp8_compute, device)
        set_fp8_compute_(model, compute)
        log.info(
            "frozen base: %d decoder matrices stored as FP8 E4M3 + fp32 row scales (model.frozen_dtype %s), "
            "multiplied %s (model.fp8_compute %s)",
            swapped,
            cfg.model.frozen_dtype,
            "as FP8 on their bytes" if compute else "dequantised",
            cfg.model.fp8_compute,
        )
    elif cfg.model.frozen_dtype == "nf4":
        swapped, kept = to_nf4_(decoder_layers(model), model.dtype)
        log.info(
            "frozen base: %d decoder linears and expert stacks stored as NF4 with double-quantised scales (%d of a"
            " shape NF4 cannot block stay %s)",
            swapped,
            kept,
            model.dtype,
        )


def layout_line(dims: ParallelDims) -> str:
    """The ranks of every FSDP shard group and expert-parallel group, read from the meshes the model was built on
    (a shard group: a row of the (replicate, shard) mesh; every rank for FSDP without a mesh)."""
    mesh = dims.fsdp_mesh()
    shards = mesh.mesh.tolist() if mesh is not None else [list(range(dims.world))]
    experts = f", expert-parallel groups {dims.expert_mesh().mesh.tolist()}" if dims.experts > 1 else ""
    return f"FSDP shard groups {shards}{experts}"


def materialization_device(fsdp: FsdpConfig, device: torch.device | None) -> torch.device:
    """Where the sharded parameters are created: the training device, except with `fsdp.cpu_offload`, where FSDP2
    keeps the shards in host memory (it copies each unit to the GPU for its forward and backward) and refuses
    parameters that live anywhere else."""
    if fsdp.cpu_offload or device is None:
        return torch.device("cpu")
    return device


def mixed_precision(cfg: Config, on_gpu: bool) -> MixedPrecisionPolicy:
    if cfg.fsdp.param_dtype == "auto":
        param_dtype = torch.bfloat16 if (on_gpu and cfg.train.bf16) else torch.float32
    else:
        param_dtype = getattr(torch, cfg.fsdp.param_dtype)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=getattr(torch, cfg.fsdp.reduce_dtype))


def apply_fsdp(
    model: nn.Module,
    fsdp: FsdpConfig,
    mp_policy: MixedPrecisionPolicy,
    dims: ParallelDims,
    ignored: set[nn.Parameter] | None = None,
) -> None:
    """Shard every decoder layer as its own FSDP unit (and each block of a vision-language model's tower), then the
    root (embeddings, final norm, LM head), over the layout's shard groups (`ParallelDims.fsdp_mesh`). `ignored`: what
    FSDP leaves alone: under expert parallelism, the experts; on a one-rank shard group, the quantised base's storage
    (`unsharded_storage`)."""
    # Pinned host memory (fast copies to the GPU) needs an accelerator; a CPU run has nothing to offload to anyway.
    offload = CPUOffloadPolicy(pin_memory=dims.device_type != "cpu") if fsdp.cpu_offload else OffloadPolicy()
    allow_integer_parameters()  # the FP8 base's bytes, on a torch whose FSDP2 cannot hold them yet
    mesh = dims.fsdp_mesh()
    reshard = fsdp.reshards()
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp_policy,
            # The last layer's backward comes right after its forward: keep it gathered (as torchtitan does).
            reshard_after_forward=reshard and i < len(layers) - 1,
            offload_policy=offload,
            ignored_params=ignored,
        )
    for block in vision_blocks(model):  # a vision-language model's frozen tower, block by block
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, offload_policy=offload, ignored_params=ignored)
    # The root's weights are needed again right at the start of backward: keep them gathered.
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=mp_policy,
        reshard_after_forward=False,
        offload_policy=offload,
        ignored_params=ignored,
    )
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    if not any(p.requires_grad for p in model.parameters() if id(p) not in in_layers):
        # Frozen embeddings + LM head never change: gathered once, not again for every micro-batch.
        cast(FSDPModule, model).set_reshard_after_backward(False, recurse=False)
    units = cast(list[FSDPModule], layers)  # the layers as fully_shard left them
    for i, unit in enumerate(units):
        if fsdp.forward_prefetch:
            ahead = units[i + 1 : i + 1 + fsdp.forward_prefetch]
            if ahead:
                unit.set_modules_to_forward_prefetch(ahead)
        if fsdp.backward_prefetch:
            behind = units[max(0, i - fsdp.backward_prefetch) : i][::-1]
            if behind:
                unit.set_modules_to_backward_prefetch(behind)


def unsharded_storage(model: nn.Module, fsdp: FsdpConfig, dims: ParallelDims) -> set[nn.Parameter]:
    """On a one-rank shard group (`fsdp.shard_size: 1`, or a single worker): the quantised base's storage (frozen,
    non-floating parameters: FP8 or NF4 bytes and their integer-held scales), which FSDP is to leave alone. FSDP2
    "gathers" a unit over one rank by copying every parameter into its unsharded storage, at every forward and
    backward: for the storage, a copy of each layer's quantised weights per pass that buys nothing (mixed precision
    never casts it, and it has no gradient). Left alone it stays where it was loaded, whole on every rank, as FSDP
    would hold it. With `fsdp.cpu_offload` FSDP keeps it in host memory and copies it to the GPU per unit, which is
    the point there: it stays FSDP's."""
    if dims.shard != 1 or fsdp.cpu_offload:
        return set()
    return {p for p in model.parameters() if not p.requires_grad and not p.is_floating_point()}


def reshard_all(model: nn.Module) -> None:
    """After a forward no backward follows (evaluation, reference scoring): free the weights FSDP keeps gathered
    after forward for the backward it expects, the root's and the last decoder layer's."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def set_gradient_sync(model: FSDPModule, sync: bool, kept_layers: list[nn.Module]) -> None:
    """Between the micro-batches of a step: no gradient reduction; and `kept_layers`, those that stay gathered after
    forward (`fsdp.reshards` false), stay gathered after backward too, since no weight changes before the optimizer
    step: one gather per step instead of one per micro-batch."""
    model.set_requires_gradient_sync(sync)
    for layer in kept_layers:
        cast(FSDPModule, layer).set_reshard_after_backward(sync, recurse=False)  # an FSDP unit since `apply_fsdp`
