"""NF4 storage (`rayft.model.nf4`) against torchao's `to_nf4`, the QLoRA reference rayft's format follows: the same
codes, block scalers, factors and mean bit for bit, and the same dequantised weight."""

from __future__ import annotations

import pytest
import torch
from fixtures.devices import DEVICES
from fixtures.torchao_nf4 import to_nf4
from torch import nn

from rayft.model.nf4 import Nf4Linear, Nf4Parts, dequantize, quantize, to_nf4_
from rayft.model.nf4_format import dequant_bytes_per_weight, fits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(128, 128), (64, 512), (256, 64), (32, 1024)])
def test_a_linear_holds_torchaos_codes_and_scales_bit_for_bit(dtype: torch.dtype, shape: tuple[int, int]):
    torch.manual_seed(sum(shape))
    linear = nn.Linear(shape[1], shape[0], bias=False).to(dtype)
    linear.weight.data[0, :64] = 0.0  # an all-zero block, as pruned or padded rows have
    layer = Nf4Linear.from_linear(linear, torch.bfloat16)
    want = to_nf4(linear.weight)
    assert torch.equal(layer.weight.flatten(), want.quantized_data)
    assert torch.equal(layer.weight_scalers.flatten(), want.quantized_scalers)
    assert torch.equal(layer.weight_factors.view(torch.float32).to(dtype), want.quantization_factor)
    assert torch.equal(layer.weight_mean.view(torch.float32).to(dtype)[0], want.scaler_mean)
    assert torch.equal(layer.dequantized_weight(dtype), want.get_original_weight())


def test_the_layer_computes_with_the_dequantised_weight_and_passes_the_input_gradient():
    torch.manual_seed(0)
    linear = nn.Linear(256, 128).to(torch.bfloat16)
    layer = Nf4Linear.from_linear(linear, torch.bfloat16)
    weight = to_nf4(linear.weight).get_original_weight()
    x = torch.randn(3, 256, dtype=torch.bfloat16, requires_grad=True)
    got = layer(x)
    got.sum().backward()
    reference = x.detach().clone().requires_grad_()
    want = reference @ weight.t() + linear.bias
    want.sum().backward()
    torch.testing.assert_close(got, want)  # bf16's tolerance: the bias is added apart
    assert torch.equal(x.grad, reference.grad)
    assert not any(p.requires_grad for p in layer.parameters())


def test_weights_nf4_cannot_block_are_kept_and_counted():
    assert fits((128, 128)) and fits((4, 64, 64)) and not fits((64, 64)) and not fits((128, 96))
    with pytest.raises(ValueError, match="whole 64-blocks"):
        quantize(torch.randn(64, 64))
    block = nn.ModuleDict({"q": nn.Linear(128, 128), "k": nn.Linear(128, 32), "norm": nn.LayerNorm(128)})
    assert to_nf4_([block], torch.float32) == (1, 1)
    assert isinstance(block["q"], Nf4Linear) and type(block["k"]) is nn.Linear


def test_lora_over_nf4_linears_of_a_bf16_model_is_fp32():
    """The adapter and its AdamW state are the master copy: fp32 next to a bf16 model (PEFT does not cast LoRA to
    an integer base weight's dtype)."""
    from peft import LoraConfig, get_peft_model
    from transformers import MistralConfig, MistralForCausalLM

    from rayft.model.build import decoder_layers

    config = MistralConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
    )
    model = MistralForCausalLM(config).to(torch.bfloat16)
    assert to_nf4_(decoder_layers(model), torch.bfloat16) == (7, 0)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert len(trainable) == 4 and {p.dtype for p in trainable} == {torch.float32}


@pytest.mark.parametrize("frozen_dtype", ["nf4", "float8_e4m3fn"])
def test_a_trainable_copy_of_a_quantised_decoder_matrix_is_refused_with_the_fix(frozen_dtype: str):
    from transformers import MistralConfig, MistralForCausalLM

    from rayft.config import Config, ConfigError
    from rayft.model.build import check_quantised_storage

    config = MistralConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
    )
    cfg = Config.from_dict(
        {"model": {"model_name_or_path": "m", "frozen_dtype": frozen_dtype}, "lora": {"modules_to_save": ["o_proj"]}}
    )
    with pytest.raises(
        ConfigError, match=f"o_proj is a decoder matrix stored in {'NF4' if frozen_dtype == 'nf4' else 'FP8'}"
    ):
        check_quantised_storage(cfg, MistralForCausalLM(config), fp8=frozen_dtype != "nf4")
    cfg.lora.modules_to_save = ["lm_head"]  # outside the decoder layers: kept in torch_dtype, a copy is fine
    check_quantised_storage(cfg, MistralForCausalLM(config), fp8=frozen_dtype != "nf4")


# Every pair of dtypes on the CPU; on a GPU the pair a bf16 job runs (each case compiles twice, within the GPU check's
# time budget).
COMPILED_CASES = [
    *(
        pytest.param(quant, compute, "cpu")
        for quant in (torch.bfloat16, torch.float32)
        for compute in (torch.bfloat16, torch.float32)
    ),
    pytest.param(torch.bfloat16, torch.bfloat16, "cuda", marks=DEVICES[1].marks),
]


@pytest.mark.parametrize(("quant", "compute", "device"), COMPILED_CASES)
def test_the_compiled_dequantisation_is_one_kernel_with_the_eager_ops_values(
    quant: torch.dtype, compute: torch.dtype, device: str
):
    """On CUDA an NF4 weight is dequantised by one compiled kernel (`rayft.model.fp8.fuses`; the CPU compiles its
    own here): bit for bit the eager ops' weight (and torchao's), for a linear and an expert stack, in one kernel
    that reads the codes and block scales once and writes the weight once, which is what `rayft plan` counts per
    weight (`dequant_bytes_per_weight`)."""
    from torch._inductor import metrics

    from rayft.model import fp8

    weight = torch.randn(256, 512, dtype=quant, generator=torch.Generator().manual_seed(0))
    stack = torch.randn(3, 64, 256, dtype=quant, generator=torch.Generator().manual_seed(1))
    experts = Nf4Parts(*(torch.stack(part) for part in zip(*(quantize(e) for e in stack), strict=True)))  # each its own
    for parts in (Nf4Parts(*(t.to(device) for t in quantize(weight))), Nf4Parts(*(t.to(device) for t in experts))):
        with fp8.fused_dequantization(device, False):
            eager = dequantize(parts, quant, compute)
        torch._dynamo.reset()
        fp8.compiled.cache_clear()
        metrics.reset()
        with fp8.fused_dequantization(device, True):
            got = dequantize(parts, quant, compute)
            assert fp8.fuses(torch.device(device)), "compiling failed and the eager ops ran"
        assert got.dtype == compute and torch.equal(got, eager)
        assert metrics.generated_kernel_count == 1
    assert torch.equal(dequantize(quantize(weight), quant, quant), to_nf4(weight).get_original_weight())
    # what that one kernel reads and writes, per weight: half a byte of code, a scale per 64 weights, the weight
    # (in quant when compute is wider, then read and written again in compute)
    n, q, c = weight.numel(), quant.itemsize, compute.itemsize
    moved = n // 2 + n // 64 * q + (n * c if c <= q else n * (q + q + c))
    assert moved / weight.numel() == dequant_bytes_per_weight(quant.itemsize, compute.itemsize)
    torch._dynamo.reset()
    fp8.compiled.cache_clear()
