"""What rayft's config sections are made of: pydantic field types that read YAML as users write it, rules that refuse
a combination of values, and pydantic's errors turned into rayft's problems (one line each, naming the key, with the
closest valid key or value).

A section is a pydantic dataclass: its fields' types, choices (`Literal`) and ranges (`Ge`, `Lt`, ...) are checked by
pydantic; the combinations of values it refuses are its `broken` rules (the `Config`'s relate one section to
another). A section built in code is refused by its `model_validator`; `read_section` reads a file's section without
them and then asks every rule, of the section and its nested groups, so that a user sees every problem of the file
at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar

import pydantic.dataclasses
from annotated_types import Ge, Gt, Le, Lt
from pydantic import (
    AllowInfNan,
    BeforeValidator,
    ConfigDict,
    Strict,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

from rayft.trl_names import trl_hint


class ConfigError(ValueError):
    """A mistake in the user's configuration or paths; the message is meant to be shown as is."""


@dataclass(frozen=True)
class Problem:
    key: str  # dotted, `train.learning_rate`: where the file sets it is looked up by this
    message: str


# Unknown keys are errors; instances stay mutable, and assignment is not validated.
SECTION_CONFIG = ConfigDict(extra="forbid")


def _integral(value: Any) -> Any:
    """`2.0` for an integer field: YAML writes a whole number either way."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _parsed_number(value: Any) -> Any:
    """`1e-4` for a number: YAML 1.1 reads an exponent without a dot as a string."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _number_as_text(value: Any) -> Any:
    """`5` for a string field (a revision, a name): the text the user typed."""
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _unquoted_no(value: Any) -> Any:
    """`no` for a `*_strategy`: YAML 1.1 reads it unquoted as false."""
    return "no" if value is False else value


def _one_as_list(value: Any) -> Any:
    """A single name where a list of them is expected (`report_to: wandb`)."""
    return [value] if isinstance(value, str) else list(value) if isinstance(value, tuple) else value


def _keys_as_text(value: Any) -> Any:
    """A mapping's keys as strings: YAML reads a key written `1` as an integer."""
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else value


# The field types. Strict: pydantic's lax mode would also read "yes" or 1 as true and "5" as an integer, which
# rayft refuses; each BeforeValidator admits one lenient form that YAML produces. A number is finite: YAML reads
# `.inf` and `.nan` (and rayft `inf`) as floats, which pass every range with no upper bound and break the run later.
Flag = Annotated[bool, Strict()]
Integer = Annotated[int, Strict(), BeforeValidator(_integral)]
Number = Annotated[float, Strict(), AllowInfNan(False), BeforeValidator(_parsed_number)]
Text = Annotated[str, Strict(), BeforeValidator(_number_as_text)]
_T = TypeVar("_T")
Listed = Annotated[list[_T], Strict(), BeforeValidator(_one_as_list)]
Keyed = Annotated[dict[str, _T], BeforeValidator(_keys_as_text)]
Strategy = Annotated[Literal["no", "steps", "epoch"], BeforeValidator(_unquoted_no)]


@dataclass(frozen=True)
class Hint:
    """What else a bounded key takes, added to its range message: `(or null to keep every checkpoint)`."""

    text: str


@dataclass(frozen=True)
class Broken:
    """A rule the values break: its message, and the keys it involves, relative to the section whose rule it is
    (`shard_size`, `rdma.network`) or, for the config's own rules, dotted from its top (`fsdp.shard_size`). The
    message is placed at the first of them the file sets."""

    message: str
    keys: tuple[str, ...]


def broken(message: str, *keys: str) -> Broken:
    return Broken(message, keys)


RULE = "rayft_rule"  # a broken rule of a section built in code
VALUE = "rayft_value"  # a value no field type can say is wrong (a bad `[min, max]`): its key is left at its default
_WITHOUT_RULES = {"rules": False}


