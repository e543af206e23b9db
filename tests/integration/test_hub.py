"""Models and datasets named by hub id resolve through a pre-seeded Hugging Face cache, offline: to the snapshot
huggingface_hub's layout puts them in, so that a job trains on them; what the cache lacks (repo, revision, file)
is refused by `rayft validate` with exit 2, naming it."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from conftest import Fixtures, run_cli, tiny_config, write_yaml
from fixtures import hf_cache
from fixtures.local_run import train_locally
from huggingface_hub import scan_cache_dir

from rayft.config import Config
from rayft.hub import resolve_names

MODEL, DATASET = "rayft-test/tiny-mistral", "rayft-test/wikitext"
MODEL_COMMIT = hashlib.sha1(b"tiny-mistral").hexdigest()
DATA_COMMIT = hashlib.sha1(b"wikitext").hexdigest()


@pytest.fixture(scope="module")
def hf_home(fixtures: Fixtures, tmp_path_factory) -> Path:
    """HF_HOME holding the test model and dataset as a platform pre-seeds it."""
    home = tmp_path_factory.mktemp("hf-home")
    hf_cache.seed(home / "hub", "model", MODEL, fixtures.model, MODEL_COMMIT)
    hf_cache.seed(home / "hub", "dataset", DATASET, fixtures.dataset, DATA_COMMIT)
    return home


@pytest.fixture
def offline(hf_home: Path, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return hf_home


def _snapshot(home: Path, kind: str, repo_id: str, commit: str) -> Path:
    """Where huggingface_hub's documented layout puts a snapshot (independent of rayft's resolution)."""
    return home / "hub" / f"{kind}s--{repo_id.replace('/', '--')}" / "snapshots" / commit


def _hub_config(fixtures: Fixtures, out: Path, **model: str) -> dict:
    cfg = tiny_config(fixtures, out)
    cfg["model"].update(model_name_or_path=MODEL, **model)
    cfg["data"]["dataset_name_or_path"] = DATASET
    return cfg


def test_the_seeded_cache_is_huggingface_hubs_own_layout(hf_home: Path, fixtures: Fixtures):
    info = scan_cache_dir(hf_home / "hub")
    assert info.warnings == []
    repos = {(r.repo_type, r.repo_id): r for r in info.repos}
    assert set(repos) == {("model", MODEL), ("dataset", DATASET)}
    (model_rev,) = repos[("model", MODEL)].revisions
    assert model_rev.commit_hash == MODEL_COMMIT and model_rev.refs == frozenset({"main"})
    assert {f.file_name for f in model_rev.files} == {p.name for p in fixtures.model.iterdir()}
    (data_rev,) = repos[("dataset", DATASET)].revisions
    assert data_rev.nb_files == sum(1 for p in fixtures.dataset.rglob("*") if p.is_file())


@pytest.mark.parametrize("revision", [None, "main", MODEL_COMMIT])
def test_hub_names_resolve_offline_to_their_cached_snapshots(offline: Path, fixtures, tmp_path, revision):
    cfg = Config.from_dict(_hub_config(fixtures, tmp_path, **({"revision": revision} if revision else {})))
    resolve_names(cfg)
    assert Path(cfg.model.model_name_or_path) == _snapshot(offline, "model", MODEL, MODEL_COMMIT)
    assert Path(cfg.data.dataset_name_or_path) == _snapshot(offline, "dataset", DATASET, DATA_COMMIT)


def test_validate_accepts_hub_names_from_the_offline_cache(offline: Path, fixtures, tmp_path, capsys):
    config = write_yaml(tmp_path / "hub.yaml", _hub_config(fixtures, tmp_path / "out"))
    result = run_cli(capsys, "validate", "--config", str(config))
    assert result.rc == 0, result.err[-3000:]
    assert str(_snapshot(offline, "dataset", DATASET, DATA_COMMIT)) in result.out


REFUSED = {
    "missing model revision": (
        ["model.revision=v2"],
        rf"model.model_name_or_path: revision 'v2' of model repo "
        rf"'{MODEL}' is not in .*refs: main; commits: {MODEL_COMMIT[:12]}",
    ),
    "missing dataset revision": (
        ["data.revision=refs/pr/1"],
        rf"data.dataset_name_or_path: revision 'refs/pr/1' "
        rf"of dataset repo '{DATASET}'.*`hf download {DATASET} --repo-type dataset "
        r"--revision refs/pr/1 --cache-dir",
    ),
    "missing model repo": (
        [f"model.model_name_or_path={MODEL}-v2"],
        rf"model repo '{MODEL}-v2' is not in the "
        rf"Hugging Face cache .*\(`hf download {MODEL}-v2 --cache-dir \S+`\)",
    ),
    "revision of a local path": (
        ["model.model_name_or_path=/nonexistent/m", "model.revision=v2"],
        "model.revision: /nonexistent/m is a local path",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_validate_refuses_what_the_cache_lacks_naming_it(case, offline, fixtures, tmp_path, capsys):
    overrides, pattern = REFUSED[case]
    config = write_yaml(tmp_path / "hub.yaml", _hub_config(fixtures, tmp_path / "out"))
    result = run_cli(capsys, "validate", "--config", str(config), *[a for o in overrides for a in ("--override", o)])
    assert result.rc == 2, result.err[-3000:]
    assert re.search(pattern, result.err), result.err[-3000:]
    assert "Traceback" not in result.err


def test_a_file_whose_blob_is_gone_is_named(fixtures, tmp_path, capsys, monkeypatch):
    home = tmp_path / "hf"
    snapshot = hf_cache.seed(home / "hub", "model", MODEL, fixtures.model, MODEL_COMMIT)
    (snapshot / "model.safetensors").resolve().unlink()  # a pruned or half-copied cache
    hf_cache.seed(home / "hub", "dataset", DATASET, fixtures.dataset, DATA_COMMIT)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = write_yaml(tmp_path / "hub.yaml", _hub_config(fixtures, tmp_path / "out"))
    result = run_cli(capsys, "validate", "--config", str(config))
    assert result.rc == 2 and f"'{MODEL}' in {snapshot} lacks file(s) model.safetensors" in result.err, result.err


def test_a_job_trains_on_a_model_and_dataset_named_by_hub_id_offline(offline: Path, fixtures, tmp_path):
    """The job's driver part in this process with HF_HOME and HF_HUB_OFFLINE set, its workers on 2 gloo ranks with
    them in their environment too, as the RayJob's pods have them (`fixtures.local_run`): the hub names become the
    cached snapshots, which the ranks load and train on. The same names through `ray job submit`, the variables in
    the job's runtime environment: test_job_e2e.py's seed-YAML job."""
    cfg = _hub_config(fixtures, tmp_path / "out", revision=MODEL_COMMIT)
    cfg["train"].update(max_steps=2, logging_steps=1)
    run = train_locally(cfg, 2, env={"HF_HOME": str(offline), "HF_HUB_OFFLINE": "1"})
    logs = run.text()
    assert re.search(r"step 2/2 \| epoch [\d.]+ \| loss [\d.]+", logs), logs[-6000:]
    final = run.out / "final"
    assert (final / "adapter_model.safetensors").is_file()
    model, data = _snapshot(offline, "model", MODEL, MODEL_COMMIT), _snapshot(offline, "dataset", DATASET, DATA_COMMIT)
    # the ranks were handed the snapshot: the base PEFT names in the adapter is the model rank 0 loaded
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model)
    settings = json.loads((run.run_dir / "rayft_run.json").read_text())["settings"]  # what the driver trained on
    assert (settings["model.model_name_or_path"], settings["data.dataset_name_or_path"]) == (str(model), str(data))
