"""PEFT's own options (`all-linear`, DoRA, rsLoRA, modules_to_save) through the sharded FSDP2 build, checkpoints and
export, each held against PEFT's own model (`get_peft_model` + `save_pretrained`) on an unsharded copy of the same
weights; and the combinations that cannot work, refused by `rayft validate` before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import torch.distributed as dist
from conftest import Fixtures, run_cli, tiny_config, write_yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rayft.config import Config, ConfigError, LoraConfig, ModelConfig
from rayft.model.build import empty_model
from rayft.model.files import ADAPTER_WEIGHTS
from rayft.model.lora import resolve_targets
from rayft.parallel.layout import ParallelDims, parallel_dims
from rayft.parallel.parallelize import build_model
from rayft.parallel.topology import Topology
from rayft.train.checkpoint import save_adapter

OPTIONS = {
    "all-linear": {"target_modules": ["all-linear"]},
    "dora": {"use_dora": True},
    "rslora": {"use_rslora": True, "r": 4},
    "modules_to_save": {"modules_to_save": ["lm_head", "embed_tokens"], "target_modules": ["q_proj", "v_proj"]},
}
IDS = torch.tensor([[1, 1784, 1937, 1278, 1812, 2], [1, 1812, 1321, 1278, 1937, 2]])


def _raw(fixtures: Fixtures, tmp_path: Path, option: str) -> dict:
    raw = tiny_config(fixtures, tmp_path / "out")
    raw["lora"].update(lora_dropout=0.0, **OPTIONS[option])
    raw["train"]["fused_loss"] = False
    return raw


def _reference(fixtures: Fixtures, raw: dict) -> peft.PeftModel:
    """PEFT's own model on the unsharded checkpoint, configured from the same `lora` section by hand."""
    lora = raw["lora"]
    targets = lora["target_modules"]
    return peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(fixtures.model), dtype=torch.float32),
        peft.LoraConfig(
            r=lora["r"],
            lora_alpha=lora["lora_alpha"],
            lora_dropout=0.0,
            target_modules="all-linear" if targets == ["all-linear"] else targets,
            use_dora=lora.get("use_dora", False),
            use_rslora=lora.get("use_rslora", False),
            modules_to_save=lora.get("modules_to_save"),
            task_type=peft.TaskType.CAUSAL_LM,
        ),
    )