def _rules_apply(info: ValidationInfo) -> bool:
    """False where a file's section is read (`read_section`): its rules are asked after, all at once."""
    return bool((info.context or {}).get("rules", True))


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class Section:
    """A config section: pydantic reads its fields, then asks the rules its `broken` states (all of them at once)."""

    section: ClassVar[str]  # the key it is read from, `k8s.node` for a nested group

    def broken(self) -> list[Broken | None]:
        """The rules over several of its keys that its values break (None for each that holds)."""
        return []

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> Self:
        if _rules_apply(info):
            _refuse(self.section, self.broken())
        return self


def _refuse(owner: str, found: Iterable[Broken | None]) -> None:
    """Raise every broken rule in one pydantic ValidationError, each at its first key, so that pydantic reports them
    beside the fields' own errors (a nested section's under its path)."""
    errors = [_error(RULE, b.message, b.keys) for b in found if b is not None]
    if errors:
        raise ValidationError.from_exception_data(owner, errors)


def refuse_value(owner: str, key: str, message: str) -> typing.NoReturn:
    """A value of `key` that its type cannot refuse (read in a `before` validator)."""
    raise ValidationError.from_exception_data(owner, [_error(VALUE, message, (key,))])


def _error(kind: str, message: str, keys: tuple[str, ...]) -> InitErrorDetails:
    # the message goes in the context: a template would read the braces of a `{field}` placeholder in it
    error = PydanticCustomError(kind, "{message}", {"message": message, "keys": list(keys)})
    return InitErrorDetails(type=error, loc=tuple(keys[0].split(".")), input=None)


_Section = TypeVar("_Section")


_ADAPTERS: dict[type, TypeAdapter[Any]] = {}


def _adapter(section_type: type) -> TypeAdapter[Any]:
    """pydantic's validator of a section, built once."""
    if section_type not in _ADAPTERS:
        _ADAPTERS[section_type] = TypeAdapter(section_type)
    return _ADAPTERS[section_type]


def read_section(name: str, section_type: type[_Section], values: Any) -> tuple[_Section, list[Problem]]:
    """The section from a file's mapping, and every problem with it. It is read without its rules: a key that is
    unknown or cannot be read is left at its default and the section read again, and then the rules of the section
    and of its nested groups are asked of the values read, all of them (a group breaking its rule would otherwise
    stop pydantic before the section's own rules)."""
    if values is None:
        return section_type(), []
    if not isinstance(values, dict):
        return section_type(), [Problem(name, f"section '{name}' must be a mapping of keys, got {values!r}")]
    given = {str(k): v for k, v in values.items()}
    values, problems = given, []
    order = {key: i for i, key in enumerate(given)}  # the file's order, not the fields'
    while True:
        try:
            section = _adapter(section_type).validate_python(values, context=_WITHOUT_RULES)
        except ValidationError as e:
            unreadable: set[tuple[int | str, ...]] = set()
            for error in sorted(e.errors(), key=lambda error: order.get(str(error["loc"][0]), len(order))):
                path, owner = _unreadable(section_type, values, error["loc"])
                if path in unreadable:  # one problem a key, as a user fixes it: the first of a list's items
                    continue
                unreadable.add(path)
                key = _dotted(name, values, error["loc"])
                problems.append(Problem(key, _mistake(key, error, owner, path[-1])))
            narrower = _without(values, unreadable)
            if narrower == values:  # nothing left to drop: the mistake is in rayft's own defaults
                raise
            values = narrower
        else:
            rules = sorted(
                _group_rules(name, given, section), key=lambda p: order.get(_top_key(name, p.key), len(order))
            )
            return section, problems + rules


def _top_key(name: str, key: str) -> str:
    """`node` of `k8s.node.memory` in section `k8s`: the key of the section's mapping."""
    return re.split(r"[.\[]", key.removeprefix(f"{name}."), maxsplit=1)[0]


def _group_rules(name: str, given: Mapping[str, Any], section: Any, prefix: tuple[str, ...] = ()) -> list[Problem]:
    """The rules a section and its nested groups break, each at the first of its keys the file sets."""
    found = [_placed(name, given, prefix, b) for b in section.broken() if b is not None]
    for field in dataclasses.fields(section):
        inner = getattr(section, field.name)
        if isinstance(inner, Section):
            found += _group_rules(name, given, inner, (*prefix, field.name))
    return found


