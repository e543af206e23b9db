"""Every way of starting rayft that a user can get wrong is answered in one line with exit 2, before any Ray process:
the config file, the command line's flags and the `RAYFT_*` environment variables. Each case runs `rayft train` (the
command that would start a Ray cluster) in this process."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayft import environment
from rayft.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
FLAT_TRL = "model_name_or_path: /m\nlora_r: 16\nlearning_rate: 2.0e-4\nmax_seq_length: 2048\n"

# config file text → what its one line says
FILES = {
    "elastic range with no count": ("ray:\n  num_workers: [0, 2]\n", "ray.num_workers must be a number of workers or"),
    "flat TRL file": (FLAT_TRL, "flat TRL/SFTConfig file, not a rayft config"),
    "TRL's lora_r": ("lora:\n  lora_r: 16\n", "unknown key 'lora.lora_r' (TRL's lora_r is rayft's lora.r)"),
    "TRL's max_seq_length": ("data:\n  max_seq_length: 2048\n", "(TRL's max_seq_length is rayft's data.max_length)"),
    "transformers' evaluation_strategy": (
        "train:\n  evaluation_strategy: steps\n",
        "(TRL's evaluation_strategy is rayft's train.eval_strategy)",
    ),
    "a key without its section": (
        "learning_rate: 1.0e-4\nlora:\n  r: 8\n",
        "it is train.learning_rate: write it under",
    ),
    "transformers' resume_from_checkpoint: true": (
        "train:\n  resume_from_checkpoint: true\n",
        "train.resume_from_checkpoint: true is transformers' spelling; rayft's is 'latest'",
    ),
    "accelerate file": ("distributed_type: FSDP\nnum_processes: 2\n", "this is an accelerate config"),
}
# command line after `rayft` → what its one line says
FLAGS = {
    "no command": ([], "the following arguments are required: command (`rayft --help` lists the options)"),
    "unknown flag": (["train", "--bogus"], "unrecognized arguments: --bogus (`rayft --help`"),
    "not a number": (["plan", "--num-nodes", "abc"], "invalid int value: 'abc' (`rayft plan --help`"),
    "unknown GPU": (["validate", "--gpu", "h900"], "argument --gpu: invalid choice: 'h900'"),
    "override without a value": (["train", "--override", "train.learning_rate"], "expected section.key=value"),
}
# environment → what its one line says (the config file does not exist: the environment is judged first)
ENVIRONMENTS = {
    "bytes with a unit": ({"RAYFT_DRIVER_TOKENIZE_BYTES": "64MB"}, "RAYFT_DRIVER_TOKENIZE_BYTES='64MB': takes"),
    "a level rayft has not": ({"RAYFT_LOG_LEVEL": "verbose"}, "RAYFT_LOG_LEVEL='verbose': takes DEBUG"),
    "a misspelt name": (
        {"RAYFT_LOG_LEVL": "DEBUG"},
        "RAYFT_LOG_LEVL: rayft does not read it (did you mean RAYFT_LOG_LEVEL?",
    ),
    "a name rayft never reads": (
        {"RAYFT_GPUS": "8"},
        "RAYFT_GPUS: rayft does not read it (rayft reads RAYFT_LOG_LEVEL",
    ),
    "a switch as a word": ({"RAYFT_FP8_FUSED": "yes"}, "RAYFT_FP8_FUSED='yes': takes 1"),
}
# a value each variable refuses; variables that take any text have none
REFUSED = {
    "RAYFT_LOG_LEVEL": "TRACE",
    "RAYFT_DRIVER_TOKENIZE_BYTES": "-1",
    "RAYFT_FP8_FUSED": "2",
    "RAYFT_LOCAL_DASHBOARD": "off",
    "RAYFT_CACHE_DIR": " ",
    "RAYFT_KUBERAY_CRDS": " ",
}
TAKES_ANY_TEXT = {"RAYFT_CONFIG_YAML"}


def _start(capsys, argv: list[str]) -> tuple[int, list[str]]:
    """`rayft ARGV` in this process: its exit code and its stderr's lines; no Ray may have started."""
    import ray

    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's mistakes end the process as `rayft` would
        code = int(e.code or 0)
    captured = capsys.readouterr()
    assert not ray.is_initialized(), "a Ray cluster was started before the mistake was answered"
    assert "Traceback" not in captured.err + captured.out
    return code, captured.err.splitlines()


