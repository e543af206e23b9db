"""`rayft export`: adapter copy, and a merged text-only checkpoint that plain transformers loads."""

from __future__ import annotations

import json
import subprocess
import sys

import peft
import torch
from conftest import REPO
from transformers import Mistral4ForCausalLM

from rayft.config import ModelConfig
from rayft.model.build import empty_model
from rayft.model.weights import buffers_kept, load_sharded_

PROBE = torch.tensor([[1, 1784, 1937, 1278, 1812, 1321, 1261, 2]])


def _dequantised_model(base, dtype="float32"):
    model = empty_model(ModelConfig(model_name_or_path=str(base), torch_dtype=dtype))
    with buffers_kept(model):
        model.to_empty(device=torch.device("cpu"))
    return model


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rayft.cli", "export", *args], capture_output=True, text=True, timeout=600, cwd=REPO
    )


def _adapter_logits(base, adapter) -> torch.Tensor:
    model = _dequantised_model(base)
    load_sharded_(model, base)
    with torch.no_grad():
        return peft.PeftModel.from_pretrained(model, str(adapter)).eval()(input_ids=PROBE).logits


def test_merged_export_loads_in_plain_transformers_and_matches_the_adapter(
    mistral4_hub, trained_expert_adapter, tmp_path
):
    out = tmp_path / "merged"
    result = _export(
        "--adapter",
        str(trained_expert_adapter),
        "--base",
        str(mistral4_hub),
        "--out",
        str(out),
        "--merge",
        "--dtype",
        "float32",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    merged = Mistral4ForCausalLM.from_pretrained(str(out), dtype=torch.float32)  # no rayft, no PEFT
    assert not any("vision" in n or "lora" in n for n, _ in merged.named_parameters())
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    with torch.no_grad():
        got = merged.eval()(input_ids=PROBE).logits
    want = _adapter_logits(mistral4_hub, trained_expert_adapter)
    base_only = _dequantised_model(mistral4_hub)
    load_sharded_(base_only, mistral4_hub)
    with torch.no_grad():
        assert (base_only.eval()(input_ids=PROBE).logits - want).abs().max() > 1e-3  # the adapter changes things
    assert (got - want).abs().max().item() < 1e-4


def test_plain_export_copies_the_adapter_and_points_it_at_the_base(mistral4_hub, trained_expert_adapter, tmp_path):
    out = tmp_path / "adapter"
    result = _export("--adapter", str(trained_expert_adapter), "--base", str(mistral4_hub), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(mistral4_hub)
    assert (out / "adapter_model.safetensors").read_bytes() == (
        trained_expert_adapter / "adapter_model.safetensors"
    ).read_bytes()
    assert (out / "tokenizer.json").is_file()


def test_export_refuses_a_directory_that_is_not_an_adapter(mistral4_hub, tmp_path):
    result = _export("--adapter", str(tmp_path), "--base", str(mistral4_hub), "--out", str(tmp_path / "x"))
    assert result.returncode == 2 and "not a PEFT adapter directory" in result.stderr


def test_a_merge_keeps_the_bases_dtype_unless_asked(fixtures, tmp_path):
    """An fp32 base merged without --dtype was written in bf16 (half its precision, unasked): the merged weights
    now keep the dtype the base's config.json declares; --dtype still chooses."""
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base = fixtures.model
    declared = json.loads((base / "config.json").read_text())["dtype"]
    assert declared == "float32"
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(str(tmp_path / "adapter"))

    def merged_dtypes(out, *dtype: str) -> set[str]:
        done = _export(
            "--adapter", str(tmp_path / "adapter"), "--base", str(base), "--out", str(out), "--merge", *dtype
        )
        assert done.returncode == 0, done.stderr[-3000:]
        with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
            return {str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118  (safe_open has no __iter__)

    assert merged_dtypes(tmp_path / "kept") == {"F32"}
    assert merged_dtypes(tmp_path / "asked", "--dtype", "bfloat16") == {"BF16"}
