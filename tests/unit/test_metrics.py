"""MFU and the metric sinks, checked against hand-computed figures."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from fixtures.hub_layout import TINY_MISTRAL4
from fixtures.moe_families import tiny_moe_config
from fixtures.trackers import wandb_records
from peft import LoraConfig, get_peft_model
from transformers import Mistral4Config, MistralConfig, MistralForCausalLM

from rayft.config import Config
from rayft.model.build import weightless_lora_model
from rayft.model.flops import PEAK_BF16_FLOPS, flop_model, mfu, peak_flops
from rayft.train.metrics import memory
from rayft.train.sinks import plot_losses


@pytest.fixture(scope="module")
def small_lora_model():
    config = MistralConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = MistralForCausalLM(config)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])), config


def test_flop_counts_and_both_mfus_match_the_hand_computation(small_lora_model):
    model, config = small_lora_model
    flops = flop_model(model, config, seq_len=128)
    # per layer: q 64·64 + k 64·32 + v 64·32 + o 64·64 + gate/up/down 3·64·128 = 36,864; ×2 layers + lm_head 64·1000
    assert flops.base_params == 2 * 36_864 + 64_000 == 137_728
    # LoRA r=4: q (4·64 + 64·4) + v (4·64 + 32·4) = 896 per layer
    assert flops.lora_params == 2 * 896 == 1_792
    # attention forward per query and key: 2 · L · H · (d_qk + d_v) = 2 · 2 · 4 · (16 + 16); a full-length causal
    # document of 128 tokens attends (128 + 1) / 2 keys per token on average
    assert flops.attention == 512
    assert flops.per_token_6n == 6 * (137_728 + 1_792) + 3 * 512 * 64.5 == 936_192
    assert flops.per_token_lora == 4 * 137_728 + 6 * 1_792 + 3 * 512 * 64.5 == 660_736
    peak = PEAK_BF16_FLOPS["H200"]
    assert peak == PEAK_BF16_FLOPS["H100"] == 989e12
    assert mfu(1e6, flops.per_token_6n, peak) == pytest.approx(936_192e6 / 989e12)
    assert mfu(1e6, flops.per_token_lora, peak) == pytest.approx(660_736e6 / 989e12)
    assert mfu(1e6, flops.per_token_lora, None) is None  # CPU: no peak, no MFU
    assert peak_flops(torch.device("cpu")) is None
    # A stated peak (train.peak_tflops) is taken as given, on any device: MFU then exists on CPU too.
    assert peak_flops(torch.device("cpu"), 0.25) == 0.25e12
    assert mfu(1e6, flops.per_token_lora, peak_flops(torch.device("cpu"), 0.25)) == pytest.approx(660_736e6 / 0.25e12)


def test_a_tied_head_still_counts_as_a_matmul():
    """With tied word embeddings the head is the embedding matrix (skipped as a lookup), but every token is still
    multiplied by it: the same FLOPs as the untied model."""
    config = MistralConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = MistralForCausalLM(config)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert flop_model(model, config, seq_len=128).base_params == 2 * 36_864 + 64_000


def test_mistral4_counts_only_the_routed_experts_a_token_visits():
    """Mistral-Small-4 (transformers' default Mistral4Config, on meta): ~6.5B parameters active per token of
    ~119B, so the MFU is about the computation that happens, not the whole MoE."""
    from transformers import Mistral4Config, Mistral4ForCausalLM

    config = Mistral4Config()
    with torch.device("meta"):
        model = Mistral4ForCausalLM(config)
    model.requires_grad_(False)
    flops = flop_model(model, config, seq_len=4096)
    total = sum(p.numel() for p in model.parameters())
    assert 110e9 < total < 125e9
    assert 5e9 < flops.base_params < 8e9, flops
    assert flops.lora_params == 0


def test_memory_on_cpu_reports_host_rss_only():
    allocated, reserved, rss = memory(torch.device("cpu"))
    assert math.isnan(allocated) and math.isnan(reserved) and 0.05 < rss < 64


def test_loss_plot_is_a_real_png():
    rows = [{"step": s, "loss": 5 - s * 0.1} for s in range(1, 30)] + [{"step": 10, "eval_loss": 4.2}]
    png = plot_losses(rows)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (800, 450)


def test_tensorboard_tracker_writes_event_files(tmp_path):
    from rayft.train.sinks import Trackers

    trackers = Trackers(["tensorboard"], str(tmp_path), "run-1", {"train.learning_rate": 1e-4})
    trackers.log({"loss": 2.5, "tokens_per_s": 1000.0, "mfu_lora": None, "step": 3}, step=3)
    trackers.close()
    events = list((tmp_path / "runs" / "run-1").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_wandb_tracker_writes_an_offline_run(tmp_path, monkeypatch):
    """`report_to: wandb` with WANDB_MODE=offline: the run's file under output_dir/wandb holds the logged steps."""
    pytest.importorskip("wandb")
    from rayft.train.sinks import Trackers

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = Trackers(["wandb"], str(tmp_path), "run-1", {"train.learning_rate": 1e-4})
    trackers.log({"loss": 2.5, "tokens_per_s": 1000.0, "mfu_lora": None, "step": 3}, step=3)
    trackers.log({"loss": 2.0, "eval_loss": 2.25, "step": 4}, step=4)
    trackers.close()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (log,) = run_dir.glob("run-*.wandb")
    records = wandb_records(log)
    rows = [
        {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    # the names transformers' Trainer logs the same values under, so TRL runs and rayft runs share panels
    assert [(r["_step"], r["train/loss"]) for r in rows] == [(3, 2.5), (4, 2.0)] and rows[1]["eval/loss"] == 2.25
    assert rows[0]["train/tokens_per_s"] == 1000.0
    assert not any("mfu_lora" in k for k in rows[0])  # None is not a number: left out, as for TensorBoard
    assert b"train.learning_rate" in log.read_bytes()  # the run's config
    assert records[-1].WhichOneof("record_type") == "exit"  # finished


# Tiny MoE configs' dims (tests/fixtures): per layer and token, the frozen matrices a token is multiplied by and the
# LoRA (r = 4, on two attention projections and on the routed experts) it goes through, counted by hand. Each
# routed expert is gate‖up [2·I, H] + down [H, I]; a token visits 2 of the 8, and only their LoRA.
R = 4
# Qwen3-MoE and Mixtral: H 32, 4 heads and 2 KV heads of 8, I 16, router [8, 32], vocab 1024, 2 layers.
GQA_ATTENTION = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32  # q, k, v, o
GQA_EXPERT = 2 * 16 * 32 + 32 * 16
GQA_LAYER = GQA_ATTENTION + 8 * 32 + 2 * GQA_EXPERT
GQA_LORA = R * (32 + 32) + R * (32 + 16) + 2 * (R * (32 + 2 * 16) + R * (16 + 32))  # q, v; 2 experts' gate_up, down
# Mistral-Small-4 (TINY_MISTRAL4): H 64, MLA (q 64→32→4·16, kv 64→16+8, 16→4·(8+16), o 4·16→64), router [8, 64],
# a shared expert of I 32 (gate, up, down), routed experts of I 32, vocab 131072, 2 layers.
MLA_ATTENTION = 64 * 32 + 32 * 64 + 64 * 24 + 16 * 96 + 64 * 64
MLA_EXPERT = 2 * 32 * 64 + 64 * 32
MLA_LAYER = MLA_ATTENTION + 8 * 64 + 3 * 64 * 32 + 2 * MLA_EXPERT
MLA_LORA = R * (32 + 64) + R * (64 + 64) + 2 * (R * (64 + 2 * 32) + R * (32 + 64))  # q_b, o; 2 experts' gate_up, down
HAND_COUNTS = {  # model_type: (LoRA targets, frozen per token, LoRA per token, attention 2·L·H·(d_qk + d_v))
    "qwen3_moe": (["q_proj", "v_proj"], 2 * GQA_LAYER + 1024 * 32, 2 * GQA_LORA, 2 * 2 * 4 * (8 + 8)),
    "mixtral": (["q_proj", "v_proj"], 2 * GQA_LAYER + 1024 * 32, 2 * GQA_LORA, 2 * 2 * 4 * (8 + 8)),
    "mistral4": (["q_b_proj", "o_proj"], 2 * MLA_LAYER + 131072 * 64, 2 * MLA_LORA, 2 * 2 * 4 * (16 + 16)),
}


@pytest.mark.parametrize("model_type", sorted(HAND_COUNTS))
def test_moe_flops_count_the_top_k_experts_and_their_lora(model_type: str):
    """Each MoE family's tiny model with LoRA on its routed experts: the hand count of 6N-style FLOPs per token."""
    targets, base, lora, attention = HAND_COUNTS[model_type]
    config = Mistral4Config(**TINY_MISTRAL4) if model_type == "mistral4" else tiny_moe_config(model_type)
    cfg = Config.from_dict(
        {
            "lora": {"r": R, "target_modules": targets, "target_experts": True, "lora_dropout": 0.0},
            "fsdp": {"activation_checkpointing": True},
        }
    )
    model, _ = weightless_lora_model(cfg, config)
    flops = flop_model(model, config, seq_len=16)
    assert (flops.base_params, flops.lora_params, flops.attention) == (base, lora, attention)
    keys = (16 + 1) / 2  # a full-length causal document's mean
    assert flops.per_token_6n == 6 * (base + lora) + 3 * attention * keys
    assert flops.per_token_lora == 4 * base + 6 * lora + 3 * attention * keys


# A token is multiplied by each matrix's weights however the frozen base stores them: FP8 (bytes, one a weight, next
# to scales per row or per row and 64-column block) and NF4 (two 4-bit codes a byte, with int8 block scalers) count
# the matrices' own shapes, as bf16 does, and never their scales. Dims NF4 can block (rows of 64-blocks, 16384-weight
# groups), counted by hand; LoRA r = 4 on q_proj and v_proj (and, for the MoE, on the routed experts).
# Mistral: H 128, 4 heads and 4 KV heads of 32, I 256, vocab 512, 2 layers.
DENSE_LAYER = 4 * 128 * 128 + 3 * 256 * 128  # q, k, v, o; gate, up, down = 163,840
DENSE_BASE = 2 * DENSE_LAYER + 512 * 128  # + lm_head = 393,216
DENSE_LORA = 2 * (R * (128 + 128) + R * (128 + 128))  # q, v = 4,096
# Qwen3-MoE: the same attention, router [8, 128], 8 routed experts of I 128 (gate‖up [256, 128], down [128, 128]),
# top-2.
MOE_LAYER = 4 * 128 * 128 + 8 * 128 + 2 * (256 * 128 + 128 * 128)  # 164,864
MOE_BASE = 2 * MOE_LAYER + 512 * 128  # 395,264
MOE_LORA = 2 * (R * (128 + 128) * 2 + 2 * (R * (128 + 256) + R * (128 + 128)))  # q, v; 2 experts = 14,336
ATTENTION = 2 * 2 * 4 * (32 + 32)  # 2 · L · H · (d_qk + d_v)
STORAGES = ["bf16", "fp8_rows", "fp8_blocks", "nf4"]


def _stored_lora_model(model_type: str, storage: str):
    """The weightless LoRA model of a tiny `model_type` whose decoder matrices are held in `storage`, built as a job
    builds it: the swap (`to_fp8_` / `to_nf4_`), then PEFT, then `adopt_lora_`."""
    from transformers import MistralConfig

    from rayft.model.build import causal_lm_class, decoder_layers
    from rayft.model.fp8 import Fp8Experts, Fp8Linear, adopt_lora_, to_fp8_
    from rayft.model.lora import apply_lora
    from rayft.model.nf4 import Nf4Experts, Nf4Linear, to_nf4_

    dims = {
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "vocab_size": 512,
        "num_hidden_layers": 2,
        "tie_word_embeddings": False,
    }
    if model_type == "mistral":
        config, lora = MistralConfig(**dims, intermediate_size=256), {}
    else:
        config, lora = tiny_moe_config(model_type, **dims, moe_intermediate_size=128), {"target_experts": True}
    cfg = Config.from_dict(
        {
            "lora": {"r": R, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, **lora},
            "fsdp": {"activation_checkpointing": True},
        }
    )
    with torch.device("meta"):
        model = causal_lm_class(config)._from_config(config, dtype=torch.bfloat16)
    layers = decoder_layers(model)
    if storage == "nf4":
        assert to_nf4_(layers, torch.bfloat16)[1] == 0  # every decoder matrix in NF4
        kinds: tuple[type, ...] = (Nf4Linear, Nf4Experts)
    elif storage != "bf16":
        to_fp8_(layers, torch.bfloat16, 64 if storage == "fp8_blocks" else None)
        kinds = (Fp8Linear, Fp8Experts)
    if storage != "bf16":
        matrices = 7 if model_type == "mistral" else 5  # q, k, v, o and the MLP's 3 linears, or the experts module
        assert sum(isinstance(m, kinds) for m in model.modules()) == 2 * matrices
    model = apply_lora(model, cfg.lora)
    if storage != "bf16":
        adopt_lora_(model)
    return model, config


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize(
    ("model_type", "base", "lora"), [("mistral", DENSE_BASE, DENSE_LORA), ("qwen3_moe", MOE_BASE, MOE_LORA)]
)
def test_quantised_storage_counts_each_matrix_in_its_own_shape(model_type: str, base: int, lora: int, storage: str):
    model, config = _stored_lora_model(model_type, storage)
    flops = flop_model(model, config, seq_len=16)
    assert (flops.base_params, flops.lora_params, flops.attention) == (base, lora, ATTENTION)
    keys = (16 + 1) / 2
    assert flops.per_token_lora == 4 * base + 6 * lora + 3 * ATTENTION * keys