def combined(
    config_type: type[_Section], sections: Mapping[str, Any], given: Mapping[str, Any]
) -> tuple[_Section, list[Problem]]:
    """The config of sections `read_section` has read (their own rules were asked there), and the rules between
    sections that it breaks, each at the first of its keys `given` (the file) sets."""
    config = _adapter(config_type).validate_python(dict(sections), context=_WITHOUT_RULES)
    return config, [_placed("", given, (), b) for b in config.broken() if b is not None]


def checked(
    name: str, section_type: type[_Section], values: Mapping[str, Any], where: Mapping[str, str] | None = None
) -> _Section:
    """The section, or a ConfigError with all its problems: for sections built from command-line flags (`where`:
    dotted key → the flag that sets it, named before the problem)."""
    section, problems = read_section(name, section_type, dict(values))
    if problems:
        raise problems_error(None, problems, where)
    return section


def _placed(name: str, given: Mapping[str, Any], prefix: tuple[str, ...], rule: Broken) -> Problem:
    """A broken rule as a problem, keyed by the first key it involves that the file sets (`prefix`: the path of the
    nested group whose rule it is)."""
    paths = [[*prefix, *key.split(".")] for key in rule.keys]
    at = next((path for path in paths if _sets(given, path)), paths[0] if paths else list(prefix))
    return Problem(".".join([name, *at] if name else at), rule.message)


def _sets(values: Any, path: list[str]) -> bool:
    for part in path:
        if not isinstance(values, Mapping) or part not in values:
            return False
        values = values[part]
    return True


def problems_error(source: str | None, problems: list[Problem], where: Mapping[str, str] | None = None) -> ConfigError:
    """One ConfigError listing every problem, each with the file and line (`where`: dotted key → `path:line`, or
    `--override`) that sets its key; `source` (a file) where none does, None for nothing more than the key."""
    located = [f"{_location(p.key, source, where or {})}{p.message}" for p in problems]
    if len(located) == 1:
        return ConfigError(located[0])
    head = f"{source}: " if source else ""
    return ConfigError(f"{head}{len(problems)} problems:\n" + "\n".join(f"  - {line}" for line in located))


def _location(key: str, source: str | None, where: Mapping[str, str]) -> str:
    """`path:line: ` of the key, or of the closest section above it that the file names; else the source."""
    parts = re.sub(r"\[\d+\]", "", key).split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in where:
            return f"{where['.'.join(parts[:n])]}: "
    return f"{source}: " if source else ""


def _unreadable(owner: type, values: dict[Any, Any], loc: tuple[int | str, ...]) -> tuple[tuple[int | str, ...], type]:
    """The key to leave out for an error at `loc`, and the dataclass that has it: the section's field, or the key
    inside a nested group (`k8s.node.gpus`), so that the group's other keys still count."""
    head = loc[0]
    inner = typing.get_type_hints(owner).get(str(head))
    if len(loc) > 1 and dataclasses.is_dataclass(inner) and isinstance(values.get(str(head)), dict):
        path, found = _unreadable(typing.cast(type, inner), values[str(head)], loc[1:])
        return (head, *path), found
    return (head,), owner


def _dotted(name: str, values: Any, loc: tuple[int | str, ...]) -> str:
    """The error's key as messages name it, `k8s.node.gpus` or `lora.target_modules[2]`; the names pydantic gives
    a union's members (`parallel.expert_parallel`: int, str) are no keys and left out, and so is the index of a
    single item the file gives without its list (`report_to: comet`)."""
    key, node = name, values
    for part in loc:
        if isinstance(node, dict):
            found = [k for k in node if str(k) == str(part)]
            if found:
                key, node = f"{key}.{part}", node[found[0]]
        elif isinstance(part, int) and isinstance(node, list):  # a single item written without its list has no index
            key, node = f"{key}[{part}]", node[part] if part < len(node) else None
    return key