def _trainable(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _step(model) -> float:
    """One AdamW step on a fixed batch; the loss before it."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _trained_pair(fixtures: Fixtures, tmp_path: Path, option: str):
    """rayft's sharded model and PEFT's own, with the same lora_A draw (the one random init), each trained a step."""
    raw = _raw(fixtures, tmp_path, option)
    torch.manual_seed(0)
    ours = build_model(Config.from_dict(raw), on_gpu=False)
    reference = _reference(fixtures, raw)
    mine = _trainable(ours)
    theirs = dict(reference.named_parameters())
    assert sorted(mine) == sorted(n for n, p in theirs.items() if p.requires_grad)
    with torch.no_grad():
        for name, value in mine.items():
            if ".lora_A." in name:
                theirs[name].copy_(value)
            else:  # B = 0, DoRA magnitudes, the modules_to_save copies: PEFT's own init on the real weights
                torch.testing.assert_close(value, theirs[name], msg=name)
    assert _step(ours) == pytest.approx(_step(reference), rel=1e-5)
    return ours, reference


@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_trains_and_saves_as_peft_does(option, fixtures: Fixtures, tmp_path, process_group):
    """Initial values, loss, one AdamW step (so gradients through FSDP2 too), the logits after it, and the saved
    adapter (config fields, tensor keys and values) equal PEFT's own model and `save_pretrained`."""
    ours, reference = _trained_pair(fixtures, tmp_path, option)
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=IDS).logits, reference(input_ids=IDS).logits, rtol=1e-4, atol=1e-5)
    save_adapter(ours, tmp_path / "ours", ParallelDims(Topology(("local",)), shard=1, experts=1, device_type="cpu"))
    reference.save_pretrained(str(tmp_path / "peft"), save_embedding_layers=False)
    mine, theirs = (load_file(str(tmp_path / d / ADAPTER_WEIGHTS)) for d in ("ours", "peft"))
    assert sorted(mine) == sorted(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=1e-4, atol=1e-6, msg=key)
    configs = [json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ours", "peft")]
    for field in ("r", "lora_alpha", "use_dora", "use_rslora", "modules_to_save"):
        assert configs[0][field] == configs[1][field], field
    assert set(configs[0]["target_modules"]) == set(configs[1]["target_modules"])


def test_modules_to_save_on_a_bf16_base_train_fp32_copies_as_peft_does_on_its_values(
    fixtures: Fixtures, tmp_path, process_group
):
    """A bf16 base (a GPU's) with whole modules trained inside a decoder layer (`down_proj`) and at the root
    (`lm_head`): every trained parameter is an fp32 master weight (the copies start from the checkpoint's own fp32
    values), and one AdamW step through FSDP2 (compute in fp32 here) equals PEFT's own model whose frozen weights
    are rounded to bf16."""
    raw = _raw(fixtures, tmp_path, "modules_to_save")
    raw["model"]["torch_dtype"] = "bfloat16"
    raw["lora"]["modules_to_save"] = ["down_proj", "lm_head"]
    torch.manual_seed(0)
    ours = build_model(Config.from_dict(raw), on_gpu=False)
    trained = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    assert sum(".modules_to_save." in n for n in trained) == 3  # down_proj of both layers, the head
    assert {p.dtype for p in trained.values()} == {torch.float32}, {n: p.dtype for n, p in trained.items()}
    reference = _reference(fixtures, raw)
    with torch.no_grad():
        for param in reference.parameters():
            if not param.requires_grad:
                param.copy_(param.bfloat16().float())
        theirs = dict(reference.named_parameters())
        for name, value in _trainable(ours).items():
            if ".lora_A." in name:
                theirs[name].copy_(value)
    assert _step(ours) == pytest.approx(_step(reference), rel=1e-5)
    mine = _trainable(ours)
    for name, param in reference.named_parameters():
        if ".modules_to_save." in name:
            torch.testing.assert_close(mine[name], param.detach(), rtol=1e-4, atol=1e-6, msg=name)


def test_all_linear_is_every_linear_layer_but_the_head(fixtures: Fixtures):
    targets = resolve_targets(
        empty_model(ModelConfig(model_name_or_path=str(fixtures.model))), LoraConfig(target_modules=["all-linear"])
    )
    assert len(targets.modules) == 2 * 7 and not [m for m in targets.modules if "lm_head" in m or "embed" in m]


def test_unknown_targets_list_linear_layers_apart_from_embeddings(fixtures: Fixtures):
    """The message once listed `embed_tokens` among the linear layers."""
    with pytest.raises(ConfigError) as error:
        resolve_targets(
            empty_model(ModelConfig(model_name_or_path=str(fixtures.model))), LoraConfig(target_modules=["qkv_proj"])
        )
    assert "its linear layers are: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj;" in str(
        error.value
    )
    assert "its embeddings: embed_tokens" in str(error.value)


def test_expert_weight_names_point_at_target_experts(tmp_path):
    """Mixtral's experts were w1/w2/w3 modules; in transformers 5 they are fused parameters, so those names matched
    nothing and LoRA went on the attention alone, with a warning at most."""
    from fixtures.moe_families import tiny_moe_config
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_moe_config("mixtral"))
    with pytest.raises(ConfigError, match=r"w1, w2, w3 name routed experts' weights.*lora.target_experts: true"):
        resolve_targets(model, LoraConfig(target_modules=["q_proj", "w1", "w2", "w3"]))
    assert resolve_targets(model, LoraConfig(target_modules=["q_proj"], lora_dropout=0.0)).modules


