"""Typed run configuration: YAML + `--override section.key=value`, checked before anything expensive starts.

Field names and defaults of `model`, `lora`, `data` and `train` follow the seed recipe's dataclasses and YAML so
users' existing files load unchanged; `fsdp` and `ray` are rayft's own. Every user mistake becomes a
`ConfigError` that names the key (and the closest valid key for typos) instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import string
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

import pydantic.dataclasses
import yaml
from pydantic import BeforeValidator, ConfigDict, Strict, ValidationError
from pydantic_core import ErrorDetails


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


class ConfigError(ValueError):
    """A mistake in the user's configuration or paths; the message is meant to be shown as is."""


@dataclass(frozen=True)
class Problem:
    key: str  # dotted, `train.learning_rate`: where the file sets it is looked up by this
    message: str


_PROBLEMS: ContextVar[list[Problem] | None] = ContextVar("rayft_config_problems", default=None)
_LEADING_KEY = re.compile(r"(?:unknown key ')?([A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*)")


def _problem(message: str, key: str | None = None) -> bool:
    """One mistake in a config: recorded while `gather_problems` collects a file's problems (so the user fixes
    them all in one round), raised as a ConfigError elsewhere. False, for `ok or _problem(...)`."""
    found = _PROBLEMS.get()
    if found is None:
        raise ConfigError(message)
    if key is None:  # every message starts with its key ("train.learning_rate must be > 0, ...")
        match = _LEADING_KEY.match(message)
        key = match.group(1) if match else ""
    found.append(Problem(key, message))
    return False


@contextmanager
def gather_problems(source: str, where: dict[str, str] | None = None) -> Iterator[None]:
    """Collect the problems `_problem` reports in the block; at its end raise one ConfigError listing them all,
    each with the file and line (`where`: dotted key → `path:line`, or `--override`) that sets its key."""
    found: list[Problem] = []
    token = _PROBLEMS.set(found)
    try:
        yield
    finally:
        _PROBLEMS.reset(token)
    if found:
        located = [f"{_location(p.key, source, where or {})}{p.message}" for p in found]
        if len(located) == 1:
            raise ConfigError(located[0])
        raise ConfigError(f"{source}: {len(found)} problems:\n" + "\n".join(f"  - {line}" for line in located))


def _location(key: str, source: str, where: dict[str, str]) -> str:
    """`path:line: ` of the key, or of the closest section above it that the file names; else the source."""
    parts = re.sub(r"\[\d+\]", "", key).split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in where:
            return f"{where['.'.join(parts[:n])]}: "
    return "" if source == "defaults" else f"{source}: "


# The sections are pydantic dataclasses: pydantic reads a YAML mapping into one, and reports every key it cannot read
# (`_section` turns its errors into rayft's problems). `dataclasses.fields/asdict/replace` work on them as on any
# dataclass. Unknown keys are errors; instances stay mutable, and assignment is not validated, as before.
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
# rayft refuses; each BeforeValidator admits one lenient form that YAML produces.
Flag = Annotated[bool, Strict()]
Integer = Annotated[int, Strict(), BeforeValidator(_integral)]
Number = Annotated[float, Strict(), BeforeValidator(_parsed_number)]
Text = Annotated[str, Strict(), BeforeValidator(_number_as_text)]
Strategy = Annotated[str, Strict(), BeforeValidator(_number_as_text), BeforeValidator(_unquoted_no)]
_T = TypeVar("_T")
Listed = Annotated[list[_T], Strict(), BeforeValidator(_one_as_list)]
Keyed = Annotated[dict[str, _T], BeforeValidator(_keys_as_text)]


SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)
# transformers' `optim` names that run here (rayft/train/schedule.py builds them; the state is the LoRA params').
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop")
# bitsandbytes' optimizers: their 8-bit/paged states are not built for FSDP2's sharded (DTensor) parameters.
BNB_OPTIMIZERS = ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "paged_adamw",
                  "lion_8bit", "lion_32bit", "paged_lion_8bit", "paged_lion_32bit")  # fmt: skip
STRATEGIES = ("no", "steps", "epoch")
DTYPES = ("float32", "bfloat16", "float16")
DATA_FORMATS = ("auto", "text", "prompt_completion", "messages", "preference")
OBJECTIVES = ("sft", "dpo")
DPO_LOSSES = ("sigmoid", "robust", "ipo")
DPO_REFERENCES = ("adapter_off", "precomputed")
PLACEMENT_STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")
# What evaluation reports, so what checkpoints can be ranked by.
BEST_METRICS = ("eval_loss",)


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class ModelConfig:
    # A local directory, or a hub id (`org/name`) resolved through the Hugging Face cache (HF_HOME; rayft/hub.py).
    model_name_or_path: Text = "/data/input/Models/Mistral-Small-4-119B-2603"
    # Branch, tag or commit of a hub model; null = main.
    revision: Text | None = None
    torch_dtype: Text = "bfloat16"
    # Accepted for seed compatibility only: FSDP decides placement, so "auto" device maps are ignored.
    device_map: Text | None = "auto"
    use_cache: Flag = False
    attn_implementation: Text | None = None
    # Where the tokenizer lives when it is not next to the weights.
    tokenizer_name_or_path: Text | None = None
    # sharded: each rank reads only its own FSDP shards from the safetensors files (no rank holds the model);
    # full: every rank loads the whole model with from_pretrained, then shards it (needs host RAM for all of it).
    load_mode: Text = "sharded"
    # Storage of the frozen decoder matrices (linears, routed experts): auto = FP8 (E4M3 + row scales) when the
    # checkpoint is FP8, else torch_dtype; float8_e4m3fn also quantises a bf16/fp32 checkpoint at load (per row);
    # nf4 = QLoRA's 4-bit NormalFloat with double-quantised scales for the decoder's linears.
    frozen_dtype: Text = "auto"


DORA_ON_FP8 = (
    "lora.use_dora: true needs the frozen weights in bf16/fp32: DoRA's magnitude is the norm of each row of W + BA, "
    "which FP8 storage (model.frozen_dtype float8_e4m3fn, or auto on an FP8 checkpoint) does not give; set "
    "model.frozen_dtype: bfloat16 or lora.use_dora: false"
)


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class LoraConfig:
    r: Integer = 16
    lora_alpha: Integer = 32
    lora_dropout: Number = 0.05
    # "auto" = the right set for the architecture (see rayft.lora.AUTO_TARGETS); "all-linear" = every linear layer
    # but the LM head (PEFT's shorthand); else module names.
    target_modules: Listed[Text] = field(default_factory=lambda: ["auto"])
    bias: Text = "none"
    task_type: Text = "CAUSAL_LM"
    # Also adapt the routed experts (fused 3D parameters, via PEFT target_parameters): one LoRA per expert.
    target_experts: Flag = False
    # PEFT's options of the same names: DoRA (a trained magnitude per output row), rank-stabilised scaling
    # (lora_alpha / sqrt(r)), and modules trained in full beside the adapter (e.g. [lm_head, embed_tokens]).
    use_dora: Flag = False
    use_rslora: Flag = False
    modules_to_save: Listed[Text] | None = None


