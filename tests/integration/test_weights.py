"""Per-rank sharded loading: shards equal the checkpoint (every common dense family, tied or not, and a real
pretrained model), FP8 slices dequantise like the file's bytes say, and a checkpoint that does not fit is refused."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import torch.distributed as dist
from conftest import Fixtures, free_port, tiny_config
from fixtures.families import FAMILIES, make_tiny_family
from fixtures.fp8_bytes import decode_e4m3, raw_tensor_bytes
from fixtures.ranks import spawn_ranks
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from rayft.config import Config, ModelConfig
from rayft.model.build import empty_model, fused_loss
from rayft.model.loss import CausalLMLoss
from rayft.model.weights import (
    CheckpointKeyError,
    CheckpointShapeError,
    SafetensorsCheckpoint,
    buffers_kept,
    dequantize,
    load_sharded_,
    model_param_name,
    tied_parameters,
)
from rayft.parallel.parallelize import build_model, reshard_all


def _sharded_rank(rank: int, world: int, port: int, raw: dict, model_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build_model(Config.from_dict(raw), on_gpu=False)
        reference = load_file(f"{model_dir}/model.safetensors")
        probe = torch.tensor([[1, 1784, 1937, 1278, 1812, 2]])
        with torch.no_grad():
            logits = model(input_ids=probe).logits  # collective: every rank runs it
        reshard_all(model)  # the root and the last layer keep their weights gathered after forward
        for name, param in model.named_parameters():
            full = param.full_tensor()  # collective too
            if rank == 0 and ".lora_" not in name:
                assert torch.equal(full, reference[model_param_name(name)]), name
            if ".lora_B." in name:
                assert not full.any(), name  # fresh LoRA: B = 0, so the model equals the base
        if rank == 0:
            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            with torch.no_grad():
                assert (base(input_ids=probe).logits - logits).abs().max() < 1e-5
    finally:
        dist.destroy_process_group()


def test_two_ranks_load_only_their_shards_and_match_the_checkpoint(fixtures: Fixtures, tmp_path):
    raw = tiny_config(fixtures, tmp_path)
    assert raw["model"].get("load_mode", "sharded") == "sharded"
    spawn_ranks(_sharded_rank, args=(2, free_port(), raw, str(fixtures.model)), nprocs=2)


def _fp8_checkpoint(tmp_path) -> tuple[SafetensorsCheckpoint, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    linear, experts = torch.randn(6, 4), torch.randn(4, 6, 3)
    linear_scale = linear.abs().max() / 448
    expert_scale = experts.abs().amax(dim=(1, 2), keepdim=True) / 448
    tensors = {
        "layers.0.proj.weight": (linear / linear_scale).to(torch.float8_e4m3fn),
        "layers.0.proj.weight_scale_inv": linear_scale.reshape(()),
        "layers.0.proj.activation_scale": torch.tensor(1.0),
        "layers.0.experts.gate_up_proj": (experts / expert_scale).to(torch.float8_e4m3fn),
        "layers.0.experts.gate_up_proj_scale_inv": expert_scale,
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return SafetensorsCheckpoint(tmp_path), tensors


def test_the_e4m3_decoder_knows_the_format():
    """Values from the OCP FP8 spec: max normal 448, min normal 2^-6, min subnormal 2^-9, NaN, signed zero."""
    got = decode_e4m3(bytes([0x7E, 0x08, 0x01, 0x38, 0xC0, 0x80, 0x7F]), [7])
    assert got[:6].tolist() == [448.0, 2.0**-6, 2.0**-9, 1.0, -2.0, 0.0] and np.isnan(got[6])


def _fp8_reference(path: Path, key: str, scale_key: str) -> np.ndarray:
    """The dequantised tensor from the file's bytes: decoded E4M3 × its fp32 scale (broadcast per tensor or expert)."""
    info, raw = raw_tensor_bytes(path, key)
    assert info["dtype"] == "F8_E4M3", key
    scale_info, scale_raw = raw_tensor_bytes(path, scale_key)
    assert scale_info["dtype"] == "F32", scale_key
    scale = np.frombuffer(scale_raw, dtype="<f4").reshape(scale_info["shape"]).astype(np.float64)
    return (decode_e4m3(raw, info["shape"]) * scale).astype(np.float32)  # fp64 product of fp32s: exact, then rounded


def test_fp8_slices_dequantise_like_the_file_bytes_say(tmp_path):
    checkpoint, _ = _fp8_checkpoint(tmp_path)
    for key, scale in (
        ("layers.0.proj.weight", "layers.0.proj.weight_scale_inv"),
        ("layers.0.experts.gate_up_proj", "layers.0.experts.gate_up_proj_scale_inv"),
    ):
        whole = torch.from_numpy(_fp8_reference(tmp_path / "model.safetensors", key, scale))
        assert whole.abs().max() > 0 and not whole.isnan().any()
        rows = checkpoint.rows(key, 1, 3)
        assert rows.dtype == torch.float8_e4m3fn and rows.shape[0] == 2
        assert torch.equal(dequantize(rows, key, checkpoint, start=1), whole[1:3]), key


