"""Checks that need the filesystem but no cluster: run by `rayft validate`, `rayft eval` and before every training
run, so that every bad input is answered in seconds, before a GPU is held.

They read what the files hold, cheaply: safetensors headers against file sizes and against the model config.json
builds on the meta device, the tokenizer against the embedding, data files by content (parquet footers and pages,
text encodings, the fields of every record), a resume checkpoint against its DCP metadata, and writability by
creating something.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from rayft.config import Config, ConfigError, DataConfig, is_uri
from rayft.data.files import DecodeBudget
from rayft.data.records import RecordFormat, record_fields, record_format
from rayft.data.sample import SampleReport, check_sample, sample_report
from rayft.data.sources import SplitSource, check_link, resolve_splits
from rayft.data.tokenizer import TOKENIZER_FILES, TokenizerFacts, has_tokenizer, tokenizer_facts, tokenizer_path
from rayft.hub import resolve_names
from rayft.limits import check_max_length, local_placement_problem, lora_rank_warning
from rayft.model.attention import check_attention
from rayft.model.files import check_safetensors_dir, check_vocab, check_weights_match
from rayft.parallel.backend import prefix_matched_hca
from rayft.parallel.torch_compat import check_torch
from rayft.plan import Structure, structure
from rayft.startup import Profile
from rayft.train.checkpoint_dir import STATE_DIR, missing_state_files
from rayft.train.run_settings import check_checkpoint_shape, check_continuation, finished_run, last_step
from rayft.train.rundir import RunDir

if TYPE_CHECKING:  # resolved on a weightless model when the check runs; PEFT is imported only then
    from peft import PeftModel
    from transformers import PreTrainedConfig

    from rayft.model.lora import LoraTargets

log = logging.getLogger(__name__)
CHAT_SAMPLE = 64  # records of each split encoded by `rayft validate` (about a second with a chat template)
STORAGE_PROBE_S = 30.0  # a remote storage_path's write probe; longer than the S3 client's own retries


@dataclass
class Preflight:
    train: SplitSource
    validation: SplitSource | None
    records: RecordFormat
    tokenizer: TokenizerFacts
    lora: LoraTargets
    structure: Structure  # parameter counts, for the memory plan
    samples: list[SampleReport]  # what the job's record pipeline made of each split's first records
    warnings: list[str]  # settings that run but are likely a mistake (validate prints them)

    @property
    def trainable_params(self) -> int:
        return self.structure.lora

    @property
    def total_params(self) -> int:
        return self.structure.total + self.structure.lora


def preflight(cfg: Config, profile: Profile | None = None) -> Preflight:
    """Every check, in the order a bad input is cheapest to find; `profile` times the three parts."""

    def timed(name: str) -> AbstractContextManager[None]:
        return profile.stage(name) if profile is not None else nullcontext()

    check_torch()  # everything below builds on it
    with timed("preflight_model"):  # hub names become cache snapshots here, once: the workers are handed paths
        resolve_names(cfg)
    model_dir = Path(cfg.model.model_name_or_path).expanduser()
    with timed("preflight_model"):  # the files first: a missing model is the most common mistake
        _check_model_dir(model_dir)
        check_safetensors_dir(model_dir)
    with timed("preflight_tokenizer"):
        tokenizer = _check_tokenizer(cfg)
    with timed("preflight_data"):
        train, validation = resolve_splits(cfg.data)
        records = _check_data(cfg, train, validation)
        samples, data_warnings = _check_samples(cfg, records, tokenizer, [s for s in (train, validation) if s])
        _check_writable("train.output_dir", Path(cfg.train.output_dir).expanduser())
        if cfg.ray.storage_path and not is_uri(cfg.ray.storage_path):
            _check_writable("ray.storage_path", Path(cfg.ray.storage_path).expanduser())
        elif cfg.ray.storage_path:
            _check_remote_writable("ray.storage_path", cfg.ray.storage_path)
        _check_resume_source(cfg)
        _check_trackers(cfg.trackers)
        tracker_warnings = _check_tracker_access(cfg)
    with timed("preflight_model"):
        from rayft.model.build import check_quantised_storage

        model, targets = _weightless_model(cfg)
        check_quantised_storage(cfg, model)
        counts = structure(model, model.config)  # walked once: the planner's `auto` and the memory plan read it
        if cfg.parallel.expert_parallel == "auto":
            from rayft.model.build import frozen_fp8

            cfg.parallel.expert_parallel = planned_expert_parallel(cfg, counts, frozen_fp8(cfg.model))
        _check_expert_parallel(cfg, model.config)
        if any(model_dir.glob("*.safetensors")):
            check_weights_match(model, model_dir)
        check_vocab(tokenizer.vocab_size, model, tokenizer_path(cfg.model))
        check_max_length(cfg, cast("PreTrainedConfig", model.config).get_text_config())
        said = (
            check_attention(cfg, model),
            lora_rank_warning(cfg, model),
            _local_placement(cfg),
            prefix_matched_hca(cfg.nccl),
        )
        warnings = [*data_warnings, *tracker_warnings, *(w for w in said if w)]
    return Preflight(train, validation, records, tokenizer, targets, counts, samples, warnings)


def check_continued_run(cfg: Config) -> str | None:
    """`rayft validate`: a local run directory holding a run this config would train on: the same model, adapter
    and settings (a remote one is checked by the job itself, where its storage is reachable); and a warning where
    that run has finished. Not part of `preflight`, which `rayft eval` shares: an evaluation reads a run, it does
    not continue it."""
    if is_uri(cfg.run_uri):
        return None
    run = RunDir(cfg.run_uri)
    if not run.has_registered_checkpoints():
        return None
    check_continuation(cfg, run.settings(), run.uri)
    final = Path(cfg.train.output_dir).expanduser() / "final"
    if not (final / "adapter_model.safetensors").is_file():
        return None
    done = last_step(run)
    if 0 < cfg.train.max_steps <= done or cfg.train.max_steps <= 0:
        return finished_run(run.uri, done, cfg.train.max_steps if cfg.train.max_steps > 0 else None)
    return None


def _local_placement(cfg: Config) -> str | None:
    """Refused for a CPU run (a config for this machine); a warning otherwise: a GPU config checked on a laptop is
    usually meant for `ray job submit`, which gives it a cluster (RAY_ADDRESS) only then."""
    problem = local_placement_problem(cfg)
    if problem and cfg.ray.use_gpu is False:
        raise ConfigError(problem)
    return f"if run without a cluster: {problem}" if problem else None


def _weightless_model(cfg: Config) -> tuple[PeftModel, LoraTargets]:
    from rayft.model.build import weightless_lora_model

    return weightless_lora_model(cfg)


def _check_expert_parallel(cfg: Config, config: Any) -> None:
    """`parallel.expert_parallel` k > 1 against the model: routed experts that split into k groups (ConfigError
    naming the valid k), before any worker starts."""
    from rayft.model.families import num_routed_experts
    from rayft.parallel.expert import check_experts

    k = cfg.parallel.expert_groups()
    if k == 1:
        return
    experts = num_routed_experts(config)
    if not experts:
        raise ConfigError(f"parallel.expert_parallel {k}: the model ({config.model_type}) has no routed experts; use 1")
    check_experts(k, experts, cfg.ray.num_workers)


def _check_data(cfg: Config, train: SplitSource, validation: SplitSource | None) -> RecordFormat:
    """Files by content first (a UTF-16 file must not be scanned as UTF-8 JSON), then the record fields across
    every record, then that a hold-out split can be cut."""
    d = cfg.data
    wanted = record_fields(d)
    budget = DecodeBudget()
    for source in (train, validation):
        if source is not None:
            source.check_content(wanted, budget)
    records = record_format(d, train.columns(wanted), train.what)
    check_objective(cfg, records, train.what)
    if validation is not None:
        record_format(d, validation.columns(wanted), validation.what)
    if records.kind in ("messages", "prompt_completion"):
        _check_chat_sample(cfg, records, [s for s in (train, validation) if s is not None])
    elif cfg.train.eval_strategy != "no":
        _check_hold_out(d, train)
    return records


def _check_samples(
    cfg: Config, records: RecordFormat, tokenizer: TokenizerFacts, sources: list[SplitSource]
) -> tuple[list[SampleReport], list[str]]:
    """Each split's first records through the job's own pipeline (rayft/data/sample.py): the reports, and the
    warnings for records it would leave out or train on without a signal."""
    reports = [sample_report(cfg, source, records, tokenizer) for source in sources]
    return reports, [w for report in reports for w in check_sample(cfg, report, records)]


def _check_chat_sample(cfg: Config, records: RecordFormat, sources: list[SplitSource]) -> None:
    """The first records of each split through the tokenizer's own chat encoding, as the job would encode them: a
    role the template does not know, a last turn that is not the assistant's or an empty loss mask is answered
    here, with the record, rather than counted as skipped after the cluster started."""
    from rayft.data.chat import ChatRefused, chat_tokens
    from rayft.data.records import chat_conversation
    from rayft.data.tokenizer import load_tokenizer

    tokenizer = None
    for source in sources:
        for where, index, record in source.sample(CHAT_SAMPLE):
            conversation = chat_conversation(record, records)
            if conversation is None:
                continue
            tokenizer = tokenizer or load_tokenizer(cfg.model)
            try:
                chat_tokens(conversation[0], tokenizer, conversation[1])
            except ChatRefused as e:
                raise ConfigError(
                    f"{where}: record {index} ({records.kind} in {source.what}): {e}; fix or drop the record, or "
                    f"point model.tokenizer_name_or_path at a tokenizer whose chat format fits"
                ) from None


def check_objective(cfg: Config, records: RecordFormat, what: str) -> None:
    """DPO trains on preference pairs and only on them; SFT cannot use pairs."""
    preference = records.kind == "preference"
    if cfg.train.objective == "dpo" and not preference:
        raise ConfigError(
            f"train.objective: dpo needs preference records (fields chosen and rejected, prompt optional); {what} "
            f"holds {records.kind} records"
        )
    if cfg.train.objective != "dpo" and preference:
        raise ConfigError(f"{what} holds preference records (chosen/rejected): set train.objective: dpo for them")


def _check_hold_out(d: DataConfig, train: SplitSource) -> None:
    """Ray's train_test_split needs at least one training record left after holding out (as Ray computes it)."""
    if d.hold_out <= 0:
        return
    rows = train.rows()
    if int(rows * (1 - d.hold_out)) < 1:
        raise ConfigError(
            f"data: {train.what} has {rows} record(s) and there is no validation split: too few to hold out "
            f"{d.hold_out:.0%} for evaluation; add records or a validation split (data.val_split), or set "
            "data.val_ratio: 0 (no evaluation)"
        )