def _without_rayft_variables(monkeypatch) -> None:
    """The suite's own variables (RAYFT_TEST_TIMES, ...) are known ones; any other is the case's."""
    import os

    for name in [n for n in os.environ if n.startswith("RAYFT_") and n not in environment.DEVELOPMENT]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("case", list(FILES))
def test_a_config_file_mistake_is_one_line(case, tmp_path, capsys, monkeypatch):
    _without_rayft_variables(monkeypatch)
    text, needle = FILES[case]
    config = tmp_path / "job.yaml"
    config.write_text(text)
    code, lines = _start(capsys, ["train", "--config", str(config)])
    assert code == 2 and len(lines) == 1, lines
    assert needle in lines[0] and str(config) in lines[0], lines[0]
    if case == "flat TRL file":
        assert f"`rayft config from-accelerate ACCELERATE.yaml --trl {config} --out rayft.yaml`" in lines[0]


@pytest.mark.parametrize("case", list(FLAGS))
def test_a_flag_mistake_is_one_line(case, capsys, monkeypatch):
    _without_rayft_variables(monkeypatch)
    argv, needle = FLAGS[case]
    code, lines = _start(capsys, argv)
    assert code == 2 and len(lines) == 1, lines
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize("case", list(ENVIRONMENTS))
def test_an_environment_mistake_is_one_line_before_anything_else(case, tmp_path, capsys, monkeypatch):
    _without_rayft_variables(monkeypatch)
    variables, needle = ENVIRONMENTS[case]
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    code, lines = _start(capsys, ["train", "--config", str(tmp_path / "absent.yaml")])
    assert code == 2 and len(lines) == 1, lines
    assert needle in lines[0], lines[0]


def test_every_mistake_of_the_environment_at_once(tmp_path, capsys, monkeypatch):
    _without_rayft_variables(monkeypatch)
    for variables, _ in ENVIRONMENTS.values():
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
    code, lines = _start(capsys, ["validate", "--config", str(tmp_path / "absent.yaml")])
    assert code == 2 and len(lines) == len(ENVIRONMENTS), lines
    for _, needle in ENVIRONMENTS.values():
        assert any(needle in line for line in lines), (needle, lines)


def test_every_variable_rayft_reads_is_documented_and_checked(capsys, monkeypatch, tmp_path):
    """Each variable in docs/cli.md, and each (but those taking any text) refusing a value it cannot use."""
    documented = DOCS.read_text()
    assert [n for n in environment.VARIABLES if f"`{n}`" not in documented] == []
    assert set(REFUSED) | TAKES_ANY_TEXT == set(environment.VARIABLES)
    for name, bad in REFUSED.items():
        _without_rayft_variables(monkeypatch)
        monkeypatch.setenv(name, bad)
        code, lines = _start(capsys, ["train", "--config", str(tmp_path / "absent.yaml")])
        assert code == 2 and len(lines) == 1 and f"{name}={bad!r}: takes" in lines[0], (name, lines)


def test_the_variable_a_config_is_read_from_is_not_an_unknown_one(capsys, monkeypatch):
    """`--config env:NAME` reads the YAML from a variable the user names, RAYFT_-prefixed or not."""
    _without_rayft_variables(monkeypatch)
    monkeypatch.setenv("RAYFT_MY_JOB", "ray: {num_workers: [0, 2]}")
    code, lines = _start(capsys, ["train", "--config", "env:RAYFT_MY_JOB"])
    assert code == 2 and len(lines) == 1 and "ray.num_workers must be a number of workers" in lines[0], lines


def test_good_values_are_read_as_rayft_uses_them(monkeypatch):
    from rayft.logs import verbose

    monkeypatch.setenv("RAYFT_LOG_LEVEL", "debug")
    monkeypatch.setenv("RAYFT_DRIVER_TOKENIZE_BYTES", "0")
    assert verbose() and environment.value(environment.DRIVER_TOKENIZE_BYTES) == 0
    monkeypatch.setenv("RAYFT_LOG_LEVEL", "INFO")
    monkeypatch.delenv("RAYFT_DRIVER_TOKENIZE_BYTES")
    assert not verbose() and environment.value(environment.DRIVER_TOKENIZE_BYTES) == 32 << 20
