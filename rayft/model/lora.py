"""Which modules get LoRA, per architecture, and the PEFT wrapping itself.

The seed recipe's list (`q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj`) is right for dense
Mistral/Llama but on Mistral4 (MLA attention + MoE) it silently matches only `o_proj` and the shared expert's MLP.
So `auto` picks the set per architecture, and an explicit list is checked name by name before training: names
that match nothing are reported loudly with the model's real module names; a list matching nothing is an error.
`auto` on an architecture it has no set for is an error listing the model's linear layers, rather than a guess.
`all-linear` is PEFT's own shorthand (every linear layer but the LM head), resolved by PEFT's own helper.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import cast

import peft
import torch
from peft.tuners.tuners_utils import _maybe_include_all_linear_layers
from peft.utils import get_peft_model_state_dict
from torch import nn
from transformers import PretrainedConfig

from rayft.config import ConfigError, LoraConfig
from rayft.model.families import DENSE_TARGETS as DENSE_TARGETS  # re-exported: the sets are named from here too
from rayft.model.families import FAMILIES
from rayft.model.families import MLA_TARGETS as MLA_TARGETS
from rayft.model.fp8_format import EXPERT_WEIGHTS
from rayft.model.vision import EXCLUDED, in_vision, vision_modules

log = logging.getLogger("rayft")

# Keyed by the text model's `model_type`; each family's set lives in `rayft.model.families`.
AUTO_TARGETS = {f.model_type: f.targets for f in FAMILIES.values()}
ADAPTABLE = (nn.Linear, nn.Embedding)
ALL_LINEAR = "all-linear"


@dataclass
class LoraTargets:
    """What a `lora` section resolves to on a given model."""

    architecture: str
    names: list[str]  # handed to PEFT
    parameters: list[str]  # expert parameters handed to PEFT's target_parameters
    modules: list[str]  # the module paths that get an adapter
    unmatched: list[str]  # requested names that match no module
    candidates: list[str]  # the model's adaptable module names, for messages
    saved: list[str] = field(default_factory=list)  # modules_to_save: the module paths trained in full

    @property
    def warning(self) -> str | None:
        if not self.unmatched:
            return None
        matched = [n for n in self.names if n not in self.unmatched]
        return (
            f"lora.target_modules: {', '.join(self.unmatched)} match nothing in {self.architecture}, so LoRA goes "
            f"only on {', '.join(matched)} ({len(self.modules)} modules). Its projections are: "
            f"{', '.join(self.candidates)}; `target_modules: auto` picks the set for this architecture."
        )


def target_names(lora: LoraConfig, model: nn.Module) -> list[str]:
    if list(lora.target_modules) == [ALL_LINEAR]:
        return sorted(n for n in all_linear(model) if not in_vision(n))
    if list(lora.target_modules) != ["auto"]:
        return list(lora.target_modules)
    # a vision wrapper: its language model's type
    model_type = getattr(cast("PretrainedConfig", model.config).get_text_config(), "model_type", "")
    if model_type not in AUTO_TARGETS:
        raise ConfigError(
            f"lora.target_modules: auto has no target set for model type '{model_type}' ({type(model).__name__}; "
            f"known: {', '.join(sorted(AUTO_TARGETS))}); list the modules to adapt instead (or all-linear) — "
            f"{layer_names(model)}"
        )
    return list(AUTO_TARGETS[model_type])


def all_linear(model: nn.Module) -> set[str]:
    """The module paths PEFT's `all-linear` picks on this model (its own helper: linear layers, LM head excluded)."""
    probe = peft.LoraConfig(target_modules=ALL_LINEAR, task_type=peft.TaskType.CAUSAL_LM)
    # PEFT returns the LoraConfig it was given, its target_modules now the set of matching names (hinted list | str)
    return set(cast(peft.LoraConfig, _maybe_include_all_linear_layers(probe, model)).target_modules)  # type: ignore[arg-type]


def layer_names(model: nn.Module) -> str:
    """The model's adaptable layer names for messages, linear layers apart from embeddings (an embedding takes
    LoRA too, but it is not a linear layer)."""

    def names(kind: type[nn.Module]) -> str:
        return ", ".join(sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, kind)}))

    embeddings = names(nn.Embedding)
    return f"its linear layers are: {names(nn.Linear)}" + (f"; its embeddings: {embeddings}" if embeddings else "")


