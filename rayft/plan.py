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
With the frozen base in FP8 (`model.frozen_dtype`), the F decoder matrices (linears, routed experts; R rows) count
1 byte + a 4-byte scale per row instead of p (sharded) or c (gathered), and one FP8 tensor at a time is dequantised
for its matmul: + F_max · c (the largest, e.g. one layer's expert stack) + its fp32 block (≤ 256 MiB).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from rayft.config import Config
from rayft.model.fp8 import DEQUANT_BLOCK, EXPERT_WEIGHTS
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
    fp8: int = 0  # frozen decoder matrices (linears, routed experts) that FP8 storage holds
    fp8_rows: int = 0  # their rows: one fp32 scale each
    fp8_layer: int = 0  # of those, in the largest layer
    fp8_layer_rows: int = 0
    fp8_largest: int = 0  # the largest single such tensor: dequantised whole for its matmul


@dataclass(frozen=True)
class MemoryPlan:
    world_size: int
    rows: list[tuple[str, float]]  # (component, GiB per GPU)
    gpu: str | None
    frozen: str = "bf16"  # how the frozen base is stored: bf16, fp32 or fp8

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
    fp8_per_layer = [fp8_matrices(layer) for layer in layers]
    largest = max(range(len(layers)), key=lambda i: sum(p.numel() for p in layers[i].parameters()))
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
        fp8_rows=sum(p.numel() // p.shape[-1] for ps in fp8_per_layer for p in ps),
        fp8_layer=sum(p.numel() for p in fp8_per_layer[largest]),
        fp8_layer_rows=sum(p.numel() // p.shape[-1] for p in fp8_per_layer[largest]),
        fp8_largest=max((p.numel() for ps in fp8_per_layer for p in ps), default=0),
    )


def fp8_matrices(layer: nn.Module) -> list[nn.Parameter]:
    """The frozen matrices of a decoder layer that FP8 storage holds: linear weights and fused 3D expert weights
    (what `rayft.model.fp8.to_fp8_` swaps), LoRA's own excluded."""
    out = []
    for name, module in layer.named_modules():
        if ".lora_" in f".{name}":
            continue
        if isinstance(module, nn.Linear):
            out.append(module.weight)
        out += [p for n, p in module.named_parameters(recurse=False) if p.ndim == 3 and n in EXPERT_WEIGHTS]
    return [p for p in out if not p.requires_grad]


def plan_memory(
    cfg: Config, s: Structure, world_size: int, on_gpu: bool, gpu: str | None = None, fp8: bool = False
) -> MemoryPlan:
    """The plan with the frozen base stored as `torch_dtype`, or (`fp8`) its decoder matrices in FP8."""
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
    if fp8:
        stored = (s.total - s.fp8) * p + s.fp8 + 4 * s.fp8_rows
        layer = (s.largest_layer - s.fp8_layer) * c + s.fp8_layer + 4 * s.fp8_layer_rows
    else:
        stored, layer = s.total * p, s.largest_layer * c
    rows = [
        (f"sharded weights (/{shards})", stored / shards),
        (f"gathered layers ({gathered_layers} x {_count(s.largest_layer)})", gathered_layers * layer),
        ("gathered root (embeddings, head)", s.root * c),
        (f"LoRA params+grads+AdamW (/{shards})", s.lora * 16 / shards),
        (label, activations),
        ("logits + loss", logit_rows * s.vocab * (c + 8)),
    ]
    if fp8:
        rows.append(
            ("FP8 weight dequantised for its matmul", s.fp8_largest * c + min(s.fp8_largest, DEQUANT_BLOCK) * 4)
        )
    if on_gpu:
        rows.append(("CUDA/NCCL/allocator overhead", RUNTIME_OVERHEAD_GIB * GIB))
    frozen = "fp8" if fp8 else ("fp32" if p == 4 else "bf16")
    return MemoryPlan(world_size=world_size, rows=[(name, b / GIB) for name, b in rows], gpu=gpu, frozen=frozen)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def meta_structure(cfg: Config, config=None) -> Structure:
    """Structure of the weightless LoRA model (from `config`, or the config of model.model_name_or_path)."""
    from rayft.model.build import weightless_lora_model

    model, _ = weightless_lora_model(cfg, config)
    return structure(model, model.config)


def format_plans(plans: list[MemoryPlan], s: Structure, tokens: int, other: list[MemoryPlan] | None = None) -> str:
    """The table of `plans`; with `other` (the same runs with the frozen base stored the other way: FP8 / bf16),
    a line of its totals next to them."""
    head = f"{s.architecture}: {s.total / 1e9:.2f}B params, LoRA {s.lora / 1e6:.1f}M trainable, {tokens} tokens/GPU"
    head += f", frozen base stored in {plans[0].frozen}"
    names = [name for name, _ in plans[0].rows]
    width = max(len(name) for name in names) + 2
    lines = [head, "component".ljust(width) + "".join(f"{'W=' + str(p.world_size):>10}" for p in plans)]
    for i, name in enumerate(names):
        label = name.split(" (/")[0] if "(/" in name else name
        lines.append(label.ljust(width) + "".join(f"{p.rows[i][1]:>10.2f}" for p in plans))
    lines.append("total GiB/GPU".ljust(width) + "".join(f"{p.total_gib:>10.1f}" for p in plans))
    if other:
        label = f"  with {other[0].frozen} base"
        lines.append(label.ljust(width) + "".join(f"{p.total_gib:>10.1f}" for p in other))
    if plans[0].capacity_gib:
        verdicts = "".join(f"{'fits' if p.total_gib <= p.capacity_gib else 'OOM':>10}" for p in plans)
        lines.append(f"on {plans[0].gpu} ({plans[0].capacity_gib} GiB)".ljust(width) + verdicts)
    return "\n".join(lines)
