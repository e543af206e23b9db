"""The model each worker trains: causal LM → PEFT LoRA → FSDP2 (`fully_shard` per decoder layer, then the root)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path

import peft
import torch
import torch.distributed as dist
import transformers
from accelerate import init_empty_weights
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from rayft.config import DORA_ON_FP8, Config, ConfigError, FsdpConfig, ModelConfig
from rayft.model.fp8 import adopt_lora_, to_fp8_
from rayft.model.lora import LoraTargets, apply_lora, modules_to_save, wrap
from rayft.model.loss import fuse_loss
from rayft.model.weights import buffers_kept, load_sharded_, tie_weights_
from rayft.parallel.alltoall import checkpoint_context
from rayft.parallel.expert import ExpertParallel, expert_parallel, expert_params, split_experts_

log = logging.getLogger("rayft")


def build_model(cfg: Config, on_gpu: bool, device: torch.device | None = None) -> peft.PeftModel:
    """`sharded`: weightless init → LoRA → fully_shard → each rank reads its own shards from disk.
    `full`: every rank loads the whole model with `from_pretrained` first (reference path, needs RAM for it all)."""
    sharded = cfg.model.load_mode == "sharded"
    model = empty_model(cfg.model) if sharded else load_base_model(cfg.model)
    ep = _expert_parallel(cfg, model, on_gpu)
    fp8 = frozen_fp8(cfg.model)
    check_fp8_storage(cfg, model, fp8)
    if fp8:  # before LoRA and FSDP: PEFT wraps the FP8 layers, FSDP shards their bytes
        swapped = to_fp8_(decoder_layers(model), model.dtype)
        log.info("frozen base: %d decoder matrices stored as FP8 E4M3 + fp32 row scales (model.frozen_dtype %s)",
                 swapped, cfg.model.frozen_dtype)  # fmt: skip
    if cfg.fsdp.activation_checkpointing or cfg.train.gradient_checkpointing:
        # HF's per-layer checkpointing keeps module names intact, so adapter keys stay PEFT-standard. With expert
        # parallelism the recompute reuses the saved all-to-all outputs instead of exchanging again.
        kwargs = {"use_reentrant": False} if ep is None else {"use_reentrant": False, "context_fn": checkpoint_context}
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    model = apply_lora(model, cfg.lora)
    if fp8:
        adopt_lora_(model)
    if ep is None:
        apply_fsdp(model, cfg.fsdp, mixed_precision(cfg, on_gpu), "cuda" if on_gpu else "cpu")
    else:
        blocks = split_experts_(model, ep)
        log.info("expert parallel: %d MoE layers, %d of %d experts each on this worker (experts %d-%d), %d-way",
                 blocks, ep.local, ep.num_experts, ep.first, ep.first + ep.local - 1, ep.k)  # fmt: skip
        model.expert_parallel = ep  # checkpoints, the adapter and the gradient step read the layout from here
        ignored = set(expert_params(model))
        apply_fsdp(model, cfg.fsdp, mixed_precision(cfg, on_gpu), "cuda" if on_gpu else "cpu", ep.mesh, ignored)
    if sharded:
        with buffers_kept(model):
            model.to_empty(device=materialization_device(cfg.fsdp, device))
        load_sharded_(model, Path(cfg.model.model_name_or_path))
    return model


def _expert_parallel(cfg: Config, model: PreTrainedModel, on_gpu: bool) -> ExpertParallel | None:
    """`parallel.expert_parallel` k > 1: the layout (mesh, groups); None for k = 1 (FSDP over every expert, as
    without the setting). `split_experts_` cuts the model to this worker's experts once LoRA is on."""
    k = cfg.parallel.expert_groups()
    if k == 1:
        return None
    return expert_parallel(k, model.config, "cuda" if on_gpu else "cpu")


def materialization_device(fsdp: FsdpConfig, device: torch.device | None) -> torch.device:
    """Where the sharded parameters are created: the training device, except with `fsdp.cpu_offload`, where FSDP2
    keeps the shards in host memory (it copies each unit to the GPU for its forward and backward) and refuses
    parameters that live anywhere else."""
    if fsdp.cpu_offload or device is None:
        return torch.device("cpu")
    return device


def fused_loss(model: peft.PeftModel, cfg: Config) -> str | None:
    """Take the loss from the hidden states in chunks (`rayft.model.loss`); returns why not, or None if it does."""
    if not cfg.train.fused_loss:
        return "train.fused_loss is false"
    return fuse_loss(model.get_base_model())


