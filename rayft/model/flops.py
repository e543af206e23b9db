"""What the model costs per token, for model FLOPs utilisation (MFU) and the planner's step time, and the peak
FLOP/s of the GPU it runs on.

MFU counts the FLOPs the model needs per token, not what the kernels did (activation recompute is excluded):
  6N      6 · (N_base + N_lora) + 3 · A       the usual formula: forward 2N, backward 4N (input and weight grads)
  LoRA    4 · N_base + 6 · N_lora + 3 · A     a frozen base needs no weight gradients: its backward is 2N
where N_base counts the frozen matrix weights a token is multiplied by (embeddings are lookups and are left out;
a token visits top_k of a layer's E routed experts, so their weight stacks count top_k / E of theirs), each matrix in
its own shape whatever the storage of a quantised base (FP8 or NF4: not its packed bytes, nor its scales), N_lora the
trainable ones (the routed experts' LoRA factors likewise top_k / E), and A = 2 · L · H · (d_qk + d_v) · k
the forward FLOPs of attention scores and values per token attending k keys (backward: 2A). Attention is causal
and never crosses documents (packed rows restart at each one), so a document of n tokens attends n (n + 1) / 2
keys in all: the window counts them from the batches it trained on, not from `max_length`; the start-up line's
figures assume full-length documents, k = (s + 1) / 2.
Peak: dense bf16 tensor-core FLOP/s of the GPU (H100/H200 SXM: 989 TFLOP/s); no MFU on CPU. MFU divides by it
whatever precision the matmuls ran in, so a frozen base multiplied in FP8 (`model.fp8_compute`) can show more than
the bf16 matmuls alone would reach. The dense FP8 peak (H100/H200 SXM: 1,979 TFLOP/s; none before compute
capability 8.9) is what the planner times those FP8 matmuls at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from rayft.gpus import GPUS
from rayft.model.families import block_of, moe_blocks, num_routed_experts
from rayft.model.fp8_format import EXPERT_WEIGHTS
from rayft.model.loss import lm_head

if TYPE_CHECKING:
    from peft import PeftModel

# Dense bf16 peak per GPU and memory bandwidth, matched against torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {name.upper(): gpu.bf16_tflops * 1e12 for name, gpu in GPUS.items()}
HBM_BYTES_PER_S = {name.upper(): gpu.hbm_tbytes_per_s * 1e12 for name, gpu in GPUS.items()}
PEAK_FP8_FLOPS = {name.upper(): gpu.fp8_tflops * 1e12 for name, gpu in GPUS.items() if gpu.fp8_tflops}


@dataclass(frozen=True)
class FlopModel:
    base_params: int  # frozen matrix weights multiplied per token
    lora_params: int  # trainable ones
    attention: float  # forward attention FLOPs of one query attending one key (all layers and heads)
    seq_len: int = 1  # the document length the per-token properties assume (data.max_length)

    def per_token(self, lora_aware: bool, keys_per_token: float | None = None) -> float:
        """FLOPs per trained token with attention over `keys_per_token` keys per query (a window's measured mean);
        by default a full-length document's causal mean, (s + 1) / 2."""
        keys = (self.seq_len + 1) / 2 if keys_per_token is None else keys_per_token
        base, lora = self.base_params, self.lora_params
        matmuls = 4 * base + 6 * lora if lora_aware else 6 * (base + lora)
        return matmuls + 3 * self.attention * keys

    @property
    def per_token_6n(self) -> float:
        return self.per_token(lora_aware=False)

    @property
    def per_token_lora(self) -> float:
        return self.per_token(lora_aware=True)


def flop_model(model: nn.Module, config: Any, seq_len: int) -> FlopModel:
    """Counts from the PEFT model and its config. The figures are the whole model's per token however it is laid
    out: a DTensor's numel is the global one under FSDP, and a worker holding E/k routed experts a layer (expert
    parallelism) counts top_k of them per token all the same."""
    text = getattr(config, "text_config", None) or config
    base = lora = 0
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            seen.update(id(p) for p in module.parameters(recurse=False))
    base_model = cast("PeftModel", model).get_base_model() if hasattr(model, "get_base_model") else model
    head = lm_head(base_model) if hasattr(base_model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    if head_weight is not None and id(head_weight) in seen and not head_weight.requires_grad:
        base += head_weight.numel()  # a tied head is the embedding matrix, yet a matmul every token goes through
    routed = routed_expert_counts(model, text)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            shape = matrix_shape(module, name, p)
            if id(p) in routed:
                count = routed[id(p)]
            elif shape is not None and (p.requires_grad or len(shape) == 2):
                count = math.prod(shape)
            else:
                continue
            if p.requires_grad:
                lora += count
            else:
                base += count
    return FlopModel(base, lora, attention_flops(text, 1), seq_len)


def matrix_shape(module: nn.Module, name: str, p: torch.Tensor) -> tuple[int, ...] | None:
    """The shape of the weights parameter `name` of `module` holds as a token meets them, or None for a tensor no
    token is multiplied by: a quantised base's weight in its own shape however it is stored (FP8: a byte a weight;
    NF4: two 4-bit codes a byte), its scales, NF4 factors and biases None; any other parameter its own shape. A
    stack of routed experts counts the experts it holds (`p`'s first dim: E, or E/k under expert parallelism)."""
    from rayft.model.fp8 import QuantisedExperts, QuantisedLinear  # the workers' layers: whoever has a model has them

    if isinstance(module, QuantisedLinear):
        return (module.out_features, module.in_features) if name == "weight" else None
    if isinstance(module, QuantisedExperts):
        return (p.shape[0], *module.shapes[name][1:]) if name in EXPERT_WEIGHTS else None
    return tuple(p.shape)


def routed_expert_counts(model: nn.Module, text: Any) -> dict[int, int]:
    """The elements a token is multiplied by, by `id`, of every parameter of the MoE blocks' routed experts: top_k of
    the experts each fused weight stack (`[E, out, in]`, in bf16, FP8 or NF4 storage: `matrix_shape`) and each LoRA
    factor (PEFT's `[E·r, in]`, `[out, r·E]`) holds, and nothing of their biases and scales (no matmul). A layer has
    E experts (the family's own config key); under expert parallelism this worker's tensors hold E/k of them. Only
    the blocks of the families rayft knows: it refuses the others before a run."""
    blocks = [m for m in moe_blocks(model) if block_of(m) is not None]
    if not blocks:
        return {}
    top_k = text.num_experts_per_tok
    counts: dict[int, int] = {}
    for block in blocks:
        experts = cast(nn.Module, block.experts)  # `moe_blocks` picked modules with an `experts` child module
        held = _held_experts(experts, num_routed_experts(text))
        for module in experts.modules():
            for name, p in module.named_parameters(recurse=False):
                shape, matrix = matrix_shape(module, name, p), p.requires_grad or name in EXPERT_WEIGHTS
                counts[id(p)] = math.prod(shape) * top_k // held if shape is not None and matrix else 0
    return counts


def _held_experts(experts: nn.Module, num_experts: int) -> int:
    """The experts a block's tensors hold on this worker: all of them, or the rows expert parallelism cut them to
    (`ep_rows`: first, count, total, set by `rayft.parallel.expert`)."""
    cut = next((cast("tuple[int, int, int]", m.ep_rows) for m in experts.modules() if hasattr(m, "ep_rows")), None)
    return cut[1] if cut is not None else num_experts


def attention_flops(text: Any, seq_len: int) -> float:
    """2 · L · s · H · (d_qk + d_v): QKᵀ and attention·V, forward, per token attending s keys (MLA: its own q/k and
    v widths)."""
    heads: int = text.num_attention_heads
    head_dim: int = getattr(text, "head_dim", None) or text.hidden_size // heads
    d_qk: int = (
        getattr(text, "qk_head_dim", None)
        or ((getattr(text, "qk_nope_head_dim", 0) or 0) + (getattr(text, "qk_rope_head_dim", 0) or 0))
        or head_dim
    )
    d_v: int = getattr(text, "v_head_dim", None) or head_dim
    layers: int = text.num_hidden_layers
    return 2.0 * layers * seq_len * heads * (d_qk + d_v)


def peak_flops(device: torch.device, stated_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of this rank's device: the one the config states (`train.peak_tflops`), else the table's bf16
    figure for a known GPU; None on CPU or an unknown GPU without a stated peak (MFU is then reported as null)."""
    if stated_tflops is not None:
        return stated_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def mfu(tokens_per_s_per_gpu: float, flops_per_token: float, peak: float | None) -> float | None:
    return tokens_per_s_per_gpu * flops_per_token / peak if peak else None
