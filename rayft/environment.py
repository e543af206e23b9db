"""The environment variables rayft reads, and what each takes.

Every `RAYFT_*` variable is read through here, so that a value rayft cannot use is refused by name when a command
starts (`problems`), before any Ray process, rather than met as a traceback halfway through a job or silently
ignored; and a misspelt name is named too, since the variable it meant would otherwise quietly keep its default.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rayft.schema import ConfigError

PREFIX = "RAYFT_"


@dataclass(frozen=True)
class Variable:
    name: str
    takes: str  # what it takes, as messages and docs say it
    parse: Callable[[str], Any]  # the value rayft uses; ValueError for text it cannot use
    default: Any


def _switch(text: str) -> bool:
    if text.strip() not in ("0", "1"):
        raise ValueError(text)
    return text.strip() == "1"


def _level(text: str) -> str:
    level = text.strip().upper()
    if level not in ("DEBUG", "INFO"):
        raise ValueError(text)
    return level


def _byte_count(text: str) -> int:
    count = int(text.strip())
    if count < 0:
        raise ValueError(text)
    return count


def _path(text: str) -> str:
    if not text.strip():
        raise ValueError(text)
    return text


def _any(text: str) -> str:
    return text


LOG_LEVEL = Variable("RAYFT_LOG_LEVEL", "DEBUG (keep Ray's routine lines, as --verbose does) or INFO", _level, "INFO")
DRIVER_TOKENIZE_BYTES = Variable(
    "RAYFT_DRIVER_TOKENIZE_BYTES",
    "a whole number of bytes (e.g. 33554432; 0: always the tokenizer actors): data up to this size is tokenized "
    "in the driver",
    _byte_count,
    32 << 20,
)
FP8_FUSED = Variable("RAYFT_FP8_FUSED", "1 (compile FP8 dequantisation on CUDA) or 0 (eager ops)", _switch, True)
LOCAL_DASHBOARD = Variable("RAYFT_LOCAL_DASHBOARD", "1 (a local Ray serves its dashboard) or 0", _switch, True)
CACHE_DIR = Variable("RAYFT_CACHE_DIR", "a directory for rayft's cache (default ~/.cache/rayft)", _path, None)
KUBERAY_CRDS = Variable("RAYFT_KUBERAY_CRDS", "a directory of KubeRay CRD files (ray.io_*.yaml)", _path, None)
CONFIG_YAML = Variable("RAYFT_CONFIG_YAML", "a config's YAML text (`--config env:RAYFT_CONFIG_YAML`)", _any, None)

VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (LOG_LEVEL, DRIVER_TOKENIZE_BYTES, FP8_FUSED, LOCAL_DASHBOARD, CACHE_DIR, KUBERAY_CRDS, CONFIG_YAML)
}
# Read by the repository's tests and benchmarks (docs/development.md), never by rayft: known, so not refused.
DEVELOPMENT = frozenset(
    {
        "RAYFT_TEST_TIMES",
        "RAYFT_TEST_CACHE",
        "RAYFT_RAY_TESTS_DIR",
        "RAYFT_PINNED_PYTHON",
        "RAYFT_BENCH_PARTS",
        "RAYFT_BENCH_DIR",
        "RAYFT_BENCH_PARTIAL",
        "RAYFT_TRL_LIGER",
    }
)


def value(variable: Variable, environ: Mapping[str, str] | None = None) -> Any:
    """The variable's value as rayft uses it (its default when unset or empty); ConfigError naming it otherwise."""
    text = (os.environ if environ is None else environ).get(variable.name, "")
    if not text:
        return variable.default
    try:
        return variable.parse(text)
    except ValueError:
        raise ConfigError(_refusal(variable, text)) from None


def _refusal(variable: Variable, text: str) -> str:
    return f"environment variable {variable.name}={text!r}: takes {variable.takes}; set it so or unset it"


def problems(environ: Mapping[str, str] | None = None, exempt: Iterable[str] = ()) -> list[str]:
    """Every `RAYFT_*` variable of the environment that rayft cannot use: a value its variable does not take, or a
    name rayft does not know (with the closest known one). `exempt`: names the command line gives a use (the
    variable `--config env:NAME` reads)."""
    environ = os.environ if environ is None else environ
    known = [name.removeprefix(PREFIX) for name in (*VARIABLES, *DEVELOPMENT)]  # the shared prefix matches any
    found = []
    for name in sorted(n for n in environ if n.startswith(PREFIX) and n not in exempt):
        if name in VARIABLES:
            try:
                value(VARIABLES[name], environ)
            except ConfigError as e:
                found.append(str(e))
        elif name not in DEVELOPMENT:
            close = difflib.get_close_matches(name.removeprefix(PREFIX), known, n=1, cutoff=0.6)
            hint = f"did you mean {PREFIX}{close[0]}?" if close else f"rayft reads {', '.join(VARIABLES)}"
            found.append(f"environment variable {name}: rayft does not read it ({hint}); unset it")
    return found
