"""The whole vision-language model (`model.vision`): a llava-style wrapper (Mistral3: Pixtral vision tower +
multimodal projector + the language model) built as one model, of which only the language model is adapted.

The tower and the projector are frozen parts of the base like the embeddings: held in `model.torch_dtype`, never in
FP8 or NF4 storage (the checkpoint keeps them in bf16, and quantising them would change the image features the
language model was trained on), never given LoRA (the target names of the language model's MLP, `o_proj`,
`gate_proj`, ..., are also the tower's). Everything else, sharding and loading, is the text model's path: the
wrapper's parameters are read under their hub names (`rayft.model.weights`).
"""

from __future__ import annotations

from typing import cast

from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

from rayft.config import ConfigError, ModelConfig
from rayft.model.blocks import declared_blocks, unwrapped

# The wrapper's modules outside the language model, as transformers names them (`model.vision_tower`, ...).
VISION_PARTS = ("vision_tower", "multi_modal_projector")
# PEFT's `exclude_modules`: no adapter anywhere inside them, whatever the target names match.
EXCLUDED = rf"(.*\.)?({'|'.join(VISION_PARTS)})(\..*)?"


def builds_vision(model_cfg: ModelConfig) -> bool:
    """Whether the whole vision-language model is built: `model.vision: true`. `auto` stays with the language model
    until the data pipeline carries images (then: whether the data has any)."""
    return model_cfg.vision is True


def vision_config(model_dir: str) -> PretrainedConfig:
    """The wrapper's config, its checkpoint quantization_config dropped (rayft dequantises or keeps FP8 itself while
    loading); refused, naming the key, when the checkpoint has no vision tower."""
    config: PretrainedConfig = AutoConfig.from_pretrained(model_dir)
    if getattr(config, "vision_config", None) is None or type(config) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        raise ConfigError(
            f"model.vision: true but {model_dir} is a {type(config).__name__} without a vision tower "
            "(no vision_config); set model.vision: false"
        )
    for part in (config, config.get_text_config()):
        if getattr(part, "quantization_config", None) is not None:
            del part.quantization_config
    return config


def vision_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The image-text-to-text class of a wrapper config (Mistral3ForConditionalGeneration)."""
    # transformers types every auto mapping's value as a tokenizer mapping's (slow, fast) pair: here, the class
    return cast(type[PreTrainedModel], MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)])


def vision_modules(model: nn.Module) -> list[nn.Module]:
    """The tower and the projector of a (PEFT-wrapped) vision-language model, in the order they run; [] for a text
    model."""
    inner = getattr(unwrapped(model), "model", None)
    return [m for part in VISION_PARTS if isinstance(m := getattr(inner, part, None), nn.Module)]


def vision_blocks(model: nn.Module) -> list[nn.Module]:
    """The tower's repeated blocks (the wrapper's `_no_split_modules` inside it), which FSDP shards one by one. Not
    the tower itself: transformers finds the modules whose outputs it records (the tower's hidden states, of which
    the projector takes one) by their class, which `fully_shard` replaces."""
    tower = {id(m) for part in vision_modules(model) for m in part.modules()}
    return [m for m in declared_blocks(model) if id(m) in tower]


def in_vision(name: str) -> bool:
    """Whether a module or parameter name lies inside the tower or the projector."""
    return any(part in name.split(".") for part in VISION_PARTS)
