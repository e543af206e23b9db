"""A config's mistakes all at once, each with its file and line; parse errors name the file; nested overrides;
an accelerate file passed as --config names the command that converts it."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SEED_CONFIG
from pydantic import ValidationError

from rayft.config import Config, ConfigError, FsdpConfig, LoraConfig, RayConfig, load_config
from rayft.schema import checked

FOUR_MISTAKES = """\
train:
  learning_rate: -0.001
  lr_scheduler_type: cosin
  learnig_rate: 0.1
ray:
  num_workers: 0
"""


def test_every_problem_of_a_file_in_one_report_with_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(FOUR_MISTAKES)
    with pytest.raises(ConfigError) as err:
        load_config(path, ["lora.r=0"])
    message = str(err.value)
    assert message.startswith(f"{path}: 5 problems:"), message
    for needle in (
        f"{path}:2: train.learning_rate must be > 0, got -0.001",
        f"{path}:3: train.lr_scheduler_type: unknown value 'cosin' (did you mean 'cosine'?)",
        f"{path}:4: unknown key 'train.learnig_rate' (did you mean 'learning_rate'?)",
        f"{path}:6: ray.num_workers must be >= 1, got 0",
        "--override: lora.r must be >= 1, got 0",
    ):
        assert needle in message, message


def test_one_problem_stays_one_line_with_its_line(tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text("train:\n  seed: 1\n  warmup_ratio: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:3: train.warmup_ratio must be in [0, 1), got 2.0"


def test_a_zero_divisor_is_reported_not_divided_by():
    """fsdp.shard_size 0 and parallel.expert_parallel 0 are problems, not a ZeroDivisionError in the checks after."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["fsdp.shard_size=0", "parallel.expert_parallel=0"])
    message = str(err.value)
    assert "fsdp.shard_size must be >= 1" in message and "parallel.expert_parallel must be >= 1" in message


def test_a_broken_yaml_file_names_its_path_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  learning_rate: 1e-4\n   seed: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}:3: not valid YAML"), message
    assert "<unicode string>" not in message and f'in "{path}", line 3' in message


def test_nested_overrides_reach_mapping_keys():
    cfg = load_config(SEED_CONFIG, ["ray.resources_per_worker.GPU=1", "ray.resources_per_worker.CPU=8"])
    assert cfg.ray.resources_per_worker == {"GPU": 1.0, "CPU": 8.0}
    cfg = load_config(None, ["nccl.env.NCCL_IB_QPS_PER_CONNECTION=2"])
    assert cfg.nccl.env == {"NCCL_IB_QPS_PER_CONNECTION": "2"}
    with pytest.raises(ConfigError, match=r"key 'train.learning_rate' must be a mapping to override"):
        load_config(SEED_CONFIG, ["train.learning_rate.x=1"])


def test_an_accelerate_config_as_config_names_the_converter():
    accelerate = SEED_CONFIG.parent / "accelerate_fsdp2_3xh200.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(accelerate)
    assert "this is an accelerate config (compute_environment" in str(err.value)
    assert f"rayft config from-accelerate {accelerate}" in str(err.value)


RULES_BROKEN = """\
k8s:
  queueing: kueue
  config_delivery: working_dir
data:
  prompt_template: "### Question: {}"
ray:
  num_workers: 6
  workers_per_node: 4
fsdp:
  shard_size: 4
"""


def test_a_broken_rule_points_at_the_line_of_a_key_the_file_sets(tmp_path):
    """A rule over several keys is reported at the first of them the file sets (here the key the message names is
    the one left out), and a section that breaks its own rules keeps the file's values for the rules between
    sections."""
    assert_reported(
        tmp_path / "rules.yaml",
        RULES_BROKEN,
        [
            "2: k8s.queue: k8s.queueing: kueue needs the queue's name",
            "3: k8s.working_dir: needed with k8s.config_delivery: working_dir",
            "5: data.prompt_template: use named placeholders of record fields, e.g. '### Question:\\n{question}",
            "7: ray.num_workers 6 must be nodes × ray.workers_per_node 4",
            "10: fsdp.shard_size 4 must divide ray.num_workers 6",
        ],
    )


def assert_reported(path: Path, text: str, lines: list[str]) -> None:
    """The file's report: as many problems as `lines`, each `LINE: message` at the file's path, in that order."""
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: {len(lines)} problems:"), message
    at = [message.find(f"{path}:{line}") for line in lines]
    assert -1 not in at and at == sorted(at), message


def test_sections_built_in_code_keep_their_rules():
    """A section or config built in code is held to the same rules as one read from a file: pydantic's
    ValidationError names the rule; `checked` (for flags) gives the user's ConfigError."""
    with pytest.raises(ValidationError, match=r"ray\.num_workers 3 must be nodes × ray\.workers_per_node 2"):
        RayConfig(num_workers=3, workers_per_node=2)
    with pytest.raises(ValidationError, match=r"fsdp\.shard_size 3 must divide ray\.num_workers 4"):
        Config(fsdp=FsdpConfig(shard_size=3), ray=RayConfig(num_workers=4))
    with pytest.raises(ConfigError, match=r"lora\.lora_dropout must be in \[0, 1\), got 1\.5"):
        checked("lora", LoraConfig, {"lora_dropout": 1.5})
    assert checked("lora", LoraConfig, {"lora_dropout": 0, "target_experts": True}).target_experts


NESTED_AND_OWN_RULES = """\
k8s:
  queueing: volcano
  fabric: roce
  node:
    memory: lots
  rdma:
    network: Not_A_Name
"""


