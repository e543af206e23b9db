"""Dense families with a tied embedding fine-tuned as a new user's first job would be: the job's own driver pipeline
and Trainer on 2 gloo ranks without Ray (`fixtures.local_run`). Sharded loading, LoRA targets and the saved adapter
are the worker's code, whoever launched it; submitting a job through Ray is test_job_e2e.py's."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from conftest import Fixtures, run_cli, tiny_config, write_yaml
from fixtures.families import make_tiny_family
from fixtures.local_run import train_locally
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from test_job_e2e import _base, _progress


def test_tied_embedding_models_of_three_families_fine_tune_with_sharded_loading(
    fixtures: Fixtures, smollm2: Path, tmp_path, capsys
):
    """What a new user does with a small real model: the job with the defaults (`load_mode: sharded`, LoRA targets
    `auto`) on the real pretrained SmolLM2-135M (Llama), whose head is the tied embedding, and on tiny Qwen2 and
    Gemma3; then `PeftModel.from_pretrained` of `final/` on `from_pretrained` of each checkpoint."""
    models = {
        "llama": smollm2,
        "qwen2": make_tiny_family("qwen2", tmp_path / "qwen2", tied=True, tokenizer_from=fixtures.model),
        "gemma3_text": make_tiny_family("gemma3_text", tmp_path / "gemma3", tied=True, tokenizer_from=fixtures.model),
    }
    configs = {}
    for family, model_dir in models.items():
        out = tmp_path / f"{family}-out"
        cfg = tiny_config(
            fixtures,
            out,
            max_steps=3,
            logging_steps=1,
            eval_strategy="no",
            save_strategy="no",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=1,
        )
        cfg["model"]["model_name_or_path"] = str(model_dir)
        cfg["lora"]["target_modules"] = ["auto"]
        out.mkdir()
        configs[family] = cfg
    # the job's checks before any worker starts (its preflight), as `ray job submit` of the llama config ran them
    validated = run_cli(capsys, "validate", "--config", str(write_yaml(tmp_path / "llama.yaml", configs["llama"])))
    assert validated.rc == 0, validated.err[-3000:]
    texts = {family: train_locally(cfg, 2).text() for family, cfg in configs.items()}
    for family, model_dir in models.items():
        out = tmp_path / f"{family}-out"
        logs = texts[family]
        losses = [loss for _, loss, _ in _progress(logs)]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses), (family, logs[-4000:])
        if family == "llama":  # pretrained weights, head included: far below a random model's ln(49152) = 10.8
            assert losses[0] < 6.0, losses

        saved = load_file(out / "final" / "adapter_model.safetensors")
        assert {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in saved} == {
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        }, family
        assert all(saved[k].abs().sum() > 0 for k in saved if ".lora_B." in k), family  # it trained
        base = _base(model_dir)
        assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
        tuned = PeftModel.from_pretrained(base, str(out / "final"))
        loaded = get_peft_model_state_dict(tuned)
        assert set(loaded) == set(saved), family  # every tensor found its place
        assert all(torch.equal(loaded[k], saved[k].to(loaded[k].dtype)) for k in saved), family