def _check_model_dir(path: Path) -> None:
    key = "model.model_name_or_path"
    check_link(path, key)
    if not path.exists():
        raise ConfigError(
            f"{key}: {path} does not exist (a local model directory is expected; download hub models to the "
            "shared volume first)"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key}: {path} has no config.json; point it at a Hugging Face model directory")
    _check_model_type(path / "config.json")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ConfigError(f"{key}: {path} has no *.safetensors weights")


def _check_model_type(config_json: Path) -> None:
    """The model_type transformers builds the model from: one it knows (rayft runs no code shipped with a model)."""
    import difflib

    import transformers

    # the module's table (with its own additions), left out of its __all__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # type: ignore[attr-defined]

    check_json_file(config_json)
    model_type = json.loads(config_json.read_bytes()).get("model_type")
    if model_type in CONFIG_MAPPING_NAMES:
        return
    if model_type is None:
        raise ConfigError(f"{config_json}: no model_type; the model's own config.json names its architecture")
    near = difflib.get_close_matches(str(model_type), CONFIG_MAPPING_NAMES, n=3)
    hint = f" (close: {', '.join(near)})" if near else ""
    raise ConfigError(
        f"{config_json}: model_type '{model_type}' is not one transformers {transformers.__version__} knows{hint}; "
        "fix it, or upgrade transformers if the architecture is newer"
    )


