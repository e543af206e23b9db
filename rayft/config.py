"""Typed run configuration: YAML + `--override section.key=value`, checked before anything expensive starts.

Field names and defaults of `model`, `lora`, `data` and `train` follow the seed recipe's dataclasses and YAML so
users' existing files load unchanged; `fsdp` and `ray` are rayft's own (`nccl` lives beside the process group it
configures, `k8s` beside the manifests). Each section is a pydantic dataclass (`rayft.schema`): its fields' types,
choices and ranges, and its rules over several of its keys; `Config`'s rules relate one section to another. Every
user mistake becomes a `ConfigError` that names the key (and the closest valid key for typos) instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import math
import os
import string
import typing
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, cast

import pydantic.dataclasses
import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import BeforeValidator, Strict, model_validator

from rayft.kube.settings import K8sConfig
from rayft.schema import (
    SECTION_CONFIG,
    Broken,
    Flag,
    Hint,
    Integer,
    Keyed,
    Listed,
    Number,
    Problem,
    Section,
    Strategy,
    Text,
    broken,
    combined,
    problems_error,
    read_section,
    refuse_value,
    suggest,
    unknown_value,
)
from rayft.schema import ConfigError as ConfigError  # every module's error for a user's mistake, named from here
from rayft.trl_names import TRL_NAMES, trl_hint


def is_uri(path: str) -> bool:
    """s3://, gs://, … (handled by pyarrow) rather than a local or shared-volume path."""
    return "://" in path


def eval_metric(name: str) -> str:
    """transformers' spelling: metric names are evaluation metrics, `loss` means `eval_loss`."""
    return name if name.startswith("eval_") else f"eval_{name}"


def template_fields(template: str) -> list[str]:
    """The record fields a `data.prompt_template` format string reads."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ConfigError(f"data.prompt_template: not a valid format string ({e}); use {{field}} names") from None
    if not names or any(not n or not n.isidentifier() for n in names):
        raise ConfigError(
            f"data.prompt_template: use named placeholders of record fields, e.g. '### Question:\\n{{question}}\\n'; "
            f"got {template!r}"
        )
    return names


SEED_DATASET_CONFIG = "wikitext-2-raw-v1"  # the seed recipe's wikitext configuration: the default

# Ranges most keys share.
Count = Annotated[Integer, Ge(1)]  # steps, sizes, workers
Share = Annotated[Number, Ge(0), Lt(1)]  # a part of a whole, less than all of it

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
# fsdp.activation_checkpointing in words (true and false read as full and none)
Checkpointing = Literal["auto", "full", "selective", "none"]


def _checkpointing_word(value: Any) -> Any:
    """true and false, as accelerate's and older rayft configs write the setting, in words."""
    return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value


CheckpointingSetting = Annotated[Checkpointing, BeforeValidator(_checkpointing_word)]
Scheduler = Literal[
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt"
]
# transformers' `optim` names that run here (rayft/train/schedule.py builds them; the state is the LoRA params').
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop")
# bitsandbytes' optimizers: their 8-bit/paged states are not built for FSDP2's sharded (DTensor) parameters.
BNB_OPTIMIZERS = ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "paged_adamw",
                  "lion_8bit", "lion_32bit", "paged_lion_8bit", "paged_lion_32bit")  # fmt: skip
STRATEGIES: tuple[str, ...] = typing.get_args(typing.get_args(Strategy)[0])
# What evaluation reports, so what checkpoints can be ranked by.
BEST_METRICS = ("eval_loss",)
DEFAULT_VAL_RATIO = 0.05
DEFAULT_VAL_SPLIT = "validation"


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class ModelConfig(Section):
    section: ClassVar[str] = "model"
    # A local directory, or a hub id (`org/name`) resolved through the Hugging Face cache (HF_HOME; rayft/hub.py).
    model_name_or_path: Text = "/data/input/Models/Mistral-Small-4-119B-2603"
    # Branch, tag or commit of a hub model; null = main.
    revision: Text | None = None
    torch_dtype: Dtype | Literal["auto"] = "bfloat16"
    # Accepted for seed compatibility only: FSDP decides placement, so "auto" device maps are ignored.
    device_map: Text | None = "auto"
    use_cache: Flag = False
    attn_implementation: Text | None = None
    # Where the tokenizer lives when it is not next to the weights.
    tokenizer_name_or_path: Text | None = None
    # sharded: each rank reads only its own FSDP shards from the safetensors files (no rank holds the model);
    # full: every rank loads the whole model with from_pretrained, then shards it (needs host RAM for all of it).
    load_mode: Literal["sharded", "full"] = "sharded"
    # Storage of the frozen decoder matrices (linears, routed experts): auto = FP8 (E4M3 + row scales) when the
    # checkpoint is FP8, else torch_dtype; float8_e4m3fn also quantises a bf16/fp32 checkpoint at load (per row);
    # nf4 = QLoRA's 4-bit NormalFloat with double-quantised scales for the decoder's linears.
    frozen_dtype: Literal["auto", "float8_e4m3fn", "nf4", "bfloat16", "float32"] = "auto"
    # An FP8 base's frozen matmuls (forward and input gradient) on its stored bytes, activations rounded to FP8 per
    # token (LoRA stays in its own dtype): auto = on GPUs that run FP8 matmuls (compute capability 8.9+: H100, H200,
    # B200), off on CPU; false = dequantise each weight to the compute dtype first (bit for bit the checkpoint's).
    fp8_compute: Literal["auto"] | Flag = "auto"
    # A vision+text checkpoint (Mistral3, llava-style: vision tower + projector + language model): true = build the
    # whole model, the tower and projector frozen in torch_dtype, LoRA on the language model; false = the language
    # model only (the tower is never read); auto = false for now (the data pipeline does not carry images yet).
    vision: Literal["auto"] | Flag = "auto"

    def broken(self) -> list[Broken | None]:
        return [
            broken(
                "model.vision: true builds the model from the checkpoint's files rank by rank; set model.load_mode: "
                "sharded",
                "vision",
                "load_mode",
            )
            if self.vision is True and self.load_mode != "sharded"
            else None,
            broken(
                f"model.frozen_dtype {self.frozen_dtype} disagrees with model.torch_dtype {self.torch_dtype}: a "
                "dequantised base is stored in torch_dtype; set one of them to match (or frozen_dtype: "
                "float8_e4m3fn / auto)",
                "frozen_dtype",
                "torch_dtype",
            )
            if self.frozen_dtype in DTYPES and self.torch_dtype not in ("auto", self.frozen_dtype)
            else None,
        ]


