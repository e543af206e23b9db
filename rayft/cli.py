"""`rayft train | validate | export`: exit 0 when fine, 2 for configuration/usage errors, 1 when a run fails."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import yaml

from rayft.config import Config, ConfigError, load_config

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
DEMO_ROOT = Path("rayft-demo")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rayft %(message)s", datefmt="%H:%M:%S")
    try:
        if args.command == "export":
            return _export(args)
        if args.command == "plan":
            return _plan(args)
        cfg = _load(args)
        if args.command == "validate":
            return _validate(cfg)
        return _train(cfg)
    except ConfigError as e:
        print(f"rayft: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayft", description="LoRA + FSDP2 fine-tuning on Ray Train.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("train", "fine-tune: joins the Ray cluster of `ray job submit` or starts a local one"),
        ("validate", "check the config, its paths and the LoRA targets without training"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", help="YAML file (seed recipe layout); omitted = the built-in tiny demo")
        p.add_argument(
            "--override",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="override one key, value parsed as YAML (repeatable)",
        )
    about = "per-GPU memory plan of the run for one or more cluster sizes (no GPU, no weights needed)"
    p = sub.add_parser("plan", help=about, description=about)
    p.add_argument("--config", help="YAML file; omitted = defaults (the seed recipe's values)")
    p.add_argument("--override", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--preset", choices=["mistral-small-4"], help="plan the real model without its files")
    p.add_argument("--num-nodes", type=int, nargs="+", default=[3], help="one or more cluster sizes")
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--gpu", choices=["h200", "h100"], default="h200")
    about = "copy a trained adapter, or merge it into a standalone text-only checkpoint"
    p = sub.add_parser("export", help=about, description=about)
    p.add_argument("--adapter", required=True, help="PEFT adapter dir (output_dir/final or a checkpoint's adapter/)")
    p.add_argument("--base", required=True, help="the base model directory the adapter was trained on")
    p.add_argument("--out", required=True, help="where to write the export")
    p.add_argument("--merge", action="store_true", help="fold LoRA into the weights (needs RAM for the whole model)")
    p.add_argument("--dtype", default="bfloat16", help="dtype of the merged weights (default bfloat16)")
    return parser


def _load(args: argparse.Namespace) -> Config:
    if args.config is not None:
        return load_config(args.config, args.override)
    from rayft import demo

    print(f"rayft: no --config given: running the built-in demo in ./{DEMO_ROOT}/", file=sys.stderr)
    demo_file = DEMO_ROOT / "demo.yaml"
    DEMO_ROOT.mkdir(exist_ok=True)
    demo_file.write_text(yaml.safe_dump(demo.prepare(DEMO_ROOT)))
    return load_config(demo_file, args.override)


def _plan(args: argparse.Namespace) -> int:
    from rayft.plan import format_plans, meta_structure, plan_memory

    cfg = load_config(args.config, args.override)
    config = None
    if args.preset == "mistral-small-4":
        from transformers import Mistral4Config

        config = Mistral4Config()  # transformers' defaults are Mistral-Small-4-119B-2603's text model
    elif not (Path(cfg.model.model_name_or_path) / "config.json").is_file():
        raise ConfigError(
            f"model.model_name_or_path: no config.json in {cfg.model.model_name_or_path}; "
            "point it at the model or use --preset mistral-small-4"
        )
    s = meta_structure(cfg, config)
    plans = [plan_memory(cfg, s, n * args.gpus_per_node, on_gpu=True, gpu=args.gpu) for n in args.num_nodes]
    print(format_plans(plans, s, cfg.data.max_length * cfg.train.per_device_train_batch_size))
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    from rayft.export import export

    out = export(Path(args.adapter), Path(args.base), Path(args.out), merge=args.merge, dtype=args.dtype)
    print(f"rayft: {'merged model' if args.merge else 'adapter'} written to {out}")
    return EXIT_OK


def _validate(cfg: Config) -> int:
    from rayft.preflight import preflight

    checked = preflight(cfg)
    val = checked.validation.describe() if checked.validation else f"none (holding out {cfg.data.val_ratio:.0%})"
    records = checked.records
    kind = records.kind + (", loss on completions only" if records.completion_only else "")
    packing = f"packed into {cfg.data.max_length}-token blocks" if cfg.data.packing else "padded per batch"
    print(f"config ok\n  train data: {checked.train.describe()}\n  validation: {val}")
    print(f"  records: {kind}; {packing}")
    lora = checked.lora
    print(f"  model: {lora.architecture}, {checked.total_params:,} params")
    print(
        f"  LoRA modules: {len(lora.modules)} ({', '.join(lora.names)}), trainable params {checked.trainable_params:,}"
    )
    if lora.warning:
        print(f"rayft: warning: {lora.warning}", file=sys.stderr)
    return EXIT_OK


def _train(cfg: Config) -> int:
    from ray.train import TrainingFailedError

    from rayft.launch import train

    try:
        outcome = train(cfg)
    except TrainingFailedError as e:
        print(f"rayft: training failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    shown = {k: v for k, v in outcome.metrics.items() if k in ("step", "loss", "eval_loss")}
    print(f"rayft: training finished {shown}")
    print(f"rayft: final adapter: {outcome.final_adapter}")
    print(f"rayft: checkpoints: {outcome.run_dir} (latest: {outcome.latest_checkpoint})")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
