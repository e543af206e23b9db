"""DeepSeek-V3's block-wise FP8 (`weight_scale_inv` per 128×128 block) loaded on two gloo ranks: into FP8 storage
that keeps the file's E4M3 bytes and block scales (its dequantised weights equal the file's values bit for bit),
and into a bf16 model (the same values, rounded once)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import Fixtures, free_port, tiny_config
from fixtures.fp8_bytes import decode_e4m3, raw_tensor_bytes
from fixtures.moe_families import make_block_fp8, make_hub_moe
from fixtures.ranks import spawn_ranks, whole

from rayft.config import Config
from rayft.model.fp8 import Fp8Experts, Fp8Linear, dequantize_rows, scales
from rayft.model.weights import model_param_name
from rayft.parallel.parallelize import build_model

EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # the hub's names
BLOCKS = [(128, 128), (16, 16)]  # the real one (every tiny tensor one partial block), and several per row


@pytest.fixture(scope="module")
def block_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("block-fp8")
    source = make_hub_moe("deepseek_v3", root / "bf16", moe_intermediate_size=24)  # 24 rows: a partial row block
    return {f"{r}x{c}": make_block_fp8(source, root / f"{r}x{c}", (r, c)) for r, c in BLOCKS}


def _block_reference(path: Path, key: str, block: tuple[int, int]) -> torch.Tensor:
    """The file's value of a block-wise FP8 tensor: its E4M3 bytes decoded × its block's scale, in fp64 (exact),
    rounded once to fp32."""
    info, raw = raw_tensor_bytes(path, key)
    assert info["dtype"] == "F8_E4M3", key
    scale_info, scale_raw = raw_tensor_bytes(path, key.removesuffix("weight") + "weight_scale_inv")
    scale = np.frombuffer(scale_raw, dtype="<f4").reshape(scale_info["shape"]).astype(np.float64)
    rows, cols = info["shape"]
    expanded = np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)[:rows, :cols]
    return torch.from_numpy((decode_e4m3(raw, info["shape"]) * expanded).astype(np.float32))


def _references(model_dir: Path, block: tuple[int, int]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(the model's parameters as the file's fp32 values, keyed by the model's names; the file's FP8 keys)."""
    path = model_dir / "model.safetensors"
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    fp8_keys = {k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F8_E4M3"}
    from safetensors.torch import load_file

    plain = load_file(str(path))
    out = {k: (_block_reference(path, k, block) if k in fp8_keys else v.float()) for k, v in plain.items()}
    experts = sorted({k.split(".experts.")[0] for k in out if ".experts." in k})
    for stem in experts:
        count = len({k.split(".")[5] for k in out if k.startswith(f"{stem}.experts.")})
        for fused, parts in EXPERT_PARTS.items():
            per_expert = [torch.cat([out[f"{stem}.experts.{e}.{p}.weight"] for p in parts]) for e in range(count)]
            out[f"{stem}.experts.{fused}"] = torch.stack(per_expert)
    return out, fp8_keys


def _block_rank(rank: int, world: int, port: int, runs: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    problems = {}
    try:
        for label, (raw, block) in runs.items():
            problems[label] = _check(Config.from_dict(raw), tuple(block), rank)
        if rank == 0:
            Path(out).write_text(json.dumps(problems))
    finally:
        dist.destroy_process_group()


def _check(cfg: Config, block: tuple[int, int], rank: int) -> list[str]:
    model = build_model(cfg, on_gpu=False)
    reference, fp8_keys = _references(Path(cfg.model.model_name_or_path), block) if rank == 0 else ({}, set())
    problems, covered = [], set()
    fp8_storage = cfg.model.frozen_dtype == "float8_e4m3fn"
    for name, module in model.named_modules():
        if not isinstance(module, (Fp8Linear, Fp8Experts)) or ".lora_" in name:
            continue
        for weight in ("weight",) if isinstance(module, Fp8Linear) else EXPERT_PARTS:
            data = whole(getattr(module, weight))  # collective
            scale = whole(getattr(module, f"{weight}_scale"))
            width = module.block if isinstance(module, Fp8Linear) else module.blocks[weight]
            if width != (block[1] if data.shape[-1] > block[1] else None):
                problems.append(f"{name}.{weight} keeps column blocks of {width}")
            if rank == 0:
                base = model_param_name(f"{name}.{weight}")
                covered.add(base)
                got = dequantize_rows(data, scales(scale), torch.float32, width)
                if not torch.equal(got, reference[base]):
                    problems.append(f"{base}: dequantised FP8 storage differs from the file's values")
    for name, param in model.named_parameters():
        full = whole(param)  # collective
        base = model_param_name(name)
        if rank == 0 and not fp8_storage and ".lora_" not in name:
            covered.add(base)
            if not torch.equal(full, reference[base].to(full.dtype)):
                problems.append(f"{base}: {full.dtype} load differs from the file's values rounded")
    if rank == 0:
        stored = {k.split(".experts.")[0] + ".experts." + f for k in fp8_keys if ".experts." in k for f in EXPERT_PARTS}
        stored |= {k for k in fp8_keys if ".experts." not in k}
        if not stored <= covered:
            problems.append(f"FP8 tensors not checked: {sorted(stored - covered)[:3]}")
    return problems


def test_block_wise_fp8_loads_losslessly_into_fp8_storage_and_rounded_into_bf16(
    block_checkpoints: dict[str, Path], fixtures: Fixtures, tmp_path
):
    runs = {}
    for label, model_dir in block_checkpoints.items():
        for frozen, dtype in (("float8_e4m3fn", "float32"), ("bfloat16", "bfloat16")):
            raw = tiny_config(fixtures, tmp_path)
            raw["model"].update(model_name_or_path=str(model_dir), torch_dtype=dtype, frozen_dtype=frozen)
            raw["lora"].update(target_modules=["o_proj"], lora_dropout=0.0)
            runs[f"{label}-{frozen}"] = (raw, [int(n) for n in label.split("x")])
    spawn_ranks(_block_rank, args=(2, free_port(), runs, str(tmp_path / "problems.json")), nprocs=2)
    problems = json.loads((tmp_path / "problems.json").read_text())
    assert problems == {label: [] for label in runs}


def test_block_scales_the_config_does_not_describe_are_refused_naming_the_key(block_checkpoints, tmp_path):
    """What used to refuse every block-wise checkpoint now takes it (FP8 storage by default, preflight's check
    passes); block scales whose block size config.json does not give are refused before anything is read."""
    import shutil

    from rayft.config import ConfigError, ModelConfig
    from rayft.model.build import empty_model, frozen_fp8
    from rayft.model.files import check_weights_match

    model_dir = block_checkpoints["16x16"]
    model_cfg = ModelConfig(model_name_or_path=str(model_dir))
    assert frozen_fp8(model_cfg)
    check_weights_match(empty_model(model_cfg), model_dir)
    undescribed = tmp_path / "undescribed"
    shutil.copytree(model_dir, undescribed)
    config = json.loads((undescribed / "config.json").read_text())
    del config["quantization_config"]["weight_block_size"]
    (undescribed / "config.json").write_text(json.dumps(config))
    refused = (
        r"'model\.layers\.0\.self_attn\.q_a_proj\.weight_scale_inv' has shape \[1, 2\]: .*weight_block_size \(None\)"
    )
    with pytest.raises(ConfigError, match=refused):
        check_weights_match(empty_model(ModelConfig(model_name_or_path=str(undescribed))), undescribed)


def test_the_plan_counts_the_block_scales_fp8_storage_keeps(block_checkpoints):
    """The planner's scale count (from the unswapped meta model) against the swapped model's scale parameters."""
    from rayft.model.build import decoder_layers, empty_model
    from rayft.model.fp8 import to_fp8_
    from rayft.model.fp8_format import weight_block
    from rayft.plan import meta_structure

    model_dir = block_checkpoints["16x16"]
    cfg = Config.from_dict({"model": {"model_name_or_path": str(model_dir)}, "lora": {"target_modules": ["o_proj"]}})
    model = empty_model(cfg.model)
    to_fp8_(decoder_layers(model), torch.bfloat16, weight_block(model_dir)[1])
    stored = sum(p.numel() for n, p in model.named_parameters() if n.endswith("_scale"))
    rows = sum(p.numel() // p.shape[-1] for p in model.parameters() if p.dtype == torch.uint8)
    assert meta_structure(cfg).fp8_rows == stored > rows  # several column blocks per row: more scales than rows
