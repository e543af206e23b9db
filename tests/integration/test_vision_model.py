"""The whole Mistral-Small-4 vision-language model (`model.vision: true`): the tiny hub-layout checkpoint (Pixtral
tower + projector in bf16, the mistral4 language model in FP8) built by rayft, sharded by FSDP2 over gloo ranks,
against transformers' own `Mistral3ForConditionalGeneration.from_pretrained` of the same weights.

The reference reads a copy of the checkpoint dequantised here by hand (each E4M3 tensor times its static scale, in
fp32), so FP8 storage is compared with the fp32 model it stands for, as the FP8 tests do; bf16 storage with that
model loaded in bf16. The image batch comes from transformers' Pixtral image processor and its image tokens are laid
out here from the config (rows of `[IMG]` per merged patch, `[IMG_BREAK]` after each row, `[IMG_END]` last).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import Fixtures, free_port, tiny_config
from fixtures.hub_layout import make_tiny_mistral_small4
from fixtures.ranks import spawn_ranks, whole
from fixtures.torchao_nf4 import to_nf4
from PIL import Image, ImageDraw
from safetensors.torch import load_file, save_file
from test_nf4_job import NF4_MISTRAL4
from torch import nn

from rayft.config import Config, ConfigError

SEQ = 20  # tokens a row
STORAGES = {"bf16": ("bfloat16", "bfloat16"), "fp8": ("float32", "auto")}  # label: (torch_dtype, frozen_dtype)


def _dequantised_copy(hub: Path, target: Path) -> Path:
    """The hub checkpoint in fp32, every FP8 tensor times its scale (0-d per tensor, [E,1,1] per expert), scales
    dropped, and no quantization_config: what transformers loads as the model the FP8 checkpoint stands for."""
    target.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(hub.glob("*.safetensors")):
        tensors.update(load_file(file))
    out = {}
    for key, tensor in tensors.items():
        if key.endswith(("_scale_inv", "activation_scale")):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = tensors.get(f"{key}_scale_inv", tensors.get(f"{key.removesuffix('.weight')}.weight_scale_inv"))
            assert scale is not None, key
            tensor = tensor.float() * scale.float()
        out[key] = tensor.float().contiguous()
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hub / "config.json").read_text())
    config.pop("quantization_config")
    (target / "config.json").write_text(json.dumps(config))
    for file in hub.iterdir():
        if file.name.startswith("tokenizer"):
            shutil.copy(file, target / file.name)
    return target


def _images() -> list[Image.Image]:
    """Two small drawings of different shapes (64×32 and 32×64 pixels), so the batch pads one of them."""
    tall = Image.new("RGB", (32, 64), (250, 250, 240))
    ImageDraw.Draw(tall).rectangle((4, 10, 27, 50), fill=(200, 30, 60))
    wide = Image.new("RGB", (64, 32), (10, 20, 30))
    ImageDraw.Draw(wide).ellipse((8, 4, 56, 28), fill=(40, 180, 90))
    return [tall, wide]


def _image_batch(hub: Path) -> dict[str, torch.Tensor]:
    """Two rows of text around one image each, labels masked on the image tokens."""
    from transformers import AutoConfig, AutoTokenizer, PixtralImageProcessorPil

    config, tokenizer = AutoConfig.from_pretrained(hub), AutoTokenizer.from_pretrained(hub)
    img, img_break, img_end = tokenizer.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    assert img == config.image_token_index
    patch = config.vision_config.patch_size
    processed = PixtralImageProcessorPil(patch_size=patch, size={"longest_edge": 64})(_images(), return_tensors="pt")
    step = patch * config.spatial_merge_size  # pixels per image token, each way
    generator = torch.Generator().manual_seed(0)
    rows = []
    for height, width in processed["image_sizes"].tolist():
        tokens = ([img] * (width // step) + [img_break]) * (height // step)
        tokens[-1] = img_end
        text = torch.randint(100, 2000, (SEQ - len(tokens),), generator=generator).tolist()
        rows.append(text[:4] + tokens + text[4:])
    input_ids = torch.tensor(rows)
    labels = input_ids.masked_fill(torch.isin(input_ids, torch.tensor([img, img_break, img_end])), -100)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "pixel_values": processed["pixel_values"],
        "image_sizes": processed["image_sizes"],
    }


def _reference_loss(dequantised: Path, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> float:
    """transformers' own model of the checkpoint, its weights as `dtype` holds them, computed in fp32."""
    from transformers import Mistral3ForConditionalGeneration

    model, info = Mistral3ForConditionalGeneration.from_pretrained(dequantised, dtype=dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return float(model.float().eval()(**batch).loss)


def _case(fixtures: Fixtures, hub: Path, root: Path, storages: dict[str, tuple[str, str]], reference: Path) -> dict:
    """The image batch, the runs of each storage (label: torch_dtype, frozen_dtype) and transformers' loss of
    `reference` (a dequantised copy of `hub`) in each storage's torch_dtype."""
    batch = _image_batch(hub)
    torch.save(batch, root / "batch.pt")
    want, runs = {}, {}
    for label, (dtype, frozen) in storages.items():
        want[label] = _reference_loss(reference, batch, getattr(torch, dtype))
        raw = tiny_config(fixtures, root / label, bf16=False)
        raw["model"].update(model_name_or_path=str(hub), torch_dtype=dtype, frozen_dtype=frozen, vision=True)
        raw["lora"].update(target_modules=["auto"], lora_dropout=0.0)
        runs[label] = raw
    return {"root": root, "dequantised": root / "dequantised", "want": want, "runs": runs, "storages": storages}


@pytest.fixture(scope="module")
def vision_case(fixtures: Fixtures, mistral4_hub: Path, tmp_path_factory) -> dict:
    """The hub checkpoint in bf16 and in FP8 storage, against its dequantised copy."""
    root = tmp_path_factory.mktemp("vision")
    dequantised = _dequantised_copy(mistral4_hub, root / "dequantised")
    return _case(fixtures, mistral4_hub, root, STORAGES, dequantised)


def _nf4_reference_copy(dequantised: Path, target: Path) -> Path:
    """The dequantised copy with every matrix NF4 holds replaced by torchao's dequantisation of its NF4 (each routed
    expert on its own): the decoder's linears but MLA's kv_a_proj_with_mqa, whose rows NF4 cannot block here."""
    shutil.copytree(dequantised, target)
    tensors = load_file(target / "model.safetensors")
    for key, tensor in tensors.items():
        if not key.startswith("language_model.model.layers."):
            continue
        if key.endswith("_proj.weight") and "kv_a_proj_with_mqa" not in key:
            tensors[key] = to_nf4(tensor).get_original_weight()
        elif key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[key] = torch.stack([to_nf4(expert).get_original_weight() for expert in tensor])
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def nf4_case(fixtures: Fixtures, tmp_path_factory) -> dict:
    """A tiny hub checkpoint whose decoder matrices NF4 can block, in NF4 storage, against transformers' model
    holding torchao's dequantised NF4 weights."""
    root = tmp_path_factory.mktemp("vision-nf4")
    hub = make_tiny_mistral_small4(root / "hub", tokenizer_from=fixtures.model, **NF4_MISTRAL4)
    dequantised = _dequantised_copy(hub, root / "dequantised")
    reference = _nf4_reference_copy(dequantised, root / "nf4-reference")
    case = _case(fixtures, hub, root, {"nf4": ("float32", "nf4")}, reference)
    case["unquantised"] = _reference_loss(dequantised, torch.load(root / "batch.pt"), torch.float32)
    return case


def _vision_rank(rank: int, world: int, port: int, runs: dict, root: str, dequantised: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        batch = torch.load(Path(root) / "batch.pt")
        checkpoint = load_file(Path(dequantised) / "model.safetensors")
        results = {label: _train_once(Config.from_dict(raw), batch, checkpoint) for label, raw in runs.items()}
        (Path(root) / f"rank{rank}-of-{world}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _train_once(cfg: Config, batch: dict[str, torch.Tensor], checkpoint: dict[str, torch.Tensor]) -> dict:
    """One loss, backward and AdamW step: the loss, which parameters got gradients, and the tower's and projector's
    weights against the checkpoint's before and after the step."""
    from rayft.model.build import fused_loss
    from rayft.model.fp8 import QuantisedExperts, QuantisedLinear
    from rayft.model.loss import CausalLMLoss
    from rayft.parallel.parallelize import build_model

    model = build_model(cfg, on_gpu=False)
    frozen = {n: p for n, p in model.named_parameters() if ".vision_tower." in n or ".multi_modal_projector." in n}
    before = {n: whole(p).detach().clone() for n, p in frozen.items()}
    loss = CausalLMLoss(fused=fused_loss(model, cfg) is None)(model, batch)
    loss.backward()
    grads = {n: float(whole(p.grad).norm()) for n, p in model.named_parameters() if p.grad is not None}
    trainable = [p for p in model.parameters() if p.requires_grad]
    torch.optim.AdamW(trainable, lr=1e-2).step()
    hub_name = {n: n.removeprefix("base_model.model.model.") for n in frozen}
    return {
        "loss": float(loss),
        "grads": grads,
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "loaded": all(torch.equal(before[n], checkpoint[hub_name[n]].to(before[n].dtype)) for n in frozen),
        "unchanged": all(torch.equal(before[n], whole(p).detach()) for n, p in frozen.items()),
        "frozen_dtypes": sorted({str(p.dtype) for p in frozen.values()}),
        "quantised": sorted(n for n, m in model.named_modules() if isinstance(m, (QuantisedLinear, QuantisedExperts))),
    }


@pytest.mark.parametrize("world", [1, 2])
def test_the_whole_vision_model_trains_like_transformers_own(vision_case: dict, world: int):
    """rayft's loss of an image batch equals transformers' own Mistral3 forward of the same checkpoint (fp32, 1e-5
    relative) with the language model in bf16 and in FP8 storage, on one and on two FSDP2 ranks; gradients reach the
    language model's LoRA factors only, and an optimizer step leaves the tower and projector as loaded."""
    ranks = _run(vision_case, world)
    fp8 = ranks[0]["fp8"]["quantised"]
    assert len(fp8) == 2 * 9, fp8  # a layer: q_a, q_b, kv_a, kv_b, o, the shared gate/up/down, the routed experts


def test_nf4_storage_of_the_language_model_computes_torchaos_weights(nf4_case: dict):
    """With the language model in NF4 (two ranks), the loss is that of transformers' model holding torchao's
    dequantised NF4 weights; the tower and projector stay in fp32."""
    want = nf4_case["want"]["nf4"]
    assert abs(nf4_case["unquantised"] - want) > 100 * 1e-5 * want  # the comparison can tell NF4 apart
    ranks = _run(nf4_case, world=2)
    nf4 = ranks[0]["nf4"]["quantised"]
    assert len(nf4) == 2 * 8, nf4  # as FP8, but MLA's kv_a_proj_with_mqa, which NF4 cannot block at this size


def _run(case: dict, world: int) -> list[dict]:
    """Every run of `case` on `world` gloo ranks, checked against transformers' losses; each rank's results."""
    root = case["root"]
    spawn_ranks(
        _vision_rank, args=(world, free_port(), case["runs"], str(root), str(case["dequantised"])), nprocs=world
    )
    ranks = [json.loads((root / f"rank{r}-of-{world}.json").read_text()) for r in range(world)]
    for label, want in case["want"].items():
        for got in (r[label] for r in ranks):
            assert abs(got["loss"] - want) <= 1e-5 * abs(want), (label, got["loss"], want)
            assert got["trainable"] and all(".language_model." in n and ".lora_" in n for n in got["trainable"])
            assert set(got["grads"]) <= set(got["trainable"]), set(got["grads"]) - set(got["trainable"])
            lora_b = [n for n in got["trainable"] if ".lora_B." in n]
            assert lora_b and all(got["grads"][n] > 0 for n in lora_b), got["grads"]
            assert got["loaded"] and got["unchanged"], label
            assert got["frozen_dtypes"] == [f"torch.{case['storages'][label][0]}"], got["frozen_dtypes"]
            assert all(".language_model.layers." in n for n in got["quantised"]), got["quantised"]
    return ranks


def test_vision_needs_a_vision_checkpoint(fixtures: Fixtures, tmp_path: Path):
    """`model.vision: true` on a text-only checkpoint is refused, naming the key, as are the settings it does not
    combine with yet."""
    from rayft.model.build import empty_model

    raw = tiny_config(fixtures, tmp_path)
    raw["model"]["vision"] = True
    with pytest.raises(ConfigError, match=r"model\.vision: true"):
        empty_model(Config.from_dict(raw).model)
    raw["parallel"] = {"context_parallel": 2}
    raw["data"]["packing"] = True
    with pytest.raises(ConfigError, match=r"cannot yet be combined with parallel\.context_parallel"):
        Config.from_dict(raw)
    raw["parallel"] = {}
    raw["model"]["load_mode"] = "full"
    with pytest.raises(ConfigError, match=r"set model\.load_mode: sharded"):
        Config.from_dict(raw)


@pytest.mark.parametrize("targets", [["all-linear"], ["auto"], ["o_proj", "gate_proj"]])
def test_lora_goes_on_the_language_model_only(mistral4_hub: Path, targets: list[str]):
    """Whatever the target names, the tower's and projector's linears (which share o_proj, gate_proj, ... with the
    language model) get no adapter; `all-linear` adapts every linear of the language model."""
    from peft.tuners.lora import LoraLayer
    from transformers import AutoConfig, Mistral3ForConditionalGeneration

    from rayft.config import LoraConfig
    from rayft.model.lora import wrap

    config = AutoConfig.from_pretrained(mistral4_hub)
    del config.quantization_config
    with torch.device("meta"):
        model = Mistral3ForConditionalGeneration._from_config(config)
    linears = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    text_linears = {n for n in linears if n.startswith("model.language_model.")}
    wrapped, _ = wrap(model, LoraConfig(target_modules=targets, lora_dropout=0.0))
    adapted = {n.removeprefix("base_model.model.") for n, m in wrapped.named_modules() if isinstance(m, LoraLayer)}
    assert adapted and adapted <= text_linears, sorted(adapted - text_linears)
    if targets == ["all-linear"]:
        assert adapted == text_linears


def test_on_text_records_the_vision_model_trains_as_the_language_model_alone(
    fixtures: Fixtures, mistral4_hub: Path, tmp_path: Path
):
    """The job's own Trainer (data pipeline, steps, checkpoint, final adapter) over the whole model, on the text
    records the pipeline carries today: the tower never runs, and the losses and gradient norms are those of the
    language model built alone."""
    from fixtures.local_run import train_locally

    runs = {}
    for vision in (True, False):
        out = tmp_path / f"vision-{vision}"
        raw = tiny_config(fixtures, out, max_steps=2, save_steps=2, logging_steps=1, eval_strategy="no")
        raw["model"].update(model_name_or_path=str(mistral4_hub), torch_dtype="float32", vision=vision)
        raw["data"]["max_length"] = 32
        raw["ray"]["num_workers"] = 1
        runs[vision] = train_locally(raw, 1).metrics()
        assert (out / "final" / "adapter_model.safetensors").exists()
    for key in ("loss", "grad_norm"):
        got, want = [m[key] for m in runs[True]], [m[key] for m in runs[False]]
        assert len(got) == 2 and got == pytest.approx(want, rel=1e-5), (key, got, want)
