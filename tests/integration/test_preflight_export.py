"""`rayft export` checks the adapter against the base before any work (a damaged or foreign one is refused the
way `validate` refuses, and leaves nothing behind) and writes --out whole: a staging directory, then a rename."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from fixtures.preflight import (
    assert_refused,
    truncated_adapter,
)

EXPORT_CASES = {
    "truncated adapter": (False, r"adapter_model\.safetensors is truncated: its header declares"),
    "truncated adapter, --merge": (True, r"adapter_model\.safetensors is truncated: its header declares"),
    "another base": (
        False,
        r"tensor 'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight' has "
        r"shape \[4, 64\], the model at .* needs \[4, 32\]",
    ),
    "another base, --merge": (True, r"q_proj\.lora_A\.weight' has shape \[4, 64\], the model at .* needs \[4, 32\]"),
}


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_export_of_a_damaged_or_foreign_adapter_is_refused_and_leaves_nothing(
    case, adapter, other_base, fixtures, tmp_path, capsys
):
    merge, pattern = EXPORT_CASES[case]
    source, base = (
        (adapter, other_base) if "another base" in case else (truncated_adapter(adapter, tmp_path), fixtures.model)
    )
    out = tmp_path / "exports" / "x"
    before = set(tmp_path.iterdir())
    result = run_cli(
        capsys,
        "export",
        "--adapter",
        str(source),
        "--base",
        str(base),
        "--out",
        str(out),
        *(["--merge"] if merge else []),
    )
    assert_refused(result, pattern)
    assert set(tmp_path.iterdir()) == before, "something was left behind"


def test_export_out_that_is_a_file_or_a_foreign_directory_is_refused(adapter, fixtures, tmp_path, capsys):
    file = tmp_path / "out.txt"
    file.write_text("mine")
    result = run_cli(capsys, "export", "--adapter", str(adapter), "--base", str(fixtures.model), "--out", str(file))
    assert_refused(result, r"--out .*out\.txt is a file; give a directory path")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_text("meow")
    result = run_cli(
        capsys, "export", "--adapter", str(adapter), "--base", str(fixtures.model), "--out", str(tmp_path / "photos")
    )
    assert_refused(result, r"--out .*photos is a directory with other content")
    assert file.read_text() == "mine" and (tmp_path / "photos" / "cat.jpg").read_text() == "meow"


def test_export_writes_out_whole_and_replaces_a_previous_export(adapter, fixtures, tmp_path, capsys):
    out = tmp_path / "export"
    for _ in range(2):  # the second run replaces the first export
        result = run_cli(capsys, "export", "--adapter", str(adapter), "--base", str(fixtures.model), "--out", str(out))
        assert result.rc == 0, result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no staging or old copies left
    assert (out / "adapter_model.safetensors").read_bytes() == (adapter / "adapter_model.safetensors").read_bytes()
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(fixtures.model)
    assert oct(out.stat().st_mode & 0o777) != oct(0o700), "the staging directory's 0700 leaked into the export"
