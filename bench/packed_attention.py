"""Attention on packed rows: SDPA's dense document mask against the varlen kernel rayft picks for packed rows on
GPUs (FlexAttention here, where flash_attn is not installed), per row length.

A tiny Llama (2 layers, hidden 32, 4 heads of 8, vocabulary 512: its logits stay below s² bytes) runs the forward of
one packed row of four documents (1/2, 1/4, 1/8, 1/8 of the row), fp32 on CPU, under each kernel: the largest single
allocation (the CPU allocator's, compiled kernels included), the forward's median time over 3 calls after a first
call that compiles FlexAttention (timed apart), and the loss. Forward only: torch has no FlexAttention backward on
CPU. Each length is compiled for itself (static shapes, as tests/unit/test_attention_choice.py does).

    python bench/packed_attention.py [--size small|default] [--out bench/results/packed_attention_cpu.json]
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import MIB, cli, machine
from fixtures.attention import largest_allocation, packed_row
from fixtures.families import TINY

SIZES = {"default": {"lengths": [2048, 4096, 8192]}, "small": {"lengths": [1024, 2048]}}
VOCAB = 512
CALLS = 3


def _model(name: str):
    from transformers import AutoConfig

    from rayft.config import ModelConfig
    from rayft.model.build import random_model

    config = AutoConfig.for_model("llama", vocab_size=VOCAB, use_cache=False, **TINY)
    torch.manual_seed(0)
    return random_model(ModelConfig(torch_dtype="float32", attn_implementation=name), config, torch.device("cpu"))


def _measure(name: str, s: int) -> dict:
    model = _model(name)
    row = packed_row([s // 2, s // 4, s // 8, s - s // 2 - s // 4 - s // 8], VOCAB)
    with torch.no_grad():
        began = time.perf_counter()
        loss = model(**row).loss.item()
        first = time.perf_counter() - began
        times = []
        for _ in range(CALLS):
            began = time.perf_counter()
            model(**row)
            times.append(time.perf_counter() - began)
        largest = largest_allocation(lambda: model(**row))
    return {"kernel": name, "row_tokens": s, "largest_allocation_mib": round(largest / MIB, 2),
            "s_squared_mib": round(s * s / MIB, 2), "first_call_s": round(first, 3),
            "forward_s": round(statistics.median(times), 4), "loss": loss}  # fmt: skip


def run(size: str) -> dict:
    from transformers import AutoConfig

    from rayft.model.attention import choose_attention, supported
    from rayft.model.build import causal_lm_class

    cls = causal_lm_class(AutoConfig.for_model("llama"))
    varlen = choose_attention(None, True, True, False, supported(cls), cls.__name__).name
    rows = []
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        for s in SIZES[size]["lengths"]:
            rows += [_measure("sdpa", s), _measure(varlen, s)]
    return {**machine(), "size": size, "varlen_kernel": varlen, "rows": rows}


if __name__ == "__main__":
    cli(__doc__ or "", SIZES, run, "packed_attention_cpu.json")
