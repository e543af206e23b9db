"""The hub's per-expert keys read into fused expert parameters in one process: an expert-parallel rank's range of
experts, and preflight's check naming every missing or misfit expert tensor before anything is copied."""

from __future__ import annotations

import shutil

import pytest
import torch
from fixtures.moe_families import make_hub_moe
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rayft.config import ConfigError, ModelConfig
from rayft.model.build import empty_model
from rayft.model.files import check_weights_match
from rayft.model.weights import buffers_kept, load_sharded_

FIRST, HELD, EXPERTS = 1, 2, 4  # this rank's experts: 1 and 2 of 4


def _expert_parallel_model(model_dir):
    """The model on the meta device with every experts module cut to experts [FIRST, FIRST + HELD), as expert
    parallelism cuts it (`ep_rows`), then given real (empty) storage."""
    model = empty_model(ModelConfig(model_name_or_path=str(model_dir), torch_dtype="float32"))
    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            for name, param in list(module.named_parameters(recurse=False)):
                local = torch.empty((HELD, *param.shape[1:]), device="meta")
                setattr(module, name, torch.nn.Parameter(local, requires_grad=False))
            module.num_experts, module.ep_rows = HELD, (FIRST, HELD, EXPERTS)
    with buffers_kept(model):
        model.to_empty(device=torch.device("cpu"))
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_an_expert_parallel_rank_reads_its_experts_from_per_expert_keys(tmp_path, family):
    model_dir = make_hub_moe(family, tmp_path / family)
    model = _expert_parallel_model(model_dir)
    load_sharded_(model, model_dir)
    want = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    for name, tensor in got.items():
        expected = want[name][FIRST : FIRST + HELD] if ".experts." in name else want[name]
        assert torch.equal(tensor, expected), name


def test_preflight_names_every_missing_and_misfit_expert_tensor(tmp_path):
    model_dir = make_hub_moe("qwen3_moe", tmp_path / "whole")
    model = empty_model(ModelConfig(model_name_or_path=str(model_dir), torch_dtype="float32"))
    check_weights_match(model, model_dir)  # the checkpoint as written fits
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del (
        tensors["model.layers.0.mlp.experts.2.gate_proj.weight"],
        tensors["model.layers.1.mlp.experts.3.down_proj.weight"],
    )
    save_file(tensors, str(broken / "model.safetensors"))
    lacking = r"lacks 2 model tensors: model\.layers\.0\.mlp\.experts\.2\.gate_proj\.weight, model\.layers\.1\."
    with pytest.raises(ConfigError, match=lacking + r"mlp\.experts\.3\.down_proj\.weight"):
        check_weights_match(model, broken)
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.0.up_proj.weight"] = torch.zeros(15, 32)  # one row short
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(
        ConfigError,
        match=r"'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight' \(\[16, 32\] \+ "
        r"\[15, 32\] concatenated\) does not make expert 0",
    ):
        check_weights_match(model, broken)


def test_per_expert_keys_inside_a_vlm_wrapper_are_found(tmp_path):
    """A transformers-5 vision+text wrapper stores the text model under `model.language_model.`: the per-expert
    tensors are looked up in the same wrapper form as every other tensor."""
    model_dir = make_hub_moe("qwen3_moe", tmp_path / "plain")
    wrapped = tmp_path / "wrapped"
    shutil.copytree(model_dir, wrapped)
    tensors = load_file(str(model_dir / "model.safetensors"))
    moved = {
        k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v for k, v in tensors.items()
    }
    assert "model.language_model.layers.1.mlp.experts.3.up_proj.weight" in moved
    save_file(moved, str(wrapped / "model.safetensors"))
    model = empty_model(ModelConfig(model_name_or_path=str(model_dir), torch_dtype="float32"))
    with buffers_kept(model):
        model.to_empty(device=torch.device("cpu"))
    load_sharded_(model, wrapped)
    want = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_every_model_type_transformers_knows_has_a_readable_key_layout():
    """The hub-key layouts come from transformers' conversion mappings, whose operations differ by model type (a
    transpose has two dims, not one): reading any of them must not fail, whatever wrapper a checkpoint names."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from rayft.model.hub_keys import checkpoint_names, expert_parts

    failed = {}
    for model_type in CONFIG_MAPPING_NAMES:
        try:
            expert_parts(model_type, "model.layers.0.mlp.experts.gate_up_proj")
            checkpoint_names(model_type, "model.layers.0.mlp.gate.weight")
        except Exception as e:  # every model type's failure is listed at once
            failed[model_type] = repr(e)
    assert not failed, failed