def _check_tokenizer(cfg: Config) -> TokenizerFacts:
    path = Path(tokenizer_path(cfg.model)).expanduser()
    if not path.is_dir() or not has_tokenizer(path):
        raise ConfigError(
            f"model.tokenizer_name_or_path: no tokenizer in {path} (looked for {', '.join(TOKENIZER_FILES)}); "
            "set model.tokenizer_name_or_path to the directory that has one"
        )
    for name in (*TOKENIZER_FILES, "special_tokens_map.json"):
        check_json_file(path / name)
    try:
        return tokenizer_facts(cfg.model)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"model.tokenizer_name_or_path: the tokenizer in {path} does not load ({type(e).__name__}: {first}); "
            "copy its tokenizer files again from the model's source"
        ) from None


def check_json_file(path: Path) -> None:
    """A JSON file of the tokenizer that does not parse (cut short by a copy, most often), named, with the fix:
    the loaders' own message is the parser's, without the file."""
    if path.suffix != ".json" or not path.is_file():
        return
    try:
        json.loads(path.read_bytes())
    except ValueError as e:
        raise ConfigError(
            f"{path}: not valid JSON ({e}; {path.stat().st_size:,} bytes): cut short or damaged; copy it again from "
            "the model's source"
        ) from None


def _check_trackers(trackers: list[str]) -> None:
    from rayft.train.sinks import missing_tracker

    for name in trackers:
        package = missing_tracker(name)
        if package:
            raise ConfigError(
                f"train.report_to: {name} needs the {package} package, which is not installed; pip install "
                f"{package} (in the cluster's image too), or set train.report_to: none"
            )