DORA_ON_FP8 = (
    "lora.use_dora: true needs the frozen weights in bf16/fp32: DoRA's magnitude is the norm of each row of W + BA, "
    "which FP8 storage (model.frozen_dtype float8_e4m3fn, or auto on an FP8 checkpoint) does not give; set "
    "model.frozen_dtype: bfloat16 or lora.use_dora: false"
)


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class LoraConfig(Section):
    section: ClassVar[str] = "lora"
    r: Count = 16
    lora_alpha: Annotated[Integer, Gt(0)] = 32
    lora_dropout: Share = 0.05
    # "auto" = the right set for the architecture (see rayft.lora.AUTO_TARGETS); "all-linear" = every linear layer
    # but the LM head (PEFT's shorthand); else module names.
    target_modules: Listed[Text] = field(default_factory=lambda: ["auto"])
    bias: Literal["none", "all", "lora_only"] = "none"
    task_type: Literal["CAUSAL_LM"] = "CAUSAL_LM"
    # Also adapt the routed experts (fused 3D parameters, via PEFT target_parameters): one LoRA per expert.
    target_experts: Flag = False
    # PEFT's options of the same names: DoRA (a trained magnitude per output row), rank-stabilised scaling
    # (lora_alpha / sqrt(r)), and modules trained in full beside the adapter (e.g. [lm_head, embed_tokens]).
    use_dora: Flag = False
    use_rslora: Flag = False
    modules_to_save: Listed[Text] | None = None

    def broken(self) -> list[Broken | None]:
        targets = self.target_modules
        return [
            None
            if targets
            else broken(
                "lora.target_modules is empty: name at least one module, e.g. [q_proj, v_proj]", "target_modules"
            ),
            broken(
                f"lora.target_modules {targets}: all-linear already names every linear layer (the LM head excepted); "
                "give it alone, or list module names without it",
                "target_modules",
            )
            if "all-linear" in targets and len(targets) > 1
            else None,
            broken(
                f"lora.target_experts: true needs lora.lora_dropout: 0 (got {self.lora_dropout}): PEFT's LoRA on "
                "expert parameters has no dropout",
                "target_experts",
                "lora_dropout",
            )
            if self.target_experts and self.lora_dropout != 0
            else None,
            broken(
                "lora.use_dora: true cannot be combined with lora.target_experts: true (PEFT has no DoRA for the "
                "routed experts' fused parameters); set one of them false",
                "use_dora",
                "target_experts",
            )
            if self.use_dora and self.target_experts
            else None,
            broken("lora.modules_to_save is empty: name modules (e.g. [lm_head]) or leave it null", "modules_to_save")
            if self.modules_to_save is not None and not self.modules_to_save
            else None,
        ]


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class DataConfig(Section):
    section: ClassVar[str] = "data"
    # A local file, directory or glob, or a hub dataset id (`org/name`) resolved through the Hugging Face cache.
    dataset_name_or_path: Text = "/data/input/Datasets/wikitext"
    # Branch, tag or commit of a hub dataset; null = main.
    revision: Text | None = None
    # The configuration (a folder of a local dataset directory) to read; the default is the seed recipe's.
    dataset_config_name: Text | None = SEED_DATASET_CONFIG
    text_field: Text = "text"
    train_split: Text = "train"
    # The split evaluated; where the dataset lacks the default, `validation`, and has `test` (TRL's default), that.
    val_split: Text | None = DEFAULT_VAL_SPLIT
    max_length: Annotated[Integer, Ge(2)] = 1024
    # Instruction data: a str.format template over the record's fields that renders the prompt, e.g.
    # "### Question:\n{question}\n\n### Answer:\n"; the completion comes from `completion_field`.
    prompt_template: Text | None = None
    completion_field: Text = "completion"
    # Chat records: a list of {role, content} messages rendered with the tokenizer's chat template.
    messages_field: Text = "messages"
    # auto: prompt_template → template; a messages column → chat; prompt + completion columns → prompt/completion;
    # otherwise plain text from text_field.
    format: Literal["auto", "text", "prompt_completion", "messages", "preference"] = "auto"
    # Loss only on completion / assistant tokens (null = true for instruction and chat data).
    completion_only_loss: Flag | None = None
    # Concatenate examples and cut max_length blocks; positions restart per document (padding-free batches).
    packing: Flag = False
    # Padded (unpacked) batches: the length rounded up to a multiple of this (at most max_length), so kernels see a
    # few shapes rather than one per batch (CPU bf16 matmuls compile a kernel for every new shape).
    pad_to_multiple_of: Count = 64
    # Wikitext stores one paragraph per record: join each article's lines (split at ` = Title = ` headings).
    join_wikitext_articles: Flag = False
    # Keep the tokenized training split in Ray's object store (spilling to disk if needed) instead of re-reading
    # and re-tokenizing it every epoch; null = when the source is at most 2 GiB.
    cache_tokenized: Flag | None = None
    # Records that cannot become an example (missing field, not text, not UTF-8, bad JSON): skip and count them,
    # or stop before training with the counts.
    bad_records: Literal["skip", "error"] = "skip"
    # Examples longer than max_length without packing: truncate or skip them (counted either way).
    overlong: Literal["truncate", "skip"] = "truncate"
    # Before any cluster resource, the job (and `rayft validate`) runs its record pipeline over the first 1,000
    # records of each split. A split where more than this share would be skipped is refused; fewer are a warning.
    max_skipped_share: Annotated[Number, Ge(0), Le(1)] = 0.5
    # Likewise for records that would train on nothing: a chat whose assistant replies are all empty, a preference
    # pair whose chosen and rejected tokenize alike. Any is a warning with the count; more than this share refused.
    max_no_signal_share: Annotated[Number, Ge(0), Le(1)] = 0.1
    # Share of the training records held out for evaluation when there is no validation split. null = 0.05 where
    # the dataset has no named splits (a single file, a glob); where it has named splits, a `val_split` it lacks
    # is an error unless this is set (a typo must not silently hold out training data).
    val_ratio: Share | None = None
    # Evaluate on the first N validation rows only (after tokenization and packing), as transformers' example
    # scripts' max_eval_samples: quicker evaluations while iterating on a config. null = the whole split.
    max_eval_samples: Count | None = None
    # Ray Data actors that tokenize in parallel with training (each holds one tokenizer).
    tokenize_workers: Count = 2
    # Rows each worker shuffles locally while streaming; 0 keeps the read order.
    shuffle_buffer_size: Annotated[Integer, Ge(0)] = 1000

    @property
    def hold_out(self) -> float:
        """The share of training records held out when there is no validation split."""
        return DEFAULT_VAL_RATIO if self.val_ratio is None else self.val_ratio

    def broken(self) -> list[Broken | None]:
        if self.prompt_template is None:
            return []
        try:
            template_fields(self.prompt_template)
            bad_template = None
        except ConfigError as e:
            bad_template = broken(str(e), "prompt_template")
        return [
            bad_template,
            broken(
                f"data.prompt_template renders prompt/completion records; data.format is {self.format}",
                "prompt_template",
                "format",
            )
            if self.format not in ("auto", "prompt_completion")
            else None,
        ]


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class TrainConfig(Section):
    section: ClassVar[str] = "train"
    output_dir: Text = "/data/output/Models/mistral4small-lora-fsdp"
    num_train_epochs: Count = 1
    # Stops after this many optimizer steps when > 0, whatever num_train_epochs says.
    max_steps: Integer = -1
    per_device_train_batch_size: Count = 1
    per_device_eval_batch_size: Count = 1
    gradient_accumulation_steps: Count = 16
    gradient_checkpointing: Flag = False
    optim: Text = "adamw_torch"
    learning_rate: Annotated[Number, Gt(0)] = 1e-4
    lr_scheduler_type: Scheduler = "cosine"
    warmup_ratio: Share = 0.05
    # Takes precedence over warmup_ratio when > 0 (the newer transformers spelling).
    warmup_steps: Annotated[Integer, Ge(0)] = 0
    weight_decay: Annotated[Number, Ge(0)] = 0.01
    max_grad_norm: Annotated[Number, Gt(0)] = 1.0
    # Dense peak of one worker's device in TFLOP/s, for MFU where rayft does not know it (another GPU, a CPU);
    # None = rayft's table of GPUs (H100/H200/B200...). Overrides the table when set.
    peak_tflops: Annotated[Number, Gt(0)] | None = None
    # Loss straight from the hidden states, chunk by chunk, never the full logits (see rayft/loss.py).
    fused_loss: Flag = True
    # GPU: FSDP2 computes in bf16 (fp32 gradients reduced). CPU: bf16 autocast where the CPU has bf16 instructions.
    bf16: Flag = True
    fp16: Flag = False
    logging_steps: Count = 25
    eval_strategy: Strategy = "steps"
    eval_steps: Count = 200
    save_strategy: Strategy = "steps"
    save_steps: Count = 200
    # Checkpoints Ray keeps on the storage path (the best by metric_for_best_model plus the latest).
    save_total_limit: Annotated[Count | None, Hint("(or null to keep every checkpoint)")] = 3
    # At the end, output_dir/final is the best checkpoint's adapter (output_dir/best says which step).
    load_best_model_at_end: Flag = False
    # Ranks checkpoints for retention and load_best_model_at_end; HF spelling ("loss" means "eval_loss").
    metric_for_best_model: Text | None = "eval_loss"
    # None = lower is better for a loss, higher otherwise (as in transformers).
    greater_is_better: Flag | None = None
    # Start from a checkpoint directory (also another run's), or "latest" = insist on continuing this run.
    # A run whose storage already has checkpoints always continues from its own latest one.
    resume_from_checkpoint: Text | None = None
    # Continuing a run whose recorded settings differ from this config (rayft/train/run_settings.py): auto refuses
    # it before anything starts; continue goes on with the new data/schedule settings (a changed model or LoRA
    # shape is refused either way).
    resume: Literal["auto", "continue"] = "auto"
    # Experiment trackers besides Ray's own metrics: none | tensorboard (output_dir/runs/<ray.name>) | mlflow |
    # wandb (output_dir/wandb; WANDB_PROJECT, WANDB_MODE=offline as wandb reads them).
    report_to: Listed[Literal["none", "tensorboard", "mlflow", "wandb"]] | None = None
    # records.jsonl in the run directory: per optimizer step, a fingerprint of each sequence it trained on (an audit
    # of the data behind the adapter; one small gather a step while on).
    record_ledger: Flag = False
    # numpy's legacy generator (Ray Data's shuffles) takes seeds in [0, 2**32): another seed fails in the workers.
    seed: Annotated[Integer, Ge(0), Lt(2**32)] = 42
    # Accepted for seed compatibility; FSDP2 has no unused-parameter search.
    ddp_find_unused_parameters: Flag = False
    # sft: next-token loss on the records; dpo: preference tuning on chosen/rejected pairs (the `dpo` section).
    objective: Literal["sft", "dpo"] = "sft"

    @model_validator(mode="before")
    @classmethod
    def _resume_as_transformers_writes_it(cls, values: Any) -> Any:
        """`resume_from_checkpoint: true` is how transformers' Trainer is told to continue: answered with rayft's
        spelling rather than with the field's type."""
        flag = values.get("resume_from_checkpoint") if isinstance(values, dict) else None
        if isinstance(flag, bool):
            refuse_value(
                "train",
                "resume_from_checkpoint",
                f"train.resume_from_checkpoint: {str(flag).lower()} is transformers' spelling; rayft's is "
                + (
                    "'latest' (continue this run from its latest checkpoint)"
                    if flag
                    else "null (a run with checkpoints in its storage continues from them on its own)"
                ),
            )
        return values

    @property
    def best_metric(self) -> tuple[str, str] | None:
        """(metric, "min"|"max") that ranks checkpoints, or None when checkpoints are kept newest-first."""
        if self.metric_for_best_model is None or self.eval_strategy == "no":
            return None
        metric = eval_metric(self.metric_for_best_model)
        greater = self.greater_is_better if self.greater_is_better is not None else not metric.endswith("loss")
        return metric, "max" if greater else "min"

    def broken(self) -> list[Broken | None]:
        best = self.metric_for_best_model
        return [
            broken(
                f"train.max_steps must be >= 1, got {self.max_steps} (or -1 to train for num_train_epochs)",
                "max_steps",
            )
            if self.max_steps < 1 and self.max_steps != -1
            else None,
            # without max_steps the total is known once the records are counted (`rayft.train.steps.plan_steps`)
            broken(warmup_too_long(self.warmup_steps, f"train.max_steps {self.max_steps}"), "warmup_steps", "max_steps")
            if 0 < self.max_steps <= self.warmup_steps
            else None,
            optimizer_problem(self.optim),
            broken("train.fp16: true is not supported (FSDP2 + LoRA trains in bf16); set train.fp16: false", "fp16")
            if self.fp16
            else None,
            broken(
                f"train.metric_for_best_model: unknown metric '{best}'; evaluation reports {', '.join(BEST_METRICS)}",
                "metric_for_best_model",
            )
            if best is not None and eval_metric(best) not in BEST_METRICS
            else None,
            broken(
                "train.load_best_model_at_end: true needs checkpoints ranked by an evaluation metric: set "
                "train.eval_strategy (steps or epoch) and train.metric_for_best_model (e.g. eval_loss)",
                "load_best_model_at_end",
                "eval_strategy",
                "metric_for_best_model",
            )
            if self.load_best_model_at_end and self.best_metric is None
            else None,
            broken(
                "train.load_best_model_at_end: true needs train.save_strategy steps or epoch",
                "load_best_model_at_end",
                "save_strategy",
            )
            if self.load_best_model_at_end and self.save_strategy == "no"
            else None,
            broken(
                "train.resume_from_checkpoint must be a checkpoint directory, 'latest' or null",
                "resume_from_checkpoint",
            )
            if self.resume_from_checkpoint is not None and not self.resume_from_checkpoint.strip()
            else None,
        ]


