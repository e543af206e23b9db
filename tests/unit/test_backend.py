"""The process group and NCCL environment a GPU worker joins with (`rayft.parallel.backend`), and the settings that
cannot work there refused before any cluster resource."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from conftest import Fixtures, run_cli, tiny_config, write_yaml

from rayft.config import Config, ConfigError
from rayft.launch import torch_config, worker_runtime_env


def test_cpu_offload_on_gpus_joins_a_group_with_gloo_for_the_host_tensors():
    """Offloaded shards, gradients and optimizer live on the host: gradient clipping all-reduces CPU tensors, which
    an NCCL-only group cannot; the group carries gloo for those and NCCL for the GPU's."""
    offload = Config.from_dict({"fsdp": {"cpu_offload": True}})
    plain = Config.from_dict({})
    assert torch_config(offload, use_gpu=True).backend == "cpu:gloo,cuda:nccl"
    assert torch_config(plain, use_gpu=True).backend == "nccl"
    assert torch_config(offload, use_gpu=False).backend == torch_config(plain, use_gpu=False).backend == "gloo"


def test_cpu_offload_with_expert_parallelism_is_refused_by_validate(fixtures: Fixtures, tmp_path: Path, capsys):
    """The routed experts of expert parallelism are not FSDP's, so offloading would leave them on the host while
    their tokens are on the GPU: `rayft validate` refuses the pair, naming both keys, exit 2."""
    raw = tiny_config(fixtures, tmp_path)
    raw["fsdp"] = {"cpu_offload": True}
    raw["parallel"] = {"expert_parallel": 2}
    result = run_cli(capsys, "validate", "--config", str(write_yaml(tmp_path / "offload.yaml", raw)))
    assert result.rc == 2, result
    assert "fsdp.cpu_offload" in result.err and "parallel.expert_parallel" in result.err, result.err


def test_auto_expert_parallelism_is_never_chosen_for_an_offloaded_run(tmp_path: Path):
    """Where `auto` takes EP 2 for Mistral-Small-4 on 2 nodes, an offloaded run gets FSDP (k = 1) instead."""
    from transformers import Mistral4Config

    from rayft.plan import meta_structure
    from rayft.plan.steptime import planned_expert_parallel

    raw = {
        "data": {"max_length": 4096},
        "fsdp": {"activation_checkpointing": True},
        "train": {"output_dir": str(tmp_path), "gradient_accumulation_steps": 1},
        "parallel": {"expert_parallel": "auto"},
        "ray": {"num_workers": 2},
    }
    assert (
        planned_expert_parallel(Config.from_dict(raw), meta_structure(Config.from_dict(raw), Mistral4Config()), "fp8")
        == 2
    )
    raw["fsdp"]["cpu_offload"] = True
    cfg = Config.from_dict(raw)
    assert planned_expert_parallel(cfg, meta_structure(cfg, Mistral4Config()), "fp8") == 1


def test_the_nccl_section_reaches_gpu_workers_through_the_runtime_env():
    """Every GPU worker gets the `nccl` section as environment variables through Ray (any Ray cluster, not only
    rendered pods): the quiet WARN level by default, exact adapter names, RoCE's GID index and extras; CPU workers
    get none of it."""
    cfg = Config.from_dict(
        {
            "nccl": {
                "ib_hca": "=mlx5_0,mlx5_1",
                "ib_gid_index": 3,
                "socket_ifname": "net1",
                "env": {"NCCL_IB_QPS_PER_CONNECTION": 1},
            }
        }
    )
    env = worker_runtime_env(cfg, use_gpu=True)["env_vars"]
    assert {k: v for k, v in env.items() if k.startswith("NCCL_")} == {
        "NCCL_IB_HCA": "=mlx5_0,mlx5_1",
        "NCCL_IB_GID_INDEX": "3",
        "NCCL_SOCKET_IFNAME": "net1",
        "NCCL_DEBUG": "WARN",
        "NCCL_IB_QPS_PER_CONNECTION": "1",
    }
    assert env["TOKENIZERS_PARALLELISM"] == "false"  # the rest of the workers' environment is still there
    defaults = worker_runtime_env(Config.from_dict({}), use_gpu=True)["env_vars"]
    assert {k: v for k, v in defaults.items() if k.startswith("NCCL_")} == {"NCCL_DEBUG": "WARN"}
    assert not [k for k in worker_runtime_env(cfg, use_gpu=False)["env_vars"] if k.startswith("NCCL_")]


@pytest.mark.parametrize(
    "nccl, key",
    [
        ({"debug": "LOUD"}, "nccl.debug"),
        ({"ib_gid_index": -1}, "nccl.ib_gid_index"),
        ({"env": {"IB_HCA": "x"}}, "nccl.env"),
    ],
)
def test_bad_nccl_settings_are_refused_naming_the_key(nccl: dict, key: str):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Config.from_dict({"nccl": nccl})


def test_validate_warns_that_a_bare_hca_name_is_a_prefix_match(fixtures: Fixtures, tmp_path: Path, capsys, caplog):
    """`mlx5` also matches Ethernet/RoCE ports of the same driver: validate passes but says how to name the
    InfiniBand adapters exactly."""
    raw = tiny_config(fixtures, tmp_path)
    raw["nccl"] = {"ib_hca": "mlx5"}
    with caplog.at_level(logging.WARNING, logger="rayft"):
        result = run_cli(capsys, "validate", "--config", str(write_yaml(tmp_path / "hca.yaml", raw)))
    assert result.rc == 0, result
    said = caplog.text + result.err + result.out
    assert "nccl.ib_hca: 'mlx5' is a prefix match" in said and "'=mlx5_0,mlx5_1'" in said, said