# What a field of each kind takes, by the error pydantic reports for a value it cannot read.
EXPECTED = {
    "bool_type": "true or false",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "finite_number": "a finite number",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
}
BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _mistake(key: str, error: ErrorDetails, owner: type, name: int | str) -> str:
    """rayft's message for one of pydantic's errors: the key, what it takes, and what the file gives."""
    kind, value = error["type"], error["input"]
    field = getattr(owner, "__pydantic_fields__", {}).get(str(name))
    if kind in ("unexpected_keyword_argument", "invalid_key"):
        hint = trl_hint(str(name)) or suggest(str(name), [f.name for f in dataclasses.fields(owner)])
        return f"unknown key '{key}'{hint}"
    if kind == VALUE:
        return str((error.get("ctx") or {})["message"])
    if kind == "literal_error":
        return unknown_value(key, value, _choices(field.annotation if field else None))
    if kind in BOUNDS:
        metadata = field.metadata if field else []
        if field is not None and float in (field.annotation, *typing.get_args(field.annotation)):
            value = float(value)  # `2` in a number field reads as 2.0
        hint = "".join(f" {m.text}" for m in metadata if isinstance(m, Hint))
        return f"{key} must be {_range(metadata, error)}, got {value}{hint}"
    expected = EXPECTED.get(kind)
    if kind == "dataclass_type":  # a nested group of keys (k8s.node, k8s.rdma)
        group = typing.get_type_hints(owner)[str(name)]
        expected = f"a mapping of {', '.join(f.name for f in dataclasses.fields(group))}"
    if expected is None:
        return f"{key}: {error['msg']}"
    if value is None:
        return f"{key} must not be null (expected {expected})"
    return f"{key} must be {expected}, got {value!r} ({type(value).__name__})"


def _range(metadata: list[Any], error: ErrorDetails) -> str:
    """`>= 1`, `> 0`, `in [0, 1)`: the field's bounds as written where it has them, else the bound the error names
    (a mapping's values)."""
    bounds = [m for m in metadata if isinstance(m, (Ge, Gt, Le, Lt))]
    if not bounds:
        bounds = [{"ge": Ge, "gt": Gt, "le": Le, "lt": Lt}[k](v) for k, v in (error.get("ctx") or {}).items()]
    low = next((b for b in bounds if isinstance(b, (Ge, Gt))), None)
    high = next((b for b in bounds if isinstance(b, (Le, Lt))), None)
    if low is not None and high is not None:
        left = f"[{low.ge}" if isinstance(low, Ge) else f"({low.gt}"
        right = f"{high.le}]" if isinstance(high, Le) else f"{high.lt})"
        return f"in {left}, {right}"
    if isinstance(low, Ge) or isinstance(high, Le):
        return f">= {low.ge}" if isinstance(low, Ge) else f"<= {high.le}"  # type: ignore[union-attr]  # one is set
    return f"> {low.gt}" if isinstance(low, Gt) else f"< {high.lt}"  # type: ignore[union-attr]  # one is set


def _choices(annotation: Any) -> tuple[str, ...]:
    """The values of the `Literal` inside a field's type (under `| None`, `list[...]`, `Annotated[...]`), and true
    and false where the Literal is one side of `| Flag`."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    inners = typing.get_args(annotation)
    for inner in inners:
        found = _choices(inner)
        if found:
            return (*found, "true", "false") if any(_is_flag(t) for t in inners) else found
    return ()


def _is_flag(annotation: Any) -> bool:
    return annotation is bool or (typing.get_origin(annotation) is Annotated and typing.get_args(annotation)[0] is bool)


def unknown_value(key: str, value: Any, choices: Iterable[str]) -> str:
    choices = list(choices)
    close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"{key}: unknown value '{value}'{hint}; choose one of {', '.join(choices)}"


def suggest(word: str, choices: Iterable[str]) -> str:
    """The closest valid name, or the list of them."""
    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{close[0]}'?)"
    return f"; valid: {', '.join(sorted(choices))}"


def _without(values: dict[Any, Any], paths: set[tuple[int | str, ...]]) -> dict[Any, Any]:
    """`values` less the keys at `paths` (the nested mappings on the way copied, not changed)."""
    kept = dict(values)
    for path in paths:
        node = kept
        for part in path[:-1]:
            node[part] = dict(node[part])
            node = node[part]
        node.pop(path[-1], None)
    return kept