def warmup_too_long(warmup: int, total: str) -> str:
    """`train.warmup_steps` that leaves no step at the full learning rate (`total`: the run's steps, said where they
    come from)."""
    return (
        f"train.warmup_steps {warmup} is not shorter than {total}: the learning rate would never reach "
        "train.learning_rate; set fewer warm-up steps (or use train.warmup_ratio)"
    )


def optimizer_problem(name: str) -> Broken | None:
    """`train.optim`: one of OPTIMIZERS; a bitsandbytes name gets why not, and what to use instead."""
    if name in OPTIMIZERS:
        return None
    if name in BNB_OPTIMIZERS:
        import importlib.util

        absent = " (and bitsandbytes is not installed)" if importlib.util.find_spec("bitsandbytes") is None else ""
        return broken(
            f"train.optim: {name} is a bitsandbytes optimizer{absent}, which rayft does not run: its quantised "
            "states are not built for FSDP2's sharded parameters, and LoRA's optimizer state is small anyway; "
            f"choose one of {', '.join(OPTIMIZERS)}",
            "optim",
        )
    return broken(unknown_value("train.optim", name, OPTIMIZERS), "optim")


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class DpoConfig(Section):
    """Preference tuning (`train.objective: dpo`), names and meanings as TRL's DPOConfig."""

    section: ClassVar[str] = "dpo"

    # Strength of the pull towards the reference: the implicit reward is beta · (log π − log π_ref).
    beta: Annotated[Number, Gt(0)] = 0.1
    # sigmoid: DPO (with label_smoothing > 0: conservative DPO); robust: robust DPO; ipo: IPO (length-averaged).
    loss_type: Literal["sigmoid", "robust", "ipo"] = "sigmoid"
    # Assumed share of flipped preference labels (sigmoid, robust); 0 = plain DPO.
    label_smoothing: Annotated[Number, Ge(0), Lt(0.5)] = 0.0
    # adapter_off: the reference is the same sharded base with the LoRA adapter switched off (no second model);
    # precomputed: that base scores every training pair once before the first step, then one forward per pair.
    reference: Literal["adapter_off", "precomputed"] = "adapter_off"
    # Prompts longer than this keep their last max_prompt_length tokens; null = only data.max_length limits them.
    max_prompt_length: Count | None = None

    def broken(self) -> list[Broken | None]:
        return [
            broken(
                "dpo.label_smoothing applies to loss_type sigmoid or robust, not ipo; set it to 0",
                "label_smoothing",
                "loss_type",
            )
            if self.label_smoothing and self.loss_type == "ipo"
            else None
        ]


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class FsdpConfig(Section):
    section: ClassVar[str] = "fsdp"
    # Free each layer's gathered weights after forward (ZeRO-3); False keeps them until backward (ZeRO-2), and across
    # the micro-batches of a step. None: True, even over a shard group of one worker, where FSDP2's "gathered" copy is
    # a second copy of the weights: kept, the whole base would be held twice for the step.
    reshard_after_forward: Flag | None = None
    # Compute dtype of gathered weights; "auto" = bfloat16 on GPU when train.bf16, float32 on CPU.
    param_dtype: Dtype | Literal["auto"] = "auto"
    reduce_dtype: Dtype = "float32"
    cpu_offload: Flag = False
    # Recompute decoder layers in backward instead of keeping their activations. auto: the planner's choice from the
    # memory plan of the job's GPU (none when the activations fit, else every n-th layer, else every layer);
    # full (true), selective (every `checkpoint_every_n_layers`-th layer; unset: the fewest layers that fit), none
    # (false). An explicit setting wins; train.gradient_checkpointing: true asks for full.
    activation_checkpointing: CheckpointingSetting = "auto"
    # Selective checkpointing's period: layers 0, n, 2n, ... are recomputed (transformers' `every_n_layers`).
    checkpoint_every_n_layers: Count | None = None
    # Layers whose all-gather is issued ahead of time; 0 leaves it to FSDP2's implicit prefetching.
    forward_prefetch: Annotated[Integer, Ge(0)] = 1
    backward_prefetch: Annotated[Integer, Ge(0)] = 1
    # Workers each weight is sharded over; None = all of them (FSDP). 1 = every worker holds the whole model and no
    # weight is ever gathered (DDP-like, for models that fit one worker); k = HSDP: sharded within groups of k
    # workers (a node), replicated across the groups, so only the LoRA gradients cross between groups.
    shard_size: Count | None = None

    def broken(self) -> list[Broken | None]:
        return [
            broken(
                f"fsdp.checkpoint_every_n_layers {self.checkpoint_every_n_layers} is selective checkpointing's period; "
                f"fsdp.activation_checkpointing is {self.checkpointing()}: set it to selective or drop the period",
                "checkpoint_every_n_layers",
                "activation_checkpointing",
            )
            if self.checkpoint_every_n_layers is not None and self.checkpointing() != "selective"
            else None
        ]

    def checkpointing(self) -> Checkpointing:
        """`activation_checkpointing` in words, also where code set it to true or false without reading it."""
        return cast(Checkpointing, _checkpointing_word(self.activation_checkpointing))

    def shard_group(self, world_size: int) -> int:
        """Workers that together hold one copy of the weights."""
        return self.shard_size or world_size

    def reshards(self) -> bool:
        """`reshard_after_forward` resolved: a layer's gathered weights freed after its forward (re-gathered for its
        backward: over one worker that is a device-local copy, far cheaper than holding every layer twice)."""
        return self.reshard_after_forward if self.reshard_after_forward is not None else True