def test_a_group_breaking_its_rule_hides_no_rule_of_its_section(tmp_path):
    """A nested group's broken rule (`k8s.node`, `k8s.rdma`) and its section's own (`k8s`) are all reported in one
    round: a user who fixes the one should not meet the other only on the next try."""
    assert_reported(
        tmp_path / "nested.yaml",
        NESTED_AND_OWN_RULES,
        [
            "2: k8s.queue: k8s.queueing: volcano needs the queue's name",
            "5: k8s.node.memory: 'lots' is not a memory quantity",
            "7: k8s.rdma.network: 'Not_A_Name' is not a valid object name",
        ],
    )


def _every_key(prefix: str, section: type) -> list[str]:
    """The dotted keys of a section and of its nested groups."""
    import dataclasses
    import typing

    keys = []
    for f in dataclasses.fields(section):
        keys.append(f"{prefix}.{f.name}")
        inner = typing.get_type_hints(section).get(f.name)
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            keys += _every_key(f"{prefix}.{f.name}", inner)
    return keys


# Values of every kind a YAML file can hold, none of them right for most keys.
WRONG_KINDS = [[0, 2], {"a": 1}, "zz-not-valid", -7, 1e309, float("nan"), None, True, [], {}, "", [None]]


def test_every_key_given_a_value_of_any_kind_is_answered_as_a_config_problem():
    """No value a file can give any key ends in another exception (a traceback, exit 1): `ray.num_workers: [0, 2]`
    did, as pydantic's own error, since the [min, max] form is read before the keys are."""
    from rayft.config import SECTIONS

    crashes = []
    for name, section in SECTIONS.items():
        for dotted in _every_key(name, section):
            for value in WRONG_KINDS:
                raw: dict = {}
                *parents, key = dotted.split(".")
                node = raw
                for part in parents:
                    node = node.setdefault(part, {})
                node[key] = value
                try:
                    Config.from_dict(raw, "job.yaml")
                except ConfigError:
                    pass
                except Exception as e:  # what the test is for: anything but a ConfigError
                    crashes.append(f"{dotted}: {value!r}: {type(e).__name__}: {str(e).splitlines()[0]}")
    assert crashes == []


# Values of the right type that cannot work: each refused in one line at its file line, naming the key. The
# expected messages are written out here, not derived from the config's code.
CANNOT_WORK = [
    ("train:\n  learning_rate: inf\n", 2, "train.learning_rate must be a finite number, got inf (float)"),
    ("train:\n  learning_rate: .inf\n", 2, "train.learning_rate must be a finite number, got inf (float)"),
    ("train:\n  learning_rate: .nan\n", 2, "train.learning_rate must be a finite number, got nan (float)"),
    ("train:\n  weight_decay: inf\n", 2, "train.weight_decay must be a finite number, got inf (float)"),
    ("train:\n  max_grad_norm: .inf\n", 2, "train.max_grad_norm must be a finite number, got inf (float)"),
    ("train:\n  peak_tflops: inf\n", 2, "train.peak_tflops must be a finite number, got inf (float)"),
    ("lora:\n  lora_dropout: nan\n", 2, "lora.lora_dropout must be a finite number, got nan (float)"),
    ("dpo:\n  beta: inf\n", 2, "dpo.beta must be a finite number, got inf (float)"),
    ("ray:\n  preemption_grace_s: .inf\n", 2, "ray.preemption_grace_s must be a finite number, got inf (float)"),
    (
        "ray:\n  resources_per_worker:\n    CPU: inf\n",
        3,
        "ray.resources_per_worker.CPU must be a finite number, got inf (float)",
    ),
    (
        "ray:\n  resources_per_worker:\n    GPU: 0.5\n",
        3,
        "ray.resources_per_worker.GPU must be a whole number, got 0.5: each worker is one NCCL rank",
    ),
    ("train:\n  seed: -1\n", 2, "train.seed must be in [0, 4294967296), got -1"),
    ("train:\n  seed: 4294967296\n", 2, "train.seed must be in [0, 4294967296), got 4294967296"),
    (
        "train:\n  max_steps: 10\n  warmup_steps: 10\n",
        3,
        "train.warmup_steps 10 is not shorter than train.max_steps 10: the learning rate would never reach "
        "train.learning_rate; set fewer warm-up steps (or use train.warmup_ratio)",
    ),
    ("ray:\n  name: ..\n", 2, "ray.name must be one directory name inside the storage path, got '..'"),
    ("ray:\n  name: .\n", 2, "ray.name must be one directory name inside the storage path, got '.'"),
    ("ray:\n  name: runs/a\n", 2, "ray.name must be one directory name inside the storage path, got 'runs/a'"),
    ("ray:\n  name: ../sibling\n", 2, "ray.name must be one directory name inside the storage path, got '../sibling'"),
    ("ray:\n  name: /abs\n", 2, "ray.name must be one directory name inside the storage path, got '/abs'"),
    ("ray:\n  name: a\\b\n", 2, "ray.name must be one directory name inside the storage path, got 'a\\\\b'"),
]


@pytest.mark.parametrize(
    ("text", "line", "message"), CANNOT_WORK, ids=[c[2].split(" ")[0] + f"-{i}" for i, c in enumerate(CANNOT_WORK)]
)
def test_values_that_type_check_but_cannot_work_are_refused(tmp_path, text, line, message):
    path = tmp_path / "cannot.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}:{line}: {message}"), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.seed=0"],
        ["train.seed=4294967295"],
        ["train.learning_rate=1e30"],
        ["train.max_steps=10", "train.warmup_steps=9"],
        ["train.warmup_steps=500"],  # the total is known only when the records are counted (`plan_steps`)
        ["ray.name=run..2"],  # dots inside a name are a name
        ["ray.name=.hidden"],
    ],
)
def test_the_nearest_values_that_work_are_kept(overrides):
    load_config(None, overrides)
