"""The family table (rayft.model.families) against transformers' own MoE blocks, run on tiny CPU models: each entry
names the block the model really builds, a router that returns (logits, weights, indices), the shared expert and
jitter the block really has and what it really returns; LoRA's `auto` set matches modules of every family; and an
MoE block the table does not know is refused, naming the key, while dense models pass."""

from __future__ import annotations

import pytest
import torch
from fixtures.hub_layout import TINY_MISTRAL4
from fixtures.moe_families import COMMON, MOE_FAMILIES, UNKNOWN_MOE

from rayft.config import ConfigError, LoraConfig
from rayft.model.families import FAMILIES, check_moe_family, moe_blocks, num_routed_experts
from rayft.model.lora import resolve_targets

CONFIGS = {**{t: {**COMMON, **fields} for t, fields in MOE_FAMILIES.items()},
           "mistral4": {**TINY_MISTRAL4, "vocab_size": 1024}}  # fmt: skip


def _model(model_type: str, fields: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, Mistral4Config, Mistral4ForCausalLM

    torch.manual_seed(0)
    if model_type == "mistral4":  # not in AutoModelForCausalLM
        return Mistral4ForCausalLM(Mistral4Config(**fields)).eval()
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_each_moe_entry_describes_the_block_transformers_builds(model_type: str):
    model = _model(model_type, CONFIGS[model_type])
    moe = FAMILIES[model_type].moe
    blocks = moe_blocks(model)
    assert blocks and {type(b).__name__ for b in blocks} == {moe.block}
    expected_experts = next(v for k, v in CONFIGS[model_type].items() if k in ("num_experts", "n_routed_experts",
                                                                              "num_local_experts"))  # fmt: skip
    assert num_routed_experts(model.config) == expected_experts == blocks[0].experts.num_experts
    block, hidden = blocks[0], torch.randn(1, 5, model.config.hidden_size)
    logits, weights, index = getattr(block, moe.router)(hidden.view(-1, hidden.shape[-1]))
    top_k = model.config.num_experts_per_tok
    assert logits.shape == (5, expected_experts) and weights.shape == index.shape == (5, top_k)
    assert (moe.shared is not None) == any("shared" in n for n, _ in block.named_children())
    if moe.shared is not None:
        assert isinstance(getattr(block, moe.shared), torch.nn.Module)
    assert (moe.jitter is not None) == hasattr(block, "jitter_noise")
    with torch.no_grad():
        out = block(hidden)
    assert isinstance(out, tuple) == moe.returns_router_weights
    if moe.returns_router_weights:
        torch.testing.assert_close(out[1], weights)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_auto_targets_match_modules_of_every_moe_family(model_type: str):
    model = _model(model_type, CONFIGS[model_type])
    targets = resolve_targets(model, LoraConfig(target_modules=["auto"], target_experts=True))
    assert not targets.unmatched, targets.unmatched
    assert any(".self_attn." in m for m in targets.modules)
    assert {p.rsplit(".", 1)[-1] for p in targets.parameters} == {"gate_up_proj", "down_proj"}


@pytest.mark.parametrize("model_type", sorted(UNKNOWN_MOE))
def test_an_unknown_moe_block_is_refused_naming_the_key(model_type: str):
    model = _model(model_type, {**COMMON, **UNKNOWN_MOE[model_type]})
    with pytest.raises(ConfigError) as refused:
        check_moe_family(model, "/models/x")
    message = str(refused.value)
    assert message.startswith(f"model.model_name_or_path: /models/x is a {model_type} model whose MoE blocks (")
    for family in ("Mistral-Small-4", "DeepSeek-V3", "Qwen3-MoE", "Mixtral", "GPT-OSS"):
        assert family in message


def test_dense_models_pass():
    check_moe_family(_model("llama", {**COMMON, "intermediate_size": 32}), "/models/x")
