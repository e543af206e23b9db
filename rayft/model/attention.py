"""The attention implementation a model is built with (`model.attn_implementation`): the one a run uses when the
setting is unset (`choose_attention`), and a named one checked before any worker: a misspelt name, one the model's
class does not implement, a GPU-only kernel on CPU workers, or a kernel package that is not installed. transformers
itself would say so only while each worker builds the model."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Collection
from dataclasses import dataclass

from torch import nn

from rayft.config import Config, ConfigError, ModelConfig

# The class flag transformers reads for each implementation, and the package a flash kernel comes from.
SUPPORT_FLAG = {
    "sdpa": "_supports_sdpa",
    "flex_attention": "_supports_flex_attn",
    "flash_attention_2": "_supports_flash_attn",
    "flash_attention_3": "_supports_flash_attn",
    "flash_attention_4": "_supports_flash_attn",
}
FLASH_PACKAGE = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface",
                 "flash_attention_4": "flash_attn"}  # fmt: skip


def offered() -> list[str]:
    """Every implementation name transformers accepts (its registry, plus `eager`)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]


def check_attention(cfg: Config, model: nn.Module) -> str | None:
    """ConfigError for an implementation this run cannot use; a warning for a flash kernel whose package is not
    installed here (a GPU config checked on a laptop: the workers' image must have it)."""
    name = cfg.model.attn_implementation
    if name is None or "/" in name:  # the model's default, or a kernel from the hub (transformers fetches it)
        return None
    key = "model.attn_implementation"
    names = offered()
    if name not in names:
        raise ConfigError(
            f"{key}: '{name}' is none of the implementations transformers offers ({', '.join(names)}); use one of "
            "them, or null for the model's default"
        )
    base = getattr(model, "get_base_model", lambda: model)()
    flag = SUPPORT_FLAG.get(name.removeprefix("paged|"))
    if flag and not getattr(type(base), flag, False):
        usable = "".join(", " + n for n in supported(type(base)))
        raise ConfigError(f"{key}: {type(base).__name__} does not implement {name}; it takes eager{usable}")
    package = FLASH_PACKAGE.get(name)
    if package is None:
        return None
    if cfg.ray.use_gpu is False:
        raise ConfigError(f"{key}: {name} runs on CUDA GPUs only and ray.use_gpu is false; use sdpa (or eager)")
    if importlib.util.find_spec(package) is None:
        return (
            f"{key}: {name} needs the {package} package, which is not installed here: the workers' image must have "
            "it, or every worker fails as it builds the model"
        )
    return None


@dataclass(frozen=True)
class AttentionChoice:
    """The implementation a run builds its model with, why, and whether it is a fallback the user must be told of
    (`loud`: packed rows that will run a dense s × s mask after all)."""

    name: str
    reason: str
    loud: bool = False

    def line(self) -> str:
        return f"{self.name} ({self.reason})"


def choose_attention(
    named: str | None, packed: bool, on_gpu: bool, flash_installed: bool, supported: Collection[str], model: str
) -> AttentionChoice:
    """The kernel for `model.attn_implementation` `named` (None: unset), given whether rows are packed, the workers
    run on GPUs, the flash_attn package is importable, and which of SUPPORT_FLAG's names the model class
    (`model`) implements. Packed rows are padding-free: under SDPA transformers builds a dense s × s document mask
    for every row and the kernel does all s² of the work; a varlen kernel does only each document's own square.
    flash-attention's varlen kernel takes the documents' boundaries from the position ids (transformers pads an MLA
    value up to the query's head dim); FlexAttention, compiled, skips the blocks of its document block mask. Neither
    runs a training step on CPU workers (flash is CUDA-only; torch has no FlexAttention backward on CPU), so they keep
    SDPA, as do padded rows, whose mask SDPA takes as it is."""
    if named is not None:
        return AttentionChoice(named, "model.attn_implementation")
    default = "sdpa" if "sdpa" in supported else "eager"  # transformers' own default for the class
    if not packed:
        return AttentionChoice(default, "rows padded per batch, data.packing false: the padding mask as it is")
    if not on_gpu:
        return AttentionChoice(
            default,
            "CPU workers: flash-attention is CUDA-only and torch has no FlexAttention backward on CPU, so packed rows "
            "attend through a dense s × s document mask; name a kernel in model.attn_implementation to change it",
        )
    if flash_installed and "flash_attention_2" in supported:
        return AttentionChoice("flash_attention_2", "packed rows on GPUs: flash-attention's varlen kernel per document")
    if "flex_attention" in supported:
        why = "flash_attn is not installed" if "flash_attention_2" in supported else f"{model} has no flash-attention"
        return AttentionChoice(
            "flex_attention", f"packed rows on GPUs, {why}: FlexAttention with a document block mask, compiled"
        )
    lacks = (
        f"{model} has no FlexAttention and flash_attn is not installed"
        if "flash_attention_2" in supported
        else f"{model} implements neither flash-attention nor FlexAttention"
    )
    return AttentionChoice(
        default, f"{lacks}: packed rows run {default} with a dense s × s document mask, s² work per row", loud=True
    )


def supported(model_class: type) -> list[str]:
    """The implementation names of SUPPORT_FLAG the model class says it implements."""
    return [name for name, flag in SUPPORT_FLAG.items() if getattr(model_class, flag, False)]


def attention_choice(cfg: Config, model_class: type, on_gpu: bool) -> AttentionChoice:
    """`choose_attention` for this run: its setting and packing, its workers' device, this process's flash_attn."""
    flash = importlib.util.find_spec(FLASH_PACKAGE["flash_attention_2"]) is not None
    return choose_attention(
        cfg.model.attn_implementation, cfg.data.packing, on_gpu, flash, supported(model_class), model_class.__name__
    )


def with_attention(model_cfg: ModelConfig, choice: AttentionChoice) -> ModelConfig:
    """`model_cfg` naming the chosen implementation: what the model is built with."""
    return dataclasses.replace(model_cfg, attn_implementation=choice.name)