def _check_tracker_access(cfg: Config) -> list[str]:
    """Credentials and endpoints of the trackers, as rank 0 would use them. A local cluster's workers inherit this
    environment, so a missing key is refused; a cluster joined (ray.address, RAY_ADDRESS) has its own, so there it
    is a warning."""
    from rayft.train.sinks import tracker_problem

    joins = cfg.ray.cluster_address() is not None
    warnings = []
    for name in cfg.trackers:
        found = tracker_problem(name, dict(os.environ))
        if found is None:
            continue
        problem, fatal = found
        if fatal and not joins:
            raise ConfigError(problem)
        warnings.append(problem + (" (unless the cluster's workers have it)" if fatal else ""))
    return warnings


def _check_resume_source(cfg: Config) -> None:
    """A checkpoint dir is rayft's: DCP training state under state/ (the adapter alone cannot resume), complete,
    and of this model and adapter shape (as its run recorded them)."""
    source = cfg.train.resume_from_checkpoint
    if source in (None, "latest") or is_uri(source):
        return
    path = Path(source).expanduser()
    key = "train.resume_from_checkpoint"
    if not (path / STATE_DIR / ".metadata").is_file():
        found = "does not exist" if not path.exists() else f"has no {STATE_DIR}/.metadata (not a rayft checkpoint)"
        raise ConfigError(
            f"{key}: {path} {found}; give a checkpoint-NNNNNN directory from a run's "
            "storage path, 'latest' to continue this run, or null"
        )
    try:
        problems = missing_state_files(path)
    except Exception as e:  # a damaged .metadata: unpickling can fail in many ways
        raise ConfigError(
            f"{key}: {path / STATE_DIR / '.metadata'} cannot be read ({type(e).__name__}: {e}); the checkpoint is "
            "damaged: resume from an earlier checkpoint-NNNNNN"
        ) from None
    if problems:
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        raise ConfigError(
            f"{key}: {path} is incomplete: {path / STATE_DIR}/{problems[0]}{more}, which its .metadata references; "
            "resume from an earlier checkpoint-NNNNNN (or copy this one again)"
        )
    check_checkpoint_shape(cfg, RunDir(str(path.parent)).settings(), str(path))


def _check_writable(key: str, path: Path) -> None:
    """Create something where the path would go: permission bits say nothing for root, nor for read-only mounts,
    quotas or network volumes that refuse writes."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}: cannot create {path}: {existing} is a file, not a directory")
    try:
        probe = tempfile.mkdtemp(prefix=".rayft-write-probe-", dir=existing)
    except OSError as e:
        raise ConfigError(
            f"{key}: cannot create {path}: creating anything in {existing} fails ({e.strerror}); choose a writable "
            "directory"
        ) from None
    shutil.rmtree(probe, ignore_errors=True)


def _check_remote_writable(key: str, uri: str, timeout_s: float = STORAGE_PROBE_S) -> None:
    """Write and delete a marker object where the run's checkpoints will go: a bucket that does not exist, refused
    credentials or no route from here fail now, with the key, instead of at the first checkpoint as a traceback."""
    import uuid
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as Timeout

    import pyarrow.fs as pafs

    def probe() -> None:
        fs, path = pafs.FileSystem.from_uri(uri)
        marker = f"{path.rstrip('/')}/.rayft-write-probe-{uuid.uuid4().hex}"
        with fs.open_output_stream(marker) as out:
            out.write(b"rayft")
        fs.delete_file(marker)

    pool = ThreadPoolExecutor(max_workers=1)
    try:
        pool.submit(probe).result(timeout=timeout_s)
    except Timeout:
        raise ConfigError(
            f"{key}: {uri} did not answer within {timeout_s:.0f} s (writing a probe object); check the endpoint and "
            "the network from here and from the workers"
        ) from None
    except Exception as e:  # the filesystems raise OSError, ArrowInvalid, ArrowNotImplementedError...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"{key}: writing a probe object under {uri} failed ({first}); check the bucket's name, the credentials "
            "(AWS_* / GOOGLE_APPLICATION_CREDENTIALS) and the network, from here and from the workers"
        ) from None
    finally:
        pool.shutdown(wait=False)


def planned_expert_parallel(cfg: Config, s: Structure, fp8: bool) -> int:
    """`parallel.expert_parallel: auto`: the planner's fastest layout that fits (`rayft plan` prints the table).
    The cluster is the config's: `ray.workers_per_node` workers on each of `ray.nodes` nodes; the GPU is an H200
    (the target; `rayft plan --gpu` compares others)."""
    from rayft.plan.comm import Cluster
    from rayft.plan.steptime import Hardware, choose_expert_parallel

    cluster = Cluster(nodes=cfg.ray.nodes, gpus_per_node=cfg.ray.workers_per_node)
    k = choose_expert_parallel(cfg, s, cluster, Hardware("h200"), fp8)
    log.info(
        "parallel.expert_parallel: auto → %d (the planner's fastest layout that fits %d x %d H200)",
        k,
        cluster.nodes,
        cluster.gpus_per_node,
    )
    return k
