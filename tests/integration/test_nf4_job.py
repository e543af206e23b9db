"""QLoRA: the job over a frozen base held in NF4 (`model.frozen_dtype: nf4`). A tiny Mistral whose every decoder
linear NF4 can block: its logits are those of the same model with torchao's dequantised weights; each rank of a
sharded load reads only its rows and stores what torchao's `to_nf4` of the whole weight gives; LoRA over it on two
gloo ranks with FSDP2 trains as on one. The same for a tiny Mistral-Small-4 from the hub's FP8 layout (routed experts
and expert LoRA too), which also stops and continues to the uninterrupted result; each MoE family's forward over
NF4; and the planner's NF4 bytes."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, STEPS, Fixtures, checkpointing_config, free_port, run_cli
from fixtures.devices import LoadMemory
from fixtures.hub_layout import make_tiny_mistral_small4
from fixtures.local_run import LocalRun, train_locally
from fixtures.moe_families import COMMON, MOE_FAMILIES, _random_model, make_block_fp8, make_hub_moe
from fixtures.ranks import spawn_ranks, whole
from fixtures.torchao_nf4 import to_nf4
from peft import PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file
from test_block_fp8 import _references
from test_fp8_job import _numpy_dequantised_text_model
from test_gpu import GRAD_RTOL, LOSS_ATOL, _batch, _lora_grads, _randomise_lora_b, _relative_error
from test_local_trainer import REORDERED, TOLERANCE, _assert_same_training
from torch import nn
from transformers import AutoModelForCausalLM

from rayft.config import Config
from rayft.demo import make_tiny_mistral
from rayft.model.build import decoder_layers, empty_model
from rayft.model.lora import AUTO_TARGETS
from rayft.model.nf4 import Nf4Experts, Nf4Linear, storage_of, to_nf4_
from rayft.model.nf4_format import storage_bytes as nf4_storage_bytes
from rayft.parallel.parallelize import build_model
from rayft.plan import meta_structure, plan_memory

# Every decoder linear a whole number of NF4 groups (16,384 weights): 128 × 128 projections, a 256-wide MLP.
NF4_SHAPES = {"hidden_size": 128, "intermediate_size": 256, "num_key_value_heads": 4, "head_dim": 32}
LINEARS = 2 * 7  # per layer: q, k, v, o, gate, up, down


@pytest.fixture(scope="module")
def nf4_model(tmp_path_factory) -> Path:
    return make_tiny_mistral(tmp_path_factory.mktemp("nf4") / "m", seed=3, **NF4_SHAPES)


def nf4_config(fixtures: Fixtures, model: Path, out: Path, **overrides) -> dict:
    cfg = checkpointing_config(fixtures, out, **overrides)
    cfg["model"].update(model_name_or_path=str(model), frozen_dtype="nf4")
    return cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_logits_are_those_of_torchaos_dequantised_weights(nf4_model: Path, dtype: torch.dtype):
    quantised = AutoModelForCausalLM.from_pretrained(nf4_model, dtype=dtype)
    reference = AutoModelForCausalLM.from_pretrained(nf4_model, dtype=dtype)
    assert to_nf4_(decoder_layers(quantised), dtype) == (LINEARS, 0)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(quantised.get_submodule(name), Nf4Linear):
                module.weight.copy_(to_nf4(module.weight).get_original_weight())
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = quantised(ids).logits, reference(ids).logits
        unquantised = AutoModelForCausalLM.from_pretrained(nf4_model, dtype=dtype)(ids).logits
    torch.testing.assert_close(got, want)  # the dtype's own tolerance
    assert (got - unquantised).abs().max() > 10 * (got - want).abs().max()  # the comparison can tell NF4 apart


def _sharded_load_rank(rank: int, world: int, port: int, raw: dict, out: str) -> None:
    """Build the job's model as a worker does (a sharded load), then gather each NF4 layer's storage whole."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build_model(Config.from_dict(raw), on_gpu=False, device=torch.device("cpu"))
        stored = {}
        for name, module in model.named_modules():
            if isinstance(module, (Nf4Linear, Nf4Experts)):
                key = name.removeprefix("base_model.model.").replace(".base_layer", "")
                for weight in ("weight",) if isinstance(module, Nf4Linear) else ("gate_up_proj", "down_proj"):
                    full = [whole(p) for p in storage_of(module, weight)]
                    stored[f"{key}.{weight}"] = dict(zip(("codes", "scalers", "factors", "mean"), full, strict=True))
        if rank == 0:
            torch.save(stored, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_each_rank_loads_its_rows_and_stores_torchaos_nf4_of_the_whole_weight(
    fixtures: Fixtures, nf4_model: Path, tmp_path: Path, dtype: str
):
    """Three ranks: 128 rows shard 43 + 43 + 42, and a weight's one factor sits on the first rank alone."""
    raw = nf4_config(fixtures, nf4_model, tmp_path)
    raw["model"]["torch_dtype"] = dtype
    out = tmp_path / "stored.pt"
    spawn_ranks(_sharded_load_rank, args=(3, free_port(), raw, str(out)), nprocs=3)
    stored = torch.load(out)
    weights = AutoModelForCausalLM.from_pretrained(nf4_model, dtype=getattr(torch, dtype)).state_dict()
    assert len(stored) == LINEARS
    assert_torchaos_nf4(stored, weights)


def assert_torchaos_nf4(stored: dict[str, dict[str, torch.Tensor]], weights: dict[str, torch.Tensor]) -> None:
    """Each stored weight's codes, scalers, factors and mean are torchao's `to_nf4` of the weight (of each expert
    of a stack) bit for bit."""
    for name, got in stored.items():
        weight = weights[name]
        for i, matrix in enumerate(weight if weight.ndim == 3 else [weight]):
            want = to_nf4(matrix.contiguous())
            part = {k: (v[i] if weight.ndim == 3 else v) for k, v in got.items()}
            assert torch.equal(part["codes"].flatten(), want.quantized_data), (name, i)
            assert torch.equal(part["scalers"].flatten(), want.quantized_scalers), (name, i)
            assert torch.equal(part["factors"].view(torch.float32).to(want.dtype), want.quantization_factor), name
            assert torch.equal(part["mean"].view(torch.float32).to(want.dtype)[0], want.scaler_mean), (name, i)


# A tiny Mistral-Small-4 in the hub's FP8 layout whose decoder matrices NF4 can block, but for MLA's kv_a_proj_with_mqa
# ((kv_lora_rank + rope) × hidden = 160 × 128): it stays in torch_dtype.
NF4_MISTRAL4 = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "head_dim": 64,
}
MISTRAL4_NF4 = (2 * 8, 2)  # per layer: q_a, q_b, kv_b, o, shared gate/up/down and the experts; kv_a_proj_with_mqa not