def text_config(model_dir: str) -> PretrainedConfig:
    """The causal LM's config; for a vision+text wrapper (Mistral3, llava) its `text_config` — the vision tower
    is never built. The checkpoint's quantization_config is dropped: rayft dequantises while loading."""
    config = AutoConfig.from_pretrained(model_dir)
    inner = getattr(config, "text_config", None)
    if inner is not None and type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        config = inner
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    return config


def frozen_fp8(model_cfg: ModelConfig, checkpoint_fp8: bool | None = None) -> bool:
    """Whether the frozen decoder matrices are kept in FP8 (`model.frozen_dtype`; `auto`: when the checkpoint is,
    read from its config unless `checkpoint_fp8` says)."""
    if model_cfg.frozen_dtype in ("bfloat16", "float32"):
        return False
    if checkpoint_fp8 is None:
        checkpoint_fp8 = _checkpoint_quantization(model_cfg).get("quant_method") == "fp8"
    return model_cfg.frozen_dtype == "float8_e4m3fn" or checkpoint_fp8


def check_fp8_storage(cfg: Config, model: nn.Module, fp8: bool | None = None) -> None:
    """What FP8 storage of the decoder matrices (`model.frozen_dtype` float8, or auto on an FP8 checkpoint) rules
    out: DoRA (PEFT's magnitude is the norm of each bf16/fp32 row) and a trainable full copy (`modules_to_save`) of
    an FP8-stored matrix. `Config.check` refuses the explicit float8 + DoRA setting; this reads the checkpoint."""
    if not (cfg.lora.use_dora or cfg.lora.modules_to_save):
        return
    if not (fp8 if fp8 is not None else frozen_fp8(cfg.model)):
        return
    if cfg.lora.use_dora:
        raise ConfigError(DORA_ON_FP8)
    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    in_layers = {id(m) for layer in decoder_layers(base) for m in layer.modules()}
    stored = [p for p in modules_to_save(base, cfg.lora) if id(base.get_submodule(p)) in in_layers]
    if stored:
        raise ConfigError(
            f"lora.modules_to_save: {stored[0]} is a decoder matrix stored in FP8 (model.frozen_dtype "
            f"{cfg.model.frozen_dtype}); a trainable full copy needs bf16/fp32: adapt it with LoRA (target_modules), "
            "or set model.frozen_dtype: bfloat16"
        )


def _checkpoint_quantization(model_cfg: ModelConfig) -> dict:
    """The checkpoint's quantization_config (top level or the text model's); block-wise FP8 is refused."""
    config = AutoConfig.from_pretrained(model_cfg.model_name_or_path)
    quant = getattr(config, "quantization_config", None) or getattr(
        getattr(config, "text_config", None), "quantization_config", None
    )
    quant = quant if isinstance(quant, dict) else (quant.to_dict() if quant is not None else {})
    if quant.get("weight_block_size"):
        raise ConfigError(
            f"model.model_name_or_path: {model_cfg.model_name_or_path} has block-wise FP8 scales "
            f"(quantization_config.weight_block_size={quant['weight_block_size']}); rayft reads static per-tensor "
            "or per-expert scales only"
        )
    return quant


def empty_model(model_cfg: ModelConfig) -> PreTrainedModel:
    """The architecture with parameters on the meta device (no memory) and real buffers (rotary tables)."""
    config = text_config(model_cfg.model_name_or_path)
    config.use_cache = model_cfg.use_cache
    kwargs = {"dtype": _dtype(model_cfg, config), "attn_implementation": model_cfg.attn_implementation}
    if getattr(config, "num_experts_per_tok", None):
        kwargs["experts_implementation"] = "grouped_mm"  # one grouped GEMM for all experts, not a Python loop
    with init_empty_weights(include_buffers=False):
        model = causal_lm_class(config)._from_config(config, **kwargs)
    tie_weights_(model)  # before LoRA and fully_shard: FSDP2 then shards the tied embedding/head as one parameter
    return model


def weightless_lora_model(cfg: Config, config: PretrainedConfig | None = None) -> tuple[peft.PeftModel, LoraTargets]:
    """The LoRA-wrapped model with every tensor on the meta device, for checks and plans: no memory, no weights."""
    config = config if config is not None else text_config(cfg.model.model_name_or_path)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # library deprecation notices, not the user's concern
        model = causal_lm_class(config)._from_config(config)
        tie_weights_(model)
        return wrap(model, cfg.lora)