DEFAULT_VAL_SPLIT = "validation"


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class DataConfig:
    # A local file, directory or glob, or a hub dataset id (`org/name`) resolved through the Hugging Face cache.
    dataset_name_or_path: Text = "/data/input/Datasets/wikitext"
    # Branch, tag or commit of a hub dataset; null = main.
    revision: Text | None = None
    dataset_config_name: Text | None = "wikitext-2-raw-v1"
    text_field: Text = "text"
    train_split: Text = "train"
    # The split evaluated; where the dataset lacks the default, `validation`, and has `test` (TRL's default), that.
    val_split: Text | None = DEFAULT_VAL_SPLIT
    max_length: Integer = 1024
    # Instruction data: a str.format template over the record's fields that renders the prompt, e.g.
    # "### Question:\n{question}\n\n### Answer:\n"; the completion comes from `completion_field`.
    prompt_template: Text | None = None
    completion_field: Text = "completion"
    # Chat records: a list of {role, content} messages rendered with the tokenizer's chat template.
    messages_field: Text = "messages"
    # auto: prompt_template → template; a messages column → chat; prompt + completion columns → prompt/completion;
    # otherwise plain text from text_field.
    format: Text = "auto"
    # Loss only on completion / assistant tokens (null = true for instruction and chat data).
    completion_only_loss: Flag | None = None
    # Concatenate examples and cut max_length blocks; positions restart per document (padding-free batches).
    packing: Flag = False
    # Padded (unpacked) batches: the length rounded up to a multiple of this (at most max_length), so kernels see a
    # few shapes rather than one per batch (CPU bf16 matmuls compile a kernel for every new shape).
    pad_to_multiple_of: Integer = 64
    # Wikitext stores one paragraph per record: join each article's lines (split at ` = Title = ` headings).
    join_wikitext_articles: Flag = False
    # Keep the tokenized training split in Ray's object store (spilling to disk if needed) instead of re-reading
    # and re-tokenizing it every epoch; null = when the source is at most 2 GiB.
    cache_tokenized: Flag | None = None
    # Records that cannot become an example (missing field, not text, not UTF-8, bad JSON): skip and count them,
    # or stop before training with the counts.
    bad_records: Text = "skip"
    # Examples longer than max_length without packing: truncate or skip them (counted either way).
    overlong: Text = "truncate"
    # Before any cluster resource, the job (and `rayft validate`) runs its record pipeline over the first 1,000
    # records of each split. A split where more than this share would be skipped is refused; fewer are a warning.
    max_skipped_share: Number = 0.5
    # Likewise for records that would train on nothing: a chat whose assistant replies are all empty, a preference
    # pair whose chosen and rejected tokenize alike. Any is a warning with the count; more than this share refused.
    max_no_signal_share: Number = 0.1
    # Share of the training records held out for evaluation when there is no validation split. null = 0.05 where
    # the dataset has no named splits (a single file, a glob); where it has named splits, a `val_split` it lacks
    # is an error unless this is set (a typo must not silently hold out training data).
    val_ratio: Number | None = None
    # Evaluate on the first N validation rows only (after tokenization and packing), as transformers' example
    # scripts' max_eval_samples: quicker evaluations while iterating on a config. null = the whole split.
    max_eval_samples: Integer | None = None
    # Ray Data actors that tokenize in parallel with training (each holds one tokenizer).
    tokenize_workers: Integer = 2
    # Rows each worker shuffles locally while streaming; 0 keeps the read order.
    shuffle_buffer_size: Integer = 1000

    @property
    def hold_out(self) -> float:
        """The share of training records held out when there is no validation split."""
        return DEFAULT_VAL_RATIO if self.val_ratio is None else self.val_ratio


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class TrainConfig:
    output_dir: Text = "/data/output/Models/mistral4small-lora-fsdp"
    num_train_epochs: Integer = 1
    # Stops after this many optimizer steps when > 0, whatever num_train_epochs says.
    max_steps: Integer = -1
    per_device_train_batch_size: Integer = 1
    per_device_eval_batch_size: Integer = 1
    gradient_accumulation_steps: Integer = 16
    gradient_checkpointing: Flag = False
    optim: Text = "adamw_torch"
    learning_rate: Number = 1e-4
    lr_scheduler_type: Text = "cosine"
    warmup_ratio: Number = 0.05
    # Takes precedence over warmup_ratio when > 0 (the newer transformers spelling).
    warmup_steps: Integer = 0
    weight_decay: Number = 0.01
    max_grad_norm: Number = 1.0
    # Dense peak of one worker's device in TFLOP/s, for MFU where rayft does not know it (another GPU, a CPU);
    # None = rayft's table of GPUs (H100/H200/B200...). Overrides the table when set.
    peak_tflops: Number | None = None
    # Loss straight from the hidden states, chunk by chunk, never the full logits (see rayft/loss.py).
    fused_loss: Flag = True
    # GPU: FSDP2 computes in bf16 (fp32 gradients reduced). CPU: bf16 autocast where the CPU has bf16 instructions.
    bf16: Flag = True
    fp16: Flag = False
    logging_steps: Integer = 25
    eval_strategy: Strategy = "steps"
    eval_steps: Integer = 200
    save_strategy: Strategy = "steps"
    save_steps: Integer = 200
    # Checkpoints Ray keeps on the storage path (the best by metric_for_best_model plus the latest).
    save_total_limit: Integer | None = 3
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
    resume: Text = "auto"
    # Experiment trackers besides Ray's own metrics: none | tensorboard (output_dir/runs/<ray.name>) | mlflow |
    # wandb (output_dir/wandb; WANDB_PROJECT, WANDB_MODE=offline as wandb reads them).
    report_to: Listed[Text] | None = None
    # records.jsonl in the run directory: per optimizer step, a fingerprint of each sequence it trained on (an audit
    # of the data behind the adapter; one small gather a step while on).
    record_ledger: Flag = False
    seed: Integer = 42
    # Accepted for seed compatibility; FSDP2 has no unused-parameter search.
    ddp_find_unused_parameters: Flag = False
    # sft: next-token loss on the records; dpo: preference tuning on chosen/rejected pairs (the `dpo` section).
    objective: Text = "sft"


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class DpoConfig:
    """Preference tuning (`train.objective: dpo`), names and meanings as TRL's DPOConfig."""

    # Strength of the pull towards the reference: the implicit reward is beta · (log π − log π_ref).
    beta: Number = 0.1
    # sigmoid: DPO (with label_smoothing > 0: conservative DPO); robust: robust DPO; ipo: IPO (length-averaged).
    loss_type: Text = "sigmoid"
    # Assumed share of flipped preference labels (sigmoid, robust); 0 = plain DPO.
    label_smoothing: Number = 0.0
    # adapter_off: the reference is the same sharded base with the LoRA adapter switched off (no second model);
    # precomputed: that base scores every training pair once before the first step, then one forward per pair.
    reference: Text = "adapter_off"
    # Prompts longer than this keep their last max_prompt_length tokens; null = only data.max_length limits them.
    max_prompt_length: Integer | None = None


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class FsdpConfig:
    # Free each layer's gathered weights after forward (ZeRO-3); False keeps them until backward (ZeRO-2), and across
    # the micro-batches of a step. None: True, even over a shard group of one worker, where FSDP2's "gathered" copy is
    # a second copy of the weights: kept, the whole base would be held twice for the step.
    reshard_after_forward: Flag | None = None
    # Compute dtype of gathered weights; "auto" = bfloat16 on GPU when train.bf16, float32 on CPU.
    param_dtype: Text = "auto"
    reduce_dtype: Text = "float32"
    cpu_offload: Flag = False
    # Recompute each decoder layer in backward (train.gradient_checkpointing turns this on too).
    activation_checkpointing: Flag = False
    # Layers whose all-gather is issued ahead of time; 0 leaves it to FSDP2's implicit prefetching.
    forward_prefetch: Integer = 1
    backward_prefetch: Integer = 1
    # Workers each weight is sharded over; None = all of them (FSDP). 1 = every worker holds the whole model and no
    # weight is ever gathered (DDP-like, for models that fit one worker); k = HSDP: sharded within groups of k
    # workers (a node), replicated across the groups, so only the LoRA gradients cross between groups.
    shard_size: Integer | None = None

    def shard_group(self, world_size: int) -> int:
        """Workers that together hold one copy of the weights."""
        return self.shard_size or world_size

    def reshards(self) -> bool:
        """`reshard_after_forward` resolved: a layer's gathered weights freed after its forward (re-gathered for its
        backward: over one worker that is a device-local copy, far cheaper than holding every layer twice)."""
        return self.reshard_after_forward if self.reshard_after_forward is not None else True


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class RayConfig:
    # Cluster to join; None = the one `ray job submit` runs us in (RAY_ADDRESS), else a new local one.
    address: Text | None = None
    # The worker group's size; `[min, max]` makes the run elastic (see min_workers).
    num_workers: Integer = 2
    # Elastic run: the smallest group it goes on with when nodes are lost or drained (Ray restarts it at the size
    # the cluster has, from the latest checkpoint, and grows it back up to num_workers as nodes return). The global
    # batch stays that of num_workers: each size accumulates more micro-batches. None: always num_workers.
    min_workers: Integer | None = None
    # Seconds between an elastic run's looks for capacity to grow back onto (each growth is a restart).
    resize_check_s: Number = 60.0
    # Workers (GPUs) on each node; num_workers = nodes × workers_per_node. 1: one worker per node
    # (placement_strategy STRICT_SPREAD). More: each node's workers placed together (PACK), exactly this many a node.
    workers_per_node: Integer = 1
    # None = use GPUs when the cluster has any.
    use_gpu: Flag | None = None
    resources_per_worker: Keyed[Number] | None = None
    # One worker per node by default: each worker owns a whole node's GPU(s) and its NIC.
    placement_strategy: Strategy = "STRICT_SPREAD"
    # None = train.output_dir, so checkpoints land next to the final adapter on the shared volume.
    storage_path: Text | None = None
    name: Text = "ray_run"
    # Worker-group restarts after a failure (a dead worker, a lost node); each resumes from the latest checkpoint.
    max_failures: Integer = 1
    # async: training goes on while the checkpoint is copied to storage_path; sync: it waits for the copy.
    checkpoint_upload: Text = "async"
    # A drain notice for one of the run's nodes (a spot reclaim, a scale-down): checkpoint saves one at once and
    # trains on until Ray restarts the run from it; ignore leaves the loss to the periodic checkpoints.
    preemption: Text = "checkpoint"
    # Optimizer steps between two looks at Ray's drain notice (each look is a barrier across the workers).
    preemption_check_steps: Integer = 1
    # Restarts after a preemption, counted apart from max_failures; -1: any number.
    max_preemptions: Integer = -1
    # Seconds the workers may train on past a drain's deadline, until its node is gone (0: Ray restarts the run
    # at the deadline, whether or not the node is still there).
    preemption_grace_s: Number = 0.0
    # Logical CPUs of the local cluster started when there is none to join (more than cores, so
    # Ray Data tasks are not starved by the training workers).
    local_num_cpus: Integer = 8
    # Seconds to wait, before training starts, for a cluster that cannot place the workers yet to grow (nodes
    # joining, an autoscaler); then the run is refused. A cluster that can never place them is refused at once.
    placement_timeout_s: Integer = 600

    @classmethod
    def shorthand(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The section's keys with `num_workers: [min, max]` read as min_workers and num_workers."""
        sizes = values.get("num_workers")
        if not isinstance(sizes, list):
            return values
        if len(sizes) != 2 or "min_workers" in values:
            _problem(
                f"ray.num_workers must be a number of workers or [min, max], got {sizes!r}"
                + ("; with ray.min_workers given, give num_workers as the maximum alone" if len(sizes) == 2 else ""),
                key="ray.num_workers",
            )
            return {k: v for k, v in values.items() if k != "num_workers"}
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


def expert_groups_follow_nodes(k: int, workers_per_node: int) -> bool:
    """Whether groups of k consecutive node-ordered workers keep to node boundaries."""
    return workers_per_node % k == 0 or k % workers_per_node == 0


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class ParallelConfig:
    # Expert parallelism: the routed experts of every MoE layer split over groups of k workers, each holding E/k
    # experts whole (frozen, never gathered); tokens travel to their experts by all-to-all. 1 = FSDP only.
    expert_parallel: Integer | Annotated[str, Strict()] = 1  # `auto` or k (a number is no word: 2.5 is refused)

    def expert_groups(self) -> int:
        """k as an integer (`check` has refused anything else; preflight has resolved `auto`)."""
        if self.expert_parallel == "auto":
            raise RuntimeError("parallel.expert_parallel: auto is resolved by preflight before it is used")
        return int(self.expert_parallel)


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class NcclConfig:
    """NCCL's fabric settings, given to every training worker on a GPU cluster through Ray's runtime environment
    (so they reach workers on any Ray cluster, not only pods rendered by `rayft k8s render`). None leaves a variable
    to the pod's environment or NCCL's own detection."""

    # NCCL_IB_HCA: '=mlx5_0,mlx5_1' names exact adapters (':1' a port); a bare 'mlx5' is a prefix match that
    # also takes Ethernet/RoCE ports of the same driver.
    ib_hca: Text | None = None
    # NCCL_IB_GID_INDEX: RoCE fabrics need the GID of the RoCE v2 address (commonly 3); InfiniBand needs none.
    ib_gid_index: Integer | None = None
    # NCCL_SOCKET_IFNAME: the interface for NCCL's bootstrap and socket fallback (e.g. net1, ^lo,docker).
    socket_ifname: Text | None = None
    # NCCL_DEBUG: WARN reports problems only; INFO prints per-rank set-up lines (which transport, NET/IB or
    # NET/Socket) and is worth it only while a fabric is being brought up.
    debug: Text = "WARN"
    # NCCL_DEBUG_SUBSYS with debug INFO, e.g. INIT,NET.
    debug_subsys: Text | None = None
    # Any other NCCL_* variable, e.g. NCCL_IB_QPS_PER_CONNECTION: "1".
    env: Keyed[Text] = field(default_factory=dict)


NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")


QUEUEING = ("none", "kueue", "volcano", "runai")
CONFIG_DELIVERY = ("path", "inline", "working_dir")
FABRICS = ("none", "infiniband", "roce")


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class RdmaConfig:
    """How GPU pods reach an RDMA fabric (`k8s.fabric: infiniband` or `roce`); nothing of it is rendered without one,
    as each setting names something a particular site has installed."""

    # The device plugin's extended resource that hands a pod the adapters; null: rdma/rdma_shared_device_a (the RDMA
    # shared device plugin's); e.g. nvidia.com/hostdev, openshift.io/mellanoxnics; '' for none (hostNetwork sites).
    resource: Text | None = None
    # A Multus NetworkAttachmentDefinition that gives each pod an interface on the fabric; null: none.
    network: Text | None = None
    # NCCL_SOCKET_IFNAME: that interface in the pod; null: net1 (Multus's first secondary one) with a network,
    # else NCCL's own choice.
    interface: Text | None = None


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class NodeShape:
    """The GPU nodes worker pods land on. A pod gets the node's CPUs and memory in proportion to its GPUs, so pods
    of any size fill a node together; `count` lets the renderer refuse a job whose pods would not all fit."""

    gpus: Integer = 8
    # What pods may use of one node: its Allocatable (`kubectl describe node`) less what DaemonSets take.
    cpus: Integer = 96
    memory: Text = "960Gi"
    # Nodes of this shape the job may use; null: not checked.
    count: Integer | None = None


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class K8sConfig:
    """What a platform requires of every pod, for `rayft k8s render` (training ignores this section). Flags of
    `rayft k8s render` add to or override these keys; `patches` covers anything no key does."""

    # Queueing: kueue (the RayJob labelled with `queue` and created suspended), volcano or runai (their
    # scheduler and `queue`); none = the default scheduler, or `scheduler_name`.
    queueing: Text = "none"
    queue: Text | None = None
    scheduler_name: Text | None = None
    priority_class_name: Text | None = None
    service_account_name: Text | None = None
    image_pull_secrets: Listed[Text] = field(default_factory=list)
    # The network NCCL uses between GPU pods: none (the pod network, as the cluster provides it), infiniband or
    # roce (the RDMA device, IPC_LOCK, the IB transport settings, and what `rdma` names).
    fabric: Text = "none"
    rdma: RdmaConfig = field(default_factory=RdmaConfig)
    # The GPU nodes, which size the worker pods (one pod holds ray.workers_per_node GPUs).
    node: NodeShape = field(default_factory=NodeShape)
    # At most one worker pod a node (required anti-affinity), so that each pod has a node's NIC to itself.
    one_pod_per_node: Flag = False
    # When Kubernetes stops a GPU worker pod (its node drained for a spot reclaim, a scale-down, maintenance), the
    # pod first drains its Ray node with this deadline, so the run checkpoints at once (`ray.preemption`), and stays
    # up that long; its termination grace period covers it. 0: no notice.
    preemption_notice_s: Integer = 30
    # GPU worker placement (the head and the submitter go where the cluster puts CPU pods; `head_node_selector`
    # pins the head). `affinity` is added to rayft's own (`one_pod_per_node`).
    node_selector: Keyed[Text] = field(default_factory=dict)
    head_node_selector: Keyed[Text] = field(default_factory=dict)
    affinity: Keyed[Any] = field(default_factory=dict)
    # On every pod (head, workers, submitter), besides the GPU taint rayft tolerates on the workers.
    tolerations: Listed[Keyed[Any]] = field(default_factory=list)
    labels: Keyed[Text] = field(default_factory=dict)
    annotations: Keyed[Text] = field(default_factory=dict)
    # Pod securityContext of every pod; IPC_LOCK is added to the GPU containers only where RDMA is on.
    run_as_user: Integer | None = None
    run_as_group: Integer | None = None
    fs_group: Integer | None = None
    run_as_non_root: Flag | None = None
    # Extra environment of every Ray container and the submitter; extra volumes (Kubernetes Volume objects) on
    # head and workers, mounted by `volume_mounts` (VolumeMount objects) in their Ray containers.
    env: Keyed[Text] = field(default_factory=dict)
    volumes: Listed[Keyed[Any]] = field(default_factory=list)
    volume_mounts: Listed[Keyed[Any]] = field(default_factory=list)
    # The Hugging Face cache of head and workers (HF_HOME, where hub model and dataset names resolve); null =
    # <mount path>/hf-cache on the PVC. hf_offline sets HF_HUB_OFFLINE=1: names resolve from a pre-seeded cache only.
    hf_home: Text | None = None
    hf_offline: Flag = False
    # The KubeRay operator's version, 1.4 to 1.7 (any patch release): the manifests use what it has and are
    # checked against its CRDs. From 1.6, preRunningDeadlineSeconds, and deletion rules (on failure the GPU
    # workers go at once, the cluster after the TTL; not for Kueue's suspended jobs); 1.5 has the rules only
    # with its RayJobDeletionPolicy feature gate on, named in kuberay_feature_gates. Older, or unknown (null):
    # the form every supported operator accepts (1.4's), shutdownAfterJobFinishes + ttlSecondsAfterFinished,
    # and the time to Running bounded by the active deadline only.
    kuberay_version: Text | None = None
    # Feature gates the operator runs with beyond its release's defaults; rayft reads RayJobDeletionPolicy.
    kuberay_feature_gates: Listed[Text] = field(default_factory=list)
    # How the job finds this config: path (in the image under jobs/, or on the PVC), inline (the config's YAML
    # carried in the RayJob's runtimeEnvYAML), working_dir (a runtime_env working_dir URI holding it).
    config_delivery: Text = "path"
    working_dir: Text | None = None
    # Strategic-merge (YAML mapping, kind + name select the manifest) or RFC 6902 JSON patch files (a list of
    # operations; `target: rayjob|raycluster` beside it), applied after rendering and validated after.
    patches: Listed[Text] = field(default_factory=list)

    def check(self) -> None:
        _one_of("k8s.queueing", self.queueing, QUEUEING)
        _one_of("k8s.config_delivery", self.config_delivery, CONFIG_DELIVERY)
        _at_least("k8s.preemption_notice_s", self.preemption_notice_s, 0)
        if self.queueing != "none" and not self.queue:
            _problem(f"k8s.queue: k8s.queueing: {self.queueing} needs the queue's name")
        if self.queueing == "none" and self.queue:
            _problem("k8s.queue: given without k8s.queueing; set k8s.queueing: kueue, volcano or runai")
        self._check_kuberay()
        self._check_fabric()
        self._check_node()
        if (self.config_delivery == "working_dir") != bool(self.working_dir):
            _problem("k8s.working_dir: needed with k8s.config_delivery: working_dir, and only then")
        if self.hf_home is not None and not self.hf_home.startswith("/"):
            _problem(f"k8s.hf_home: '{self.hf_home}' must be an absolute path in the pods (on the PVC)")
        names = {v.get("name") for v in self.volumes}
        for i, m in enumerate(self.volume_mounts):
            if m.get("name") not in names:
                _problem(f"k8s.volume_mounts[{i}]: name '{m.get('name')}' is none of k8s.volumes")
        for problem in self._api_problems():
            _problem(problem)

    def _api_problems(self) -> list[str]:
        """What the API server (or Kueue, for the queue-name label) would refuse when the manifests are applied."""
        apirules = _apirules()
        found: list[str] = (
            apirules.labels("k8s.labels", self.labels)
            + apirules.annotation_keys("k8s.annotations", self.annotations)
            + apirules.labels("k8s.node_selector", self.node_selector)
            + apirules.labels("k8s.head_node_selector", self.head_node_selector)
            + apirules.tolerations("k8s.tolerations", self.tolerations)
        )
        named = {
            key: getattr(self, key)
            for key in ("queue", "priority_class_name", "service_account_name", "scheduler_name")
        }
        named.update({f"image_pull_secrets[{i}]": s for i, s in enumerate(self.image_pull_secrets)})
        for key, value in named.items():
            if value is not None:
                found += apirules.dns_subdomain(f"k8s.{key}", value)
        if self.queue and not apirules.dns_subdomain("k8s.queue", self.queue):
            found += apirules.label_value("k8s.queue", self.queue)  # Kueue's queue-name label holds it
        return found

    def _check_fabric(self) -> None:
        _one_of("k8s.fabric", self.fabric, FABRICS)
        if self.fabric == "none":
            for key, value in dataclasses.asdict(self.rdma).items():
                if value is not None:
                    _problem(
                        f"k8s.rdma.{key}: '{value}' is given but k8s.fabric is none, which renders no RDMA; "
                        "set k8s.fabric: infiniband or roce (or --fabric)"
                    )
        if self.rdma.network is not None:
            for problem in _apirules().dns_subdomain("k8s.rdma.network", self.rdma.network.rpartition("/")[2]):
                _problem(problem)

    def _check_node(self) -> None:
        n = self.node
        _at_least("k8s.node.gpus", n.gpus, 1)
        _at_least("k8s.node.cpus", n.cpus, 1)
        if n.count is not None:
            _at_least("k8s.node.count", n.count, 1, hint=" (or null: not checked)")
        try:
            _apirules().quantity_bytes(n.memory)
        except ValueError as e:
            _problem(f"k8s.node.memory: {e}")

    def _check_kuberay(self) -> None:
        from rayft.deploy import kuberay

        try:
            release = kuberay.minor(self.kuberay_version) or kuberay.OLDEST
        except ValueError as e:
            _problem(f"k8s.kuberay_version: {e}")
            return
        for gate in self.kuberay_feature_gates:
            problem = kuberay.gate_problem(gate, release)
            if problem:
                _problem(f"k8s.kuberay_feature_gates: {problem}")


def _apirules() -> types.ModuleType:
    from rayft.deploy import apirules  # the deploy package imports this module: imported when first checked

    return apirules


REPORT_TO = ("none", "tensorboard", "mlflow", "wandb")
DEFAULT_VAL_RATIO = 0.05


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
class Config:
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
        cls, raw: dict[str, Any] | None, source: str = "config", where: dict[str, str] | None = None
    ) -> Config:
        """The checked config; every problem of `raw` (unknown keys, wrong types, bad values) in one ConfigError.
        A key that cannot be read keeps its default, so the checks of the others still run."""
        raw = raw or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a mapping of sections ({', '.join(SECTIONS)}), got {raw!r}")
        with gather_problems(source, where):
            sections: dict[str, Any] = {}
            for name, values in raw.items():
                section_type = SECTIONS.get(name)
                if section_type is None:
                    _problem(f"unknown section '{name}'{_suggest(str(name), SECTIONS)}", key=str(name))
                    continue
                sections[name] = _section(name, section_type, values)
            cfg = cls(**sections)
            cfg.check()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def recomputes_activations(self) -> bool:
        """Activation checkpointing, asked for in FSDP's section or as the HF trainer's `gradient_checkpointing`."""
        return self.fsdp.activation_checkpointing or self.train.gradient_checkpointing

    @property
    def storage_path(self) -> str:
        """Absolute local path (a shared volume on a cluster) or a pyarrow URI such as s3://bucket/runs."""
        path = self.ray.storage_path or self.train.output_dir
        if is_uri(path):
            return path
        return str(Path(path).expanduser().resolve())

    @property
    def trackers(self) -> list[str]:
        return [name for name in self.train.report_to or [] if name != "none"]

    @property
    def run_uri(self) -> str:
        return f"{self.storage_path.rstrip('/')}/{self.ray.name}"

    @property
    def best_metric(self) -> tuple[str, str] | None:
        """(metric, "min"|"max") that ranks checkpoints, or None when checkpoints are kept newest-first."""
        t = self.train
        if t.metric_for_best_model is None or t.eval_strategy == "no":
            return None
        metric = eval_metric(t.metric_for_best_model)
        greater = t.greater_is_better if t.greater_is_better is not None else not metric.endswith("loss")
        return metric, "max" if greater else "min"

    def check(self) -> None:
        """Refuse out-of-range values and combinations that cannot work (each problem recorded, see `_problem`)."""
        self.k8s.check()
        self.check_train()
        self.check_dpo()
        self.check_data()
        self.check_lora()
        self.check_model_and_fsdp()
        self.check_ray()

    def check_train(self) -> None:
        t = self.train
        _positive("train.learning_rate", t.learning_rate)
        _at_least("train.num_train_epochs", t.num_train_epochs, 1)
        _at_least("train.per_device_train_batch_size", t.per_device_train_batch_size, 1)
        _at_least("train.per_device_eval_batch_size", t.per_device_eval_batch_size, 1)
        _at_least("train.gradient_accumulation_steps", t.gradient_accumulation_steps, 1)
        _at_least("train.logging_steps", t.logging_steps, 1)
        _at_least("train.eval_steps", t.eval_steps, 1)
        _at_least("train.save_steps", t.save_steps, 1)
        _at_least("train.warmup_steps", t.warmup_steps, 0)
        _at_least("train.weight_decay", t.weight_decay, 0)
        _positive("train.max_grad_norm", t.max_grad_norm)
        if t.peak_tflops is not None:
            _positive("train.peak_tflops", t.peak_tflops)
        if t.max_steps != -1:
            _at_least("train.max_steps", t.max_steps, 1, hint=" (or -1 to train for num_train_epochs)")
        if t.save_total_limit is not None:
            _at_least("train.save_total_limit", t.save_total_limit, 1, hint=" (or null to keep every checkpoint)")
        if not 0 <= t.warmup_ratio < 1:
            _problem(f"train.warmup_ratio must be in [0, 1), got {t.warmup_ratio}")
        _one_of("train.lr_scheduler_type", t.lr_scheduler_type, SCHEDULERS)
        check_optim(t.optim)
        _one_of("train.eval_strategy", t.eval_strategy, STRATEGIES)
        _one_of("train.save_strategy", t.save_strategy, STRATEGIES)
        if t.fp16:
            _problem("train.fp16: true is not supported (FSDP2 + LoRA trains in bf16); set train.fp16: false")
        for tracker in t.report_to or []:
            _one_of("train.report_to", tracker, REPORT_TO)
        if t.metric_for_best_model is not None and eval_metric(t.metric_for_best_model) not in BEST_METRICS:
            _problem(
                f"train.metric_for_best_model: unknown metric '{t.metric_for_best_model}'; "
                f"evaluation reports {', '.join(BEST_METRICS)}"
            )
        if t.load_best_model_at_end and self.best_metric is None:
            _problem(
                "train.load_best_model_at_end: true needs checkpoints ranked by an evaluation metric: set "
                "train.eval_strategy (steps or epoch) and train.metric_for_best_model (e.g. eval_loss)"
            )
        if t.load_best_model_at_end and t.save_strategy == "no":
            _problem("train.load_best_model_at_end: true needs train.save_strategy steps or epoch")
        if t.resume_from_checkpoint is not None and not t.resume_from_checkpoint.strip():
            _problem("train.resume_from_checkpoint must be a checkpoint directory, 'latest' or null")
        _one_of("train.objective", t.objective, OBJECTIVES)
        _one_of("train.resume", t.resume, ("auto", "continue"))

    def check_data(self) -> None:
        d = self.data
        _at_least("data.max_length", d.max_length, 2)
        _at_least("data.tokenize_workers", d.tokenize_workers, 1)
        _at_least("data.shuffle_buffer_size", d.shuffle_buffer_size, 0)
        if d.max_eval_samples is not None:
            _at_least("data.max_eval_samples", d.max_eval_samples, 1)
        if d.val_ratio is not None and not 0 <= d.val_ratio < 1:
            _problem(f"data.val_ratio must be in [0, 1), got {d.val_ratio}")
        _one_of("data.format", d.format, DATA_FORMATS)
        _one_of("data.bad_records", d.bad_records, ("skip", "error"))
        _one_of("data.overlong", d.overlong, ("truncate", "skip"))
        for key in ("max_skipped_share", "max_no_signal_share"):
            if not 0 <= getattr(d, key) <= 1:
                _problem(f"data.{key} must be in [0, 1], got {getattr(d, key)}")
        if d.prompt_template is not None:
            try:
                template_fields(d.prompt_template)
            except ConfigError as e:
                _problem(str(e))
            if d.format not in ("auto", "prompt_completion"):
                _problem(f"data.prompt_template renders prompt/completion records; data.format is {d.format}")
        _at_least("data.pad_to_multiple_of", d.pad_to_multiple_of, 1)

    def check_lora(self) -> None:
        lo, t, f = self.lora, self.train, self.fsdp
        _at_least("lora.r", lo.r, 1)
        _positive("lora.lora_alpha", lo.lora_alpha)
        if not 0 <= lo.lora_dropout < 1:
            _problem(f"lora.lora_dropout must be in [0, 1), got {lo.lora_dropout}")
        if not lo.target_modules:
            _problem("lora.target_modules is empty: name at least one module, e.g. [q_proj, v_proj]")
        _one_of("lora.bias", lo.bias, ("none", "all", "lora_only"))
        if lo.target_experts and lo.lora_dropout != 0:
            _problem(
                f"lora.target_experts: true needs lora.lora_dropout: 0 (got {lo.lora_dropout}): PEFT's LoRA on "
                "expert parameters has no dropout"
            )
        if lo.target_experts and not (f.activation_checkpointing or t.gradient_checkpointing):
            _problem(
                "lora.target_experts: true needs fsdp.activation_checkpointing: true (or train.gradient_checkpointing):"
                " every expert's W + BA is materialised in forward, keeping it for backward does not fit"
            )
        _one_of("lora.task_type", lo.task_type, ("CAUSAL_LM",))
        self.check_peft_options()

    def check_model_and_fsdp(self) -> None:
        m, f, r = self.model, self.fsdp, self.ray
        _one_of("model.torch_dtype", m.torch_dtype, (*DTYPES, "auto"))
        _one_of("model.load_mode", m.load_mode, ("sharded", "full"))
        _one_of("model.frozen_dtype", m.frozen_dtype, ("auto", "float8_e4m3fn", "nf4", "bfloat16", "float32"))
        if m.frozen_dtype in DTYPES and m.torch_dtype not in ("auto", m.frozen_dtype):
            _problem(
                f"model.frozen_dtype {m.frozen_dtype} disagrees with model.torch_dtype {m.torch_dtype}: a dequantised "
                "base is stored in torch_dtype; set one of them to match (or frozen_dtype: float8_e4m3fn / auto)"
            )
        _one_of("fsdp.param_dtype", f.param_dtype, (*DTYPES, "auto"))
        _one_of("fsdp.reduce_dtype", f.reduce_dtype, DTYPES)
        _at_least("fsdp.forward_prefetch", f.forward_prefetch, 0)
        if f.shard_size is not None and _at_least("fsdp.shard_size", f.shard_size, 1) and r.num_workers % f.shard_size:
            _problem(
                f"fsdp.shard_size {f.shard_size} must divide ray.num_workers {r.num_workers} "
                "(groups of shard_size workers each hold one full copy of the model)"
            )
        _at_least("fsdp.backward_prefetch", f.backward_prefetch, 0)
        if r.use_gpu is False:
            self.check_cpu_precision()
        self.check_expert_parallel()
        self.check_nccl()

    def check_ray(self) -> None:
        r = self.ray
        _at_least("ray.num_workers", r.num_workers, 1)
        _at_least("ray.max_failures", r.max_failures, -1, hint=" (-1 retries forever)")
        _at_least("ray.local_num_cpus", r.local_num_cpus, 1)
        _at_least("ray.placement_timeout_s", r.placement_timeout_s, 0)
        _one_of("ray.checkpoint_upload", r.checkpoint_upload, ("async", "sync"))
        _one_of("ray.preemption", r.preemption, ("checkpoint", "ignore"))
        _at_least("ray.preemption_check_steps", r.preemption_check_steps, 1)
        _at_least("ray.max_preemptions", r.max_preemptions, -1, hint=" (-1 retries forever)")
        _at_least("ray.preemption_grace_s", r.preemption_grace_s, 0)
        _one_of("ray.placement_strategy", r.placement_strategy, PLACEMENT_STRATEGIES)
        if _at_least("ray.workers_per_node", r.workers_per_node, 1) and r.num_workers % r.workers_per_node:
            _problem(
                f"ray.num_workers {r.num_workers} must be nodes × ray.workers_per_node {r.workers_per_node}; set "
                f"ray.num_workers to a multiple of {r.workers_per_node}"
            )
        if r.workers_per_node > 1 and r.placement_strategy in ("SPREAD", "STRICT_PACK") and r.nodes > 1:
            _problem(
                f"ray.placement_strategy {r.placement_strategy} cannot keep ray.workers_per_node "
                f"{r.workers_per_node} workers on each of {r.nodes} nodes; use STRICT_SPREAD (the default) or PACK"
            )
        if not r.name or "/" in r.name:
            _problem(f"ray.name must be a non-empty directory name, got {r.name!r}")
        _at_least("ray.resize_check_s", r.resize_check_s, 0)
        if r.min_workers is not None and _at_least("ray.min_workers", r.min_workers, 1):
            if r.min_workers > r.num_workers:
                _problem(f"ray.num_workers [{r.min_workers}, {r.num_workers}]: the minimum exceeds the maximum")
            elif r.min_workers % r.workers_per_node:
                _problem(
                    f"ray.num_workers [{r.min_workers}, {r.num_workers}]: the minimum must be whole nodes of "
                    f"ray.workers_per_node {r.workers_per_node} workers; set it to a multiple of {r.workers_per_node}",
                    key="ray.num_workers",
                )
            elif r.elastic:
                self.check_elastic()
        for key, amount in (r.resources_per_worker or {}).items():
            if amount < 0:
                _problem(f"ray.resources_per_worker.{key} must be >= 0, got {amount}")

    def check_elastic(self) -> None:
        """Every size an elastic run may take keeps the global batch (a whole number of micro-batches per worker)
        and the layout (expert-parallel groups, shard groups); refused up front, not when a node is lost."""
        r, t = self.ray, self.train
        global_micro = t.gradient_accumulation_steps * r.num_workers
        rows = global_micro * t.per_device_train_batch_size
        k = self.parallel.expert_parallel if isinstance(self.parallel.expert_parallel, int) else 1
        if self.parallel.expert_parallel == "auto":
            _problem(
                "parallel.expert_parallel: auto sizes the expert groups for one group size; an elastic run "
                "(ray.num_workers [min, max]) needs a number dividing every size it may take"
            )
        broken: dict[int, str] = {}
        for n in r.sizes():
            if global_micro % n:
                broken[n] = f"the {global_micro} micro-batches of a step do not split over {n} workers"
            elif k > 1 and (n % k or not expert_groups_follow_nodes(k, r.workers_per_node)):
                broken[n] = f"parallel.expert_parallel {k} does not divide {n} workers"
            elif self.fsdp.shard_size and n % self.fsdp.shard_size:
                broken[n] = f"fsdp.shard_size {self.fsdp.shard_size} does not divide {n} workers"
        if broken:
            step = math.lcm(*(n // math.gcd(n, r.num_workers) for n in r.sizes()))
            _problem(
                f"ray.num_workers [{r.min_workers}, {r.num_workers}]: an elastic run keeps the global batch of "
                f"{rows} rows ({t.per_device_train_batch_size} per device × {t.gradient_accumulation_steps} "
                f"accumulation × {r.num_workers} workers) at every size it may take, and here "
                + "; ".join(f"at {n}: {why}" for n, why in broken.items())
                + f". Narrow the range, or make train.gradient_accumulation_steps a multiple of {step}"
                + (" (and keep the expert/shard groups dividing every size)" if k > 1 or self.fsdp.shard_size else ""),
                key="ray.num_workers",
            )

    def check_expert_parallel(self) -> None:
        """`parallel.expert_parallel`: an integer k >= 1 dividing the workers, and what EP cannot combine with
        (the experts' count is checked where the model's config is read: `rayft.parallel.expert.check_experts`)."""
        k, workers = self.parallel.expert_parallel, self.ray.num_workers
        if isinstance(k, str):
            if k != "auto":
                _problem(
                    f"parallel.expert_parallel: {k!r} is neither an integer k nor auto (the planner's choice, "
                    f"`rayft plan`); give a k that divides ray.num_workers {workers} and the routed experts"
                )
            return  # resolved by preflight, where the model's structure is known (`rayft.plan.choose_expert_parallel`)
        if not _at_least("parallel.expert_parallel", k, 1) or k == 1:
            return
        if workers % k:
            valid = [d for d in range(1, workers + 1) if workers % d == 0]
            _problem(f"parallel.expert_parallel {k} must divide ray.num_workers {workers}; valid: {valid}")
        elif not expert_groups_follow_nodes(k, self.ray.workers_per_node):
            per_node = self.ray.workers_per_node
            valid = [d for d in range(1, workers + 1) if workers % d == 0 and expert_groups_follow_nodes(d, per_node)]
            _problem(
                f"parallel.expert_parallel {k} with ray.workers_per_node {per_node}: each expert-parallel group must "
                f"lie within a node (k divides the node's workers) or span whole nodes (they divide k), or its "
                f"all-to-all straddles the network; valid: {valid}"
            )
        if self.fsdp.shard_size is not None:
            _problem(
                "fsdp.shard_size cannot be combined with parallel.expert_parallel > 1 (the non-expert part is then "
                "sharded within each node, over its ray.workers_per_node workers); remove fsdp.shard_size"
            )
        if self.model.load_mode != "sharded":
            _problem(
                "parallel.expert_parallel > 1 needs model.load_mode: sharded (each worker reads only its own experts)"
            )
        if self.fsdp.cpu_offload:
            _problem(
                "fsdp.cpu_offload: true cannot be combined with parallel.expert_parallel > 1: the routed experts are "
                "not FSDP's, so they would stay in host memory while their tokens are on the GPU; set "
                "fsdp.cpu_offload: false or parallel.expert_parallel: 1"
            )

    def check_nccl(self) -> None:
        """The `nccl` section: a known debug level, a non-negative GID index, only NCCL_* names in `env`."""
        n = self.nccl
        _one_of("nccl.debug", n.debug, NCCL_DEBUG_LEVELS)
        if n.ib_gid_index is not None:
            _at_least("nccl.ib_gid_index", n.ib_gid_index, 0)
        for name in n.env:
            if not name.startswith("NCCL_"):
                _problem(f"nccl.env: '{name}' is not an NCCL variable (names start with NCCL_)")

    def check_peft_options(self) -> None:
        """`all-linear`, DoRA and modules_to_save where they cannot work: refused here, before any cluster resource
        (DoRA on a checkpoint that is FP8 under `frozen_dtype: auto` is refused by `rayft.model.build`, which reads
        the checkpoint's config)."""
        lo = self.lora
        if "all-linear" in lo.target_modules and len(lo.target_modules) > 1:
            _problem(
                f"lora.target_modules {lo.target_modules}: all-linear already names every linear layer (the LM head "
                "excepted); give it alone, or list module names without it"
            )
        if lo.use_dora and lo.target_experts:
            _problem(
                "lora.use_dora: true cannot be combined with lora.target_experts: true (PEFT has no DoRA for the "
                "routed experts' fused parameters); set one of them false"
            )
        if lo.use_dora and self.model.frozen_dtype == "float8_e4m3fn":
            _problem(DORA_ON_FP8)
        if self.model.frozen_dtype == "nf4" and self.parallel.expert_parallel != 1:
            _problem(
                f"model.frozen_dtype nf4 cannot be combined with parallel.expert_parallel "
                f"{self.parallel.expert_parallel}: NF4 experts are sharded by FSDP over all workers; set "
                "parallel.expert_parallel: 1 or model.frozen_dtype: auto (FP8)"
            )
        if lo.use_dora and self.model.frozen_dtype == "nf4":
            _problem(
                "lora.use_dora: true needs the frozen weights in bf16/fp32 (DoRA's magnitude is the norm of each row "
                "of W + BA), not model.frozen_dtype nf4; set model.frozen_dtype: bfloat16 or lora.use_dora: false"
            )
        if lo.modules_to_save is not None and not lo.modules_to_save:
            _problem("lora.modules_to_save is empty: name modules (e.g. [lm_head]) or leave it null")
        if lo.modules_to_save and self.parallel.expert_parallel != 1:
            _problem(
                f"lora.modules_to_save {lo.modules_to_save} cannot be combined with parallel.expert_parallel "
                f"{self.parallel.expert_parallel}: the expert-parallel adapter gathering handles LoRA factors only; "
                "set parallel.expert_parallel: 1 or remove lora.modules_to_save"
            )

    def check_dpo(self) -> None:
        """The `dpo` section's ranges, and the data settings preference pairs cannot use."""
        p, d = self.dpo, self.data
        _positive("dpo.beta", p.beta)
        _one_of("dpo.loss_type", p.loss_type, DPO_LOSSES)
        _one_of("dpo.reference", p.reference, DPO_REFERENCES)
        if not 0 <= p.label_smoothing < 0.5:
            _problem(f"dpo.label_smoothing must be in [0, 0.5), got {p.label_smoothing}")
        if p.label_smoothing and p.loss_type == "ipo":
            _problem("dpo.label_smoothing applies to loss_type sigmoid or robust, not ipo; set it to 0")
        if p.max_prompt_length is not None:
            _at_least("dpo.max_prompt_length", p.max_prompt_length, 1)
        if self.train.objective != "dpo":
            return
        if d.packing:
            _problem("data.packing: true cannot hold preference pairs (train.objective: dpo); set it false")
        if d.format not in ("auto", "preference"):
            _problem(f"train.objective: dpo trains on preference records; data.format is {d.format}")
        if d.prompt_template is not None:
            _problem("data.prompt_template is for SFT records; preference records carry their own prompt")

    def check_cpu_precision(self) -> None:
        """gloo cannot all-gather bf16/fp16 (the process aborts), so CPU training computes in fp32."""
        if self.fsdp.param_dtype not in ("auto", "float32") or self.fsdp.reduce_dtype != "float32":
            _problem(
                "fsdp.param_dtype/reduce_dtype must be float32 (or auto) when training on CPU: "
                "the gloo backend cannot gather bf16/fp16 tensors"
            )


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
    for item in overrides:
        keys, value = parse_override(item)
        set_nested(raw, keys, value, source)
        where[".".join(keys)] = "--override"
    return Config.from_dict(raw, source, where)


ACCELERATE_KEYS = ("compute_environment", "distributed_type", "fsdp_config", "num_processes", "mixed_precision")


def _refuse_accelerate(raw: dict[str, Any], source: str) -> None:
    """An accelerate launch config passed as a rayft config: name the command that converts it."""
    found = [k for k in ACCELERATE_KEYS if k in raw]
    if found:
        raise ConfigError(
            f"{source}: this is an accelerate config ({', '.join(found)}), not a rayft one; convert it with "
            f"`rayft config from-accelerate {source} [--trl sft.yaml] --out rayft.yaml` and pass --config rayft.yaml"
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
        raise ConfigError(f"--override '{item}': unknown section '{keys[0]}'{_suggest(keys[0], SECTIONS)}")
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


_Section = TypeVar("_Section")


def _section(name: str, section_type: type[_Section], values: Any) -> _Section:
    """The section's dataclass, validated by pydantic; keys that are unknown or of the wrong type are reported and
    left at their defaults (validated again without them), so the checks of the other keys still run."""
    if values is None:
        return section_type()
    if not isinstance(values, dict):
        _problem(f"section '{name}' must be a mapping of keys, got {values!r}", key=name)
        return section_type()
    shorthand = getattr(section_type, "shorthand", None)
    if shorthand is not None:  # forms a section reads beside its own keys
        values = shorthand(values)
    values = {str(k): v for k, v in values.items()}
    while True:
        try:
            return section_type(**values)
        except ValidationError as e:
            unreadable: set[tuple[int | str, ...]] = set()
            order = {key: i for i, key in enumerate(values)}  # the file's order, not the fields'
            for error in sorted(e.errors(), key=lambda error: order.get(str(error["loc"][0]), len(order))):
                path, owner = _unreadable(section_type, values, error["loc"])
                if path not in unreadable:  # one problem a key, as a user fixes it: the first of a list's items
                    unreadable.add(path)
                    key = _dotted(name, values, error["loc"])
                    _problem(_mistake(key, error, owner, path[-1]), key=key)
            narrower = _without(values, unreadable)
            if narrower == values:  # nothing left to drop: the mistake is in rayft's own defaults
                raise
            values = narrower


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
    a union's members (`parallel.expert_parallel`: int, str) are no keys and left out."""
    key, node = name, values
    for part in loc:
        if isinstance(node, dict):
            found = [k for k in node if str(k) == str(part)]
            if found:
                key, node = f"{key}.{part}", node[found[0]]
        elif isinstance(part, int):
            key, node = f"{key}[{part}]", node[part] if isinstance(node, list) and part < len(node) else None
    return key


# What a field of each kind takes, by the error pydantic reports for a value it cannot read.
EXPECTED = {
    "bool_type": "true or false",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
}


def _mistake(key: str, error: ErrorDetails, owner: type, name: int | str) -> str:
    """rayft's message for one of pydantic's errors: the key, what it takes, and what the file gives."""
    kind, value = error["type"], error["input"]
    if kind in ("unexpected_keyword_argument", "invalid_key"):
        return f"unknown key '{key}'{_suggest(str(name), [f.name for f in dataclasses.fields(owner)])}"
    expected = EXPECTED.get(kind)
    if kind == "dataclass_type":  # a nested group of keys (k8s.node, k8s.rdma)
        group = typing.get_type_hints(owner)[str(name)]
        expected = f"a mapping of {', '.join(f.name for f in dataclasses.fields(group))}"
    if expected is None:
        return f"{key}: {error['msg']}"
    if value is None:
        return f"{key} must not be null (expected {expected})"
    return f"{key} must be {expected}, got {value!r} ({type(value).__name__})"


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


def _suggest(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{close[0]}'?)"
    return f"; valid: {', '.join(sorted(choices))}"


def check_optim(name: str) -> bool:
    """`train.optim`: one of OPTIMIZERS; a bitsandbytes name gets why not, and what to use instead."""
    if name in BNB_OPTIMIZERS:
        import importlib.util

        absent = " (and bitsandbytes is not installed)" if importlib.util.find_spec("bitsandbytes") is None else ""
        return _problem(
            f"train.optim: {name} is a bitsandbytes optimizer{absent}, which rayft does not run: its quantised "
            "states are not built for FSDP2's sharded parameters, and LoRA's optimizer state is small anyway; "
            f"choose one of {', '.join(OPTIMIZERS)}"
        )
    return _one_of("train.optim", name, OPTIMIZERS)


def _positive(key: str, value: float) -> bool:
    """True when value > 0; else the problem is recorded (or raised outside `Problems`)."""
    return value > 0 or _problem(f"{key} must be > 0, got {value}")


def _at_least(key: str, value: float, low: float, hint: str = "") -> bool:
    """True when value >= low; else the problem is recorded, so checks that divide by it can skip themselves."""
    return value >= low or _problem(f"{key} must be >= {low}, got {value}{hint}")


def _one_of(key: str, value: str, choices: tuple[str, ...]) -> bool:
    if value in choices:
        return True
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return _problem(f"{key}: unknown value '{value}'{hint}; choose one of {', '.join(choices)}")
