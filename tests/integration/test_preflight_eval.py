"""`rayft eval` refuses a damaged or foreign adapter, or a split the data lacks, before it starts Ray."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, write_yaml
from fixtures.preflight import (
    assert_refused,
    truncated_adapter,
)


@pytest.mark.parametrize("case", ["truncated adapter", "another base", "missing split"])
def test_eval_of_a_damaged_or_foreign_adapter_is_refused_before_ray(case, adapter, other_base, base, tmp_path, capsys):
    raw = json.loads(json.dumps(base))
    split = []
    if case == "missing split":
        source, pattern, split = adapter, r"data: no split 'tset' in .*; name one with --split", ["--split", "tset"]
    elif case == "another base":
        source, pattern = adapter, r"q_proj\.lora_A\.weight' has shape \[4, 64\], the model at .* needs \[4, 32\]"
        raw["model"]["model_name_or_path"] = str(other_base)
    else:
        source, pattern = truncated_adapter(adapter, tmp_path), r"adapter_model\.safetensors is truncated"
    config = write_yaml(tmp_path / "config.yaml", raw)
    assert_refused(run_cli(capsys, "eval", "--config", str(config), "--adapter", str(source), *split), pattern)
