"""Per-GPU memory plan of a run, from the model's structure on the meta device (no weights needed).

Formula (bytes per GPU, world W = nodes × GPUs per node, s = tokens per micro-batch, h = hidden, V = vocab,
c = bytes of the compute dtype, p = bytes of the stored weights):
  sharded weights      P_total · p / W
  gathered layers      (1 + forward_prefetch) · P_layer · c      (every layer when reshard_after_forward is off)
  gathered root        P_root · c                                 (embeddings + head stay gathered after forward)
  LoRA                 P_lora · (4 param + 4 grad + 8 Adam) / W
  activations, AC on   L · s · h · c  (layer inputs)  +  one layer's working set
               AC off  L · (one layer's working set)
      a layer's working set = s · h · 17c (attention/norms/MLP, flash attention: no s² term)
                              + s · top_k · moe_intermediate · 3c (routed experts' gate/up/act)
  logits + loss        s · V · (c + 8)    (logits, fp32 log-softmax, fp32 gradient)
  runtime overhead     2 GiB on GPU (CUDA context, NCCL buffers, allocator slack); not counted on CPU
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from rayft.config import Config
from rayft.model.loss import chunk_rows

GIB = 2**30
GPU_GIB = {"h100": 79.6, "h200": 139.8}  # usable memory the device reports
RUNTIME_OVERHEAD_GIB = 2.0


@dataclass(frozen=True)
class Structure:
    """What the formula needs from the model."""

    architecture: str
    total: int
    largest_layer: int
    layers: int
    root: int
    lora: int
    hidden: int
    vocab: int
    top_k: int
    moe_intermediate: int


@dataclass(frozen=True)
class MemoryPlan:
    world_size: int
    rows: list[tuple[str, float]]  # (component, GiB per GPU)
    gpu: str | None

    @property
    def total_gib(self) -> float:
        return sum(gib for _, gib in self.rows)

    @property
    def capacity_gib(self) -> float | None:
        return GPU_GIB.get(self.gpu) if self.gpu else None


def structure(model: nn.Module, config) -> Structure:
    """Parameter counts of a (meta) PEFT model with its decoder layers."""
    from rayft.model.build import decoder_layers

    layers = decoder_layers(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    params = list(model.parameters())
    return Structure(
        architecture=type(model.get_base_model()).__name__,
        total=sum(p.numel() for p in params if not p.requires_grad),
        largest_layer=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
        layers=len(layers),
        root=sum(p.numel() for p in params if id(p) not in in_layers),
        lora=sum(p.numel() for p in params if p.requires_grad),
        hidden=config.hidden_size,
        vocab=config.vocab_size,
        top_k=getattr(config, "num_experts_per_tok", 0) or 0,
        moe_intermediate=getattr(config, "moe_intermediate_size", 0) or 0,
    )


def plan_memory(cfg: Config, s: Structure, world_size: int, on_gpu: bool, gpu: str | None = None) -> MemoryPlan:
    c = 2 if (on_gpu and cfg.train.bf16 and cfg.fsdp.param_dtype in ("auto", "bfloat16")) else 4
    p = 4 if cfg.model.torch_dtype == "float32" else 2
    tokens = cfg.data.max_length * cfg.train.per_device_train_batch_size
    shards = cfg.fsdp.shard_group(world_size)
    # logits in the compute dtype + fp32 logits + fp32 log-probs: for every token, or one chunk with the fused loss
    logit_rows = min(tokens, chunk_rows(s.vocab, on_gpu)) if cfg.train.fused_loss else tokens
    gathered_layers = 1 + cfg.fsdp.forward_prefetch if cfg.fsdp.reshards(world_size) else s.layers
    layer_working_set = tokens * s.hidden * 17 * c + tokens * s.top_k * s.moe_intermediate * 3 * c
    if cfg.fsdp.activation_checkpointing or cfg.train.gradient_checkpointing:
        activations, label = s.layers * tokens * s.hidden * c + layer_working_set, "activations (AC on)"
    else:
        activations, label = s.layers * layer_working_set, "activations (AC off)"
    rows = [
        (f"sharded weights (/{shards})", s.total * p / shards),
        (f"gathered layers ({gathered_layers} x {_count(s.largest_layer)})", gathered_layers * s.largest_layer * c),
        ("gathered root (embeddings, head)", s.root * c),
        (f"LoRA params+grads+AdamW (/{shards})", s.lora * 16 / shards),
        (label, activations),
        ("logits + loss", logit_rows * s.vocab * (c + 8)),
    ]
    if on_gpu:
        rows.append(("CUDA/NCCL/allocator overhead", RUNTIME_OVERHEAD_GIB * GIB))
    return MemoryPlan(world_size=world_size, rows=[(name, b / GIB) for name, b in rows], gpu=gpu)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def meta_structure(cfg: Config, config=None) -> Structure:
    """Structure of the weightless LoRA model (from `config`, or the config of model.model_name_or_path)."""
    from rayft.model.build import weightless_lora_model

    model, _ = weightless_lora_model(cfg, config)
    return structure(model, model.config)


def format_plans(plans: list[MemoryPlan], s: Structure, tokens: int) -> str:
    head = f"{s.architecture}: {s.total / 1e9:.2f}B params, LoRA {s.lora / 1e6:.1f}M trainable, {tokens} tokens/GPU"
    width = max(len(name) for name, _ in plans[0].rows) + 2
    lines = [head, "component".ljust(width) + "".join(f"{'W=' + str(p.world_size):>10}" for p in plans)]
    for i, (name, _) in enumerate(plans[0].rows):
        label = name.split(" (/")[0] if "(/" in name else name
        lines.append(label.ljust(width) + "".join(f"{p.rows[i][1]:>10.2f}" for p in plans))
    lines.append("total GiB/GPU".ljust(width) + "".join(f"{p.total_gib:>10.1f}" for p in plans))
    if plans[0].capacity_gib:
        verdicts = "".join(f"{'fits' if p.total_gib <= p.capacity_gib else 'OOM':>10}" for p in plans)
        lines.append(f"on {plans[0].gpu} ({plans[0].capacity_gib} GiB)".ljust(width) + verdicts)
    return "\n".join(lines)