def resolve_targets(model: nn.Module, lora: LoraConfig) -> LoraTargets:
    names = target_names(lora, model)
    # a vision-language model's tower and projector take no LoRA (`rayft.model.vision`)
    adaptable = [n for n, m in model.named_modules() if isinstance(m, ADAPTABLE) and not in_vision(n)]
    hits = {t: [m for m in adaptable if m == t or m.endswith(f".{t}")] for t in names}
    targets = LoraTargets(
        architecture=type(model).__name__,
        names=[ALL_LINEAR] if list(lora.target_modules) == [ALL_LINEAR] else names,
        parameters=expert_parameters(model) if lora.target_experts else [],
        modules=sorted({m for found in hits.values() for m in found}),
        unmatched=[t for t, found in hits.items() if not found],
        candidates=sorted({m.rsplit(".", 1)[-1] for m in adaptable}),
        saved=modules_to_save(model, lora),
    )
    if lora.use_dora and (embedded := [m for m in targets.modules if isinstance(model.get_submodule(m), nn.Embedding)]):
        raise ConfigError(
            f"lora.use_dora: true on the embedding {embedded[0]}: rayft gives DoRA to linear layers only (an "
            "embedding's magnitude runs across FSDP's shards); drop it from lora.target_modules or set use_dora: false"
        )
    if lora.target_experts and not targets.parameters:
        raise ConfigError(f"lora.target_experts: true but {targets.architecture} has no fused expert parameters")
    _refuse_expert_names(targets, bool(expert_parameters(model)))
    if not targets.modules:
        raise ConfigError(
            f"lora.target_modules {names} match no module of {targets.architecture}; {layer_names(model)}"
        )
    return targets


# Names of routed experts' weights in other layouts (Mixtral's w1/w2/w3, per-expert projections).
EXPERT_NAMES = ("w1", "w2", "w3", "experts", "gate_up_proj", "gate_proj", "up_proj", "down_proj")


def _refuse_expert_names(targets: LoraTargets, moe: bool) -> None:
    """An MoE model's routed experts are fused 3D parameters, not modules: a target naming their weights matches
    nothing, and LoRA would quietly leave the experts out."""
    named = [n for n in targets.unmatched if n in EXPERT_NAMES]
    if moe and named:
        raise ConfigError(
            f"lora.target_modules: {', '.join(named)} name routed experts' weights, which {targets.architecture} "
            f"holds as fused parameters ({', '.join(EXPERT_WEIGHTS)} of each mlp.experts), not modules; set "
            "lora.target_experts: true to adapt the experts, and drop these names"
        )


def modules_to_save(model: nn.Module, lora: LoraConfig) -> list[str]:
    """The module paths `lora.modules_to_save` names (matched as PEFT does: the path or its last parts); each name
    must match, and none may be a tied embedding/head, whose trained copy would stop being tied on export."""
    from rayft.model.weights import tied_parameters

    found, paths = [], [n for n, _ in model.named_modules() if n]
    tied = {name.rpartition(".")[0] for pair in tied_parameters(model).items() for name in pair}
    for name in lora.modules_to_save or []:
        hits = [p for p in paths if p == name or p.endswith(f".{name}")]
        if not hits:
            raise ConfigError(
                f"lora.modules_to_save: '{name}' matches no module of {type(model).__name__}; name a module such as "
                f"lm_head or embed_tokens ({layer_names(model)})"
            )
        if tied & set(hits):
            raise ConfigError(
                f"lora.modules_to_save: '{name}' is tied (tie_word_embeddings: the embedding and the LM head are one "
                "matrix); a trained copy of one would untie them. Adapt it with LoRA (target_modules) instead"
            )
        found += hits
    return sorted(found)


def expert_parameters(model: nn.Module) -> list[str]:
    """Relative names (`mlp.experts.gate_up_proj`) of the routed experts' fused 3D weights."""
    found = set()
    for name, param in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        if param.ndim == 3 and module.endswith("experts") and leaf in EXPERT_WEIGHTS:  # not quantised storage's parts
            found.add(".".join([*module.split(".")[-2:], leaf]))
    return sorted(found)


