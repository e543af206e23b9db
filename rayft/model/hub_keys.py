"""Where a model parameter is in a checkpoint written in transformers' `save_pretrained` (hub) layout, which is not
always the model's in-memory names.

transformers 5 holds routed experts fused (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `mlp.experts.down_proj`
`[E, H, I]`) but writes, and the hub ships, one tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight`,
Mixtral's `block_sparse_moe.experts.{e}.w1.weight`). The layout is read from transformers' own conversion mapping
(`get_checkpoint_conversion_mapping`), not from a table here: a converter that merges a module list (then
concatenates its parts) says which per-expert tensors make which fused parameter, a renaming which names the file
uses. Converters with other operations are left alone: those parameters are looked up under their own names.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming

if TYPE_CHECKING:
    from transformers.core_model_loading import ConversionOps

PLAIN = re.compile(r"[\w.*]+")  # a pattern that is a literal name (`*`: the expert index), not a regex


@dataclass(frozen=True)
class ExpertParts:
    """A fused `[E, ...]` parameter stored per expert: expert e's slice is its `parts` (names with `*` for e)
    concatenated along the slice's first dimension (gate rows, then up rows)."""

    parts: tuple[str, ...]

    def keys(self, expert: int) -> tuple[str, ...]:
        return tuple(part.replace("*", str(expert)) for part in self.parts)

    def renamed(self, rename: Callable[..., str]) -> ExpertParts:  # `...`: callers' lambdas bind loop values too
        return ExpertParts(tuple(rename(part) for part in self.parts))


@dataclass(frozen=True)
class _Layout:
    renamings: tuple[tuple[str, str], ...]  # (in-memory substring, checkpoint substring)
    fused: tuple[tuple[str, tuple[str, ...]], ...]  # (in-memory name ending, per-expert name endings)


@functools.cache
def _layout(model_type: str) -> _Layout:
    """The renamings and expert merges of `model_type`'s conversion mapping that are plain names."""
    renamings, fused = [], []
    # transformers leaves get_checkpoint_conversion_mapping unannotated
    for transform in get_checkpoint_conversion_mapping(model_type) or ():  # type: ignore[no-untyped-call]
        sources, targets = transform.source_patterns, transform.target_patterns
        if not all(PLAIN.fullmatch(p) for p in (*sources, *targets)) or len(targets) != 1:
            continue
        if isinstance(transform, WeightRenaming) and len(sources) == 1:
            renamings.append((targets[0], sources[0]))
        elif isinstance(transform, WeightConverter) and _merges_experts(transform.operations):
            fused.append((targets[0], tuple(sources)))
    return _Layout(tuple(renamings), tuple(fused))


def _merges_experts(operations: list[ConversionOps]) -> bool:
    """Stack per-expert tensors on a new dim 0, then (several parts) concatenate them along dim 1. (Other
    operations, such as a transpose with its two dims, make it something else.)"""
    kinds = [(type(op), getattr(op, "dim", None)) for op in operations]
    return kinds in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)])


def checkpoint_names(model_type: str, name: str) -> list[str]:
    """The names a (non-expert-split) parameter may have in a checkpoint: its own, then as the hub layout renames it
    (Mixtral's `mlp.gate.weight` is `block_sparse_moe.gate.weight` in its files)."""
    names = [name]
    for ours, theirs in _layout(model_type).renamings:
        renamed = name.replace(ours, theirs)
        if renamed not in names:
            names.append(renamed)
    return names


def expert_parts(model_type: str, name: str) -> list[ExpertParts]:
    """The per-expert layouts a fused expert parameter may be stored in (its in-memory name, then renamed), or []
    when the hub stores it under its own name."""
    for target, sources in _layout(model_type).fused:
        if name.endswith(target) and (len(name) == len(target) or target[0] == "." or name[-len(target) - 1] == "."):
            stem = name[: len(name) - len(target)]
            parts = ExpertParts(tuple(stem + source for source in sources))
            out = [parts]
            for ours, theirs in _layout(model_type).renamings:
                renamed = parts.renamed(lambda key, ours=ours, theirs=theirs: key.replace(ours, theirs))
                if renamed not in out:
                    out.append(renamed)
            return out
    return []
