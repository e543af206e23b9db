"""`make demo` ends by checking its own result, so that CI's run of it proves something: the final adapter loads
with PEFT and lowers the held-out loss, else exit 1. Here the check is shown to fail an adapter that learned nothing
(PEFT's initialisation: B = 0, the base exactly)."""

from __future__ import annotations

import pytest
from conftest import Fixtures


def test_the_demo_check_fails_an_adapter_that_learned_nothing(fixtures: Fixtures, tmp_path, monkeypatch, capsys):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rayft.cli import DEMO_ROOT, EXIT_FAILED, _check_demo
    from rayft.demo import held_out_losses

    base = AutoModelForCausalLM.from_pretrained(str(fixtures.model), dtype=torch.float32)
    untrained = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    untrained.save_pretrained(str(tmp_path / "untrained"))
    before, after = held_out_losses(fixtures.model.parent, tmp_path / "untrained")
    assert after == pytest.approx(before, rel=1e-6) and before > 0

    (tmp_path / DEMO_ROOT).symlink_to(fixtures.model.parent)  # the demo's files, where the CLI makes them
    monkeypatch.chdir(tmp_path)
    assert _check_demo(tmp_path / "untrained") == EXIT_FAILED
    assert "NOT lower: the demo did not learn" in capsys.readouterr().out
