"""The attention kernel a run builds its model with when `model.attn_implementation` is unset: a varlen kernel for
packed rows on GPUs (flash-attention when installed, else FlexAttention), SDPA otherwise, and a loud fallback for a
family that has neither. The GPU choice is made on CPU here; FlexAttention's forward runs here compiled (torch has no
FlexAttention backward on CPU), which is what the allocation and loss comparisons use."""

from __future__ import annotations

import pytest
import torch
from fixtures.attention import largest_allocation, packed_row
from fixtures.families import FAMILIES, TINY, make_tiny_family
from fixtures.hub_layout import TINY_MISTRAL4
from transformers import AutoConfig, FalconForCausalLM, LlamaForCausalLM, Mistral4Config, Mistral4ForCausalLM

from rayft.config import Config, ModelConfig
from rayft.model.attention import AttentionChoice, choose_attention, supported
from rayft.model.build import attention_model_config, causal_lm_class, random_model, text_config

ALL = ["sdpa", "flex_attention", "flash_attention_2"]


@pytest.fixture(autouse=True)
def static_shapes():
    """Each row length compiled for itself: after a first length, torch recompiles FlexAttention with a dynamic
    sequence length, and inductor's CPU template for that does not compile (torch 2.13). The GPU template is
    another; here only the kernel's results are compared."""
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield


def test_packed_rows_on_gpus_get_a_varlen_kernel():
    assert choose_attention(None, True, True, True, ALL, "M").name == "flash_attention_2"
    flex = choose_attention(None, True, True, False, ALL, "M")
    assert flex.name == "flex_attention" and not flex.loud
    assert "GPUs, flash_attn is not installed: FlexAttention" in flex.reason
    no_flash = choose_attention(None, True, True, True, ["sdpa", "flex_attention"], "M")
    assert no_flash.name == "flex_attention" and "GPUs, M has no flash-attention" in no_flash.reason


def test_padded_rows_cpu_workers_and_named_kernels_keep_their_kernel():
    assert choose_attention(None, False, True, True, ALL, "M").name == "sdpa"
    cpu = choose_attention(None, True, False, True, ALL, "M")
    assert cpu.name == "sdpa" and "no FlexAttention backward on CPU" in cpu.reason and not cpu.loud
    assert choose_attention("eager", True, True, True, ALL, "M") == AttentionChoice(
        "eager", "model.attn_implementation"
    )
    # a class without SDPA keeps transformers' own default for it
    assert choose_attention(None, False, True, True, ["flex_attention"], "M").name == "eager"


def test_a_family_without_a_varlen_kernel_falls_back_loudly():
    """Falcon implements flash-attention and SDPA but not FlexAttention: without flash_attn installed, packed rows
    on GPUs run SDPA's dense mask, and the choice says so."""
    assert "flex_attention" not in supported(FalconForCausalLM) and "sdpa" in supported(FalconForCausalLM)
    choice = choose_attention(None, True, True, False, supported(FalconForCausalLM), "FalconForCausalLM")
    assert choice.loud and choice.name == "sdpa"
    assert "FalconForCausalLM has no FlexAttention and flash_attn is not installed" in choice.reason
    assert "dense s × s document mask" in choice.reason
    neither = choose_attention(None, True, True, True, ["sdpa"], "M")
    assert neither.loud and "M implements neither flash-attention nor FlexAttention" in neither.reason


def test_mistral_small4_mla_is_served_by_both_varlen_kernels():
    """Mistral-Small-4's MLA (query/key head dim ≠ value head dim): transformers' flash path pads the value to the
    query's head dim, FlexAttention takes a different value head dim (the loss comparison below runs it)."""
    assert {"flex_attention", "flash_attention_2"} <= set(supported(Mistral4ForCausalLM))
    assert set(ALL) <= set(supported(LlamaForCausalLM))


def test_a_packed_4096_row_allocates_no_s_squared_tensor_with_the_default_kernel(tmp_path):
    """The default for packed rows on GPUs, built as the workers build it, runs a 4096-token row of four documents
    without any allocation of 4096² bytes; SDPA, the kernel before, allocates its dense document mask (this measure
    sees it). Forward only: FlexAttention has no CPU backward, and the GPU one is fused like its forward."""
    s = 4096
    model_dir = make_tiny_family("llama", tmp_path / "llama", tied=False)  # vocab 512: logits are 8 MiB, below s²
    cfg = Config.from_dict(
        {
            "model": {"model_name_or_path": str(model_dir), "torch_dtype": "float32"},
            "data": {"packing": True, "max_length": s},
        }
    )
    model_cfg, choice = attention_model_config(cfg, on_gpu=True)
    assert choice.name in ("flex_attention", "flash_attention_2") and not choice.loud
    row = packed_row([1024, 2048, 512, 512], 512)
    for name, limit_ok in ((model_cfg.attn_implementation, True), ("sdpa", False)):
        built = ModelConfig(model_name_or_path=str(model_dir), torch_dtype="float32", attn_implementation=name)
        model = random_model(built, text_config(str(model_dir)), torch.device("cpu"))
        with torch.no_grad():
            model(**row)  # compiles FlexAttention once: the measured call is the kernel's, not the compiler's
            largest = largest_allocation(lambda model=model: model(**row))
        assert (largest < s * s) is limit_ok, f"{name}: largest allocation {largest:,} bytes, s² = {s * s:,}"


def family_configs() -> dict[str, object]:
    dense = {f: AutoConfig.for_model(f, vocab_size=512, **TINY, **FAMILIES[f]) for f in ("mistral", "llama", "qwen3")}
    # v_head_dim 8 against a query/key head dim of 8 + 8 rotary: the MLA shape where the two differ
    mla = Mistral4Config(**{**TINY_MISTRAL4, "vocab_size": 512, "v_head_dim": 8})
    return {**dense, "mistral4": mla}


@pytest.mark.parametrize("family", ["mistral", "llama", "qwen3", "mistral4"])
def test_losses_of_the_varlen_kernel_equal_sdpa_on_packed_rows(family):
    """fp32, the same weights, one packed row of documents of uneven lengths: the loss under the kernel chosen for
    packed rows on GPUs equals SDPA's. The two sum the same products in other orders; over documents of at most 90
    keys and hidden 32-64 that moves an fp32 loss by a few ulps, so 1e-5 relative (about 80 ulps) is the bound."""
    config = family_configs()[family]
    config.use_cache = False  # a cache would hide the packing from transformers' mask (as in training)
    choice = choose_attention(None, True, True, False, supported(causal_lm_class(config)), family)
    assert choice.name == "flex_attention" and not choice.loud
    row = packed_row([37, 90, 13, 60], 512)
    losses = {}
    for name in ("sdpa", choice.name):
        torch.manual_seed(0)
        model_cfg = ModelConfig(torch_dtype="float32", attn_implementation=name)
        model = random_model(model_cfg, config, torch.device("cpu"))
        with torch.no_grad():
            losses[name] = model(**row).loss.item()
    assert losses[choice.name] == pytest.approx(losses["sdpa"], rel=1e-5), losses
