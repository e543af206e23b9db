"""MoE checkpoints in the hub's layout, loaded sharded: per-expert tensors read into the fused expert parameters,
rank by rank, equal to what transformers' `from_pretrained` makes of the same files — in the model's dtype, and in
FP8 storage (`model.frozen_dtype: float8_e4m3fn`, GPT-OSS's transposed biased experts included) equal to those
weights quantised per row by hand."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import Fixtures, free_port, tiny_config
from fixtures.moe_families import MOE_FAMILIES, make_hub_moe
from fixtures.ranks import spawn_ranks, whole
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rayft.config import Config
from rayft.model.weights import model_param_name
from rayft.parallel.parallelize import build_model

FROZEN = ["float32", "float8_e4m3fn"]
HUB_EXPERT_KEYS = {  # what save_pretrained writes for layer 1's expert 3 (independent of rayft's key mapping)
    "qwen3_moe": "model.layers.1.mlp.experts.3.up_proj.weight",
    "deepseek_v3": "model.layers.1.mlp.experts.3.up_proj.weight",
    "mixtral": "model.layers.1.block_sparse_moe.experts.3.w3.weight",
    "gpt_oss": "model.layers.1.mlp.experts.gate_up_proj",
}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-families")
    return {family: make_hub_moe(family, root / family) for family in MOE_FAMILIES}


@pytest.fixture(scope="module")
def moe_loads(moe_models: dict[str, Path], fixtures: Fixtures, tmp_path_factory) -> dict[str, list[str]]:
    """Every family loaded sharded on 2 gloo ranks in one spawn, in fp32 and in FP8 storage, compared on rank 0 with
    `from_pretrained`: what went wrong, per family and storage."""
    out = tmp_path_factory.mktemp("moe-loads")
    raw = tiny_config(fixtures, out)
    raw["model"].update(load_mode="sharded", torch_dtype="float32")
    raw["lora"].update(target_modules=["o_proj"], lora_dropout=0.0)  # every family has one
    models = {family: str(path) for family, path in moe_models.items()}
    spawn_ranks(_moe_rank, args=(2, free_port(), raw, models, str(out / "problems.json")), nprocs=2)
    return json.loads((out / "problems.json").read_text())


@pytest.mark.parametrize("frozen", FROZEN)
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_each_moe_family_loads_sharded_exactly_as_from_pretrained(moe_loads, moe_models, family, frozen):
    with safe_open(str(moe_models[family] / "model.safetensors"), framework="pt") as f:
        assert HUB_EXPERT_KEYS[family] in set(f.keys())  # the hub layout, not the model's in-memory names
    assert moe_loads[f"{family}-{frozen}"] == []


def _moe_rank(rank: int, world: int, port: int, raw: dict, models: dict[str, str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    problems = {}
    try:
        for family, model_dir in models.items():
            for frozen in FROZEN:
                raw["model"].update(model_name_or_path=model_dir, frozen_dtype=frozen)
                try:
                    cfg = Config.from_dict(raw)
                    check = _check_family if frozen == "float32" else _check_fp8_storage
                    problems[f"{family}-{frozen}"] = check(cfg, rank)
                except Exception as e:  # raised alike on both ranks (the load is planned whole before any copy)
                    problems[f"{family}-{frozen}"] = [f"{type(e).__name__}: {e}"]
                gc.collect()
        if rank == 0:
            Path(out).write_text(json.dumps(problems))
    finally:
        dist.destroy_process_group()


def _check_family(cfg: Config, rank: int) -> list[str]:
    """Collectives on both ranks; comparisons on rank 0, collected so both ranks stay in step."""
    problems = []
    model = build_model(cfg, on_gpu=False)
    reference = AutoModelForCausalLM.from_pretrained(cfg.model.model_name_or_path, dtype=torch.float32)
    expected = dict(reference.state_dict())
    loaded, experts = set(), 0
    for name, param in model.named_parameters():
        full = whole(param)  # collective
        if ".lora_" in name:
            continue
        base = model_param_name(name)
        loaded.add(base)
        experts += base.endswith("experts.gate_up_proj")
        if rank == 0 and not torch.equal(full, expected[base]):
            problems.append(f"{base} differs from from_pretrained")
    buffers = {n: b for n, b in model.get_base_model().named_buffers() if "rotary" not in n}
    for name, buffer in buffers.items():
        if rank == 0 and not torch.equal(buffer, expected[name]):
            problems.append(f"buffer {name} differs from from_pretrained")
    if rank == 0 and loaded | set(buffers) != {k for k in expected if "rotary" not in k}:
        problems.append(f"loaded {sorted(loaded ^ set(expected))} unlike from_pretrained")
    if experts != 2 - (cfg.model.model_name_or_path.endswith("deepseek_v3")):
        problems.append(f"{experts} fused expert layers")
    ids = torch.tensor([[1, 17, 200, 42, 5, 77, 2]])
    model.eval()  # as from_pretrained's: no training-time router jitter (Mixtral)
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # LoRA B = 0: the base model's logits
        if rank == 0 and (reference(input_ids=ids).logits - logits).abs().max() > 1e-5:
            problems.append("logits differ from from_pretrained")
    return problems


def _quantised_by_hand(weight: torch.Tensor) -> torch.Tensor:
    """Independent per-row E4M3 round trip (rows: every dim but the last): scale = row amax / 448, cast with torch,
    multiplied back."""
    scale = weight.abs().amax(dim=-1, keepdim=True) / 448.0
    return (weight / scale).to(torch.float8_e4m3fn).float() * scale


def _check_fp8_storage(cfg: Config, rank: int) -> list[str]:
    """Every FP8 storage parameter holds the `from_pretrained` weight quantised per row (the fused experts too, read
    from the per-expert tensors); everything else, biases of GPT-OSS's experts included, is the file's value."""
    problems, fp8 = [], 0
    model = build_model(cfg, on_gpu=False)
    expected = AutoModelForCausalLM.from_pretrained(cfg.model.model_name_or_path, dtype=torch.float32).state_dict()
    named = dict(model.named_parameters())
    for name, param in named.items():
        full = whole(param)  # collective
        if ".lora_" in name or name.endswith("_scale"):
            continue
        base = model_param_name(name)
        if param.dtype == torch.uint8:
            fp8 += 1
            scale_name = name.removesuffix(".weight") + ".weight_scale" if name.endswith(".weight") else f"{name}_scale"
            scale = whole(named[scale_name]).view(torch.float32)  # collective
            full = full.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1)
            want = _quantised_by_hand(expected[base])
        else:
            want = expected[base]
        if rank == 0 and not torch.equal(full, want):
            problems.append(
                f"{base} differs from the from_pretrained weight{' quantised' * (param.dtype == torch.uint8)}"
            )
    if fp8 < 2 * 4:  # per layer at least q/k/v/o or the MLA projections, and the experts
        problems.append(f"only {fp8} FP8 storage parameters")
    return problems