@pytest.fixture(scope="module")
def mistral4_nf4_hub(fixtures: Fixtures, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("mistral4-nf4") / "hub"
    return make_tiny_mistral_small4(directory, tokenizer_from=fixtures.model, **NF4_MISTRAL4)


def mistral4_config(fixtures: Fixtures, hub: Path, out: Path, **overrides) -> dict:
    settings = {"lora__lora_dropout": 0.0, "lora__target_experts": True, "train__bf16": False, **overrides}
    cfg = nf4_config(fixtures, hub, out, **settings)
    cfg["lora"]["target_modules"] = ["auto"]
    cfg["fsdp"] = {"activation_checkpointing": True}  # target_experts needs it
    return cfg


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_fp8_hub_checkpoint_loads_sharded_into_torchaos_nf4_of_its_dequantised_weights(
    fixtures: Fixtures, mistral4_nf4_hub: Path, tmp_path: Path, dtype: str
):
    """Each rank reads and dequantises only its rows (its experts), then quantises: the stored NF4 is torchao's of
    the hub's weights decoded with numpy (not rayft) and cast to torch_dtype."""
    raw = mistral4_config(fixtures, mistral4_nf4_hub, tmp_path)
    raw["model"]["torch_dtype"] = dtype
    out = tmp_path / "stored.pt"
    spawn_ranks(_sharded_load_rank, args=(2, free_port(), raw, str(out)), nprocs=2)
    stored = torch.load(out)
    decoded = _numpy_dequantised_text_model(mistral4_nf4_hub).state_dict()
    weights = {name: decoded[name].to(getattr(torch, dtype)) for name in stored}
    assert len(stored) == 2 * (7 + 2)  # 7 NF4 linears a layer, and its experts' two weights
    assert_torchaos_nf4(stored, weights)


ELASTIC = {"ray__num_workers": [1, 2], "train__learning_rate": 3e-3}  # one global order: the same records at 1 or 2


def test_lora_over_nf4_on_two_ranks_trains_as_on_one(fixtures: Fixtures, nf4_model: Path, tmp_path: Path):
    two_ranks = train_locally(nf4_config(fixtures, nf4_model, tmp_path / "two", **ELASTIC), 2)
    assert f"frozen base: {LINEARS} decoder linears and expert stacks stored as NF4" in two_ranks.text()
    one = train_locally(nf4_config(fixtures, nf4_model, tmp_path / "one", **ELASTIC), 1)
    assert [r["step"] for r in two_ranks.metrics()] == list(range(1, STEPS + 1))
    _assert_same_training(two_ranks, one, range(1, STEPS + 1), REORDERED)
    losses = [r["loss"] for r in two_ranks.metrics()]
    assert losses[-1] < losses[0], losses
    # The adapter is a plain PEFT adapter of the original (unquantised) base: every key loads into it.
    base = AutoModelForCausalLM.from_pretrained(nf4_model)
    adapter = PeftModel.from_pretrained(base, two_ranks.out / "final")
    loaded = load_file(two_ranks.out / "final" / "adapter_model.safetensors")
    assert loaded and set_peft_model_state_dict(adapter, loaded).unexpected_keys == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mistral4s_logits_and_input_gradient_are_those_of_torchaos_dequantised_weights(
    mistral4_nf4_hub: Path, dtype: torch.dtype
):
    """MLA attention, the shared expert and the routed experts (dequantised a chunk of experts at a time)."""
    assert_computes_with_torchaos_weights(_numpy_dequantised_text_model(mistral4_nf4_hub).to(dtype), MISTRAL4_NF4)


# The other MoE families at shapes NF4 blocks (hidden 128, experts 128 wide; DeepSeek-V3's dense first layer 256).
NF4_FAMILIES = {
    "qwen3_moe": ({"moe_intermediate_size": 128, "intermediate_size": 256}, (2 * 5, 0)),
    "mixtral": ({"intermediate_size": 128}, (2 * 5, 0)),
    "gpt_oss": ({"intermediate_size": 128}, (2 * 5, 0)),  # transposed, biased experts
    "deepseek_v3": (
        {
            "moe_intermediate_size": 128,
            "intermediate_size": 256,
            "q_lora_rank": 128,
            "kv_lora_rank": 128,
            "qk_rope_head_dim": 32,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
        },
        (2 * 4 + 3 + 4, 2),  # MLA's q_a, q_b, kv_b, o; the dense MLP; shared MLP + experts; kv_a_proj_with_mqa not
    ),
}


@pytest.mark.parametrize("family", sorted(NF4_FAMILIES))
def test_each_moe_familys_logits_and_input_gradient_over_nf4_are_those_of_torchaos_dequantised_weights(family: str):
    overrides, swapped = NF4_FAMILIES[family]
    fields = {
        **COMMON,
        **MOE_FAMILIES[family],
        "hidden_size": 128,
        "num_key_value_heads": 4,
        "head_dim": 32,
        **overrides,
    }
    assert_computes_with_torchaos_weights(_random_model(family, fields), swapped)


def assert_computes_with_torchaos_weights(reference: nn.Module, swapped: tuple[int, int]) -> None:
    """A copy of `reference` in NF4 (`swapped`: what `to_nf4_` reports) gives the logits of `reference` holding
    torchao's dequantised weights, and logits the unquantised model does not give; and the gradient of its input,
    which backward carries through every NF4 matrix (dequantised again there) to the LoRA weights before them."""
    reference.eval()  # no dropout, no router jitter (Mixtral)
    dtype = next(reference.parameters()).dtype
    quantised, unquantised = copy.deepcopy(reference), copy.deepcopy(reference)
    assert to_nf4_(decoder_layers(quantised), dtype) == swapped
    with torch.no_grad():
        for name, module in quantised.named_modules():
            twin = reference.get_submodule(name)
            if isinstance(module, Nf4Linear):
                twin.weight.copy_(to_nf4(twin.weight).get_original_weight())
            elif isinstance(module, Nf4Experts):
                for weight in (twin.gate_up_proj, twin.down_proj):
                    weight.copy_(torch.stack([to_nf4(m.contiguous()).get_original_weight() for m in weight]))
        ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
        embeds = reference.get_input_embeddings()(ids)
    (got, got_grad), (want, want_grad), (before, _) = (
        _logits_and_input_grad(m, embeds) for m in (quantised, reference, unquantised)
    )
    torch.testing.assert_close(got, want)
    assert (got - before).abs().max() > 10 * (got - want).abs().max()
    torch.testing.assert_close(got_grad, want_grad)
    assert got_grad.abs().sum() > 0


def _logits_and_input_grad(model: nn.Module, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = embeds.detach().clone().requires_grad_()
    logits = model(inputs_embeds=x).logits
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach(), x.grad


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_deepseeks_block_fp8_checkpoint_loads_sharded_into_torchaos_nf4_of_its_decoded_weights(
    fixtures: Fixtures, tmp_path: Path, dtype: str
):
    """DeepSeek-V3 as its hub checkpoint ships (per-expert keys, FP8 with a scale per 128 × 128 block): each rank
    decodes its rows (its experts) with their blocks' scales and quantises them; the stored NF4 is torchao's of the
    file's values, decoded with numpy (not rayft) and cast to torch_dtype."""
    overrides, swapped = NF4_FAMILIES["deepseek_v3"]
    shape = {"hidden_size": 128, "num_key_value_heads": 4, "head_dim": 32, **overrides}
    model_dir = make_block_fp8(make_hub_moe("deepseek_v3", tmp_path / "bf16", **shape), tmp_path / "fp8", (128, 128))
    raw = mistral4_config(fixtures, model_dir, tmp_path / "out")  # expert LoRA too, as a DeepSeek job would run
    raw["model"]["torch_dtype"] = dtype
    out = tmp_path / "stored.pt"
    spawn_ranks(_sharded_load_rank, args=(2, free_port(), raw, str(out)), nprocs=2)
    stored = torch.load(out)
    decoded, fp8_keys = _references(model_dir, (128, 128))
    assert len(stored) == swapped[0] + 1  # the experts module holds two stacks
    assert any(".experts." in key for key in fp8_keys) and any("self_attn" in key for key in fp8_keys)
    assert_torchaos_nf4(stored, {name: decoded[name].to(getattr(torch, dtype)) for name in stored})


@pytest.fixture(scope="module")
def mistral4_two_ranks(fixtures: Fixtures, mistral4_nf4_hub: Path, tmp_path_factory) -> LocalRun:
    out = tmp_path_factory.mktemp("mistral4-nf4-two")
    run = train_locally(mistral4_config(fixtures, mistral4_nf4_hub, out, **ELASTIC), 2)
    assert [r["step"] for r in run.metrics()] == list(range(1, STEPS + 1))
    return run


def test_lora_over_mistral4_in_nf4_on_two_ranks_trains_as_on_one(
    fixtures: Fixtures, mistral4_nf4_hub: Path, mistral4_two_ranks: LocalRun, tmp_path: Path
):
    """Expert LoRA too (`lora.target_experts`), over the NF4 experts."""
    swapped, kept = MISTRAL4_NF4
    assert f"frozen base: {swapped} decoder linears and expert stacks stored as NF4" in mistral4_two_ranks.text()
    assert f"({kept} of a shape NF4 cannot block stay torch.float32)" in mistral4_two_ranks.text()
    one = train_locally(mistral4_config(fixtures, mistral4_nf4_hub, tmp_path, **ELASTIC), 1)
    _assert_same_training(mistral4_two_ranks, one, range(1, STEPS + 1), REORDERED)
    losses = [r["loss"] for r in mistral4_two_ranks.metrics()]
    assert losses[-1] < losses[0], losses
    adapter = load_file(mistral4_two_ranks.out / "final" / "adapter_model.safetensors")
    experts_b = [v for k, v in adapter.items() if ".experts." in k and "lora_B" in k]
    assert experts_b and all(v.abs().max() > 0 for v in experts_b)  # expert LoRA trained (it starts at zero)


def test_a_stopped_mistral4_nf4_run_continues_to_the_uninterrupted_result(
    fixtures: Fixtures, mistral4_nf4_hub: Path, mistral4_two_ranks: LocalRun, tmp_path: Path
):
    cfg = mistral4_config(fixtures, mistral4_nf4_hub, tmp_path, **ELASTIC)
    stopped = train_locally(cfg, 2, crash_saving=3)
    run = train_locally(cfg, 2, resume=stopped.checkpoint(2))
    assert run.resumes() == [2]
    _assert_same_training(run, mistral4_two_ranks, range(1, STEPS + 1), TOLERANCE)


def test_the_plan_counts_exactly_the_bytes_nf4_storage_holds(mistral4_nf4_hub: Path):
    """The planner's NF4 figures (from the unswapped meta model) against the swapped model's own parameters."""
    cfg = Config.from_dict(
        {
            "model": {"model_name_or_path": str(mistral4_nf4_hub), "frozen_dtype": "nf4"},
            "lora": {"target_modules": ["auto"]},
        }
    )
    s = meta_structure(cfg)
    model = empty_model(cfg.model)
    assert to_nf4_(decoder_layers(model), torch.bfloat16) == MISTRAL4_NF4
    held = [m for m in model.modules() if isinstance(m, (Nf4Linear, Nf4Experts))]
    storage = [p for m in held for p in m.parameters(recurse=False) if p.dtype != torch.bfloat16]  # not a bias
    codes = [p for m in held for n, p in m.named_parameters(recurse=False) if p.dtype == torch.uint8]
    assert s.nf4 == 2 * sum(p.numel() for p in codes) > 0
    stored = sum(p.numel() * p.element_size() for p in storage)
    assert nf4_storage_bytes(s.nf4, s.nf4_matrices) == stored
    bf16 = dict(plan_memory(cfg, s, 1, on_gpu=True).rows)
    nf4 = dict(plan_memory(cfg, s, 1, on_gpu=True, held="nf4").rows)
    saved = (bf16["sharded weights (/1)"] - nf4["sharded weights (/1)"]) * 2**30
    assert saved == pytest.approx(s.nf4 * 2 - stored)
    assert "NF4 weight dequantised for its matmul" in nf4


def test_rayft_plan_puts_mistral_small_4_in_nf4_on_one_h200(capsys):
    """The example QLoRA job on the real model's structure (transformers' Mistral-Small-4 defaults): one H200 holds
    it, with some 53 GiB more room than FP8 would leave, at the tokens per GPU the head line states."""
    example = str(REPO / "jobs" / "mistral4-nf4-1xh200.yaml")
    result = run_cli(
        capsys, "plan", "--config", example, "--preset", "mistral-small-4", "--gpu", "h200", "--no-layouts"
    )
    assert result.rc == 0, result.err
    table = result.out
    assert (
        "frozen base stored in nf4" in table
        and "4096 tokens/GPU (1 x 4096: per_device_train_batch_size x max_length)" in table
    ), table
    fits = re.search(r"on h200 \([\d.]+ GiB\)\s+(\w+)", table)
    nf4_total = float(re.search(r"total GiB/GPU\s+([\d.]+)", table)[1])
    fp8_total = float(re.search(r"with fp8 base\s+([\d.]+)", table)[1])
    assert fits[1] == "fits" and nf4_total < fp8_total - 50, table  # 117.9B weights at 4.127 bits, not 8


def test_a_bf16_lora_step_over_nf4_on_the_device_matches_the_fp32_reference(
    fixtures: Fixtures, mistral4_nf4_hub: Path, tmp_path: Path, device_group, record_property
):
    """The worker's model (sharded NF4 load from the hub's FP8 layout onto the device, bf16, FSDP2, LoRA) against
    transformers' own Mistral4 on CPU in fp32 holding torchao's dequantisation of the same bf16 weights: loss and
    every LoRA gradient within bf16 error. On a GPU, the load's peak device memory is the rank's share of the model
    as stored plus one checkpoint tensor dequantised in fp32 (and the encoding's bounded working set)."""
    cuda = device_group.type == "cuda"
    raw = mistral4_config(fixtures, mistral4_nf4_hub, tmp_path, lora__target_experts=False, train__bf16=True)
    raw["model"]["torch_dtype"] = "bfloat16"
    raw["fsdp"] = {}
    with LoadMemory(device_group) as load:
        model = build_model(Config.from_dict(raw), on_gpu=cuda, device=device_group)
    load.report(record_property, model)
    if cuda:
        share = load.share_bytes(model)
        largest = max(p.numel() for p in _numpy_dequantised_text_model(mistral4_nf4_hub).parameters()) * 4
        assert load.peak_bytes <= share + largest + ENCODE_WORKING_SET, (load.peak_bytes, share, largest)
    _randomise_lora_b(model)
    reference = _nf4_reference(model, mistral4_nf4_hub, raw)
    batch = _batch(device_group)
    loss = model(**batch).loss
    loss.backward()
    want = reference(**{k: v.cpu() for k, v in batch.items()}).loss
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=LOSS_ATOL)
    got = _lora_grads(model)
    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert set(got) == set(expected) and got
    errors = {n: _relative_error(got[n], expected[n]) for n in got}
    worst = max(errors, key=errors.get)
    assert errors[worst] < GRAD_RTOL["mistral4-hub"], f"{worst}: relative gradient error {errors[worst]:.3g}"


ENCODE_WORKING_SET = 128 * 2**20  # `rayft.model.nf4.encode` compares a chunk of 2**20 weights with the 16 levels


def _nf4_reference(model: nn.Module, hub: Path, raw: dict) -> nn.Module:
    """transformers' Mistral4 on CPU in fp32: the hub's weights decoded with numpy and rounded to bf16 (what the
    worker quantised), each NF4-held one replaced by torchao's dequantisation, with the worker's LoRA weights."""
    import peft

    base = _numpy_dequantised_text_model(hub).to(torch.bfloat16)
    base.config.use_cache = False  # as in training: with a cache transformers would not split packed rows
    held = {
        name.removeprefix("base_model.model.").replace(".base_layer", "")
        for name, m in model.named_modules()
        if isinstance(m, (Nf4Linear, Nf4Experts))
    }
    with torch.no_grad():
        for name in held:
            module = base.get_submodule(name)
            for weight in [module.weight] if isinstance(module, nn.Linear) else [module.gate_up_proj, module.down_proj]:
                stack = weight if weight.ndim == 3 else weight[None]
                weight.copy_(torch.stack([to_nf4(m).get_original_weight() for m in stack]).view(weight.shape))
    base = base.float()
    lora = raw["lora"]
    reference = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=lora["r"],
            lora_alpha=lora["lora_alpha"],
            lora_dropout=0.0,
            target_modules=list(AUTO_TARGETS["mistral4"]),
            task_type=peft.TaskType.CAUSAL_LM,
        ),
    )
    trained = {n: p.full_tensor().detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}
    unexpected = reference.load_state_dict(trained, strict=False).unexpected_keys
    assert not unexpected, unexpected
    assert {n for n, p in reference.named_parameters() if p.requires_grad} == set(trained)
    return reference
