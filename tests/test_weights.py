"""Per-rank sharded loading: shards equal the checkpoint, FP8 slices dequantise like the whole tensor."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import Fixtures, free_port, tiny_config
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rayft.config import Config
from rayft.model.build import build_model
from rayft.model.weights import CheckpointKeyError, SafetensorsCheckpoint, dequantize, load_sharded_, model_param_name


def _sharded_rank(rank: int, world: int, port: int, raw: dict, model_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build_model(Config.from_dict(raw), on_gpu=False)
        reference = load_file(f"{model_dir}/model.safetensors")
        probe = torch.tensor([[1, 1784, 3937, 1278, 8312, 2]])
        with torch.no_grad():
            logits = model(input_ids=probe).logits  # collective: every rank runs it
        model.reshard()  # the root keeps its weights gathered after forward
        for name, param in model.named_parameters():
            full = param.full_tensor()  # collective too
            if rank == 0 and ".lora_" not in name:
                assert torch.equal(full, reference[model_param_name(name)]), name
            if ".lora_B." in name:
                assert not full.any(), name  # fresh LoRA: B = 0, so the model equals the base
        if rank == 0:
            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            with torch.no_grad():
                assert (base(input_ids=probe).logits - logits).abs().max() < 1e-5
    finally:
        dist.destroy_process_group()


def test_two_ranks_load_only_their_shards_and_match_the_checkpoint(fixtures: Fixtures, tmp_path):
    raw = tiny_config(fixtures, tmp_path)
    assert raw["model"].get("load_mode", "sharded") == "sharded"
    mp.spawn(_sharded_rank, args=(2, free_port(), raw, str(fixtures.model)), nprocs=2)


def _fp8_checkpoint(tmp_path) -> tuple[SafetensorsCheckpoint, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    linear, experts = torch.randn(6, 4), torch.randn(4, 6, 3)
    linear_scale = linear.abs().max() / 448
    expert_scale = experts.abs().amax(dim=(1, 2), keepdim=True) / 448
    tensors = {
        "layers.0.proj.weight": (linear / linear_scale).to(torch.float8_e4m3fn),
        "layers.0.proj.weight_scale_inv": linear_scale.reshape(()),
        "layers.0.proj.activation_scale": torch.tensor(1.0),
        "layers.0.experts.gate_up_proj": (experts / expert_scale).to(torch.float8_e4m3fn),
        "layers.0.experts.gate_up_proj_scale_inv": expert_scale,
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return SafetensorsCheckpoint(tmp_path), tensors


def test_fp8_slices_dequantise_like_the_whole_tensor(tmp_path):
    checkpoint, raw = _fp8_checkpoint(tmp_path)
    for key, scale in (("layers.0.proj.weight", "layers.0.proj.weight_scale_inv"),
                       ("layers.0.experts.gate_up_proj", "layers.0.experts.gate_up_proj_scale_inv")):  # fmt: skip
        whole = raw[key].to(torch.float32) * raw[scale].to(torch.float32)
        rows = checkpoint.rows(key, 1, 3)
        assert rows.dtype == torch.float8_e4m3fn and rows.shape[0] == 2
        assert torch.equal(dequantize(rows, key, checkpoint, start=1), whole[1:3]), key


def test_a_tensor_missing_from_the_checkpoint_fails_loudly(tmp_path):
    save_file({"weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=True))
    with pytest.raises(CheckpointKeyError, match=r"lacks 2 model tensors: 0\.weight, 0\.bias"):
        load_sharded_(model, tmp_path)


MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def _dequantised_reference(model_dir: str) -> dict[str, torch.Tensor]:
    """Every language-model tensor of the hub files as fp32 (`fp8 * scale`), keyed like the llava layout."""
    checkpoint = SafetensorsCheckpoint(model_dir)
    out = {}
    for key in checkpoint.weight_map:
        if key.startswith("language_model.") and not key.endswith(("_scale_inv", "activation_scale")):
            rows = checkpoint.rows(key, 0, checkpoint.shape(key)[0])
            out[key] = dequantize(rows, key, checkpoint, 0).to(torch.float32)
    return out


def _hub_rank(rank: int, world: int, port: int, raw: dict, model_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build_model(Config.from_dict(raw), on_gpu=False)
        assert type(model.get_base_model()).__name__.endswith("Mistral4ForCausalLM")
        reference = _dequantised_reference(model_dir) if rank == 0 else {}
        seen = set()
        for name, param in model.named_parameters():
            full = param.full_tensor()
            if rank == 0 and ".lora_" not in name:
                key = "language_model." + model_param_name(name)
                assert full.dtype == torch.bfloat16, name
                assert torch.equal(full, reference[key].to(full.dtype)), name
                seen.add(key)
        if rank == 0:
            assert seen == set(reference), set(reference) ^ seen  # experts, router, norms, head: all of it
            assert any("experts.gate_up_proj" in k for k in seen)
        assert not any("vision_tower" in n or "multi_modal" in n for n, _ in model.named_parameters())
    finally:
        dist.destroy_process_group()


def test_fp8_hub_layout_loads_dequantised_on_two_ranks(fixtures: Fixtures, mistral4_hub, tmp_path):
    model_dir = mistral4_hub
    raw = tiny_config(fixtures, tmp_path)
    raw["model"].update(model_name_or_path=str(model_dir), torch_dtype="bfloat16", frozen_dtype="bfloat16")
    raw["lora"]["target_modules"] = MLA_TARGETS
    mp.spawn(_hub_rank, args=(2, free_port(), raw, str(model_dir)), nprocs=2)


def test_routed_expert_lora_trains_on_every_rank_and_saves(trained_expert_adapter):
    """The fixture trained it on 2 ranks, asserting non-zero gradients on each rank's shards of every expert LoRA."""
    adapter = load_file(trained_expert_adapter / "adapter_model.safetensors")
    experts = {k: v for k, v in adapter.items() if ".experts." in k}
    assert len(experts) == 8 and all(v.abs().sum() > 0 for v in experts.values())
    config = json.loads((trained_expert_adapter / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
