"""The model families rayft knows, keyed by the text model's `model_type`: what LoRA's `auto` adapts and, for an
MoE family, how its MoE block is laid out. Expert parallelism, LoRA and `rayft validate` read this one table, so a
family's differences are written here once instead of as branches in each of them.

The MoE blocks of transformers share one shape (a router returning `(logits, weights, indices)` and fused experts
called as `experts(hidden, indices, weights)`) and differ in the details kept below: the router's attribute name,
a shared expert added after the routed ones, training-time input jitter, whether the block also returns the
router's weights, and the config key of the routed expert count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from rayft.config import ConfigError

DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Multi-head latent attention's projections; with MoE, gate/up/down exist only in the shared expert and the dense
# layers (the routed experts are fused 3D parameters, not modules: `lora.target_experts` adapts them).
MLA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLA_MOE_TARGETS = (*MLA_TARGETS, "gate_proj", "up_proj", "down_proj")
# DeepSeek-V3's `auto` leaves its shared and dense MLPs out: PEFT reads gate_proj/up_proj/down_proj on the models
# transformers converts from the per-expert layout as the routed experts' old names, and adapts the routed experts
# instead (`rayft.model.lora.check_peft_keeps_targets`).


@dataclass(frozen=True)
class MoeBlock:
    """How one family's MoE block computes, as far as expert parallelism re-enacts it around the all-to-all."""

    block: str  # the block's class name in transformers
    experts_key: str  # the config key holding the number of routed experts
    router: str = "gate"  # the router's attribute: called on [T, H], returns (logits, weights [T, K], indices [T, K])
    shared: str | None = None  # a shared expert's attribute, added to the routed output (it sees every token)
    jitter: str | None = None  # a training-time input jitter's attribute (multiplies the input by U(1 ± jitter))
    returns_router_weights: bool = False  # the block returns (hidden, router weights), not hidden alone


@dataclass(frozen=True)
class Family:
    """One architecture: its name for people, LoRA's `auto` targets and its MoE block (None for a dense model)."""

    model_type: str
    name: str
    targets: tuple[str, ...]
    moe: MoeBlock | None = None


_MLA_MOE = MoeBlock("Mistral4MoE", "n_routed_experts", shared="shared_experts")  # DeepSeek-V3's block, renamed
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "Llama", DENSE_TARGETS),
        Family("mistral", "Mistral", DENSE_TARGETS),
        Family("qwen2", "Qwen2", DENSE_TARGETS),
        Family("qwen3", "Qwen3", DENSE_TARGETS),
        Family("gemma", "Gemma", DENSE_TARGETS),
        Family("gemma2", "Gemma 2", DENSE_TARGETS),
        Family("gemma3_text", "Gemma 3", DENSE_TARGETS),
        Family("mistral4", "Mistral-Small-4", MLA_MOE_TARGETS, _MLA_MOE),
        Family("deepseek_v3", "DeepSeek-V3", MLA_TARGETS, replace(_MLA_MOE, block="DeepseekV3MoE")),
        Family("qwen3_moe", "Qwen3-MoE", ATTENTION_TARGETS, MoeBlock("Qwen3MoeSparseMoeBlock", "num_experts")),
        Family("mixtral", "Mixtral", ATTENTION_TARGETS, MoeBlock("MixtralSparseMoeBlock", "num_local_experts",
                                                                 jitter="jitter_noise")),
        Family("gpt_oss", "GPT-OSS", ATTENTION_TARGETS, MoeBlock("GptOssMLP", "num_local_experts", router="router",
                                                                 returns_router_weights=True)),
    )
}  # fmt: skip
MOE_BLOCKS: dict[str, MoeBlock] = {f.moe.block: f.moe for f in FAMILIES.values() if f.moe is not None}


def moe_family(config: Any) -> MoeBlock | None:
    """The MoE block of the config's family; None for a dense family or one not in the table."""
    family = FAMILIES.get(getattr(config, "model_type", ""))
    return family.moe if family is not None else None


def num_routed_experts(config: Any) -> int:
    """The routed experts per MoE layer (0 for a dense model), read from the family's own config key."""
    moe = moe_family(config)
    return int(getattr(config, moe.experts_key, 0) or 0) if moe is not None else 0


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """Every module holding routed experts as a child named `experts`: the MoE blocks, of any family."""
    return [m for m in model.modules() if "experts" in m._modules]


def block_of(module: nn.Module) -> MoeBlock | None:
    """The table's entry for an MoE block, found through its class's MRO (expert parallelism puts a class of its
    own in front of the block's)."""
    return next((MOE_BLOCKS[c.__name__] for c in type(module).__mro__ if c.__name__ in MOE_BLOCKS), None)


def unsupported_moe(model: nn.Module) -> list[str]:
    """The class names of MoE blocks no family in the table describes (empty for dense and supported models)."""
    return sorted({type(m).__name__ for m in moe_blocks(model) if block_of(m) is None})


def supported_moe_families() -> str:
    return ", ".join(f"{f.name} ({f.model_type})" for f in FAMILIES.values() if f.moe is not None)


def check_moe_family(model: nn.Module, path: str) -> None:
    """A ConfigError naming `model.model_name_or_path` (here `path`) when the model's decoder has routed experts in
    a block the table does not describe: expert parallelism, expert LoRA and FP8 experts are written against those
    blocks alone, so an unknown one is refused before anything runs rather than half-supported."""
    unknown = unsupported_moe(model)
    if not unknown:
        return
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    raise ConfigError(
        f"model.model_name_or_path: {path} is a {model_type} model whose MoE blocks ({', '.join(unknown)}) rayft "
        f"does not support; the supported MoE families are {supported_moe_families()}: point "
        "model.model_name_or_path at one of those, or at a dense model"
    )
