"""`rayft train | validate | eval | plan | export | k8s render | k8s validate | config from-accelerate`.

Exit 0 when fine, 2 for configuration/usage errors, 1 when a run fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import sys
import traceback
import typing
from pathlib import Path

import yaml

from rayft import environment
from rayft.config import Config, ConfigError, load_config, parse_override
from rayft.gpus import GPUS
from rayft.logs import LEVEL_ENV, quiet_console, verbose

if typing.TYPE_CHECKING:
    from rayft.data.sample import SampleReport
    from rayft.deploy.k8s import Deployment
    from rayft.kube.settings import K8sConfig
    from rayft.model.frozen import Held
    from rayft.plan.comm import Cluster
    from rayft.plan.memory import MemoryPlan
    from rayft.plan.steptime import Hardware, LayoutPlan
    from rayft.plan.structure import Structure

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 0, 1, 2, 130
DEMO_ROOT = Path("rayft-demo")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    unusable = environment.problems(exempt=_config_variable(args))
    if unusable:
        for problem in unusable:
            print(f"rayft: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    if args.verbose:  # also for the workers: the launcher hands RAYFT_LOG_LEVEL to their environment
        os.environ[LEVEL_ENV] = "DEBUG"
    logging.basicConfig(
        level=logging.DEBUG if verbose() else logging.INFO, format="%(asctime)s rayft %(message)s", datefmt="%H:%M:%S"
    )
    quiet_console()
    try:
        if args.command == "export":
            return _export(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "k8s":
            return _k8s(args, argv if argv is not None else sys.argv[1:])
        if args.command == "config":
            return _config(args)
        cfg = _load(args)
        if args.command == "validate":
            return _validate(cfg, args)
        if args.command == "eval":
            return _eval(cfg, args)
        return _train(cfg, demo=args.config is None)
    except ConfigError as e:
        if args.verbose:
            traceback.print_exc()
        print(f"rayft: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt as e:
        print(f"rayft: interrupted{f': {e}' if str(e) else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED


def _config_variable(args: argparse.Namespace) -> list[str]:
    """The variable `--config env:NAME` reads the config from (any name the user chooses)."""
    given = str(getattr(args, "config", None) or "")
    return [given.removeprefix("env:")] if given.startswith("env:") else []


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage mistakes are one line (argparse prints the whole usage block first)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_CONFIG, f"{self.prog}: {message} (`{self.prog} --help` lists the options)\n")


def _parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = _Parser(
        prog="rayft",
        description="LoRA + FSDP2 fine-tuning on Ray Train.",
        epilog="exit codes: 0 ok, 2 usage or configuration error (the message names the key or path), 1 the run "
        "failed. `rayft COMMAND --help` for each command.",
    )
    # Accepted before or after the command (`rayft --verbose validate`, `jobs/mistral4.py --verbose`).
    common = _Parser(add_help=False)
    common.add_argument(
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="a configuration error's traceback too, and Ray's routine log lines",
    )
    parser.add_argument("--verbose", action="store_true", default=False, help=common._actions[0].help)
    sub = parser.add_subparsers(dest="command", required=True)
    _job_parsers(sub, common)
    _plan_parser(sub, common)
    _export_parser(sub, common)
    _k8s_parser(sub, common)
    _config_parser(sub, common)
    return parser


def _job_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """train, validate and eval: a config and overrides each, and their own few flags."""
    for name, help_text in (
        ("train", "fine-tune: joins the Ray cluster of `ray job submit` or starts a local one"),
        ("validate", "check config, data, tokenizer and LoRA targets and print the memory plan; no cluster, no GPU"),
        (
            "eval",
            "perplexity of the base model, or base + a trained adapter, on one split (on the Ray cluster); "
            "on preference pairs (train.objective: dpo) the DPO loss and reward metrics against the base",
        ),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[common])
        p.add_argument("--config", help="YAML file (seed recipe layout); omitted = the built-in tiny demo")
        p.add_argument(
            "--override",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="override one key, value parsed as YAML (repeatable)",
        )
        if name == "validate":
            p.add_argument("--gpu", choices=list(GPUS), default="h200", help="GPU the memory plan is for")
        if name == "eval":
            p.add_argument("--adapter", type=Path, help="PEFT adapter dir (output_dir/final); omitted = base model")
            p.add_argument("--split", help="split to score (default: data.val_split)")
            p.add_argument(
                "--with-base",
                action="store_true",
                help="with --adapter: score the base model too, in the same job (one load)",
            )


def _plan_context_arguments(p: argparse.ArgumentParser) -> None:
    """`rayft plan`'s sequence lengths and context-parallel degree."""
    p.add_argument(
        "--max-length",
        type=int,
        nargs="+",
        metavar="TOKENS",
        help="tokens per sequence (data.max_length), one or more: each planned in turn",
    )
    p.add_argument(
        "--context-parallel",
        metavar="N|auto",
        type=_context_parallel,
        help="split each packed row over N GPUs (parallel.context_parallel; default: the config's); auto: for each "
        "--max-length, the fewest GPUs and the N that fit, searched over the model's divisors of its heads",
    )


