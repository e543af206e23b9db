"""Activation bytes a rank keeps for backward with `parallel.context_parallel` N = 1, 2, 4, at one sequence length.

A tiny Llama with LoRA on its attention and MLP, one packed row of several documents (a completion-only mask), N
gloo ranks each holding 1/N of the row (`rayft.parallel.context`). Measured: every tensor autograd saves during
the forward (`torch.autograd.graph.saved_tensors_hooks`), counted once per storage, parameters left out; that is
the activation memory the backward holds, the part context parallelism divides. N = 1 is measured twice: as rayft
trains without context parallelism (transformers' SDPA with the whole row's dense s × s document mask, which the
CPU kernel keeps as fp32 in every layer) and through the per-document SDPA the split ranks run, which has none.

Predicted: `rayft plan`'s activations row for the same model and row on CPU (fp32, no recompute) at each N of the
per-document path (`rayft.plan.memory.activation_bytes`), beside the largest rank's measured bytes and their ratio;
`within_10_percent` says whether the prediction holds at N = 4. Likewise the bytes each rank's all-to-alls
received in the forward and backward (the collective tally) beside the plan's (`rayft.plan.comm`). The dense mask
of N = 1 as rayft trains without the setting is not predicted: the plan is a GPU run's, whose varlen kernel takes
no mask.

    python bench/context_parallel_memory.py [--size small|default] [--out bench/results/context_parallel_cpu.json]
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from _common import cli, free_port, machine, run_ranks

SIZES = {
    "default": {"hidden_size": 512, "heads": 8, "kv_heads": 4, "layers": 4, "tokens": 4096, "documents": 4},
    "small": {"hidden_size": 64, "heads": 4, "kv_heads": 2, "layers": 2, "tokens": 256, "documents": 4},
}


def _model(shape: dict) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=shape["hidden_size"],
        intermediate_size=2 * shape["hidden_size"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=shape["tokens"],
        attn_implementation="sdpa",
    )
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules=targets))


def _row(shape: dict) -> dict[str, torch.Tensor]:
    tokens, docs = shape["tokens"], shape["documents"]
    length = tokens // docs
    ids = torch.randint(3, 4096, (1, tokens), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(length).repeat(docs)[None]
    labels = ids.clone()
    labels[positions < length // 2] = -100  # the first half of each document is its prompt
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _saved_bytes(model: torch.nn.Module, run) -> int:
    """Bytes of the distinct non-parameter storages autograd saved while `run()` ran the forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.device.type != "meta":
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    loss.backward()
    return sum(seen.values())


def _rank(rank: int, world: int, port: int, shape: dict, out: str, ulysses: bool) -> None:
    from rayft.model.loss import CausalLMLoss
    from rayft.parallel.context import NAME, register, shard_batch
    from rayft.parallel.tally import TALLY
    from rayft.train.step import targets

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, batch = _model(shape), _row(shape)
        if ulysses:
            register()
            model.set_attn_implementation(NAME)
            batch = shard_batch(batch, dist.group.WORLD, world, "sdpa")
        count = targets(batch).double()
        dist.all_reduce(count)
        loss = CausalLMLoss(fused=True)
        TALLY.take()  # from here: the forward's and backward's exchanges only
        saved = _saved_bytes(model, lambda: loss(model, batch, count))
        exchanged = TALLY.take()["all_to_all"]
        (Path(out) / f"rank{rank}.json").write_text(json.dumps({"saved_bytes": saved, "all_to_all_bytes": exchanged}))
    finally:
        dist.destroy_process_group()


def _predicted(shape: dict, n: int) -> tuple[int, int]:
    """`rayft plan`'s activation bytes of a rank for the bench's model and row split over `n` ranks, on CPU, and
    the bytes it receives in the all-to-alls of one micro-batch (forward and backward, no recompute)."""
    from rayft.config import Config
    from rayft.plan import structure
    from rayft.plan.comm import Cluster, Layout, plan_comm
    from rayft.plan.memory import activation_bytes

    model = _model(shape)
    raw = {
        "model": {"model_name_or_path": "tiny-llama", "torch_dtype": "float32", "attn_implementation": "sdpa"},
        "lora": {
            "r": 8,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        },
        "data": {"max_length": shape["tokens"], "packing": True},
        "train": {"gradient_accumulation_steps": 1},
        "fsdp": {"activation_checkpointing": False},
        "parallel": {"context_parallel": n},
        "ray": {"use_gpu": False, "num_workers": n},
    }
    cfg, s = Config.from_dict(raw), structure(model, model.config)
    received = plan_comm(cfg, s, Layout(shard=n), Cluster(1, n), on_gpu=False, held="dtype").per_step("all_to_all")
    return int(activation_bytes(cfg, s, on_gpu=False)), int(received)


def _compare(cases: dict, shape: dict) -> dict:
    """Predicted against measured (the largest rank) for every per-document case."""
    out = {}
    for name, n in (("1 per-document", 1), ("2", 2), ("4", 4)):
        case = cases[f"context_parallel={name}"]
        measured = max(case["saved_activation_bytes_per_rank"])
        predicted, received = _predicted(shape, n)
        out[f"context_parallel={name}"] = {
            "predicted_bytes": predicted,
            "measured_bytes": measured,
            "predicted_over_measured": round(predicted / measured, 4),
            "all_to_all_predicted_bytes": received,
            "all_to_all_measured_bytes": max(case["all_to_all_received_bytes_per_rank"]),
        }
    out["within_10_percent"] = abs(out["context_parallel=4"]["predicted_over_measured"] - 1) <= 0.10
    return out


def run(size: str) -> dict:
    shape = SIZES[size]
    tokens = shape["tokens"]
    report = {**machine(), "size": size, "model": shape, "cases": {}}
    report["dense_mask_bytes"] = tokens * tokens  # bool (1, 1, s, s): the same on every rank
    with tempfile.TemporaryDirectory() as tmp:
        # N = 1 twice: as rayft trains without the setting (transformers' SDPA with the dense document mask), and
        # through the same per-document SDPA the split ranks run (the exchanges are then no-ops).
        for name, n, ulysses in (("1", 1, False), ("1 per-document", 1, True), ("2", 2, True), ("4", 4, True)):
            out = Path(tmp) / name.replace(" ", "_")
            out.mkdir()
            run_ranks(_rank, (n, free_port(), shape, str(out), ulysses), n)
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
            report["cases"][f"context_parallel={name}"] = {
                "saved_activation_bytes_per_rank": [r["saved_bytes"] for r in ranks],
                "all_to_all_received_bytes_per_rank": [r["all_to_all_bytes"] for r in ranks],
            }
    cases = report["cases"]
    for base in ("1", "1 per-document"):
        one = max(cases[f"context_parallel={base}"]["saved_activation_bytes_per_rank"])
        for case in cases.values():
            case[f"ratio_to_{base.replace(' ', '_')}"] = round(max(case["saved_activation_bytes_per_rank"]) / one, 4)
    report["plan"] = _compare(cases, shape)
    return report


if __name__ == "__main__":
    cli(__doc__, SIZES, run, "context_parallel_cpu.json")
