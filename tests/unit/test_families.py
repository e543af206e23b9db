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

CONFIGS = {
    **{t: {**COMMON, **fields} for t, fields in MOE_FAMILIES.items()},
    "mistral4": {**TINY_MISTRAL4, "vocab_size": 1024},
}


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
    expected_experts = next(
        v for k, v in CONFIGS[model_type].items() if k in ("num_experts", "n_routed_experts", "num_local_experts")
    )
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
    targets = resolve_targets(model, LoraConfig(target_modules=["auto"], target_experts=True, lora_dropout=0.0))
    assert not targets.unmatched, targets.unmatched
    assert any(".self_attn." in m for m in targets.modules)
    assert {p.rsplit(".", 1)[-1] for p in targets.parameters} == {"gate_up_proj", "down_proj"}


def _adapted(peft_model: torch.nn.Module) -> set[str]:
    """The modules PEFT gave an adapter: their paths in the base model (an experts module once, however many of its
    parameters it adapts)."""
    wrapped = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    return {n.replace(".base_layer", "") for n in wrapped}


@pytest.mark.parametrize("target_experts", [False, True])
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_peft_adapts_exactly_what_auto_says_on_every_moe_family(model_type: str, target_experts: bool):
    """What `auto` resolves to (the modules the log and the plan name, the expert parameters) is what PEFT adapts:
    PEFT maps transformers-4 expert names (gate_proj, up_proj, down_proj) onto the fused experts of the models
    transformers converts from that layout, which would move the dense and shared MLPs' adapters onto the routed
    experts."""
    from rayft.model.frozen import fused_experts
    from rayft.model.lora import wrap

    model = _model(model_type, CONFIGS[model_type])
    experts = {n for n, m in model.named_modules() if fused_experts(m)} if target_experts else set()
    lora = LoraConfig(target_modules=["auto"], target_experts=target_experts, lora_dropout=0.0)
    peft_model, targets = wrap(model, lora)
    assert _adapted(peft_model) == set(targets.modules) | experts


@pytest.mark.parametrize("target", ["gate_proj", "up_proj", "down_proj", "all-linear"])
def test_expert_names_peft_would_move_onto_the_routed_experts_are_refused(target: str):
    """Explicit targets PEFT would rewrite (DeepSeek-V3's shared and dense MLPs) are refused before PEFT wraps
    anything, naming them and the way to LoRA on the experts; PEFT itself would adapt the routed experts instead,
    or fail on the dropout."""
    from rayft.model.lora import wrap

    targets = [target] if target == "all-linear" else ["q_a_proj", target]
    with pytest.raises(ConfigError, match=r"lora\.target_modules on .*routed experts.*lora\.target_experts: true"):
        wrap(_model("deepseek_v3", CONFIGS["deepseek_v3"]), LoraConfig(target_modules=targets))


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
