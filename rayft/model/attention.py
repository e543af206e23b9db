"""The attention implementation a model is built with (`model.attn_implementation`), checked before any worker: a
misspelt name, one the model's class does not implement, a GPU-only kernel on CPU workers, or a kernel package that
is not installed. transformers itself would say so only while each worker builds the model."""

from __future__ import annotations

import importlib.util

from torch import nn

from rayft.config import Config, ConfigError

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
        usable = [n for n, f in SUPPORT_FLAG.items() if getattr(type(base), f, False)]
        raise ConfigError(
            f"{key}: {type(base).__name__} does not implement {name}; it takes eager{''.join(', ' + n for n in usable)}"
        )
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
