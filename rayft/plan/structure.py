"""What the planner needs to know about a model: parameter counts by role, read from the LoRA-wrapped model on the
meta device (no weights, no memory)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from rayft.config import Config
from rayft.model.fp8_format import EXPERT_WEIGHTS, storage_block, weight_block
from rayft.model.frozen import frozen_matrices

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Structure:
    """What the memory, communication and time formulas need from the model (counts of parameters)."""

    architecture: str
    total: int  # frozen parameters
    largest_layer: int
    layers: int
    root: int  # every parameter outside the decoder layers (embeddings, final norm, head), LoRA included
    lora: int  # trainable parameters
    hidden: int
    vocab: int
    top_k: int
    moe_intermediate: int
    fp8: int = 0  # frozen decoder matrices (linears, routed experts) that FP8 storage holds
    fp8_rows: int = 0  # their fp32 scales: one per row (per row and column block for a block-wise checkpoint)
    fp8_layer: int = 0  # of those, in the largest layer
    fp8_layer_rows: int = 0
    fp8_largest: int = 0  # the largest single such tensor
    fp8_linear_largest: int = 0  # the largest FP8 linear weight: dequantised whole for its matmul
    fp8_expert_numel: int = 0  # one routed expert's weight in the largest FP8 expert stack (out · in)
    nf4: int = 0  # frozen decoder matrices NF4 storage holds (`rayft.model.nf4.to_nf4_`: the shapes it can block)
    nf4_matrices: int = 0  # how many matrices those are, an expert counting as one
    nf4_layer: int = 0  # of those, in the largest layer
    nf4_experts: int = 0  # of those, routed-expert weights
    layers_lora: int = 0  # trainable parameters inside the decoder layers (the rest are the root's)
    experts: int = 0  # frozen routed-expert weights (fused 3D stacks), all layers
    expert_rows: int = 0  # their rows (FP8 row scales)
    experts_layer: int = 0  # of those, in the largest layer
    expert_lora: int = 0  # LoRA parameters on the routed experts (`lora.target_experts`)
    num_experts: int = 0  # routed experts per MoE layer (E)
    moe_layers: int = 0  # decoder layers with routed experts
    active_base: int = 0  # frozen matrix weights a token is multiplied by (routed experts: top_k / E of theirs)
    attention_per_position: float = 0.0  # forward attention FLOPs per token per position of context (A(s) / s)
    heads: int = 0  # query heads of an attention layer
    kv_heads: int = 0  # key and value heads as attention receives them (MLA: one per query head)
    qk_head_dim: int = 0  # width of a query and key head
    v_head_dim: int = 0  # width of a value head (and of a head of attention's output)

    @property
    def layers_frozen(self) -> int:
        """Frozen parameters inside the decoder layers: what FSDP gathers per layer, less LoRA."""
        return self.total - (self.root - (self.lora - self.layers_lora))

    @property
    def root_lora(self) -> int:
        return self.lora - self.layers_lora

    @property
    def params(self) -> int:
        """Every parameter of the model with its adapter: frozen and trainable."""
        return self.total + self.lora


def structure(model: PeftModel, config: Any) -> Structure:
    """Parameter counts of a (meta) PEFT model with its decoder layers."""
    from rayft.model.build import decoder_layers
    from rayft.model.flops import flop_model

    layers = decoder_layers(model)
    block = weight_block(Path(getattr(config, "name_or_path", "") or "."))  # block-wise FP8 scales, kept as filed
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    params = list(model.parameters())
    fp8_per_layer = [frozen_matrices(layer, "fp8") for layer in layers]
    experts_per_layer = [expert_stacks(layer) for layer in layers]
    nf4_per_layer = [frozen_matrices(layer, "nf4") for layer in layers]
    largest = max(range(len(layers)), key=lambda i: sum(p.numel() for p in layers[i].parameters()))
    flops = flop_model(model, config, seq_len=1)
    return Structure(
        architecture=type(model.get_base_model()).__name__,
        total=sum(p.numel() for p in params if not p.requires_grad),
        largest_layer=sum(p.numel() for p in layers[largest].parameters()),
        layers=len(layers),
        root=sum(p.numel() for p in params if id(p) not in in_layers),
        lora=sum(p.numel() for p in params if p.requires_grad),
        hidden=config.hidden_size,
        vocab=config.vocab_size,
        top_k=getattr(config, "num_experts_per_tok", 0) or 0,
        moe_intermediate=getattr(config, "moe_intermediate_size", 0) or 0,
        fp8=sum(p.numel() for ps in fp8_per_layer for p in ps),
        fp8_rows=sum(_scales(p, block) for ps in fp8_per_layer for p in ps),
        fp8_layer=sum(p.numel() for p in fp8_per_layer[largest]),
        fp8_layer_rows=sum(_scales(p, block) for p in fp8_per_layer[largest]),
        fp8_largest=max((p.numel() for ps in fp8_per_layer for p in ps), default=0),
        fp8_linear_largest=max((p.numel() for ps in fp8_per_layer for p in ps if p.ndim == 2), default=0),
        fp8_expert_numel=max((p[0].numel() for ps in fp8_per_layer for p in ps if p.ndim == 3), default=0),
        nf4=sum(p.numel() for ps in nf4_per_layer for p in ps),
        nf4_matrices=sum(p.shape[0] if p.ndim == 3 else 1 for ps in nf4_per_layer for p in ps),
        nf4_layer=sum(p.numel() for p in nf4_per_layer[largest]),
        nf4_experts=sum(p.numel() for ps in nf4_per_layer for p in ps if p.ndim == 3),
        layers_lora=sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) in in_layers),
        experts=sum(p.numel() for ps in experts_per_layer for p in ps),
        expert_rows=sum(_rows(p) for ps in experts_per_layer for p in ps),
        experts_layer=sum(p.numel() for p in experts_per_layer[largest]),
        expert_lora=sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and ".experts." in n),
        num_experts=max((p.shape[0] for ps in experts_per_layer for p in ps), default=0),
        moe_layers=sum(1 for ps in experts_per_layer if ps),
        active_base=flops.base_params,
        attention_per_position=flops.attention,
        **attention_heads(config),
    )


def attention_heads(config: Any) -> dict[str, int]:
    """Heads and head widths as the attention function receives q, k and v (what context parallelism exchanges):
    MLA (a `kv_lora_rank`) expands its latent into one key and value head per query head, of its own q/k and v
    widths; GQA keeps `num_key_value_heads`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads: int = text.num_attention_heads
    head_dim: int = getattr(text, "head_dim", None) or text.hidden_size // heads
    mla = getattr(text, "kv_lora_rank", None) is not None
    qk: int = (
        getattr(text, "qk_head_dim", None)
        or (getattr(text, "qk_nope_head_dim", 0) or 0) + (getattr(text, "qk_rope_head_dim", 0) or 0)
        or head_dim
    )
    kv_heads: int = heads if mla else (getattr(text, "num_key_value_heads", None) or heads)
    return {
        "heads": heads,
        "kv_heads": kv_heads,
        "qk_head_dim": qk,
        "v_head_dim": getattr(text, "v_head_dim", None) or head_dim,
    }


def _rows(p: nn.Parameter) -> int:
    return p.numel() // p.shape[-1]


def _scales(p: nn.Parameter, block: tuple[int, int] | None) -> int:
    """The fp32 scales FP8 storage keeps for matrix `p` (`rayft.model.fp8`: per row, or per row and column block)."""
    width = storage_block(p.shape[-1], block[1] if block else None)
    return _rows(p) * (math.ceil(p.shape[-1] / width) if width else 1)


def expert_stacks(layer: nn.Module) -> list[nn.Parameter]:
    """The frozen fused routed-expert weights of a decoder layer ([E, out, in]): what expert parallelism keeps whole
    on the rank that owns each expert instead of sharding."""
    return [
        p
        for module in layer.modules()
        for n, p in module.named_parameters(recurse=False)
        if p.ndim == 3 and n in EXPERT_WEIGHTS and not p.requires_grad
    ]


def meta_structure(cfg: Config, config: PretrainedConfig | None = None) -> Structure:
    """Structure of the weightless LoRA model (from `config`, or the config of model.model_name_or_path)."""
    from rayft.model.build import weightless_lora_model

    model, _ = weightless_lora_model(cfg, config)
    return structure(model, model.config)
