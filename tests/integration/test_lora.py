"""LoRA target resolution per architecture, on weightless (meta) models."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, SEED_CONFIG, Fixtures

from rayft.config import ConfigError, LoraConfig, ModelConfig
from rayft.model.build import empty_model
from rayft.model.lora import DENSE_TARGETS, MLA_TARGETS, resolve_targets

SEED_TARGETS = list(DENSE_TARGETS)


def _resolve(model_dir, targets):
    return resolve_targets(
        empty_model(ModelConfig(model_name_or_path=str(model_dir))), LoraConfig(target_modules=targets)
    )


def test_dense_mistral_takes_the_seed_list_whole(fixtures: Fixtures):
    targets = _resolve(fixtures.model, SEED_TARGETS)
    assert targets.unmatched == [] and targets.warning is None
    assert len(targets.modules) == 2 * 7
    assert _resolve(fixtures.model, ["auto"]).names == SEED_TARGETS


def test_names_that_match_nothing_are_refused_with_the_real_names(fixtures: Fixtures):
    with pytest.raises(ConfigError, match=r"match no module of MistralForCausalLM.*q_proj"):
        _resolve(fixtures.model, ["q_a_proj", "kv_b_proj"])


def test_seed_list_on_mistral4_warns_what_actually_matched(mistral4_hub):
    targets = _resolve(mistral4_hub, SEED_TARGETS)
    assert targets.architecture == "Mistral4ForCausalLM"
    assert targets.unmatched == ["q_proj", "k_proj", "v_proj"]
    assert all(
        m.endswith(("o_proj", "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"))
        for m in targets.modules
    )
    warning = targets.warning
    assert "q_proj, k_proj, v_proj match nothing in Mistral4ForCausalLM" in warning
    assert "q_a_proj" in warning and "kv_a_proj_with_mqa" in warning and "auto" in warning


def test_auto_on_mistral4_is_mla_plus_shared_expert_and_never_the_vision_tower(mistral4_hub):
    model = empty_model(ModelConfig(model_name_or_path=str(mistral4_hub)))
    assert model.config._experts_implementation == "grouped_mm"
    targets = _resolve(mistral4_hub, ["auto"])
    assert targets.names == [*MLA_TARGETS, "gate_proj", "up_proj", "down_proj"] and not targets.unmatched
    assert len(targets.modules) == 2 * 8
    assert not [m for m in targets.modules if "vision" in m or "projector" in m]


def test_validate_prints_the_warning_for_the_seed_yaml_on_mistral4(mistral4_hub, fixtures: Fixtures, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rayft.cli",
            "validate",
            "--config",
            str(SEED_CONFIG),
            "--override",
            f"model.model_name_or_path={mistral4_hub}",
            "--override",
            f"data.dataset_name_or_path={fixtures.dataset}",
            "--override",
            f"train.output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert "Mistral4ForCausalLM" in result.stdout and "trainable params" in result.stdout
    assert "warning: lora.target_modules: q_proj, k_proj, v_proj match nothing" in result.stderr


def _meta_model(model_type: str, **fields):
    import torch
    from fixtures.families import FAMILIES, TINY
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=512, **{**TINY, **FAMILIES.get(model_type, {}), **fields})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"])
def test_auto_targets_every_projection_of_each_dense_family(model_type):
    targets = resolve_targets(_meta_model(model_type), LoraConfig(target_modules=["auto"]))
    assert targets.names == SEED_TARGETS and not targets.unmatched
    assert len(targets.modules) == 2 * 7  # 2 layers x q, k, v, o, gate, up, down


def test_auto_on_an_unknown_architecture_is_an_error_listing_its_linear_layers():
    """Phi-3 fuses q/k/v and gate/up: the dense list would silently adapt only o_proj and down_proj."""
    names = r"its linear layers are: down_proj, gate_up_proj, lm_head, o_proj, qkv_proj"
    with pytest.raises(ConfigError, match=r"auto has no target set for model type 'phi3' \(Phi3ForCausalLM.*" + names):
        resolve_targets(_meta_model("phi3"), LoraConfig(target_modules=["auto"]))
    explicit = resolve_targets(_meta_model("phi3"), LoraConfig(target_modules=["qkv_proj", "o_proj"]))
    assert len(explicit.modules) == 2 * 2
