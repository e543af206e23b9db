"""The model each worker trains: causal LM → PEFT LoRA → FSDP2 (`fully_shard` per decoder layer, then the root)."""

from __future__ import annotations

import warnings
from pathlib import Path

import peft
import torch
import transformers
from accelerate import init_empty_weights
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from rayft.config import Config, ConfigError, FsdpConfig, ModelConfig
from rayft.lora import LoraTargets, apply_lora, wrap
from rayft.weights import buffers_kept, load_sharded_


def build_model(cfg: Config, on_gpu: bool, device: torch.device | None = None) -> peft.PeftModel:
    """`sharded`: weightless init → LoRA → fully_shard → each rank reads its own shards from disk.
    `full`: every rank loads the whole model with `from_pretrained` first (reference path, needs RAM for it all)."""
    sharded = cfg.model.load_mode == "sharded"
    model = empty_model(cfg.model) if sharded else load_base_model(cfg.model)
    if cfg.fsdp.activation_checkpointing or cfg.train.gradient_checkpointing:
        # HF's per-layer checkpointing keeps module names intact, so adapter keys stay PEFT-standard.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model = apply_lora(model, cfg.lora)
    apply_fsdp(model, cfg.fsdp, mixed_precision(cfg, on_gpu))
    if sharded:
        with buffers_kept(model):
            model.to_empty(device=device or torch.device("cpu"))
        load_sharded_(model, Path(cfg.model.model_name_or_path))
    return model


def chunked_loss(model: peft.PeftModel, on_gpu: bool) -> dict[str, bool]:
    """Forward kwargs for a loss that never holds the (tokens × vocab) logits: TRL's fused LM head scores the labels
    chunk by chunk (a 131k vocabulary is 0.5 MB of fp32 logits per token, the largest activation of a step).
    GPU only: its CPU path is twice as slow as the full logits (measured here). Not when the LM head carries LoRA:
    the fused head multiplies by its bare weight."""
    base = model.get_base_model()
    head = base.get_output_embeddings()
    if not on_gpu or head is None or isinstance(head, peft.tuners.lora.LoraLayer):
        return {}
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(base)
    return {"fused_lm_head": True}


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


def empty_model(model_cfg: ModelConfig) -> PreTrainedModel:
    """The architecture with parameters on the meta device (no memory) and real buffers (rotary tables)."""
    config = text_config(model_cfg.model_name_or_path)
    config.use_cache = model_cfg.use_cache
    kwargs = {"dtype": _dtype(model_cfg, config), "attn_implementation": model_cfg.attn_implementation}
    if getattr(config, "num_experts_per_tok", None):
        kwargs["experts_implementation"] = "grouped_mm"  # one grouped GEMM for all experts, not a Python loop
    with init_empty_weights(include_buffers=False):
        return causal_lm_class(config)._from_config(config, **kwargs)


def weightless_lora_model(cfg: Config, config: PretrainedConfig | None = None) -> tuple[peft.PeftModel, LoraTargets]:
    """The LoRA-wrapped model with every tensor on the meta device, for checks and plans: no memory, no weights."""
    config = config if config is not None else text_config(cfg.model.model_name_or_path)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # library deprecation notices, not the user's concern
        return wrap(causal_lm_class(config)._from_config(config), cfg.lora)


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


def apply_fsdp(model: nn.Module, fsdp: FsdpConfig, mp_policy: MixedPrecisionPolicy) -> None:
    """Shard every decoder layer as its own FSDP unit, then the root (embeddings, final norm, LM head)."""
    offload = CPUOffloadPolicy() if fsdp.cpu_offload else OffloadPolicy()
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(
            layer, mp_policy=mp_policy, reshard_after_forward=fsdp.reshard_after_forward, offload_policy=offload
        )
    # The root's weights are needed again right at the start of backward: keep them gathered.
    fully_shard(model, mp_policy=mp_policy, reshard_after_forward=False, offload_policy=offload)
    for i, layer in enumerate(layers):
        if fsdp.forward_prefetch:
            ahead = layers[i + 1 : i + 1 + fsdp.forward_prefetch]
            if ahead:
                layer.set_modules_to_forward_prefetch(ahead)
        if fsdp.backward_prefetch:
            behind = layers[max(0, i - fsdp.backward_prefetch) : i][::-1]
            if behind:
                layer.set_modules_to_backward_prefetch(behind)
