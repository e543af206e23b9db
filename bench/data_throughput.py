"""Is the Ray Data pipeline fast enough that training never waits for it?

Two measurements, one invocation:
  pipeline   tokens/s of rayft's Ray Data pipeline alone (read parquet → tokenizer actors → pack into blocks,
             consumed on the driver) against `datasets` in one process on the same wikitext-shaped files
             (`load_dataset("parquet")` → filter empty lines → `map(tokenize, batched=True)`, and the same plus
             TRL's `pack_dataset`), alternating, median of the repeats, at two sizes; a line through the two
             splits each pipeline's time into a fixed part and a per-token rate. Ray start-up and the first
             execution of a fresh session (worker processes warming up; reported as `warmup`) are outside the
             timing; each execution's own start (tokenizer actors) is inside. Both sides load the tokenizer's
             metadata on the driver before the clock starts.
  training   the tiny demo training run (2 CPU workers, packing on): the share of step time spent waiting for
             the next batch, from the run's metrics.jsonl (the wait before the very first batch is start-up and
             reported apart).

    python bench/data_throughput.py [--size small|default] [--out bench/results/data_throughput_cpu.json]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from _common import cli, machine

# ~5.8M and ~23M tokens: twice and eight times wikitext-2 (the seeds' dataset), to separate fixed from per-token cost
SIZES = {
    "default": {"articles": [25000, 100000], "repeats": 2, "train": True},
    "small": {"articles": [200], "repeats": 1, "train": False},
}
MAX_LENGTH = 1024


def _config(model: Path, dataset: Path) -> dict:
    from rayft import demo

    raw = demo.demo_config(model.parent)
    raw["model"]["model_name_or_path"] = str(model)
    raw["data"].update(dataset_name_or_path=str(dataset), max_length=MAX_LENGTH, packing=True, cache_tokenized=False)
    return raw


def ray_pipeline(raw: dict) -> dict:
    from functools import partial

    from rayft.config import Config
    from rayft.data.pipeline import actors_at_start, configure_ray_data, finished, read_split, tokenized
    from rayft.data.records import record_fields, record_format
    from rayft.data.sources import resolve_splits
    from rayft.data.tokenizer import tokenizer_facts

    cfg = Config.from_dict(raw)
    configure_ray_data()  # as in training
    tokenizer = tokenizer_facts(cfg.model)  # the driver's look at the tokenizer (preflight's), like datasets_map's
    started = time.perf_counter()
    source, _ = resolve_splits(cfg.data)
    fmt = record_format(cfg.data, source.columns(record_fields(cfg.data)), source.what)
    tokenize = partial(tokenized, fmt=fmt, model=cfg.model, data=cfg.data, tokenizer=tokenizer,
                       actors_at_start=actors_at_start(cfg))  # as training's at this cluster size  # fmt: skip
    blocks = tokens = 0
    for batch in finished(tokenize(read_split(source), source.format), cfg.data).iter_batches(batch_format="pyarrow"):
        blocks += batch.num_rows
        tokens += len(batch.column("input_ids").combine_chunks().flatten())
    return {"seconds": time.perf_counter() - started, "tokens": tokens, "rows": blocks}


def datasets_map(raw: dict, pack: bool) -> dict:
    import datasets
    from trl.data_utils import pack_dataset

    from rayft.config import ModelConfig
    from rayft.data.tokenizer import load_tokenizer

    datasets.disable_progress_bars()
    tok = load_tokenizer(ModelConfig(**raw["model"]))
    files = sorted(str(p) for p in Path(raw["data"]["dataset_name_or_path"]).glob("*/train-*.parquet"))
    started = time.perf_counter()
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=tempfile.mkdtemp())
    ds = ds.filter(lambda b: [bool(t.strip()) for t in b["text"]], batched=True)

    def tokenize(batch: dict) -> dict:
        ids = tok(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [[tok.bos_token_id, *i, tok.eos_token_id] for i in ids]}

    ds = ds.map(tokenize, batched=True, remove_columns=["text"])
    if pack:
        ds = pack_dataset(ds, MAX_LENGTH, strategy="wrapped")
    tokens = sum(len(i) for i in ds["input_ids"])
    return {"seconds": time.perf_counter() - started, "tokens": tokens, "rows": len(ds)}


def training_wait(root: Path) -> dict:
    """The demo's training run; data wait from metrics.jsonl (per logging window, slowest rank)."""
    from rayft import demo
    from rayft.config import Config
    from rayft.launch import train
    from rayft.train.rundir import RunDir

    raw = demo.prepare(root / "demo")
    raw["train"].update(output_dir=str(root / "demo-out"), logging_steps=1, eval_strategy="no", save_strategy="no")
    cfg = Config.from_dict(raw)
    train(cfg)
    return wait_summary(RunDir(cfg.run_uri).read_metrics())