def causal_lm_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The causal-LM class for a config; Mistral4 is missing from AutoModelForCausalLM in transformers 5.x."""
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    name = type(config).__name__.removesuffix("Config") + "ForCausalLM"
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ConfigError(
            f"model.model_name_or_path: no causal LM class for {type(config).__name__} (looked for {name})"
        )
    return cls


def load_base_model(model_cfg: ModelConfig) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        model_cfg.model_name_or_path,
        dtype=_dtype(model_cfg, None) if model_cfg.torch_dtype != "auto" else "auto",
        attn_implementation=model_cfg.attn_implementation,
        use_cache=model_cfg.use_cache,
    )
    model.config.use_cache = model_cfg.use_cache
    return model


def _dtype(model_cfg: ModelConfig, config: PretrainedConfig | None) -> torch.dtype:
    if model_cfg.torch_dtype != "auto":
        return getattr(torch, model_cfg.torch_dtype)
    declared = getattr(config, "dtype", None) if config is not None else None
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) and declared.is_floating_point else torch.bfloat16


def cpu_bf16(cfg: Config, device: torch.device) -> bool:
    """`train.bf16` on CPU: matmuls autocast to bf16 where the CPU has bf16 instructions (AVX512-BF16, AMX); elsewhere
    bf16 is emulated and slower than fp32. FSDP keeps fp32 weights there: gloo cannot gather bf16."""
    return (
        device.type == "cpu"
        and cfg.train.bf16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def cpu_autocast(cfg: Config, device: torch.device) -> Callable[[], AbstractContextManager]:
    """The context each forward runs in: bf16 autocast per `cpu_bf16`, else a no-op (GPU precision is FSDP's)."""
    return partial(torch.autocast, "cpu", dtype=torch.bfloat16, enabled=cpu_bf16(cfg, device))


def mixed_precision(cfg: Config, on_gpu: bool) -> MixedPrecisionPolicy:
    if cfg.fsdp.param_dtype == "auto":
        param_dtype = torch.bfloat16 if (on_gpu and cfg.train.bf16) else torch.float32
    else:
        param_dtype = getattr(torch, cfg.fsdp.param_dtype)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=getattr(torch, cfg.fsdp.reduce_dtype))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP shards one by one: the classes the model declares as not splittable."""
    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    block_names = set(getattr(base, "_no_split_modules", None) or [])
    # MRO, not type(m): fully_shard swaps a module's class for a generated `FSDP<Name>` subclass.
    layers = [m for m in base.modules() if any(c.__name__ in block_names for c in type(m).__mro__)]
    if not layers:
        raise RuntimeError(f"{type(base).__name__} declares no decoder layer class (_no_split_modules) to shard")
    return layers


def fsdp_mesh(fsdp: FsdpConfig, device_type: str) -> DeviceMesh | None:
    """None (fully_shard's default: shard over every rank), or a (replicate, shard) mesh for `fsdp.shard_size`."""
    world = dist.get_world_size()
    shards = fsdp.shard_group(world)
    if shards == world:
        return None
    return init_device_mesh(device_type, (world // shards, shards), mesh_dim_names=("replicate", "shard"))


def apply_fsdp(
    model: nn.Module,
    fsdp: FsdpConfig,
    mp_policy: MixedPrecisionPolicy,
    device_type: str = "cpu",
    mesh: DeviceMesh | None = None,
    ignored: set[nn.Parameter] | None = None,
) -> None:
    """Shard every decoder layer as its own FSDP unit, then the root (embeddings, final norm, LM head).
    `mesh`/`ignored`: expert parallelism's (ep, dp) mesh (HSDP: replicated over ep) and its experts, which
    FSDP leaves alone."""
    # Pinned host memory (fast copies to the GPU) needs an accelerator; a CPU run has nothing to offload to anyway.
    offload = CPUOffloadPolicy(pin_memory=device_type != "cpu") if fsdp.cpu_offload else OffloadPolicy()
    if mesh is None:
        mesh, reshard = fsdp_mesh(fsdp, device_type), fsdp.reshards(dist.get_world_size())
    else:
        shards = mesh.size(1)
        reshard = fsdp.reshard_after_forward if fsdp.reshard_after_forward is not None else shards > 1
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
    # The root's weights are needed again right at the start of backward: keep them gathered.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, offload_policy=offload,
                ignored_params=ignored)  # fmt: skip
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    if not any(p.requires_grad for p in model.parameters() if id(p) not in in_layers):
        # Frozen embeddings + LM head never change: gathered once, not again for every micro-batch.
        model.set_reshard_after_backward(False, recurse=False)
    for i, layer in enumerate(layers):
        if fsdp.forward_prefetch:
            ahead = layers[i + 1 : i + 1 + fsdp.forward_prefetch]
            if ahead:
                layer.set_modules_to_forward_prefetch(ahead)
        if fsdp.backward_prefetch:
            behind = layers[max(0, i - fsdp.backward_prefetch) : i][::-1]
            if behind:
                layer.set_modules_to_backward_prefetch(behind)


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
        layer.set_reshard_after_backward(sync, recurse=False)