def cpu_precision_problem(fsdp: FsdpConfig) -> Broken | None:
    """gloo cannot all-gather bf16/fp16 (the process aborts), so CPU training computes in fp32."""
    if fsdp.param_dtype in ("auto", "float32") and fsdp.reduce_dtype == "float32":
        return None
    return broken(
        "fsdp.param_dtype/reduce_dtype must be float32 (or auto) when training on CPU: the gloo backend cannot "
        "gather bf16/fp16 tensors",
        "fsdp.param_dtype",
        "fsdp.reduce_dtype",
    )


def check_cpu_precision(fsdp: FsdpConfig) -> None:
    """`cpu_precision_problem` for a run that finds no GPU on its cluster."""
    problem = cpu_precision_problem(fsdp)
    if problem is not None:
        raise ConfigError(problem.message)


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class RayConfig(Section):
    section: ClassVar[str] = "ray"
    # Cluster to join; None = the one `ray job submit` runs us in (RAY_ADDRESS), else a new local one.
    address: Text | None = None
    # The worker group's size; `[min, max]` makes the run elastic (see min_workers).
    num_workers: Count = 2
    # Elastic run: the smallest group it goes on with when nodes are lost or drained (Ray restarts it at the size
    # the cluster has, from the latest checkpoint, and grows it back up to num_workers as nodes return). The global
    # batch stays that of num_workers: each size accumulates more micro-batches. None: always num_workers.
    min_workers: Count | None = None
    # Seconds between an elastic run's looks for capacity to grow back onto (each growth is a restart).
    resize_check_s: Annotated[Number, Ge(0)] = 60.0
    # Workers (GPUs) on each node; num_workers = nodes × workers_per_node. 1: one worker per node
    # (placement_strategy STRICT_SPREAD). More: each node's workers placed together (PACK), exactly this many a node.
    workers_per_node: Count = 1
    # None = use GPUs when the cluster has any.
    use_gpu: Flag | None = None
    resources_per_worker: Keyed[Annotated[Number, Ge(0)]] | None = None
    # One worker per node by default: each worker owns a whole node's GPU(s) and its NIC.
    placement_strategy: Literal["STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"] = "STRICT_SPREAD"
    # None = train.output_dir, so checkpoints land next to the final adapter on the shared volume.
    storage_path: Text | None = None
    name: Text = "ray_run"
    # Worker-group restarts after a failure (a dead worker, a lost node); each resumes from the latest checkpoint.
    max_failures: Annotated[Integer, Ge(-1), Hint("(-1 retries forever)")] = 1
    # async: training goes on while the checkpoint is copied to storage_path; sync: it waits for the copy.
    checkpoint_upload: Literal["async", "sync"] = "async"
    # A drain notice for one of the run's nodes (a spot reclaim, a scale-down): checkpoint saves one at once and
    # trains on until Ray restarts the run from it; ignore leaves the loss to the periodic checkpoints.
    preemption: Literal["checkpoint", "ignore"] = "checkpoint"
    # Optimizer steps between two looks at Ray's drain notice (each look is a barrier across the workers).
    preemption_check_steps: Count = 1
    # Restarts after a preemption, counted apart from max_failures; -1: any number.
    max_preemptions: Annotated[Integer, Ge(-1), Hint("(-1 retries forever)")] = -1
    # Seconds the workers may train on past a drain's deadline, until its node is gone (0: Ray restarts the run
    # at the deadline, whether or not the node is still there).
    preemption_grace_s: Annotated[Number, Ge(0)] = 0.0
    # Logical CPUs of the local cluster started when there is none to join (more than cores, so
    # Ray Data tasks are not starved by the training workers).
    local_num_cpus: Count = 8
    # Seconds to wait, before training starts, for a cluster that cannot place the workers yet to grow (nodes
    # joining, an autoscaler); then the run is refused. A cluster that can never place them is refused at once.
    placement_timeout_s: Annotated[Integer, Ge(0)] = 600

    @model_validator(mode="before")
    @classmethod
    def _worker_range(cls, values: Any) -> Any:
        """`num_workers: [min, max]` read as min_workers and num_workers."""
        sizes = values.get("num_workers") if isinstance(values, dict) else None
        if not isinstance(sizes, list):
            return values
        counts = len(sizes) == 2 and all(type(n) is int and n >= 1 for n in sizes)
        if not counts or "min_workers" in values:
            refuse_value(
                "ray",
                "num_workers",
                f"ray.num_workers must be a number of workers or [min, max] (two whole numbers >= 1), got {sizes!r}"
                + ("; with ray.min_workers given, give num_workers as the maximum alone" if counts else ""),
            )
        return {**values, "min_workers": sizes[0], "num_workers": sizes[1]}

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers < self.num_workers

    @property
    def fewest_workers(self) -> int:
        """The smallest group the run starts or goes on with: what a cluster must place."""
        return self.min_workers if self.min_workers is not None and self.elastic else self.num_workers

    def sizes(self) -> list[int]:
        """The group sizes the run may take: whole nodes, from min_workers (else num_workers) to num_workers."""
        low = self.min_workers if self.min_workers is not None else self.num_workers
        return [n for n in range(max(low, 1), self.num_workers + 1) if n % self.workers_per_node == 0]

    @property
    def nodes(self) -> int:
        return self.num_workers // self.workers_per_node

    def ray_placement_strategy(self) -> str:
        """The placement group's strategy. Several workers a node: STRICT_SPREAD (one node each) becomes PACK, which
        fills a node before the next; a bundle holds one worker's resources, so a node whose resources hold exactly
        `workers_per_node` of them (a GPU each on nodes of that many GPUs) gets exactly that many. The workers check
        the outcome at set-up (`rayft.parallel.topology`), as Ray offers no strategy that counts workers per node."""
        if self.workers_per_node > 1 and self.placement_strategy == "STRICT_SPREAD":
            return "PACK"
        return self.placement_strategy

    def cluster_address(self) -> str | None:
        """The cluster a run joins: `address`, else the one `ray job submit` runs it in (RAY_ADDRESS); None where
        it starts a local one."""
        return self.address or os.environ.get("RAY_ADDRESS") or None

    def broken(self) -> list[Broken | None]:
        per_node, low, high = self.workers_per_node, self.min_workers, self.num_workers
        return [
            broken(
                f"ray.num_workers {high} must be nodes × ray.workers_per_node {per_node}; set ray.num_workers to a "
                f"multiple of {per_node}",
                "num_workers",
                "workers_per_node",
            )
            if high % per_node
            else None,
            broken(
                f"ray.placement_strategy {self.placement_strategy} cannot keep ray.workers_per_node {per_node} "
                f"workers on each of {self.nodes} nodes; use STRICT_SPREAD (the default) or PACK",
                "placement_strategy",
                "workers_per_node",
            )
            if per_node > 1 and self.placement_strategy in ("SPREAD", "STRICT_PACK") and self.nodes > 1
            else None,
            broken(
                f"ray.name must be one directory name inside the storage path, got {self.name!r}: no '/' or '\\', "
                "not '.' or '..' (the run's checkpoints and records would land beside other runs'); e.g. "
                f"{one_name(self.name)!r}",
                "name",
            )
            if one_name(self.name) != self.name
            else None,
            broken(
                f"ray.resources_per_worker.GPU must be a whole number, got {gpus}: each worker is one NCCL rank with a "
                "GPU of its own (two ranks on one GPU fail when the process group starts); set it to 1",
                "resources_per_worker.GPU",
            )
            if (gpus := (self.resources_per_worker or {}).get("GPU")) is not None and not gpus.is_integer()
            else None,
            broken(f"ray.num_workers [{low}, {high}]: the minimum exceeds the maximum", "num_workers", "min_workers")
            if low is not None and low > high
            else None,
            broken(
                f"ray.num_workers [{low}, {high}]: the minimum must be whole nodes of ray.workers_per_node "
                f"{per_node} workers; set it to a multiple of {per_node}",
                "num_workers",
                "min_workers",
            )
            if low is not None and low <= high and low % per_node
            else None,
        ]


