"""The model each worker trains, before it is parallelised: the causal LM class and its config, built empty (meta)
or loaded, wrapped in PEFT LoRA; the storage and precision of its frozen base; its decoder layers. The order of
FP8/NF4, checkpointing, LoRA, expert parallelism and FSDP2 is `rayft.parallel.parallelize`'s."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any, cast

import peft
import torch
import transformers
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from rayft.config import DORA_ON_FP8, Config, ConfigError, ModelConfig
from rayft.model.attention import AttentionChoice, attention_choice, with_attention
from rayft.model.blocks import declared_blocks, unwrapped
from rayft.model.families import check_moe_family
from rayft.model.frozen import Held
from rayft.model.lora import LoraTargets, modules_to_save, wrap
from rayft.model.loss import why_not_fused
from rayft.model.vision import builds_vision, vision_class, vision_config, vision_modules
from rayft.model.weights import tie_weights_

log = logging.getLogger("rayft")


def fused_loss(model: peft.PeftModel, cfg: Config) -> str | None:
    """Why the next-token loss of this model cannot be taken from its hidden states in chunks
    (`rayft.model.loss.CausalLMLoss`); None when it can."""
    if not cfg.train.fused_loss:
        return "train.fused_loss is false"
    return why_not_fused(cast(PreTrainedModel, model.get_base_model()))


def text_config(model_dir: str) -> PretrainedConfig:
    """The causal LM's config; for a vision+text wrapper (Mistral3, llava) its `text_config` — the vision tower
    is never built. The checkpoint's quantization_config is dropped: rayft dequantises while loading."""
    config: PretrainedConfig = AutoConfig.from_pretrained(model_dir)
    inner = getattr(config, "text_config", None)
    if inner is not None and type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        config = inner
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    return config


def frozen_fp8(model_cfg: ModelConfig, checkpoint_fp8: bool | None = None) -> bool:
    """Whether the frozen decoder matrices are kept in FP8 (`model.frozen_dtype`; `auto`: when the checkpoint is,
    read from its config unless `checkpoint_fp8` says)."""
    if model_cfg.frozen_dtype in ("bfloat16", "float32", "nf4"):
        return False
    return model_cfg.frozen_dtype == "float8_e4m3fn" or checkpoint_held(model_cfg, checkpoint_fp8) == "fp8"


def held_as(model_cfg: ModelConfig, checkpoint_fp8: bool | None = None) -> Held:
    """How the frozen base is held (`model.frozen_dtype`): NF4, FP8 (`frozen_fp8`), or in `model.torch_dtype`."""
    if model_cfg.frozen_dtype == "nf4":
        return "nf4"
    return "fp8" if frozen_fp8(model_cfg, checkpoint_fp8) else "dtype"


def checkpoint_held(model_cfg: ModelConfig, checkpoint_fp8: bool | None = None) -> Held:
    """How the checkpoint's files hold the base, what a (re)start reads: FP8 or `model.torch_dtype`."""
    if checkpoint_fp8 is None:
        checkpoint_fp8 = _checkpoint_quantization(model_cfg).get("quant_method") == "fp8"
    return "fp8" if checkpoint_fp8 else "dtype"


def check_quantised_storage(cfg: Config, model: nn.Module, fp8: bool | None = None) -> None:
    """What quantised storage of the decoder matrices (`model.frozen_dtype` float8 or nf4, or auto on an FP8
    checkpoint) rules out: DoRA (PEFT's magnitude is the norm of each bf16/fp32 row) and a trainable full copy
    (`modules_to_save`) of a stored matrix. The config's rules refuse the explicit settings with DoRA; this reads the
    checkpoint."""
    if not (cfg.lora.use_dora or cfg.lora.modules_to_save):
        return
    nf4 = cfg.model.frozen_dtype == "nf4"
    if not (nf4 or (fp8 if fp8 is not None else frozen_fp8(cfg.model))):
        return
    if cfg.lora.use_dora:
        raise ConfigError(DORA_ON_FP8)
    base = unwrapped(model)
    in_layers = {id(m) for layer in decoder_layers(base) for m in layer.modules()}
    stored = [p for p in modules_to_save(base, cfg.lora) if id(base.get_submodule(p)) in in_layers]
    if stored:
        raise ConfigError(
            f"lora.modules_to_save: {stored[0]} is a decoder matrix stored in {'NF4' if nf4 else 'FP8'} "
            f"(model.frozen_dtype {cfg.model.frozen_dtype}); a trainable full copy needs bf16/fp32: adapt it with "
            "LoRA (target_modules), or set model.frozen_dtype: bfloat16"
        )


def _checkpoint_quantization(model_cfg: ModelConfig) -> dict[str, Any]:
    """The checkpoint's quantization_config (top level or the text model's)."""
    config = AutoConfig.from_pretrained(model_cfg.model_name_or_path)
    quant = getattr(config, "quantization_config", None) or getattr(
        getattr(config, "text_config", None), "quantization_config", None
    )
    return quant if isinstance(quant, dict) else (quant.to_dict() if quant is not None else {})