COMBINED = {
    "target_modules": ["all-linear"],
    "use_dora": True,
    "use_rslora": True,
    "modules_to_save": ["lm_head", "embed_tokens"],
    "lora_dropout": 0.0,
}


def _train_and_save_rank(rank: int, world: int, port: int, raw: dict, out: str) -> None:
    from test_checkpoint import _full_state, _setup

    from rayft.train.checkpoint import save_checkpoint
    from rayft.train.checkpoint_dir import Progress

    model, optimizer, scheduler, layout = _setup(rank, world, port, raw)
    try:
        init = _trainable(model)
        for _ in range(2):
            model(input_ids=IDS, labels=IDS).loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        progress = Progress(2, 0, 4, world)
        save_checkpoint(Path(out), model, optimizer, scheduler, progress, {"loss": 1.0}, layout, "run-a")
        state = _full_state(model, optimizer)
        with torch.no_grad():
            logits = model(input_ids=IDS).logits
        if rank == 0:
            torch.save({**state, "init": init, "logits": logits}, Path(out) / "expected.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _resume_rank(rank: int, world: int, port: int, raw: dict, out: str) -> None:
    from test_checkpoint import _full_state, _setup

    from rayft.train.checkpoint import load_adapter_weights, load_checkpoint
    from rayft.train.checkpoint_dir import ADAPTER_DIR

    model, optimizer, scheduler, layout = _setup(rank, world, port, raw)
    try:
        load_checkpoint(Path(out), model, optimizer, scheduler, layout)
        resumed = _full_state(model, optimizer)
        cfg = Config.from_dict(raw)
        fresh_layout = parallel_dims(cfg, "cpu")
        fresh = build_model(cfg, on_gpu=False, dims=fresh_layout)
        load_adapter_weights(fresh, Path(out) / ADAPTER_DIR, fresh_layout)
        with torch.no_grad():
            logits = fresh(input_ids=IDS).logits
        torch.save({**resumed, "adapter": _trainable(fresh), "logits": logits}, Path(out) / "loaded.pt")
    finally:
        dist.destroy_process_group()


def test_checkpoint_resume_adapter_and_export_keep_every_option(fixtures: Fixtures, tmp_path):
    """all-linear + DoRA + rsLoRA + modules_to_save, sharded over 2 ranks: the magnitudes and copies start as PEFT's
    (each rank's own rows), the DCP state (magnitudes, copies and their optimizer moments) resumes exactly on 1 rank,
    the saved adapter loads back into a fresh sharded model, and the merged export gives the trained model's logits."""
    from conftest import free_port
    from fixtures.ranks import spawn_ranks
    from test_checkpoint import _assert_equal

    from rayft.export import export

    raw = tiny_config(fixtures, tmp_path / "out")
    raw["lora"].update(COMBINED)
    raw["train"]["fused_loss"] = False
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    spawn_ranks(_train_and_save_rank, args=(2, free_port(), raw, str(ckpt)), nprocs=2)
    spawn_ranks(_resume_rank, args=(1, free_port(), raw, str(ckpt)), nprocs=1)
    expected, loaded = torch.load(ckpt / "expected.pt"), torch.load(ckpt / "loaded.pt")

    reference = dict(_reference(fixtures, raw).named_parameters())
    for name, value in expected["init"].items():
        if ".lora_A." not in name:
            torch.testing.assert_close(value, reference[name], msg=name)
    assert any("modules_to_save" in k for k in expected["optim"]["state"]), "the copies are not in the optimizer"
    _assert_equal(loaded["model"], expected["model"], "model")
    _assert_equal(loaded["optim"], expected["optim"], "optim")
    for name, value in loaded["adapter"].items():
        torch.testing.assert_close(value, expected["model"][name], msg=name)
    torch.testing.assert_close(loaded["logits"], expected["logits"])

    merged_dir = export(ckpt / "adapter", fixtures.model, tmp_path / "merged", merge=True, dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=IDS).logits, expected["logits"], rtol=1e-4, atol=1e-4)
    plain = export(ckpt / "adapter", fixtures.model, tmp_path / "plain", merge=False)
    assert json.loads((plain / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head", "embed_tokens"]


REFUSED = {
    "dora-on-fp8-storage": (
        {"lora": {"use_dora": True}, "model": {"frozen_dtype": "float8_e4m3fn"}},
        "lora.use_dora: true needs the frozen weights in bf16/fp32",
    ),
    "dora-on-experts": (
        {
            "lora": {"use_dora": True, "target_experts": True, "lora_dropout": 0.0},
            "fsdp": {"activation_checkpointing": True},
        },
        "lora.use_dora: true cannot be combined with lora.target_experts: true",
    ),
    "modules_to_save-with-expert-parallel": (
        {"lora": {"modules_to_save": ["lm_head"]}, "parallel": {"expert_parallel": 2}, "ray": {"num_workers": 2}},
        "cannot be combined with parallel.expert_parallel 2",
    ),
    "modules_to_save-of-an-fp8-matrix": (
        {
            "lora": {"modules_to_save": ["o_proj"], "target_modules": ["q_proj"]},
            "model": {"frozen_dtype": "float8_e4m3fn"},
        },
        "lora.modules_to_save: model.layers.0.self_attn.o_proj is a decoder matrix",
    ),
    "all-linear-with-names": (
        {"lora": {"target_modules": ["all-linear", "q_proj"]}},
        "all-linear already names every linear layer",
    ),
    "dora-on-an-embedding": (
        {"lora": {"use_dora": True, "target_modules": ["embed_tokens", "q_proj"]}},
        "lora.use_dora: true on the embedding model.embed_tokens",
    ),
    "unknown-modules_to_save": (
        {"lora": {"modules_to_save": ["score"]}},
        "lora.modules_to_save: 'score' matches no module of MistralForCausalLM",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_combinations_that_cannot_work_are_refused_by_validate(case, fixtures: Fixtures, tmp_path, capsys):
    settings, message = REFUSED[case]
    raw = tiny_config(fixtures, tmp_path / "out")
    for section, values in settings.items():
        raw.setdefault(section, {}).update(values)
    result = run_cli(capsys, "validate", "--config", str(write_yaml(tmp_path / "c.yaml", raw)))
    assert result.rc == 2 and message in result.err, result.err


def test_dora_on_an_fp8_checkpoint_under_frozen_dtype_auto_is_refused(
    mistral4_hub, fixtures: Fixtures, tmp_path, capsys
):
    """`frozen_dtype: auto` keeps an FP8 checkpoint in FP8: only the checkpoint's config says so, read by preflight."""
    raw = tiny_config(fixtures, tmp_path / "out")
    raw["model"]["model_name_or_path"] = str(mistral4_hub)
    raw["lora"].update(use_dora=True)
    result = run_cli(capsys, "validate", "--config", str(write_yaml(tmp_path / "c.yaml", raw)))
    assert result.rc == 2 and "or auto on an FP8 checkpoint" in result.err, result.err


def test_dpo_reference_pass_switches_off_the_modules_to_save_copies(fixtures: Fixtures, tmp_path, process_group):
    """`dpo.reference: adapter_off` scores the base model: its own LM head and embedding, not the trained copies."""
    from rayft.train.dpo import adapter_off

    raw = _raw(fixtures, tmp_path, "modules_to_save")
    model = build_model(Config.from_dict(raw), on_gpu=False)
    _step(model)  # the copies (and LoRA) move away from the base
    base = AutoModelForCausalLM.from_pretrained(str(fixtures.model), dtype=torch.float32)
    with torch.no_grad(), adapter_off(model):
        torch.testing.assert_close(model(input_ids=IDS).logits, base(input_ids=IDS).logits, rtol=1e-4, atol=1e-5)


def test_modules_to_save_refuses_a_tied_head():
    """A trained copy of a tied LM head would untie it from the embedding; the exported config still ties them."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "llama",
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match=r"lora.modules_to_save: 'lm_head' is tied"):
        resolve_targets(model, LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"]))