def test_a_tensor_missing_from_the_checkpoint_fails_loudly(tmp_path):
    save_file({"weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=True))
    with pytest.raises(CheckpointKeyError, match=r"lacks 2 model tensors: 0\.weight, 0\.bias"):
        load_sharded_(model, tmp_path)


MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def _dequantised_reference(model_dir: str) -> dict[str, torch.Tensor]:
    """Every language-model tensor of the hub files as fp32, keyed like the llava layout: FP8 ones decoded from
    their bytes × their scale (`_fp8_reference`), the rest as the safetensors library reads them."""
    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        plain = load_file(str(path))
        keys = list(plain)
        for key in keys:
            if not key.startswith("language_model.") or key.endswith(("_scale_inv", "activation_scale")):
                continue
            scale = next(
                (k for k in (f"{key}_scale_inv", f"{key.rsplit('.', 1)[0]}.weight_scale_inv") if k in keys), None
            )
            if scale is not None:
                out[key] = torch.from_numpy(_fp8_reference(path, key, scale))
            else:
                out[key] = plain[key].to(torch.float32)
    return out


def _hub_rank(rank: int, world: int, port: int, raw: dict, model_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build_model(Config.from_dict(raw), on_gpu=False)
        assert type(model.get_base_model()).__name__.endswith("Mistral4ForCausalLM")
        reference = _dequantised_reference(model_dir) if rank == 0 else {}
        seen = set()
        for name, param in model.named_parameters():
            full = param.full_tensor()
            if rank == 0 and ".lora_" not in name:
                key = "language_model." + model_param_name(name)
                assert full.dtype == torch.bfloat16, name
                assert torch.equal(full, reference[key].to(full.dtype)), name
                seen.add(key)
        if rank == 0:
            assert seen == set(reference), set(reference) ^ seen  # experts, router, norms, head: all of it
            assert any("experts.gate_up_proj" in k for k in seen)
        assert not any("vision_tower" in n or "multi_modal" in n for n, _ in model.named_parameters())
    finally:
        dist.destroy_process_group()


def test_fp8_hub_layout_loads_dequantised_on_two_ranks(fixtures: Fixtures, mistral4_hub, tmp_path):
    model_dir = mistral4_hub
    raw = tiny_config(fixtures, tmp_path)
    raw["model"].update(model_name_or_path=str(model_dir), torch_dtype="bfloat16", frozen_dtype="bfloat16")
    raw["lora"]["target_modules"] = MLA_TARGETS
    spawn_ranks(_hub_rank, args=(2, free_port(), raw, str(model_dir)), nprocs=2)


def test_routed_expert_lora_trains_on_every_rank_and_saves(trained_expert_adapter):
    """The fixture trained it on 2 ranks, asserting non-zero gradients on each rank's shards of every expert LoRA."""
    adapter = load_file(trained_expert_adapter / "adapter_model.safetensors")
    experts = {k: v for k, v in adapter.items() if ".experts." in k}
    assert len(experts) == 8 and all(v.abs().sum() > 0 for v in experts.values())
    config = json.loads((trained_expert_adapter / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


# --- Model families: sharded loading equals from_pretrained, tied heads are the embedding, the model trains -------

FAMILY_CASES = [f"{family}-{'tied' if tied else 'untied'}" for family in FAMILIES for tied in (True, False)]
REAL = "smollm2-135m"  # real pretrained weights: Llama architecture, tied embeddings


@pytest.fixture(scope="module")
def family_models(smollm2: Path) -> dict[str, Path]:
    """Every family tied and untied, built once per machine (tests/fixtures/cache.py): read-only."""
    from fixtures import families
    from fixtures.cache import cache_key, cached_dir

    def build(root: Path) -> None:
        for c in FAMILY_CASES:
            make_tiny_family(c.rpartition("-")[0], root / c, tied=c.endswith("-tied"))

    key = cache_key(("torch", "transformers", "safetensors"), (Path(families.__file__),), extra=",".join(FAMILY_CASES))
    root = cached_dir("tiny-families", key, build)
    return {**{c: root / c for c in FAMILY_CASES}, REAL: smollm2}


@pytest.fixture(scope="module")
def family_loads(family_models: dict[str, Path], fixtures: Fixtures, tmp_path_factory) -> dict[str, list[str]]:
    """Every family loaded sharded on 2 gloo ranks in one spawn (cheap), checked against `from_pretrained` of the
    same directory on rank 0: what went wrong, per family (empty when all is right)."""
    out = tmp_path_factory.mktemp("family-loads")
    raw = tiny_config(fixtures, out)
    raw["lora"].update(target_modules=["auto"], lora_dropout=0.0)
    models = {case: str(path) for case, path in family_models.items()}
    spawn_ranks(_families_rank, args=(2, free_port(), raw, models, str(out / "problems.json")), nprocs=2)
    return json.loads((out / "problems.json").read_text())


@pytest.mark.parametrize("case", [*FAMILY_CASES, REAL])
def test_each_family_loads_sharded_exactly_as_from_pretrained_and_trains(family_loads, family_models, case):
    with safe_open(str(family_models[case] / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    tied = case.endswith("-tied") or case == REAL
    assert ("lm_head.weight" in stored) is not tied  # a tied checkpoint stores the head once, as the embedding
    assert family_loads[case] == []


def _families_rank(rank: int, world: int, port: int, raw: dict, models: dict[str, str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # toy matrices: threads would only contend with the other rank
    dist.init_process_group("gloo", rank=rank, world_size=world)
    problems = {}
    try:
        for case, model_dir in models.items():
            raw["model"]["model_name_or_path"] = model_dir
            try:
                problems[case] = _check_family(Config.from_dict(raw), case, rank)
            except Exception as e:  # raised alike on both ranks (the load is planned whole before any copy)
                problems[case] = [f"{type(e).__name__}: {e}"]
            gc.collect()
        if rank == 0:
            Path(out).write_text(json.dumps(problems))
    finally:
        dist.destroy_process_group()


def _check_family(cfg: Config, case: str, rank: int) -> list[str]:
    """Collectives on both ranks; comparisons on rank 0, collected rather than raised so both ranks stay in step."""
    problems = []
    model_dir = cfg.model.model_name_or_path
    torch.manual_seed(0)
    model = build_model(cfg, on_gpu=False)
    base = model.get_base_model()
    head, embedding = base.get_output_embeddings().weight, base.get_input_embeddings().weight
    tied = bool(tied_parameters(model))
    if tied != case.endswith(("-tied", REAL)):
        problems.append(f"tied_parameters says tied={tied}")
    if tied and not (head is embedding and isinstance(head, DTensor)):
        problems.append("the head is not the embedding's DTensor")
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) if rank == 0 else None
    expected = reference.state_dict() if rank == 0 else {}
    loaded = set(tied_parameters(model))
    for name, param in model.named_parameters():
        full = param.full_tensor()  # collective
        if rank == 0 and ".lora_" not in name:
            loaded.add(model_param_name(name))
            if not torch.equal(full, expected[model_param_name(name)]):
                problems.append(f"{name} differs from from_pretrained")
    if rank == 0 and loaded != set(expected):
        problems.append(f"loaded {sorted(loaded ^ set(expected))} unlike from_pretrained")

    tokenizer = AutoTokenizer.from_pretrained(model_dir) if case == REAL else None
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids if tokenizer else None
    if ids is None:
        ids = torch.tensor([[1, 17, 300, 42, 5, 77, 2]])
    with torch.no_grad():
        output = model(input_ids=ids, labels=ids)  # LoRA B = 0: the base model's logits
        logits, plain_loss = output.logits, output.loss.item()
    if rank == 0:
        with torch.no_grad():
            want = reference(input_ids=ids).logits
        if (want - logits).abs().max() > 1e-4:
            problems.append(f"logits differ from from_pretrained by {(want - logits).abs().max():.2e}")
        if tokenizer is not None and tokenizer.decode(logits[0, -1].argmax()) != " Paris":
            problems.append(f"the real model's next token is {tokenizer.decode(logits[0, -1].argmax())!r}")
    del reference, expected

    if tied and case != REAL:  # training goes the same way untied; the real model trains in the job test
        problems += _fused_loss_and_training_problems(model, cfg, case, ids, plain_loss)
    return problems


def _fused_loss_and_training_problems(model, cfg: Config, case: str, ids: torch.Tensor, plain_loss: float) -> list[str]:
    """The fused loss finds the head through the tied embedding and equals transformers' loss (Gemma2's soft-capped
    logits keep the plain path); LoRA training lowers the loss and leaves the head tied."""
    problems = []
    why_not = fused_loss(model, cfg)
    if case.startswith("gemma2"):
        if "final_logit_softcapping" not in (why_not or ""):
            problems.append(f"fused loss on soft-capped logits: {why_not}")
    elif why_not is not None:
        problems.append(f"no fused loss: {why_not}")
    loss_of = CausalLMLoss(fused=why_not is None)  # as the trainer takes it
    batch = {"input_ids": ids, "labels": ids}
    if why_not is None:
        with torch.no_grad():
            fused = loss_of(model, batch).item()
        if abs(fused - plain_loss) > 1e-5 * abs(plain_loss):
            problems.append(f"fused loss {fused} != {plain_loss}")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    losses = []
    for _ in range(2):  # the second loss is after one update
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if not losses[-1] < losses[0]:
        problems.append(f"LoRA training did not lower the loss: {losses}")
    base = model.get_base_model()
    if base.get_output_embeddings().weight is not base.get_input_embeddings().weight:
        problems.append("training untied the head")
    return problems


# --- Checkpoints that do not fit the model are refused before a byte is copied ------------------------------------


def _sentinel_model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Embedding(8, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    return model


@pytest.mark.parametrize(
    ("stored", "message"),
    [
        (
            {"0.weight": torch.ones(4, 6)},
            r"'0\.weight' has shape \[4, 6\] in the checkpoint, the model's '0\.weight' "
            r"has \[6, 4\]",
        ),  # transposed
        (
            {"1.weight": torch.ones(9, 4)},
            r"'1\.weight' has shape \[9, 4\] in the checkpoint, the model's '1\.weight' "
            r"has \[8, 4\]",
        ),  # a bigger vocabulary: main copied its first 8 rows
        ({"0.bias": torch.ones(5)}, r"'0\.bias' has shape \[5\] .* has \[6\]"),  # main read past its end
        (
            {"0.weight": torch.ones(6, 4, dtype=torch.int32)},
            r"'0\.weight' is torch\.int32 in the checkpoint, the "
            r"model's '0\.weight' is torch\.float32",
        ),
    ],
    ids=["transposed", "more-rows", "fewer-rows", "integer"],
)
def test_a_tensor_that_does_not_fit_is_refused_before_any_copy(tmp_path, stored, message):
    fitting = {"0.weight": torch.zeros(6, 4), "0.bias": torch.zeros(6), "1.weight": torch.zeros(8, 4)}
    save_file({**fitting, **stored}, str(tmp_path / "model.safetensors"))
    model = _sentinel_model()
    with pytest.raises(CheckpointShapeError, match=message):
        load_sharded_(model, tmp_path)
    assert all((p == 7.0).all() for p in model.parameters())  # nothing was copied, not even the fitting tensors


def test_rows_outside_a_tensor_are_refused(tmp_path):
    save_file({"a": torch.arange(6.0).reshape(3, 2), "b": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    checkpoint = SafetensorsCheckpoint(tmp_path)
    assert checkpoint.rows("a", 1, 3).tolist() == [[2.0, 3.0], [4.0, 5.0]]
    with pytest.raises(CheckpointShapeError, match=r"rows \[2, 4\) of 'a' lie outside its shape \[3, 2\]"):
        checkpoint.rows("a", 2, 4)  # main returned a's last row and b's first


# --- Embedding LoRA starts as PEFT starts it: a zero delta ---------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_embedding_lora_starts_like_peft_a_zero_delta(tmp_path, tied):
    """One process, no FSDP (the export path); LoRA on the embedding (tied: also the head) and on q_proj."""
    model_dir = make_tiny_family("llama", tmp_path / "llama", tied=tied)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"])
    meta = empty_model(ModelConfig(model_name_or_path=str(model_dir), torch_dtype="float32"))
    model = peft.get_peft_model(meta, lora)
    with buffers_kept(model):
        model.to_empty(device=torch.device("cpu"))
    torch.manual_seed(0)
    load_sharded_(model, model_dir)
    ours = dict(model.named_parameters())
    base = model.get_base_model()
    assert (base.lm_head.weight is base.model.embed_tokens.base_layer.weight) is tied  # retied after to_empty
    # PEFT's own init of the same adapter on from_pretrained, for comparison
    theirs = dict(peft.get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir)), lora).named_parameters())
    for name in (
        "base_model.model.model.embed_tokens.lora_embedding_A.default",
        "base_model.model.model.embed_tokens.lora_embedding_B.default",
    ):
        assert ours[name].shape == theirs[name].shape
        assert ours[name].any().item() == theirs[name].any().item(), name  # A = 0, B ≠ 0 in both
    b_ours, b_theirs = (p["base_model.model.model.embed_tokens.lora_embedding_B.default"] for p in (ours, theirs))
    assert 0.7 < b_ours.std().item() < 1.3 and 0.7 < b_theirs.std().item() < 1.3  # N(0, 1) in both
    ids = torch.tensor([[1, 17, 300, 42, 5]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(model_dir))(input_ids=ids).logits
        assert torch.allclose(model(input_ids=ids).logits, want, atol=1e-5)  # the adapter starts as no change
