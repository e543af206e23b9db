"""Small random checkpoints in the exact on-disk layout of `mistralai/Mistral-Small-4-119B-2603`.

What the hub ships, reproduced at toy size so loading code is tested against the real thing:
- a vision+text `Mistral3ForConditionalGeneration` config (`text_config` = mistral4, `vision_config` = pixtral),
- llava-style keys: `language_model.model.layers.N.*`, `language_model.lm_head.weight`, `vision_tower.*`,
  `multi_modal_projector.*`,
- FP8 E4M3 weights with *static per-tensor* scales for every decoder Linear (`weight` + 0-d `weight_scale_inv`
  + 0-d `activation_scale`), and the routed experts already fused as 3D `mlp.experts.gate_up_proj` /
  `mlp.experts.down_proj` with `[E,1,1]` `*_scale_inv`; embeddings, norms, router and LM head stay bf16,
- `quantization_config = {quant_method: fp8, activation_scheme: static, weight_block_size: null, ...}`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

FP8_MAX = 448.0  # largest finite float8_e4m3fn

TINY_MISTRAL4 = {
    "vocab_size": 131072,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "head_dim": 16,
    "tie_word_embeddings": False,
}
TINY_PIXTRAL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "head_dim": 16,
    "image_size": 32,
    "patch_size": 16,
}
NOT_QUANTIZED = ("embed_tokens", "norm", "mlp.gate.", "lm_head")


def hub_key(name: str) -> str:
    """transformers-5 wrapper names → the llava-style names of the hub files."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    if name == "lm_head.weight":
        return "language_model.lm_head.weight"
    return name.removeprefix("model.")


def _quantize(tensor: torch.Tensor, per_expert: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = tensor.abs().amax(dim=(1, 2), keepdim=True) if per_expert else tensor.abs().max()
    scale = (amax / FP8_MAX).clamp(min=1e-12).to(torch.float32)
    return (tensor / scale).to(torch.float8_e4m3fn), scale


def hub_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        key, tensor = hub_key(name), tensor.detach().to(torch.bfloat16)
        is_text_linear = key.startswith("language_model.model.layers.") and key.endswith(".weight")
        is_expert = key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        if is_expert:
            out[key], out[f"{key}_scale_inv"] = _quantize(tensor.float(), per_expert=True)
            out[f"{key}_activation_scale"] = torch.ones(())
        elif is_text_linear and tensor.ndim == 2 and not any(t in key for t in NOT_QUANTIZED):
            out[key], scale = _quantize(tensor.float(), per_expert=False)
            stem = key.removesuffix(".weight")
            out[f"{stem}.weight_scale_inv"] = scale.reshape(())
            out[f"{stem}.activation_scale"] = torch.ones(())
        else:
            out[key] = tensor.contiguous()
    return out


def make_tiny_mistral_small4(
    directory: Path, seed: int = 0, tokenizer_from: Path | None = None, **text_overrides: int
) -> Path:
    """A tiny Mistral-Small-4 in the hub's layout; returns the directory (reused when it already exists)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Mistral4Config, PixtralVisionConfig

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = Mistral3Config(
        text_config=Mistral4Config(**{**TINY_MISTRAL4, **text_overrides}),
        vision_config=PixtralVisionConfig(**TINY_PIXTRAL),
    )
    model = Mistral3ForConditionalGeneration(config)
    tensors = hub_state_dict(model)
    # Two shards + an index, like the hub's 40-odd files.
    keys = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2 :]}  # fmt: skip
    for file, names in halves.items():
        save_file({k: tensors[k].contiguous() for k in names}, str(directory / file), metadata={"format": "pt"})
    weight_map = {k: file for file, names in halves.items() for k in names}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    config_dict = config.to_dict()
    config_dict["architectures"] = ["Mistral3ForConditionalGeneration"]
    config_dict["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "static",
        "weight_block_size": None,
        "modules_to_not_convert": ["vision_tower", "multi_modal_projector", "lm_head", "mlp.gate"],
    }
    (directory / "config.json").write_text(json.dumps(config_dict, indent=2, default=str))
    if tokenizer_from is not None:
        from rayft.tokenizer import copy_tokenizer_files

        copy_tokenizer_files(Path(tokenizer_from), directory)
    return directory