def _context_parallel(value: str) -> str:
    """`--context-parallel`: a positive integer or `auto`."""
    if value == "auto" or (value.isdigit() and int(value) >= 1):
        return value
    raise argparse.ArgumentTypeError(f"a positive integer or auto, got {value!r}")


def _plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    about = (
        "per-GPU memory plan of the run for one or more cluster sizes, and each layout's bytes moved and step "
        "time (no GPU, no weights needed)"
    )
    p = sub.add_parser("plan", help=about, description=about, parents=[common])
    p.add_argument("--config", help="YAML file; omitted = defaults (the seed recipe's values)")
    p.add_argument("--override", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--preset", choices=["mistral-small-4"], help="plan the real model without its files")
    p.add_argument(
        "--num-nodes",
        type=int,
        nargs="+",
        help="one or more cluster sizes (default: ray.num_workers / ray.workers_per_node)",
    )
    p.add_argument("--gpus-per-node", type=int, help="GPUs (workers) a node (default: ray.workers_per_node)")
    p.add_argument(
        "--gpu",
        choices=list(GPUS),
        default="h200",
        help="GPU: its memory, dense bf16 peak, memory bandwidth and NVLink (rayft/gpus.py)",
    )
    # Defaults (None here, so `rayft --help` needs no torch): rayft.plan.steptime.Hardware's.
    p.add_argument("--mfu", type=float, help="share of the peak FLOP/s the matmuls reach, assumed (default 0.4)")
    p.add_argument(
        "--interconnect-gbps",
        type=float,
        metavar="GBIT_S",
        help="inter-node network per GPU in gigaBITS per second, each direction "
        "(default 400: one 400G InfiniBand NIC per GPU)",
    )
    p.add_argument(
        "--intra-node-gbps",
        type=float,
        metavar="GBYTE_S",
        help="NVLink per GPU in gigaBYTES per second, both directions together as NVIDIA quotes it "
        "(default: the GPU's, e.g. 900 for H100/H200 SXM); half of it is what a GPU receives",
    )
    p.add_argument(
        "--storage-gbps",
        type=float,
        metavar="GBYTE_S",
        help="what the shared volume reads and writes in aggregate, in gigaBYTES per second, for the cost of a "
        "preemption (default 2)",
    )
    _plan_context_arguments(p)
    p.add_argument(
        "--no-layouts",
        dest="layouts",
        action="store_false",
        help="the memory table only, without the layouts' communication and step time",
    )


def _export_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    about = "copy a trained adapter, or merge it into a standalone text-only checkpoint"
    p = sub.add_parser("export", help=about, description=about, parents=[common])
    p.add_argument("--adapter", required=True, help="PEFT adapter dir (output_dir/final or a checkpoint's adapter/)")
    p.add_argument("--base", required=True, help="the base model directory the adapter was trained on")
    p.add_argument("--out", required=True, help="where to write the export")
    p.add_argument("--merge", action="store_true", help="fold LoRA into the weights (needs RAM for the whole model)")
    p.add_argument(
        "--dtype", default=None, help="dtype of the merged weights (default: the base's own; bfloat16 for an FP8 base)"
    )


def _config_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    config = sub.add_parser("config", help="write a rayft config from other tools' files")
    actions = config.add_subparsers(dest="action", required=True)
    about = (
        "the rayft config doing what an accelerate launch config (FSDP) and a TRL/SFT training YAML did: "
        "processes become Ray workers, fsdp_* the fsdp section, the SFT keys model/lora/data/train"
    )
    p = actions.add_parser("from-accelerate", help=about, description=about, parents=[common])
    p.add_argument("accelerate", help="accelerate config (accelerate config / fsdp.yaml)")
    p.add_argument("--trl", help="the TRL/SFT training YAML (sections model/lora/data/train, or SFTConfig's flat keys)")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="set one key of the written config (repeatable)",
    )
    p.add_argument(
        "--accept-differences",
        action="store_true",
        help="write the config even where rayft trains otherwise than TRL (each difference is listed)",
    )
    p.add_argument("--out", help="where to write the config (default: stdout)")