def wait_summary(rows: list[dict]) -> dict:
    """Share of training time spent waiting for data, from metrics.jsonl rows (each row's share covers the window
    since the previous row; `elapsed_s` is cumulative)."""
    rows = [r for r in rows if "data_wait_share" in r]
    elapsed = [r["elapsed_s"] - (rows[i - 1]["elapsed_s"] if i else 0.0) for i, r in enumerate(rows)]
    waited = [r["data_wait_share"] * e for r, e in zip(rows, elapsed, strict=True)]
    return {
        "steps": rows[-1]["step"],
        "data_wait_share": round(sum(waited) / sum(elapsed), 4),
        "data_wait_share_max_window": round(max(r["data_wait_share"] for r in rows), 4),
        "first_batch_wait_s": rows[0].get("first_batch_wait_s"),
        "train_s": round(sum(elapsed), 2),
    }


def warm_up(root: Path, model: Path) -> dict:
    """One small run of each pipeline before any timing. A fresh Ray session's first execution also starts and
    warms its worker processes (imports, file cache): a once-per-cluster cost, recorded here, not a per-run one."""
    from rayft import demo

    raw = _config(model, demo.make_wikitext(root / "wikitext-warmup", train_articles=200, val_articles=4, seed=2))
    return {"ray_data_first_execution_s": round(ray_pipeline(raw)["seconds"], 2),
            "datasets_map_first_s": round(datasets_map(raw, pack=True)["seconds"], 2)}  # fmt: skip


def pipeline_at(root: Path, model: Path, articles: int, repeats: int) -> dict:
    """The three pipelines alternating on one dataset size; medians and ratios."""
    from rayft import demo

    dataset = demo.make_wikitext(root / f"wikitext-{articles}", train_articles=articles, val_articles=4, seed=1)
    raw = _config(model, dataset)
    runs: dict[str, list[dict]] = {"ray_data": [], "datasets_map": [], "datasets_map_trl_pack": []}
    for _ in range(repeats):  # alternating, so drift on a noisy machine hits all three alike
        runs["ray_data"].append(ray_pipeline(raw))
        runs["datasets_map"].append(datasets_map(raw, pack=False))
        runs["datasets_map_trl_pack"].append(datasets_map(raw, pack=True))
    pipeline = {
        name: {
            "tokens": rs[0]["tokens"],
            "rows": rs[0]["rows"],
            "seconds_median": round(statistics.median(r["seconds"] for r in rs), 3),
            "tokens_per_s": round(rs[0]["tokens"] / statistics.median(r["seconds"] for r in rs)),
        }
        for name, rs in runs.items()
    }
    ray_tps = pipeline["ray_data"]["tokens_per_s"]
    return {
        "articles": articles,
        "pipeline": pipeline,
        "ratio_ray_vs_datasets_map": round(ray_tps / pipeline["datasets_map"]["tokens_per_s"], 3),
        "ratio_ray_vs_datasets_map_trl_pack": round(ray_tps / pipeline["datasets_map_trl_pack"]["tokens_per_s"], 3),
        "runs": runs,
    }


def fixed_and_marginal(sizes: list[dict], name: str) -> dict:
    """Fit seconds = fixed + tokens / marginal rate through the smallest and largest size."""
    (t1, s1), (t2, s2) = ((c["pipeline"][name]["tokens"], c["pipeline"][name]["seconds_median"]) for c in
                          (sizes[0], sizes[-1]))  # fmt: skip
    rate = (t2 - t1) / (s2 - s1) if s2 > s1 else float("inf")
    return {"fixed_s": round(s1 - t1 / rate, 2), "marginal_tokens_per_s": round(rate)}


def run(size: str) -> dict:
    import ray

    from rayft import demo
    from rayft.config import Config

    s = SIZES[size]
    root = Path(tempfile.mkdtemp(prefix="rayft-data-bench-"))
    model = demo.make_tiny_mistral(root / "tiny-mistral")
    ray.init(num_cpus=8, logging_level="ERROR", log_to_driver=False)
    try:
        warmup = warm_up(root, model)
        sizes = [pipeline_at(root, model, articles, s["repeats"]) for articles in s["articles"]]
    finally:
        ray.shutdown()
    report = {
        **machine(),
        "settings": {
            **s,
            "max_length": MAX_LENGTH,
            "tokenize_workers": Config.from_dict(_config(model, root)).data.tokenize_workers,
            "tokenizer": "tekken (mistral-common, 131k vocab)",
        },
        "warmup": warmup,
        "sizes": sizes,
    }
    if len(sizes) > 1:
        report["fit"] = {name: fixed_and_marginal(sizes, name) for name in sizes[0]["pipeline"]}
    if s["train"]:
        report["training"] = training_wait(root)
    return report


if __name__ == "__main__":
    cli(__doc__, SIZES, run, "data_throughput_cpu.json")
