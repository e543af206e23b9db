"""What the driver decides for the config's `auto` settings comes back as decisions, and the config stays as it was
validated: preflight's expert-parallel degree and the recompute the memory plan chooses."""

from __future__ import annotations

import copy
from pathlib import Path

from conftest import Fixtures, tiny_config

from rayft.config import Config


def _auto(fixtures: Fixtures, model: Path, out: Path) -> Config:
    """The tiny hub Mistral-Small-4 on 2 CPU workers, both choices left to rayft."""
    raw = tiny_config(fixtures, out)
    raw["model"]["model_name_or_path"] = str(model)
    raw["ray"]["num_workers"] = 2
    raw["parallel"] = {"expert_parallel": "auto"}
    raw["fsdp"] = {"activation_checkpointing": "auto"}
    return Config.from_dict(raw)


def test_preflight_and_the_recompute_choice_leave_the_config_as_validated(
    fixtures: Fixtures, mistral4_hub: Path, tmp_path: Path
):
    from rayft.launch import _plan_recompute
    from rayft.preflight import preflight

    cfg = _auto(fixtures, mistral4_hub, tmp_path)
    validated = copy.deepcopy(cfg.to_dict())
    checked = preflight(cfg)
    decisions = _plan_recompute(cfg, checked, use_gpu=False)
    assert cfg.to_dict() == validated
    # One worker a node: FSDP would gather every expert over the network in each pass, while expert parallelism
    # keeps them resident and sends only the tokens' rows; nothing else differs for a model this small.
    assert checked.decisions.expert_parallel == decisions.expert_parallel == 2
    # CPU workers, no GPU capacity to fit: `auto` keeps its fallback, no recompute without expert LoRA (the
    # demo's LoRA targets none)
    assert (decisions.recompute, decisions.recompute_every) == ("none", None)
    assert decisions.settings() == {"parallel.expert_parallel": 2, "fsdp.activation_checkpointing": "none"}


def test_the_model_is_built_with_the_decided_recompute_not_the_configs_fallback(
    fixtures: Fixtures, tmp_path: Path, process_group
):
    """`auto` in the config (its fallback for the demo's LoRA: no recompute); the driver's decision is what the
    workers build: full recomputes both layers, selective every 2nd recomputes layer 0 only."""
    from rayft.decisions import Decisions
    from rayft.model.build import decoder_layers
    from rayft.parallel.parallelize import build_model

    raw = tiny_config(fixtures, tmp_path)
    raw["fsdp"] = {"activation_checkpointing": "auto"}
    cfg = Config.from_dict(raw)
    validated = copy.deepcopy(cfg.to_dict())
    built = {}
    for mode, every in (("none", None), ("full", None), ("selective", 2)):
        decisions = Decisions.of(cfg).recomputing(mode, every)
        model = build_model(cfg, on_gpu=False, decisions=decisions)
        built[mode] = [layer.gradient_checkpointing for layer in decoder_layers(model)]
    assert built == {"none": [False, False], "full": [True, True], "selective": [True, False]}
    assert cfg.to_dict() == validated