def _config(args: argparse.Namespace) -> int:
    from rayft.config_import import convert, to_yaml

    raw, notes = convert(args.accelerate, args.trl, args.override, args.accept_differences)
    text = to_yaml(raw, notes, args.accelerate, args.trl)
    for note in notes:
        print(f"rayft: note: {note}", file=sys.stderr)
    if args.out is None:
        print(text, end="")
    else:
        Path(args.out).write_text(text)
        print(f"rayft: wrote {args.out} (check it with: rayft validate --config {args.out})", file=sys.stderr)
    return EXIT_OK


def _k8s_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    from rayft.deploy.flags import KUBERAY_FLAGS, PLATFORM_FLAGS, add_flags
    from rayft.deploy.k8s import Deployment

    d = Deployment()
    k8s = sub.add_parser("k8s", help="KubeRay manifests: render them from the config, validate them")
    actions = k8s.add_subparsers(dest="action", required=True)
    about = "write the RayJob and RayCluster for a config (worker pods, GPUs, paths and entrypoint from it)"
    p = actions.add_parser("render", help=about, description=about, parents=[common])
    p.add_argument("--config", required=True, help="the training YAML (under jobs/ to be baked into the image)")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key; also passed to the job's entrypoint",
    )
    p.add_argument("--out", help="directory for rayjob.yaml and raycluster.yaml (default: both to stdout)")
    p.add_argument("--config-in-cluster", help="the config's path on the PVC when it is not under jobs/")
    _deployment_flags(p, d)
    about = "also render a PodMonitor (head and workers) and rayft's Grafana dashboard as a ConfigMap"
    p.add_argument("--monitoring", action="store_true", default=None, help=about)
    group = p.add_argument_group("platform (add to or override the config's k8s: section)")
    add_flags(group, (*PLATFORM_FLAGS, *KUBERAY_FLAGS))
    about = "check manifests against the KubeRay CRDs (strict) and the operator's rules"
    p = actions.add_parser("validate", help=about, description=about, parents=[common])
    p.add_argument("files", nargs="+", type=Path)
    add_flags(p, KUBERAY_FLAGS)


# `rayft k8s render` flags, one per field of rayft.deploy.k8s.Deployment (its default shown in the help).
DEPLOYMENT_FLAGS = {
    "name": "RayJob name (the RayCluster gets -cluster appended)",
    "namespace": "Kubernetes namespace",
    "image": "the rayft image (cluster/Containerfile)",
    "pvc": "PersistentVolumeClaim with models, data and checkpoints (ReadWriteMany)",
    "mount_path": "where the PVC is mounted on every pod",
    "gpus_per_pod": "GPUs per worker pod, one Ray worker each (default: ray.workers_per_node, which it must equal)",
    "gpu_resource": "the GPU extended resource",
    "worker_cpus": "CPUs per GPU pod, tokenization included (default: the node's CPUs per GPU × the pod's GPUs)",
    "worker_memory": "memory per GPU pod, /dev/shm included (default: the node's memory per GPU × the pod's GPUs)",
    "shm_size": "size of the memory-backed /dev/shm",
    "head_cpus": "CPUs of the head pod (driver, dashboard)",
    "head_memory": "memory of the head pod",
    "head_shm_size": "size of the head's memory-backed /dev/shm",
    "ib_hca": "NCCL_IB_HCA where nccl.ib_hca is unset, with a fabric: '=mlx5_0,mlx5_1' names adapters exactly "
    "(default: NCCL's choice)",
    "pre_running_deadline_s": "seconds the RayJob may take to start running (before KubeRay 1.6: kept by the "
    "rendered start watcher, a small Job beside the RayJob)",
    "active_deadline_s": "seconds the RayJob may run",
    "ttl_after_finished_s": "seconds the finished cluster is kept (for its logs)",
    "backoff_limit": "fresh clusters after a failed job (default: 1, or 0 with ray.max_failures: -1)",
    "prometheus_host": "RAY_PROMETHEUS_HOST on the head: the in-cluster Prometheus URL the dashboard queries",
    "grafana_host": "RAY_GRAFANA_HOST on the head: the in-cluster Grafana URL the dashboard checks",
    "grafana_iframe_host": "RAY_GRAFANA_IFRAME_HOST on the head: the Grafana URL the browser loads panels from",
}