def peft_config(lora: LoraConfig, names: list[str], parameters: list[str] | None = None) -> peft.LoraConfig:
    """PEFT's config for these targets; `[all-linear]` is handed over as PEFT's own shorthand string."""
    return peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=ALL_LINEAR if list(names) == [ALL_LINEAR] else names,
        use_dora=lora.use_dora,
        use_rslora=lora.use_rslora,
        modules_to_save=lora.modules_to_save,
        target_parameters=parameters or None,
        bias=lora.bias,
        task_type=peft.TaskType.CAUSAL_LM,
    )


def check_peft_keeps_targets(model: nn.Module, config: peft.LoraConfig) -> None:
    """Refuse module targets PEFT would move onto the routed experts. On the MoE models transformers converts from
    the per-expert layout (DeepSeek-V3, Qwen3-MoE), PEFT reads gate_proj/up_proj/down_proj (and `all-linear`) as the
    experts' transformers-4 names and adapts the fused experts instead of the shared and dense MLPs those names also
    match: not what `rayft validate`, the plan and the log say; with dropout it fails outright."""
    moved = _moved_by_peft(model, config)
    if moved is not None:
        raise ConfigError(
            f"lora.target_modules on {type(model).__name__}: {moved}. PEFT {peft.__version__} reads gate_proj, "
            "up_proj and down_proj on this model as the routed experts' transformers-4 names and adapts the routed "
            "experts instead of the shared and dense MLPs; leave them out of lora.target_modules (`auto` does), and "
            "set lora.target_experts: true (with lora.lora_dropout: 0) for LoRA on the routed experts"
        )


def _moved_by_peft(model: nn.Module, config: peft.LoraConfig) -> str | None:
    """What PEFT's transformers-4 compatibility would make of these targets, or None where it keeps them."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a PEFT without it keeps every target as given
        return None

    probe = copy.deepcopy(config)
    try:
        convert_peft_config_for_transformers(probe, model=model, conversions=None)
    except ValueError as e:  # half of a fused pair (gate_proj without up_proj): PEFT refuses to map it
        return str(e).rstrip(".")
    added = sorted(set(probe.target_parameters or ()) - set(config.target_parameters or ()))
    if not added:
        return None
    asked = config.target_modules
    names = asked if isinstance(asked, str) else ", ".join(sorted(set(asked or ()) - set(probe.target_modules or ())))
    return f"{names} would become LoRA on {', '.join(added)}"


def wrap(model: nn.Module, lora: LoraConfig) -> tuple[peft.PeftModel, LoraTargets]:
    targets = resolve_targets(model, lora)
    config = peft_config(lora, targets.names, targets.parameters)
    if vision_modules(model):  # the language model's target names are also the tower's (o_proj, gate_proj, ...)
        config.exclude_modules = EXCLUDED
    check_peft_keeps_targets(model, config)
    return peft.get_peft_model(model, config), targets


def apply_lora(model: nn.Module, lora: LoraConfig) -> peft.PeftModel:
    """`wrap`, saying in the log when part of an explicit target list matched nothing."""
    peft_model, targets = wrap(model, lora)
    if targets.warning:
        log.warning(targets.warning)
    trainable_in_fp32_(peft_model)
    return peft_model


def trainable_in_fp32_(model: nn.Module) -> None:
    """Every trained parameter kept in fp32, whatever the base's dtype. PEFT upcasts the LoRA factors of a bf16 base
    but leaves `modules_to_save` copies in it: AdamW on bf16 master weights loses most small updates, and one FSDP
    unit holding both fp32 factors and a bf16 copy is refused (its gradients must share one dtype). The mixed-
    precision policy still casts them to the compute dtype for each forward."""
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()


def adapter_file_keys(model: peft.PeftModel) -> dict[str, str]:
    """Key in the model's saved PEFT adapter file → key of its state dict, for every tensor the adapter holds
    (LoRA factors, DoRA magnitudes, modules_to_save copies): PEFT's own renaming (`get_peft_model_state_dict`),
    run over the key names."""
    keys = {k: k for k in model.state_dict()}
    return dict(get_peft_model_state_dict(model, state_dict=keys, save_embedding_layers=False))
