"""The checks that need the filesystem but no cluster, in the order a bad input is cheapest to find: run by `rayft
validate`, `rayft eval` and before every training run, so that every bad input is answered in seconds, before a GPU
is held.

Each check lives with the fact it checks (the model directory in rayft/model/files.py, the tokenizer in
rayft/data/tokenizer.py, the data in rayft/data/sample.py, a resume checkpoint in rayft/train/checkpoint_dir.py, ...);
this module only runs them in order. They read what the files hold, cheaply: safetensors headers against file sizes
and against the model config.json builds on the meta device, the tokenizer against the embedding, data files by
content (parquet footers and pages, text encodings, the fields of every record), a resume checkpoint against its DCP
metadata, and writability by creating something.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from rayft.config import Config, is_uri
from rayft.data.records import RecordFormat
from rayft.data.sample import SampleReport, check_data, check_samples
from rayft.data.sources import SplitSource, resolve_splits
from rayft.data.tokenizer import TokenizerFacts, check_tokenizer, tokenizer_path
from rayft.decisions import Decisions
from rayft.hub import resolve_names
from rayft.limits import check_max_length, local_placement, lora_rank_warning
from rayft.model.attention import AttentionChoice, attention_choice, check_attention
from rayft.model.files import check_model_dir, check_safetensors_dir, check_vocab, check_weights_match
from rayft.parallel.backend import prefix_matched_hca
from rayft.parallel.torch_compat import check_torch
from rayft.plan import Structure, structure
from rayft.startup import Profile
from rayft.train.checkpoint_dir import check_resume_source, damaged_note
from rayft.train.run_settings import check_continuation, finished_run, last_step
from rayft.train.rundir import RunDir
from rayft.train.sinks import check_tracker_access, check_trackers
from rayft.train.writable import check_run_writable

if TYPE_CHECKING:  # of the weightless model the checks build; PEFT (rayft.model.lora's) is imported only then
    from transformers import PreTrainedConfig

    from rayft.model.lora import LoraTargets


@dataclass
class Preflight:
    train: SplitSource
    validation: SplitSource | None
    records: RecordFormat
    tokenizer: TokenizerFacts
    lora: LoraTargets
    structure: Structure  # parameter counts, for the memory plan
    samples: list[SampleReport]  # what the job's record pipeline made of each split's first records
    attention: AttentionChoice  # the kernel the workers build the model with, and why
    warnings: list[str]  # settings that run but are likely a mistake (validate prints them)
    decisions: Decisions  # what `auto` became (the expert-parallel degree); the config stays as validated


def preflight(cfg: Config, profile: Profile | None = None) -> Preflight:
    """Every check, in the order a bad input is cheapest to find; `profile` times the three parts."""

    def timed(name: str) -> AbstractContextManager[None]:
        return profile.stage(name) if profile is not None else nullcontext()

    check_torch()  # everything below builds on it
    with timed("preflight_model"):  # hub names become cache snapshots here, once: the workers are handed paths
        resolve_names(cfg)
    model_dir = Path(cfg.model.model_name_or_path).expanduser()
    with timed("preflight_model"):  # the files first: a missing model is the most common mistake
        check_model_dir(model_dir)
        check_safetensors_dir(model_dir)
    with timed("preflight_tokenizer"):
        tokenizer = check_tokenizer(cfg)
    with timed("preflight_data"):
        train, validation = resolve_splits(cfg.data)
        records = check_data(cfg, train, validation)
        samples, data_warnings = check_samples(cfg, records, tokenizer, [s for s in (train, validation) if s])
        check_run_writable(cfg)
        check_resume_source(cfg)
        check_trackers(cfg.trackers)
        tracker_warnings = check_tracker_access(cfg)
    with timed("preflight_model"):
        from rayft.model.build import check_quantised_storage, weightless_lora_model
        from rayft.parallel.context import check_heads
        from rayft.parallel.expert import check_expert_parallel

        model, targets = weightless_lora_model(cfg)
        check_quantised_storage(cfg, model)
        counts = structure(model, model.config)  # walked once: the planner's `auto` and the memory plan read it
        decisions = Decisions.of(cfg, _expert_parallel(cfg, counts))
        check_expert_parallel(cfg, model.config, decisions.expert_parallel)
        check_heads(model.config, cfg.parallel.context_parallel)
        if any(model_dir.glob("*.safetensors")):
            check_weights_match(model, model_dir)
        check_vocab(tokenizer.vocab_size, model, tokenizer_path(cfg.model))
        check_max_length(cfg, cast("PreTrainedConfig", model.config).get_text_config())
        attention = attention_choice(cfg, type(model.get_base_model()), on_gpu=cfg.ray.use_gpu is not False)
        said = (
            check_attention(cfg, model),
            f"model.attn_implementation unset: {attention.reason}" if attention.loud else None,
            lora_rank_warning(cfg, model),
            local_placement(cfg),
            prefix_matched_hca(cfg.nccl),
        )
        warnings = [*data_warnings, *tracker_warnings, *(w for w in said if w)]
    return Preflight(train, validation, records, tokenizer, targets, counts, samples, attention, warnings, decisions)


def _expert_parallel(cfg: Config, counts: Structure) -> int | None:
    """`parallel.expert_parallel: auto` decided: the planner's fastest layout that fits; None where the config
    gives k itself."""
    if cfg.parallel.expert_parallel != "auto":
        return None
    from rayft.model.build import held_as
    from rayft.plan.steptime import planned_expert_parallel

    return planned_expert_parallel(cfg, counts, held_as(cfg.model))


def check_continued_run(cfg: Config) -> str | None:
    """`rayft validate`: a local run directory holding a run this config would train on: the same model, adapter
    and settings (a remote one is checked by the job itself, where its storage is reachable); and a warning where
    its newest checkpoints are damaged (the job will set them aside) or that run has finished. Not part of
    `preflight`, which `rayft eval` shares: an evaluation reads a run, it does not continue it."""
    if is_uri(cfg.run_uri):
        return None
    run = RunDir(cfg.run_uri)
    if not run.has_registered_checkpoints():
        return None
    check_continuation(cfg, run.settings(), run.uri)
    damaged = damaged_note(run)
    if damaged is not None:
        return damaged
    final = Path(cfg.train.output_dir).expanduser() / "final"
    if not (final / "adapter_model.safetensors").is_file():
        return None
    done = last_step(run)
    if 0 < cfg.train.max_steps <= done or cfg.train.max_steps <= 0:
        return finished_run(run.uri, done, cfg.train.max_steps if cfg.train.max_steps > 0 else None)
    return None