def _deployment_flags(p: argparse.ArgumentParser, d: Deployment) -> None:
    """One flag per `DEPLOYMENT_FLAGS` field: its type and metavar from the Deployment default's."""
    hints = typing.get_type_hints(type(d))
    for field, text in DEPLOYMENT_FLAGS.items():
        default = getattr(d, field)
        flag = "--" + field.removesuffix("_s").replace("_after_finished", "").replace("_", "-")
        kind = int if int in (hints[field], *typing.get_args(hints[field])) else str
        metavar = "SECONDS" if field.endswith("_s") else "N" if kind is int else "VALUE"
        shown = "" if default is None or "default" in text else f" (default {default})"
        p.add_argument(flag, dest=field, type=kind, metavar=metavar, help=f"{text}{shown}")


def _load(args: argparse.Namespace) -> Config:
    if args.config is not None:
        return load_config(args.config, args.override)
    for item in args.override:  # a mistake in one is answered before the demo's files are made
        parse_override(item)
    from rayft import demo

    print(f"rayft: no --config given: running the built-in demo in ./{DEMO_ROOT}/", file=sys.stderr)
    demo_file = DEMO_ROOT / "demo.yaml"
    DEMO_ROOT.mkdir(exist_ok=True)
    demo_file.write_text(yaml.safe_dump(demo.prepare(DEMO_ROOT)))
    return load_config(demo_file, args.override)


def _plan(args: argparse.Namespace) -> int:
    from rayft.model.build import checkpoint_held, held_as
    from rayft.plan.long_context import fewest_gpus, format_fits, with_context
    from rayft.plan.steptime import Hardware

    cfg = load_config(args.config, args.override)
    if args.num_nodes is None:
        args.num_nodes = [cfg.ray.nodes]
    if args.gpus_per_node is None:
        args.gpus_per_node = cfg.ray.workers_per_node
    for flag, values in (
        ("--num-nodes", args.num_nodes),
        ("--gpus-per-node", [args.gpus_per_node]),
        ("--max-length", args.max_length or [1]),
    ):
        if any(n < 1 for n in values):
            raise ConfigError(f"{flag} must be >= 1, got {' '.join(map(str, values))}")
    s = _plan_structure(cfg, args.preset)
    # The preset stands for the hub checkpoint, which is FP8: `auto` keeps it FP8. The checkpoint's config is read
    # once, for both.
    filed = checkpoint_held(cfg.model, True if args.preset else None)
    held = held_as(cfg.model, checkpoint_fp8=filed == "fp8")
    given = {"mfu": args.mfu, "inter_gbits": args.interconnect_gbps, "intra_gbytes": args.intra_node_gbps}
    hw = Hardware(args.gpu, **{k: v for k, v in given.items() if v is not None})
    if cfg.ray.use_gpu is False:  # the plan is a GPU cluster's; say so rather than judge a CPU run by it
        print(
            f"rayft plan: the config trains on CPU workers (ray.use_gpu: false); below is the same run on "
            f"{args.gpu} GPUs, for a GPU cluster (`rayft validate` gives the CPU workers' host memory)"
        )
    auto = args.context_parallel == "auto"
    context = cfg.parallel.context_parallel if auto or args.context_parallel is None else int(args.context_parallel)
    _check_context(context, s, [n * args.gpus_per_node for n in args.num_nodes], auto)
    for i, length in enumerate(args.max_length or [cfg.data.max_length]):
        run = with_context(cfg, context, length)
        print("" if i == 0 else "\n", end="")
        if auto:
            print(format_fits(run, s, hw, fewest_gpus(run, s, hw, held, args.gpus_per_node), args.gpus_per_node))
        else:
            _plan_tables(run, s, args, hw, (held, filed))
    return EXIT_OK


def _plan_structure(cfg: Config, preset: str | None) -> Structure:
    """The model's structure on the meta device: the preset's config, or the model directory's."""
    from rayft.plan import meta_structure

    config = None
    if preset == "mistral-small-4":
        from transformers import Mistral4Config

        config = Mistral4Config()  # transformers' defaults are Mistral-Small-4-119B-2603's text model
    elif not (Path(cfg.model.model_name_or_path) / "config.json").is_file():
        raise ConfigError(
            f"model.model_name_or_path: no config.json in {cfg.model.model_name_or_path}; "
            "point it at the model or use --preset mistral-small-4"
        )
    return meta_structure(cfg, config)


def _check_context(context: int, s: Structure, worlds: list[int], auto: bool) -> None:
    """ConfigError for a context-parallel degree the model's heads or a cluster size cannot take (`auto` searches
    its own sizes)."""
    if context > 1 and s.heads % context:
        valid = [d for d in range(1, s.heads + 1) if s.heads % d == 0]
        raise ConfigError(
            f"--context-parallel {context} must divide the model's {s.heads} attention heads; valid: {valid}"
        )
    uneven = [w for w in worlds if w % context]
    if context > 1 and uneven and not auto:
        raise ConfigError(
            f"--context-parallel {context} must divide the workers of every cluster size; "
            f"{' '.join(map(str, uneven))} GPU(s) do not split into groups of {context}"
        )