def attention_model_config(cfg: Config, on_gpu: bool) -> tuple[ModelConfig, AttentionChoice]:
    """`cfg.model` naming the attention kernel the model is built with on this worker (`choose_attention`: with the
    setting unset, a varlen kernel for packed rows on GPUs), and the choice with its reason."""
    choice = attention_choice(cfg, causal_lm_class(text_config(cfg.model.model_name_or_path)), on_gpu)
    return with_attention(cfg.model, choice), choice


def empty_model(model_cfg: ModelConfig) -> PreTrainedModel:
    """The architecture with parameters on the meta device (no memory) and real buffers (rotary tables): the causal
    LM, or with `model.vision` the whole vision-language wrapper (`rayft.model.vision`)."""
    vision = builds_vision(model_cfg)
    path = model_cfg.model_name_or_path
    config = vision_config(path) if vision else text_config(path)
    with init_empty_weights(include_buffers=False):
        model = _from_config(model_cfg, config, vision_class(config) if vision else None)
    # tied outside the context: init_empty_weights makes every parameter registered in it a new one
    tie_weights_(model)
    return model


def random_model(model_cfg: ModelConfig, config: PretrainedConfig, device: torch.device) -> PreTrainedModel:
    """The architecture of `config` made on `device` with transformers' random init, as `empty_model` would build it
    for `model_cfg`: what a throughput measurement trains, where no checkpoint need be written or read (a step's time
    does not depend on the weights' values)."""
    with torch.device(device):
        model = _from_config(model_cfg, config)
    tie_weights_(model)
    return model


def _from_config(
    model_cfg: ModelConfig, config: PretrainedConfig, cls: type[PreTrainedModel] | None = None
) -> PreTrainedModel:
    """The causal LM of `config` (or `cls`'s model: a vision-language wrapper) with `model_cfg`'s dtype, attention and
    expert kernels; its head is tied by the caller (`tie_weights_`), before LoRA and fully_shard: FSDP2 then shards
    the tied embedding/head as one parameter."""
    config.use_cache = model_cfg.use_cache
    kwargs: dict[str, Any] = {"dtype": _dtype(model_cfg, config), "attn_implementation": model_cfg.attn_implementation}
    text = config.get_text_config()
    if getattr(text, "num_experts_per_tok", None):
        # one grouped GEMM for all experts, not a Python loop; a wrapper's own class has no experts: its text model's
        kwargs["experts_implementation"] = "grouped_mm" if text is config else {"text_config": "grouped_mm"}
    cls = cls or causal_lm_class(config)
    # transformers leaves _from_config unannotated
    model: PreTrainedModel = cls._from_config(config, **kwargs)  # type: ignore[no-untyped-call]
    return model


def weightless_lora_model(cfg: Config, config: PretrainedConfig | None = None) -> tuple[peft.PeftModel, LoraTargets]:
    """The LoRA-wrapped model with every tensor on the meta device, for checks and plans: no memory, no weights.
    An MoE model of a family rayft does not know is refused here, before LoRA resolves its targets."""
    config = config if config is not None else text_config(cfg.model.model_name_or_path)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # library deprecation notices, not the user's concern
        model = causal_lm_class(config)._from_config(config)  # type: ignore[no-untyped-call]  # as above
        check_moe_family(model, cfg.model.model_name_or_path)
        tie_weights_(model)
        return wrap(model, cfg.lora)


def causal_lm_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The causal-LM class for a config; Mistral4 is missing from AutoModelForCausalLM in transformers 5.x."""
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        # transformers types every auto mapping's value as a tokenizer mapping's (slow, fast) pair: here, the class
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # type: ignore[return-value]
    name = type(config).__name__.removesuffix("Config") + "ForCausalLM"
    cls: type[PreTrainedModel] | None = getattr(transformers, name, None)
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
        return cast(torch.dtype, getattr(torch, model_cfg.torch_dtype))
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
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]  # torch: unannotated
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def forward_context(cfg: Config, device: torch.device) -> Callable[[], AbstractContextManager[None]]:
    """The context each forward runs in: bf16 autocast per `cpu_bf16`, else a no-op (GPU precision is FSDP's)."""
    return partial(torch.autocast, "cpu", dtype=torch.bfloat16, enabled=cpu_bf16(cfg, device))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP shards one by one: the classes the model declares as not splittable."""
    # A vision-language model's tower blocks are no decoder layers: never quantised, never recomputed by count.
    tower = {id(m) for part in vision_modules(model) for m in part.modules()}
    layers = [m for m in declared_blocks(model) if id(m) not in tower]
    if not layers:
        name = type(unwrapped(model)).__name__
        raise RuntimeError(f"{name} declares no decoder layer class (_no_split_modules) to shard")
    return layers