def one_name(name: str) -> str:
    """`name` made one directory name: its parts (split at either platform's separator) joined by `-`, without the parts
    of dots alone (`.`, `..`); `run` where nothing is left."""
    joined = "-".join(part for part in name.replace("\\", "/").split("/") if part.strip("."))
    return joined or "run"


def expert_groups_follow_nodes(k: int, workers_per_node: int) -> bool:
    """Whether groups of k consecutive node-ordered workers keep to node boundaries."""
    return workers_per_node % k == 0 or k % workers_per_node == 0


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class ParallelConfig(Section):
    section: ClassVar[str] = "parallel"
    # Expert parallelism: the routed experts of every MoE layer split over groups of k workers, each holding E/k
    # experts whole (frozen, never gathered); tokens travel to their experts by all-to-all. 1 = FSDP only.
    expert_parallel: Count | Annotated[str, Strict()] = 1  # `auto` or k (a number is no word: 2.5 is refused)
    # Context parallelism: each packed row split over N workers, attention exchanged over heads (Ulysses,
    # `rayft.parallel.context`); the data is split over num_workers / N data-parallel ranks. 1 = off.
    context_parallel: Count = 1

    def expert_groups(self) -> int:
        """k as an integer (the rules have refused anything else; `auto` is preflight's to decide)."""
        if self.expert_parallel == "auto":
            raise RuntimeError("parallel.expert_parallel: auto is decided by preflight (rayft.decisions)")
        return int(self.expert_parallel)

    def broken(self) -> list[Broken | None]:
        k = self.expert_parallel
        return [
            broken(
                f"parallel.expert_parallel: {k!r} is neither an integer k nor auto (the planner's choice, "
                "`rayft plan`); give a k that divides ray.num_workers and the routed experts",
                "expert_parallel",
            )
            if isinstance(k, str) and k != "auto"
            else None
        ]


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class NcclConfig(Section):
    """The config's `nccl` section: NCCL's fabric settings, given to every training worker on a GPU cluster through
    Ray's runtime environment (so they reach workers on any Ray cluster, not only pods rendered by `rayft k8s
    render`). None leaves a variable to the pod's environment or NCCL's own detection."""

    section: ClassVar[str] = "nccl"

    # NCCL_IB_HCA: '=mlx5_0,mlx5_1' names exact adapters (':1' a port); a bare 'mlx5' is a prefix match that
    # also takes Ethernet/RoCE ports of the same driver.
    ib_hca: Text | None = None
    # NCCL_IB_GID_INDEX: RoCE fabrics need the GID of the RoCE v2 address (commonly 3); InfiniBand needs none.
    ib_gid_index: Annotated[Integer, Ge(0)] | None = None
    # NCCL_SOCKET_IFNAME: the interface for NCCL's bootstrap and socket fallback (e.g. net1, ^lo,docker).
    socket_ifname: Text | None = None
    # NCCL_DEBUG: WARN reports problems only; INFO prints per-rank set-up lines (which transport, NET/IB or
    # NET/Socket) and is worth it only while a fabric is being brought up.
    debug: Literal["VERSION", "WARN", "INFO", "TRACE"] = "WARN"
    # NCCL_DEBUG_SUBSYS with debug INFO, e.g. INIT,NET.
    debug_subsys: Text | None = None
    # Any other NCCL_* variable, e.g. NCCL_IB_QPS_PER_CONNECTION: "1".
    env: Keyed[Text] = field(default_factory=dict)

    def broken(self) -> list[Broken | None]:
        return [
            broken(f"nccl.env: '{name}' is not an NCCL variable (names start with NCCL_)", f"env.{name}")
            for name in self.env
            if not name.startswith("NCCL_")
        ]


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "lora": LoraConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "fsdp": FsdpConfig,
    "ray": RayConfig,
    "parallel": ParallelConfig,
    "dpo": DpoConfig,
    "nccl": NcclConfig,
    "k8s": K8sConfig,
}


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class Config(Section):
    """The run's settings, one section a key; its own rules relate one section to another."""

    section: ClassVar[str] = "config"

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    nccl: NcclConfig = field(default_factory=NcclConfig)

    k8s: K8sConfig = field(default_factory=K8sConfig)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any] | None, source: str | None = "config", where: dict[str, str] | None = None
    ) -> Config:
        """The checked config; every problem of `raw` (unknown keys, wrong types, bad values, broken rules) in one
        ConfigError. A key that cannot be read keeps its default, so the checks of the others still run."""
        raw = raw or {}
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{source or 'config'}: expected a mapping of sections ({', '.join(SECTIONS)}), got {raw!r}"
            )
        sections: dict[str, Any] = {}
        problems: list[Problem] = []
        for name, values in raw.items():
            section_type = SECTIONS.get(name)
            if section_type is None:
                problems.append(Problem(str(name), f"unknown section '{name}'{_section_hint(str(name))}"))
                continue
            sections[name], found = read_section(name, section_type, values)
            problems += found
        cfg, found = combined(cls, sections, raw)
        problems += found
        if problems:
            raise problems_error(source, problems, where)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def checkpointing(self) -> Checkpointing:
        """Activation checkpointing as asked, in FSDP's section or as the HF trainer's `gradient_checkpointing`
        (true: full, unless FSDP's section asks for selective)."""
        asked = self.fsdp.checkpointing()
        return "full" if self.train.gradient_checkpointing and asked in ("auto", "none") else asked

    def checkpoint_every(self) -> int | None:
        """Every n-th decoder layer recomputed in backward (1: every layer), None: none. `auto` is decided on the
        driver from the memory plan of the job's GPU (`rayft.plan.recompute`), handed to the workers beside the
        config (`rayft.decisions`); where nothing decided it (a model built outside a job, a GPU the planner does
        not know) it keeps what rayft did before it chose: none, or
        every layer with expert LoRA (a bf16 base's experts keep W + BA of every layer for backward)."""
        mode = self.checkpointing
        if mode == "auto":
            return 1 if self.lora.target_experts else None
        if mode == "selective":
            return self.fsdp.checkpoint_every_n_layers or 2
        return 1 if mode == "full" else None

    @property
    def recomputes_activations(self) -> bool:
        """Whether any decoder layer is recomputed in backward (`checkpoint_every`)."""
        return self.checkpoint_every() is not None

    @property
    def storage_path(self) -> str:
        """Absolute local path (a shared volume on a cluster) or a pyarrow URI such as s3://bucket/runs."""
        path = self.ray.storage_path or self.train.output_dir
        if is_uri(path):
            return path
        return str(Path(path).expanduser().resolve())

    def relative_paths(self) -> list[str]:
        """`train.output_dir` and `ray.storage_path` given as relative paths, each with the directory it resolves
        to: the working directory of the driver, which under `ray job submit --working-dir` is Ray's temporary copy
        of that directory, not the directory the job was submitted from."""
        return [
            f"{key} {value!r} is relative: it resolves against the working directory, to "
            f"{Path(value).expanduser().resolve()}; under `ray job submit --working-dir` that is Ray's temporary copy, "
            "gone with the job: give an absolute path (a shared volume)"
            for key, value in (("train.output_dir", self.train.output_dir), ("ray.storage_path", self.ray.storage_path))
            if value and not is_uri(value) and not Path(value).expanduser().is_absolute()
        ]

    @property
    def trackers(self) -> list[str]:
        return [name for name in self.train.report_to or [] if name != "none"]

    @property
    def run_uri(self) -> str:
        return f"{self.storage_path.rstrip('/')}/{self.ray.name}"

    @property
    def best_metric(self) -> tuple[str, str] | None:
        return self.train.best_metric

    def broken(self) -> list[Broken | None]:
        """The rules that relate one section to another (a section's own are its `broken`)."""
        rules = (
            self._lora_broken,
            self._dpo_broken,
            self._layout_broken,
            self._expert_broken,
            self._elastic_broken,
            self._context_broken,
            self._vision_broken,
        )
        return [found for rule in rules for found in rule()]

    def _lora_broken(self) -> list[Broken | None]:
        lo, frozen, k = self.lora, self.model.frozen_dtype, self.parallel.expert_parallel
        return [
            broken(DORA_ON_FP8, "lora.use_dora", "model.frozen_dtype")
            if lo.use_dora and frozen == "float8_e4m3fn"
            else None,
            broken(
                f"model.frozen_dtype nf4 cannot be combined with parallel.expert_parallel {k}: NF4 experts are sharded "
                "by FSDP over all workers; set parallel.expert_parallel: 1 or model.frozen_dtype: auto (FP8)",
                "model.frozen_dtype",
                "parallel.expert_parallel",
            )
            if frozen == "nf4" and k != 1
            else None,
            broken(
                "lora.use_dora: true needs the frozen weights in bf16/fp32 (DoRA's magnitude is the norm of each row "
                "of W + BA), not model.frozen_dtype nf4; set model.frozen_dtype: bfloat16 or lora.use_dora: false",
                "lora.use_dora",
                "model.frozen_dtype",
            )
            if lo.use_dora and frozen == "nf4"
            else None,
            broken(
                f"lora.modules_to_save {lo.modules_to_save} cannot be combined with parallel.expert_parallel {k}: the "
                "expert-parallel adapter gathering handles LoRA factors only; set parallel.expert_parallel: 1 or "
                "remove lora.modules_to_save",
                "lora.modules_to_save",
                "parallel.expert_parallel",
            )
            if lo.modules_to_save and k != 1
            else None,
        ]

    def _dpo_broken(self) -> list[Broken | None]:
        """The data settings preference pairs cannot use."""
        d = self.data
        if self.train.objective != "dpo":
            return []
        return [
            broken(
                "data.packing: true cannot hold preference pairs (train.objective: dpo); set it false",
                "data.packing",
                "train.objective",
            )
            if d.packing
            else None,
            broken(
                f"train.objective: dpo trains on preference records; data.format is {d.format}",
                "train.objective",
                "data.format",
            )
            if d.format not in ("auto", "preference")
            else None,
            broken(
                "data.prompt_template is for SFT records; preference records carry their own prompt",
                "data.prompt_template",
                "train.objective",
            )
            if d.prompt_template is not None
            else None,
        ]

    def _layout_broken(self) -> list[Broken | None]:
        """Shard groups against the workers, and what a run on CPUs computes in."""
        f, r = self.fsdp, self.ray
        return [
            broken(
                f"fsdp.shard_size {f.shard_size} must divide ray.num_workers {r.num_workers} (groups of shard_size "
                "workers each hold one full copy of the model)",
                "fsdp.shard_size",
                "ray.num_workers",
            )
            if f.shard_size is not None and r.num_workers % f.shard_size
            else None,
            cpu_precision_problem(f) if r.use_gpu is False else None,
        ]

    def _expert_broken(self) -> list[Broken | None]:
        """Expert-parallel groups against the workers, and what EP cannot combine with (the experts' count is checked
        where the model's config is read: `rayft.parallel.expert.check_experts`)."""
        f, r, k = self.fsdp, self.ray, self.parallel.expert_parallel
        if isinstance(k, str) or k == 1:
            return []  # `auto` is resolved by preflight, where the model's structure is known
        workers, per_node = r.num_workers, r.workers_per_node
        valid = [d for d in range(1, workers + 1) if workers % d == 0 and expert_groups_follow_nodes(d, per_node)]
        return [
            broken(
                f"parallel.expert_parallel {k} must divide ray.num_workers {workers}; valid: "
                f"{[d for d in range(1, workers + 1) if workers % d == 0]}",
                "parallel.expert_parallel",
                "ray.num_workers",
            )
            if workers % k
            else broken(
                f"parallel.expert_parallel {k} with ray.workers_per_node {per_node}: each expert-parallel group must "
                f"lie within a node (k divides the node's workers) or span whole nodes (they divide k), or its "
                f"all-to-all straddles the network; valid: {valid}",
                "parallel.expert_parallel",
                "ray.workers_per_node",
            )
            if not expert_groups_follow_nodes(k, per_node)
            else None,
            broken(
                "fsdp.shard_size cannot be combined with parallel.expert_parallel > 1 (the non-expert part is then "
                "sharded within each node, over its ray.workers_per_node workers); remove fsdp.shard_size",
                "fsdp.shard_size",
                "parallel.expert_parallel",
            )
            if f.shard_size is not None
            else None,
            broken(
                "parallel.expert_parallel > 1 needs model.load_mode: sharded (each worker reads only its own experts)",
                "parallel.expert_parallel",
                "model.load_mode",
            )
            if self.model.load_mode != "sharded"
            else None,
            broken(
                "fsdp.cpu_offload: true cannot be combined with parallel.expert_parallel > 1: the routed experts are "
                "not FSDP's, so they would stay in host memory while their tokens are on the GPU; set "
                "fsdp.cpu_offload: false or parallel.expert_parallel: 1",
                "fsdp.cpu_offload",
                "parallel.expert_parallel",
            )
            if f.cpu_offload
            else None,
        ]

    def _vision_broken(self) -> list[Broken | None]:
        """What the whole vision-language model (`model.vision: true`) is not yet combined with: expert and context
        parallelism cut the language model alone."""
        p = self.parallel
        not_yet = [
            name
            for name, on in (
                (f"parallel.expert_parallel {p.expert_parallel}", p.expert_parallel != 1),
                (f"parallel.context_parallel {p.context_parallel}", p.context_parallel > 1),
            )
            if on
        ]
        if self.model.vision is not True or not not_yet:
            return []
        return [
            broken(
                f"model.vision: true cannot yet be combined with {', '.join(not_yet)}; set model.vision: false (the "
                "language model alone) or leave them at 1",
                "model.vision",
                *(name.split()[0] for name in not_yet),
            )
        ]

    def _context_broken(self) -> list[Broken | None]:
        """What context parallelism needs, and what it is not yet combined with (the heads' count is checked where
        the model's config is read, in preflight: `rayft.parallel.context.check_heads`). Expert parallelism combines:
        the experts act per token, so their all-to-all takes whatever tokens a rank holds (`rayft.parallel.expert`)."""
        n, workers = self.parallel.context_parallel, self.ray.num_workers
        if n == 1:
            return []
        key = "parallel.context_parallel"
        attention = self.model.attn_implementation
        not_yet = [
            ("train.objective: dpo", self.train.objective == "dpo"),
            ("ray.min_workers (elastic)", self.ray.elastic),
            ("fsdp.shard_size", self.fsdp.shard_size is not None),
        ]
        combined = [name for name, on in not_yet if on]
        return [
            broken(
                f"{key} {n} must divide ray.num_workers {workers}; valid: "
                f"{[d for d in range(1, workers + 1) if workers % d == 0]}",
                key,
                "ray.num_workers",
            )
            if workers % n
            else None,
            broken(f"{key} > 1 splits packed rows; set data.packing: true", key, "data.packing")
            if not self.data.packing
            else None,
            broken(
                f"{key} > 1 runs sdpa or eager attention on the whole sequence; model.attn_implementation is "
                f"{attention}: set sdpa, eager or null",
                key,
                "model.attn_implementation",
            )
            if attention not in (None, "sdpa", "eager")
            else None,
            broken(
                f"{key} > 1 is not yet combined with {', '.join(combined)}; set {key}: 1 or leave those out",
                key,
            )
            if combined
            else None,
        ]

    def _elastic_broken(self) -> list[Broken | None]:
        """Every size an elastic run may take keeps the global batch (a whole number of micro-batches per worker)
        and the layout (expert-parallel groups, shard groups); refused up front, not when a node is lost."""
        r, t, k = self.ray, self.train, self.parallel.expert_parallel
        if not r.elastic:
            return []
        auto = broken(
            "parallel.expert_parallel: auto sizes the expert groups for one group size; an elastic run "
            "(ray.num_workers [min, max]) needs a number dividing every size it may take",
            "parallel.expert_parallel",
            "ray.num_workers",
        )
        groups = k if isinstance(k, int) else 1
        global_micro = t.gradient_accumulation_steps * r.num_workers
        broken_at: dict[int, str] = {}
        for n in r.sizes():
            if global_micro % n:
                broken_at[n] = f"the {global_micro} micro-batches of a step do not split over {n} workers"
            elif groups > 1 and (n % groups or not expert_groups_follow_nodes(groups, r.workers_per_node)):
                broken_at[n] = f"parallel.expert_parallel {groups} does not divide {n} workers"
            elif self.fsdp.shard_size and n % self.fsdp.shard_size:
                broken_at[n] = f"fsdp.shard_size {self.fsdp.shard_size} does not divide {n} workers"
        if not broken_at:
            return [auto if k == "auto" else None]
        step = math.lcm(*(n // math.gcd(n, r.num_workers) for n in r.sizes()))
        rows = global_micro * t.per_device_train_batch_size
        return [
            auto if k == "auto" else None,
            broken(
                f"ray.num_workers [{r.min_workers}, {r.num_workers}]: an elastic run keeps the global batch of "
                f"{rows} rows ({t.per_device_train_batch_size} per device × {t.gradient_accumulation_steps} "
                f"accumulation × {r.num_workers} workers) at every size it may take, and here "
                + "; ".join(f"at {n}: {why}" for n, why in broken_at.items())
                + f". Narrow the range, or make train.gradient_accumulation_steps a multiple of {step}"
                + (
                    " (and keep the expert/shard groups dividing every size)"
                    if groups > 1 or self.fsdp.shard_size
                    else ""
                ),
                "ray.num_workers",
                "ray.min_workers",
                "train.gradient_accumulation_steps",
            ),
        ]


def key_owners(sections: tuple[str, ...] = tuple(SECTIONS)) -> dict[str, str]:
    """Key name → `section.key`, for the names only one of `sections` has: where a key written without its section
    (a flat TRL file's) belongs."""
    owners: dict[str, list[str]] = {}
    for section in sections:
        for f in dataclasses.fields(SECTIONS[section]):
            owners.setdefault(f.name, []).append(f"{section}.{f.name}")
    return {name: places[0] for name, places in owners.items() if len(places) == 1}


def _section_hint(name: str) -> str:
    """What an unknown top-level name means: a TRL name, a key written without its section, or a misspelt section."""
    owner = key_owners().get(name)
    if owner is not None:
        return f" (it is {owner}: write it under the section '{owner.split('.')[0]}')"
    return trl_hint(name) or suggest(name, SECTIONS)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML file (None = all defaults) and apply `section.key=value` overrides on top. `env:NAME` reads
    the YAML from an environment variable: how a RayJob carries the config inline (`k8s.config_delivery`)."""
    raw: dict[str, Any] = {}
    where: dict[str, str] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        raw, where = read_yaml(path)
        if raw is None:
            raise ConfigError(
                f"{path}: the file is empty (no sections); write the sections to change "
                f"({', '.join(SECTIONS)}), or leave out --config for the built-in demo"
            )
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections ({', '.join(SECTIONS)})")
        _refuse_accelerate(raw, source)
        _refuse_flat(raw, source)
    for item in overrides:
        keys, value = parse_override(item)
        set_nested(raw, keys, value, source)
        where[".".join(keys)] = "--override"
    return Config.from_dict(raw, source if path is not None else None, where)  # defaults: the key alone


ACCELERATE_KEYS = ("compute_environment", "distributed_type", "fsdp_config", "num_processes", "mixed_precision")


def _refuse_accelerate(raw: dict[str, Any], source: str) -> None:
    """An accelerate launch config passed as a rayft config: name the command that converts it."""
    found = [k for k in ACCELERATE_KEYS if k in raw]
    if found:
        raise ConfigError(
            f"{source}: this is an accelerate config ({', '.join(found)}), not a rayft one; convert it with "
            f"`rayft config from-accelerate {source} [--trl sft.yaml] --out rayft.yaml` and pass --config rayft.yaml"
        )


def _refuse_flat(raw: dict[str, Any], source: str) -> None:
    """A flat TRL file (SFTConfig's keys at the top level, as `trl sft --config` reads them) passed as a rayft config:
    say so once, and name the command that converts it, rather than one `unknown section` a key."""
    if any(key in SECTIONS for key in raw):
        return
    owners = key_owners()
    flat = [str(key) for key in raw if str(key) in owners or str(key) in TRL_NAMES]
    if flat:
        raise ConfigError(
            f"{source}: keys at the top level ({', '.join(flat[:4])}{', ...' if len(flat) > 4 else ''}) make this a "
            f"flat TRL/SFTConfig file, not a rayft config (sections {', '.join(SECTIONS)}); convert it with `rayft "
            f"config from-accelerate ACCELERATE.yaml --trl {source} --out rayft.yaml` (ACCELERATE.yaml: the "
            "accelerate config the recipe was launched with) and pass --config rayft.yaml"
        )


def _read_text(path: str | Path) -> str:
    source = str(path)
    try:
        if source.startswith("env:"):
            if source[4:] not in os.environ:
                raise ConfigError(f"--config {source}: environment variable {source[4:]} is not set")
            return os.environ[source[4:]]
        return Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None


def read_yaml(path: str | Path) -> tuple[Any, dict[str, str]]:
    """A YAML file's data, and where each of its keys is written (dotted key → `path:line`), for messages."""
    loader = UniqueKeyLoader(_read_text(path))
    loader.name = str(path)  # PyYAML's own messages then say `in "<path>"`, not `in "<unicode string>"`
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.MarkedYAMLError as e:
        line = f":{e.problem_mark.line + 1}" if e.problem_mark is not None else ""
        raise ConfigError(f"{path}{line}: not valid YAML: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    finally:
        loader.dispose()
    return data, _key_lines(node, str(path))


def _key_lines(node: yaml.Node | None, path: str, prefix: str = "") -> dict[str, str]:
    lines: dict[str, str] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = f"{prefix}{key_node.value}"
                lines[key] = f"{path}:{key_node.start_mark.line + 1}"
                lines.update(_key_lines(value_node, path, f"{key}."))
    return lines


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error: PyYAML keeps the last
    value silently, so a second `train:` section would quietly replace the first one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: keys it brings may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not None:
                where = f"lines {first} and {line}" if first != line else f"line {line}"
                raise ConfigError(f"key '{key}' appears twice in one mapping ({where}); keep one of them")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`section.key[.subkey...]=value` → the key path and the value parsed as YAML."""
    dotted, sep, text = item.partition("=")
    keys = dotted.strip().split(".")
    if not sep or len(keys) < 2 or not all(keys):
        raise ConfigError(f"--override '{item}': expected section.key=value, e.g. train.learning_rate=2e-4")
    if keys[0] not in SECTIONS:
        raise ConfigError(f"--override '{item}': unknown section '{keys[0]}'{suggest(keys[0], SECTIONS)}")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--override '{item}': value is not valid YAML: {e}") from None
    return keys, value


def set_nested(raw: dict[str, Any], keys: list[str], value: Any, source: str) -> None:
    """raw[k0][k1]...[kn] = value, making the mappings on the way (`ray.resources_per_worker.GPU=1`)."""
    node = raw
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(
                f"{source}: {'section' if depth == 0 else 'key'} '{'.'.join(keys[: depth + 1])}' must be a mapping "
                f"to override '{'.'.join(keys)}' (it is {child!r})"
            )
        node = child
    node[keys[-1]] = value
