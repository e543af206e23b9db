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