def _plan_tables(cfg: Config, s: Structure, args: argparse.Namespace, hw: Hardware, storage: tuple[Held, Held]) -> None:
    """The memory table for every cluster size, then each size's layouts, activation checkpointing and what a
    preemption costs."""
    from rayft.plan import format_plans, plan_memory
    from rayft.plan.comm import Cluster
    from rayft.plan.memory import choose_recompute
    from rayft.plan.report import format_layouts, format_recompute
    from rayft.plan.steptime import fastest_fitting, plan_layouts
    from rayft.plan.ulysses import degree

    held, filed = storage

    def plans(held: Held) -> list[MemoryPlan]:
        """FSDP over each cluster size, with the recompute `fsdp.activation_checkpointing` asks or chooses there."""
        fp8 = hw.multiplies_fp8(cfg, held)
        worlds = [n * args.gpus_per_node for n in args.num_nodes]
        chosen = [choose_recompute(cfg, s, w, True, args.gpu, held, fp8_compute=fp8) for w in worlds]
        return [plan_memory(cfg, s, w, True, args.gpu, held, 1, r, fp8) for w, r in zip(worlds, chosen, strict=True)]

    beside = _storage_beside(held, bool(s.fp8))
    batch = (cfg.train.per_device_train_batch_size, cfg.data.max_length)
    tokens = -(-batch[0] * batch[1] // degree(cfg))
    print(format_plans(plans(held), s, tokens, plans(beside) if beside else None, batch, degree(cfg)))
    if args.layouts:
        for nodes in args.num_nodes:
            cluster = Cluster(nodes, args.gpus_per_node)
            layouts = [p for h in (held, beside) if h for p in plan_layouts(cfg, s, cluster, hw, h)]
            print("\n" + format_layouts(cfg, s, cluster, hw, layouts))
            print(format_recompute(cfg, s, fastest_fitting(layouts) or layouts[0], cluster, hw))
            print(_preemption_lines(cfg, s, cluster, layouts, args.storage_gbps, (args.gpu, held, filed)))


def _storage_beside(held: Held, fp8_holds_any: bool) -> Held | None:
    """The base storage `rayft plan` shows beside the config's, for the choice it is: FP8 beside NF4, FP8 beside
    bf16 and back; none for a model FP8 would hold nothing of."""
    if held == "nf4":
        return "fp8"
    return ("dtype" if held == "fp8" else "fp8") if fp8_holds_any else None


def _preemption_lines(
    cfg: Config,
    s: Structure,
    cluster: Cluster,
    layouts: list[LayoutPlan],
    storage_gbps: float | None,
    stored: tuple[str, Held, Held],
) -> str:
    """What a preemption costs the fastest layout that fits (`rayft.plan.preemption`), and how far an elastic run
    can shrink on `stored`: the GPU, how the config holds the base, and how the checkpoint's files hold it."""
    from rayft.plan.preemption import STORAGE_GBYTES_S, format_preemption, preemption_cost, smallest_group
    from rayft.plan.steptime import fastest_fitting

    gpu, held, filed = stored
    best = fastest_fitting(layouts) or layouts[0]
    cost = preemption_cost(cfg, s, filed, best.layout, cluster, storage_gbps or STORAGE_GBYTES_S)
    smallest = smallest_group(cfg, s, gpu, held) if cfg.ray.elastic else None
    step_s = best.time.predicted_s if best.fits else None
    return format_preemption(cfg, cost, cluster.world, step_s, smallest, gpu)


def _k8s(args: argparse.Namespace, argv: list[str]) -> int:
    from rayft.deploy import auth
    from rayft.deploy.crd import ManifestError, crd_dir, validate, validate_file
    from rayft.deploy.flags import KUBERAY_FLAGS, flags_set, given
    from rayft.deploy.k8s import operator, to_yaml
    from rayft.kube.settings import K8sConfig
    from rayft.schema import checked

    if args.action == "validate":
        plat = checked("k8s", K8sConfig, given(args, KUBERAY_FLAGS), flags_set(args, KUBERAY_FLAGS))
        try:
            problems = [p for f in args.files for p in validate_file(f, operator(plat))]
        except ManifestError as e:
            raise ConfigError(str(e)) from e
        for problem in problems:
            print(problem, file=sys.stderr)
        print(f"rayft: {len(args.files)} file(s): {'invalid' if problems else 'valid'}")
        return EXIT_CONFIG if problems else EXIT_OK
    manifests, plat, said = render_manifests(args)
    kuberay = operator(plat)
    try:
        problems = [f"{kind}: {p}" for kind, doc in manifests.items() for p in validate(doc, kuberay, crd_dir(kuberay))]
    except ManifestError as e:  # a manifest not checked is not written: no silent skip
        raise ConfigError(str(e)) from e
    if problems:  # the k8s: section's objects and the patches are checked here too
        raise ConfigError(
            "rendered manifests fail validation (check k8s.tolerations, k8s.affinity, k8s.volumes and the "
            "patches):\n  " + "\n  ".join(problems)
        )
    for note in said:
        print(f"rayft: note: {note}", file=sys.stderr)
    warned = [w for w in [auth.warning(plat)] if w]
    for warning in warned:
        print(f"rayft: warning: {warning}", file=sys.stderr)
    if args.out is None:
        print(_render_header(argv, said, warned) + "---\n".join(to_yaml(doc) for doc in manifests.values()), end="")
        return EXIT_OK
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for kind, doc in manifests.items():  # the notes are the RayJob's, the warnings every file's
        header = _render_header(argv, said if kind == "rayjob" else [], warned)
        (out / f"{kind}.yaml").write_text(header + to_yaml(doc))
        print(f"rayft: wrote {out / f'{kind}.yaml'}")
    return EXIT_OK


def render_manifests(args: argparse.Namespace) -> tuple[dict[str, dict[str, typing.Any]], K8sConfig, list[str]]:
    """The manifests `rayft k8s render` writes, the platform settings (the config's plus the flags) they are
    rendered for, and the notes to print beside them."""
    from rayft.deploy import patch, platform
    from rayft.deploy.flags import KUBERAY_FLAGS, PLATFORM_FLAGS, flags_set, given
    from rayft.deploy.k8s import JobSource, check_fits, config_in_cluster, deployment_from_flags, notes, render

    cfg = load_config(args.config, args.override)
    dep = deployment_from_flags(**{k: v for k, v in vars(args).items() if k in _deployment_fields()})
    base = dataclasses.replace(  # the config's patch files are relative to the config, the flags' to here
        cfg.k8s, patches=[str(Path(args.config).parent / p) for p in cfg.k8s.patches]
    )
    flags = (*PLATFORM_FLAGS, *KUBERAY_FLAGS)
    plat = platform.with_flags(base, given(args, flags), flags_set(args, flags))
    if plat.config_delivery == "inline":
        job = JobSource("", tuple(args.override), inline=Path(args.config).read_text())
    elif plat.config_delivery == "working_dir":
        job = JobSource(Path(args.config).name, tuple(args.override))  # the job's cwd is the working_dir
    else:
        repo = Path(__file__).resolve().parents[1]
        job = JobSource(
            config_in_cluster(Path(args.config), repo, dep.mount_path, args.config_in_cluster), tuple(args.override)
        )
    pods = check_fits(cfg, dep, plat)
    manifests = render(cfg, job, dep, pods, plat)
    for path in plat.patches:
        manifests = patch.apply_file(manifests, Path(path))
    return manifests, plat, notes(plat, pods, dep, cfg.nccl)


def _deployment_fields() -> set[str]:
    import dataclasses

    from rayft.deploy.k8s import Deployment

    return {f.name for f in dataclasses.fields(Deployment)}


def _render_header(argv: list[str], notes: list[str], warnings: list[str]) -> str:
    shown = []
    skip = False
    for arg in argv:  # the command that reproduces the file, minus where it was written
        if skip or arg == "--out":
            skip = not skip
            continue
        if not arg.startswith("--out="):
            shown.append(arg)
    return (
        f"# Rendered by: rayft {' '.join(shlex.quote(a) for a in shown)}\n"
        "# Change the config or the flags and render again; do not edit by hand.\n"
        + "".join(f"# Warning: {warning}\n" for warning in warnings)
        + "".join(f"# Note: {note}\n" for note in notes)
    )


def _export(args: argparse.Namespace) -> int:
    from rayft.export import export

    out = export(Path(args.adapter), Path(args.base), Path(args.out), merge=args.merge, dtype=args.dtype)
    print(f"rayft: {'merged model' if args.merge else 'adapter'} written to {out}")
    return EXIT_OK


def _eval(cfg: Config, args: argparse.Namespace) -> int:
    from ray.train import TrainingFailedError

    from rayft.launch import evaluate

    split = args.split or cfg.data.val_split or "validation"
    if args.with_base and not args.adapter:
        raise ConfigError("--with-base compares the base model with an adapter: add --adapter DIR (output_dir/final)")
    if args.with_base and cfg.train.objective == "dpo":
        raise ConfigError("--with-base: train.objective dpo already scores the adapter against the base; leave it out")
    try:
        result = evaluate(cfg, args.adapter, split, with_base=args.with_base)
    except TrainingFailedError as e:
        print(f"rayft: eval failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    if args.with_base:
        print(eval_summary({**result["base"], "rows": result["rows"], "split": split}, adapter=False))
    print(eval_summary(result, adapter=bool(args.adapter)))
    return EXIT_OK


def eval_summary(result: dict[str, typing.Any], adapter: bool) -> str:
    """The result line of `rayft eval`; perplexity is null when the loss is not finite (an empty split) or
    overflows exp()."""
    model = "base + adapter" if adapter else "base model"
    if "eval_rewards/margins" in result:  # preference pairs: rewards of base + adapter against the base alone
        shown = [k for k in result if k.startswith("eval_") and "/" in k]
        rewards = ", ".join(f"{k.removeprefix('eval_')} {result[k]:.4f}" for k in shown)
        return (
            f"rayft: eval {model} on '{result['split']}' ({result['rows']:,} pairs): DPO loss "
            f"{result['eval_loss']:.4f}, {rewards}"
        )
    ppl = result.get("eval_perplexity")
    perplexity = f"{ppl:.3f}" if ppl is not None else "n/a (the loss is not a finite number below 700)"
    return (
        f"rayft: eval {model} on '{result['split']}' ({result['rows']:,} rows): loss {result['eval_loss']:.4f}, "
        f"perplexity {perplexity}"
    )


def _validate(cfg: Config, args: argparse.Namespace) -> int:
    from rayft.deploy import auth
    from rayft.model.build import held_as
    from rayft.preflight import check_continued_run, preflight

    checked = preflight(cfg)
    finished = check_continued_run(cfg)
    val = checked.validation.describe() if checked.validation else _held_out(cfg)
    records = checked.records
    kind = records.kind + (", loss on completions only" if records.completion_only else "")
    packing = f"packed into {cfg.data.max_length}-token blocks" if cfg.data.packing else "padded per batch"
    print(f"config ok\n  train data: {checked.train.describe()}\n  validation: {val}")
    print(f"  records: {kind}; {packing}")
    for sample in checked.samples:
        print(f"  checked with the job's pipeline: {sample.describe()}")
    _show_example(cfg, checked.samples)
    lora = checked.lora
    print(f"  model: {lora.architecture}, {checked.structure.params:,} params")
    print(f"  LoRA modules: {len(lora.modules)} ({', '.join(lora.names)}), trainable params {checked.structure.lora:,}")
    print(f"  attention: {checked.attention.line()}")
    r = cfg.ray
    world = r.fewest_workers  # an elastic run's fewest workers hold the largest shares: its worst case
    where = f"{world} workers" + (f" (the fewest of ray.num_workers [{world}, {r.num_workers}])" if r.elastic else "")
    held = held_as(cfg.model)
    on_gpu = r.use_gpu is not False
    k = checked.decisions.expert_parallel
    plan, recompute = _validate_plan(cfg, checked.structure, held, args.gpu if on_gpu else None, k)
    print(f"  frozen base: {_storage(checked.structure, held, cfg.model.torch_dtype)}")
    print(f"  memory plan: {_memory_verdict(plan, where, on_gpu, args.gpu)} (rayft plan for details)")
    print(f"  {recompute}")
    final = Path(cfg.train.output_dir).expanduser().resolve() / "final"
    print(f"  writes: final adapter {final}, run directory {cfg.run_uri}")
    if cfg.train.warmup_steps > 0 and cfg.train.max_steps <= 0:
        print(
            f"  train.warmup_steps {cfg.train.warmup_steps}: checked against the run's steps when the job counts its "
            "records (set train.max_steps to check it here)"
        )
    for warning in [lora.warning, *checked.warnings, *cfg.relative_paths(), finished, auth.warning(cfg.k8s)]:
        if warning:
            print(f"rayft: warning: {warning}", file=sys.stderr)
    return EXIT_OK


def _validate_plan(cfg: Config, s: Structure, held: Held, gpu: str | None, k: int) -> tuple[MemoryPlan, str]:
    """The memory plan of the config's layout (with k, the expert-parallel degree preflight decided) on its fewest
    workers and the line of its activation checkpointing: on `gpu` with what `auto` chooses there (and its cost),
    or, CPU workers (None), what the config says."""
    from rayft.plan import plan_memory
    from rayft.plan.recompute import Recompute
    from rayft.plan.report import format_recompute
    from rayft.plan.steptime import Hardware, config_layout, layout_plan

    if gpu is None:
        recompute = Recompute.of(cfg, s.layers)
        plan = plan_memory(cfg, s, cfg.ray.fewest_workers, False, held=held, recompute=recompute)
        line = f"activation checkpointing {cfg.checkpointing} → {recompute.describe()} (CPU workers: no GPU to fit)"
        return plan, line
    cluster, layout = config_layout(cfg, k)
    hw = Hardware(gpu)
    chosen = layout_plan(cfg, s, layout, cluster, hw, held)
    return chosen.memory, format_recompute(cfg, s, chosen, cluster, hw)


def _show_example(cfg: Config, samples: list[SampleReport]) -> None:
    """What the job will train on, seen: the first record that trains, rendered by the job's own encoding."""
    from rayft.data.sample import rendered
    from rayft.data.tokenizer import load_tokenizer

    found = next((s for s in samples if s.example is not None), None)
    if found is None or found.example is None:
        return
    (file, index), tokenizer = found.example.where, load_tokenizer(cfg.model)
    print(f"  trains on ({file}: record {index}; trained text in ⟦ ⟧): {rendered(found.example, tokenizer)}")


def _held_out(cfg: Config) -> str:
    """The validation line without a validation split: records are held out only where something evaluates."""
    if cfg.train.eval_strategy == "no" or cfg.data.hold_out <= 0:
        return "none (no evaluation)"
    return f"none (holding out {cfg.data.hold_out:.0%} of the training records for evaluation)"


def _memory_verdict(plan: MemoryPlan, where: str, on_gpu: bool, gpu: str) -> str:
    """A GPU verdict only where the run trains on GPUs: CPU workers (ray.use_gpu: false) hold it in host memory."""
    if not on_gpu:
        return f"{plan.total_gib:.1f} GiB of host memory per CPU worker on {where} (ray.use_gpu: false)"
    # `gpu` is one of GPUS (the flag's choices): its capacity is known, never None
    verdict = (
        f"fits {gpu} ({plan.capacity_gib} GiB)" if plan.total_gib <= typing.cast(float, plan.capacity_gib) else "OOM"
    )
    return f"{plan.total_gib:.1f} GiB per GPU on {where}: {verdict}"


def _storage(s: Structure, held: Held, torch_dtype: str) -> str:
    """How the frozen base is held, with its bytes (model.frozen_dtype)."""
    if held == "nf4":
        from rayft.model.nf4_format import storage_bytes

        size = storage_bytes(s.nf4, s.nf4_matrices)
        return (
            f"NF4 for {s.nf4:,} decoder-matrix params ({_size(size)}: 4.127 bits each, double-quantised scales), "
            f"the other {s.total - s.nf4:,} in {torch_dtype}"
        )
    if held == "dtype":
        return f"{torch_dtype} (model.frozen_dtype; FP8 would hold {s.fp8:,} of its matrices' params in 1 byte)"
    size = s.fp8 + 4 * s.fp8_rows
    shown = _size(size)
    return (
        f"FP8 E4M3 for {s.fp8:,} decoder-matrix params ({shown}: 1 byte each + {s.fp8_rows:,} fp32 scales),"
        f" the other {s.total - s.fp8:,} in {torch_dtype}"
    )


def _size(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def _train(cfg: Config, demo: bool) -> int:
    from ray.train import TrainingFailedError

    from rayft.launch import train
    from rayft.startup import Profile

    profile = Profile()
    profile.add("launch", profile.since_origin())  # interpreter start, imports, config (demo files): before any work
    try:
        outcome = train(cfg, profile)
    except TrainingFailedError as e:
        print(f"rayft: training failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    shown = {k: v for k, v in outcome.metrics.items() if k in ("step", "loss", "eval_loss")}
    print(f"rayft: training finished {shown}")
    print(f"rayft: final adapter: {outcome.final_adapter}")
    print(f"rayft: checkpoints: {outcome.run_dir} (latest: {outcome.latest_checkpoint})")
    return _check_demo(outcome.final_adapter) if demo else EXIT_OK


def _check_demo(adapter: Path) -> int:
    """The demo ends by checking its own result: the final adapter loads with PEFT and lowers the held-out loss."""
    from rayft.demo import held_out_losses

    base, tuned = held_out_losses(DEMO_ROOT.resolve(), adapter)
    verdict = "lower" if tuned < base else "NOT lower: the demo did not learn"
    print(f"rayft: demo check: {adapter} loads with PEFT; held-out loss {base:.3f} (base) -> {tuned:.3f} ({verdict})")
    return EXIT_OK if tuned < base else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
